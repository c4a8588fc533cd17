"""The residual norm after a mixture-of-experts layer, done by its down launch: one launch, not two.

The decode step's MoE layer ends with

    down          partials[k] = w_k * (down_k h[k] + b)     float32 [top_k, H] (programs over k and rows)
    add_rmsnorm   residual += sum of the k rows; normed = next norm(residual)   (one program)

Here the down launch's last program to arrive (norm.last_program) runs add_rmsnorm's very arithmetic
over the same rows in the same order (norm.residual_norm_row, the rows read past L1, since other
programs of the launch wrote them), as the int8/fp8 matvecs' `matvec_finish` does for a dense layer's
down. What it saves is a launch of one program, microseconds of ramp and drain in the graph; what it
costs is that program's tail, with the tiling's warps (not add_rmsnorm's) loading the rows. Only a
layer whose experts' down weights share one format (one down launch) can finish this way, and only
with tilings whose warps hold a row of H in registers. Whether it pays is timed per kind of layer
(`choose`); under the interpreter the engine runs it where asked (DecodeEngine's finish_norm).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace

import torch

from . import interpreting
from .common import next_power_of_2
from .expert_rows import TRELLIS
from .expert_tiles import ExpertConfig, routings
from .norm import Finish, add_rmsnorm, fastest_fused


def holds_row(config: ExpertConfig, hidden: int, post: bool = False) -> bool:
    """Whether `config`'s program holds a row of `hidden` values in registers for the norm: at most 32 a
    thread, as matvec_finish's tilings (2 warps at 2048, 4 at 2880 or 4096), or 16 with a post-norm's
    weights too (under Triton 3.6 a 2-warp tiling at 2048 then spills 8 bytes)."""
    return config.num_warps * 32 * (16 if post else 32) >= hidden


def candidates(kernels, post: bool = False) -> list[ExpertConfig]:
    """Tilings of `kernels`' (an experts.MoEKernels) one down group that can finish the norm (`post`: with
    a post-norm), the first the default: its down candidates that hold a row (holds_row), then its
    whole-word (and trellis) tilings of too few warps again with the fewest warps that do (a warp's 32
    chunks, or trellis's 32 blocks of 16 columns, a step each: where the row has fewer, lanes idle, as
    down's 768 columns leave 40 of a 2-warp tile's 64 chunks, 16 of its 64 blocks). None for a layer of
    several down formats."""
    if len(kernels.down_groups) != 1:
        return []
    H = kernels.hidden
    group = kernels.down_groups[0]
    own = kernels.candidates(group, "down")
    out = [c for c in own if holds_row(c, H, post)]
    warps = next_power_of_2(-(-H // (512 if post else 1024)))
    if not interpreting():
        for c in own:
            if (c.words or group.fmt == TRELLIS) and not holds_row(c, H, post) and c.groups == 32 * c.num_warps:
                wider = replace(c, groups=32 * warps, num_warps=warps)
                if wider not in out:
                    out.append(wider)
    return out


def choose(layers: list, post: bool, norm: bool, eps: float = 1e-5) -> ExpertConfig | None:
    """The tiling among `candidates` with which `layers` (MoEKernels of one shape and down format, their
    tiles chosen) run their down projection and the residual norm fastest in one launch on this device,
    if that beats their chosen down launch then add_rmsnorm; else None. Timed on scratch rows as the
    decode step's graph runs them: a post-norm when `post`, the next norm when `norm`, each launch on the
    next layer in turn and each routing to other experts (expert_tiles.routings), so the weights come
    from DRAM, not L2."""
    first = layers[0]
    configs = candidates(first, post)
    if not configs:
        return None
    H, device, dtype = first.hidden, first.device, first.dtype
    residual, normed = torch.randn(H, device=device).to(dtype), torch.empty(H, dtype=dtype, device=device)
    out = torch.empty(first.top_k, H, dtype=torch.float32, device=device)
    ones = torch.ones(H, device=device)
    finish = Finish(torch.zeros(1, dtype=torch.int32, device=device), residual, normed, None,
                    (ones, eps) if post else None, (ones, eps) if norm else None)
    _, chosen, weights = routings(first.down_groups[0], first.num_experts, first.top_k, first.normalize, device)
    x = torch.randn(H, device=device).to(dtype)
    for kernels in layers:  # every layer's h, which its down launches read
        kernels._prime(x)
    turn = itertools.count()

    def in_turn(run):
        def launch():
            t = next(turn)
            run(layers[t % len(layers)], chosen[t % chosen.shape[0]], weights[t % chosen.shape[0]])
        return launch

    def separate(kernels, c, w):
        kernels._down(0, out, kernels.config(0, "down"), chosen=c, weights=w)
        add_rmsnorm(residual, normed, partials=out, post=finish.post, norm=finish.norm)

    launches = [(config, in_turn(lambda k, c, w, config=config: k._down(0, out, config, chosen=c, weights=w,
                                                                         finish=finish)))
                for config in configs]
    best, best_ms, separate_ms = fastest_fused(device, in_turn(separate), launches, "finishing expert down")
    how = f"in the down launch's last program ({best.label()})" if best is not None else "a launch of its own"
    logging.getLogger("thin.runtime").info(
        f"expert down {first.inter}->{H} x top-{first.top_k}: residual norm {how}: {1e3 * best_ms:.1f} us, down "
        f"({first.config(0, 'down').label()}) then add_rmsnorm {1e3 * separate_ms:.1f} us (timed over "
        f"{len(layers)} layers in turn)")
    return best
