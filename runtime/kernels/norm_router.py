"""The residual norm before a mixture-of-experts layer, done by its router: one launch, not two.

The decode step's MoE layer starts with o's split-K partial sums, then

    add_rmsnorm   residual += sum of the partials + bias; normed = ffn_norm(residual)   (one program)
    router        logits = router . normed (+ router bias)                              (programs over experts)

Here each router program computes the new residual and normed itself (norm.residual_norm_values,
the very arithmetic add_rmsnorm runs, from the same partial rows in the same order), keeps normed in
registers for its experts' logits, and the launch's last program (norm.last_program) stores the
residual and normed, once every program has read the old residual. On a small row the norm is a
few loads each program repeats; what it saves is a launch of one program, microseconds of ramp and
drain in the graph. Whether it pays is timed per kind of layer (`choose`); under the interpreter the
engine runs it where asked (DecodeEngine's finish_norm).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import next_power_of_2
from .expert_tiles import RouterConfig
from .norm import MAX_UNROLLED, Finish, add_rmsnorm, fastest_fused, last_program, residual_norm_values
from .tuning import in_turn


@triton.jit
def _norm_router_kernel(res_ptr, parts_ptr, bias_ptr, post_ptr, norm_ptr, normed_ptr, counter_ptr, w_ptr, rbias_ptr,
                        logits_ptr, E, H, n_parts, post_eps, eps, HAS_BIAS: tl.constexpr, POST: tl.constexpr,
                        NORM: tl.constexpr, BLOCK: tl.constexpr, N_PARTS: tl.constexpr, BE: tl.constexpr,
                        ROUTER_BIAS: tl.constexpr):
    """Program i: the logits of experts i*BE.. of norm(residual + partials + bias), whole rows in one
    step; the last program to arrive stores the new residual and normed (the others read the old one)."""
    rows = tl.program_id(0) * BE + tl.arange(0, BE)
    row_mask = rows < E
    cols = tl.arange(0, BLOCK)
    cmask = cols < H
    # The router rows first (from DRAM): their latency overlaps the norm's loads and sums.
    w = tl.load(w_ptr + rows[:, None] * H + cols[None, :], mask=row_mask[:, None] & cmask[None, :], other=0.0)
    res, out = residual_norm_values(res_ptr, parts_ptr, bias_ptr, post_ptr, norm_ptr, 0, H, n_parts, H, post_eps,
                                    eps, 1, HAS_BIAS, POST, NORM, BLOCK, N_PARTS, False)
    dtype = res_ptr.dtype.element_ty
    x = out.to(dtype).to(tl.float32)  # what the router reads from `normed` when launched apart
    logits = tl.sum(w * x[None, :], axis=1)
    if ROUTER_BIAS:
        logits += tl.load(rbias_ptr + rows, mask=row_mask, other=0.0)
    tl.store(logits_ptr + rows, logits, mask=row_mask)
    if last_program(counter_ptr):
        tl.store(res_ptr + cols, res.to(dtype), mask=cmask)
        tl.store(normed_ptr + cols, out.to(dtype), mask=cmask)


def norm_route(kernels, finish: Finish, partials: torch.Tensor, config: RouterConfig) -> None:
    """`kernels` (an experts.MoEKernels) routes norm(residual + partials' sum + bias): add_rmsnorm(finish's
    residual, normed, partials, bias, post, norm) then kernels.route(normed), in one launch of `config`
    (block_h: the whole row). partials: float32 [n, hidden]; finish.counter zero, left zero."""
    E, H = kernels.num_experts, kernels.hidden
    if partials.dtype != torch.float32 or partials.dim() != 2 or partials.shape[1] != H or not partials.is_contiguous():
        raise ValueError(f"the router's residual norm adds float32 partial sums [n, {H}], got "
                         f"{tuple(partials.shape)} {partials.dtype}")
    if finish.residual.numel() != H or finish.normed.numel() != H:
        raise ValueError(f"the router's residual norm norms one row of {H} values, got a residual of "
                         f"{finish.residual.numel()} and an output of {finish.normed.numel()}")
    if config.block_h < H:
        raise ValueError(f"the router's residual norm reads whole rows of {H} values a step, not {config.label()}")
    post_w, post_eps = finish.post if finish.post is not None else (finish.residual, 0.0)
    norm_w, eps = finish.norm if finish.norm is not None else (finish.residual, 0.0)
    rbias = kernels.router_bias
    n = partials.shape[0]
    _norm_router_kernel[(-(-E // config.block_e),)](
        finish.residual, partials, finish.bias if finish.bias is not None else finish.residual, post_w, norm_w,
        finish.normed, finish.counter, kernels.router_weight, rbias if rbias is not None else kernels.logits,
        kernels.logits, E, H, n, float(post_eps), float(eps), HAS_BIAS=finish.bias is not None,
        POST=finish.post is not None, NORM=finish.norm is not None, BLOCK=config.block_h,
        N_PARTS=n if n <= MAX_UNROLLED else 0, BE=config.block_e, ROUTER_BIAS=rbias is not None,
        num_warps=config.num_warps)


def candidates(num_experts: int, hidden: int) -> list[RouterConfig]:
    """Tilings of the norming router worth timing, the first the default: BE experts a program over the
    whole row (normed is in registers, not read in steps), with threads enough for the row (at most 32
    values a thread) and the router tile (at most 64 weights a thread). The interpreter: 2 experts a
    program, so a launch has several programs and its last one stores."""
    block = next_power_of_2(hidden)
    if interpreting():
        return [RouterConfig(2, block, 4)]
    out = []
    for block_e, warps in ((2, 4), (1, 4), (4, 4), (1, 8), (2, 8), (4, 8), (8, 8), (4, 16), (8, 16)):
        threads = 32 * warps
        if block_e <= next_power_of_2(num_experts) and block <= 32 * threads and block_e * block <= 64 * threads:
            out.append(RouterConfig(block_e, block, warps))
    return out


def choose(layers: list, parts: int, post: bool, bias: bool, eps: float = 1e-5) -> RouterConfig | None:
    """The tiling among `candidates` with which `layers` (MoEKernels of one shape, their router tiles
    chosen) route and norm fastest in one launch on this device, if that beats add_rmsnorm then their
    router; else None. Timed on scratch rows as the decode step's graph runs them: `parts` partial rows
    (plus a bias when `bias`, a post-norm when `post`), each launch on the next layer's router in turn."""
    first = layers[0]
    H, device, dtype = first.hidden, first.device, first.dtype
    residual, normed = torch.randn(H, device=device).to(dtype), torch.empty(H, dtype=dtype, device=device)
    partials = torch.randn(parts, H, device=device)
    ones = torch.ones(H, device=device)
    finish = Finish(torch.zeros(1, dtype=torch.int32, device=device), residual, normed,
                    torch.randn(H, device=device).to(dtype) if bias else None, (ones, eps) if post else None,
                    (ones, eps))
    def separate(kernels):
        add_rmsnorm(residual, normed, partials=partials, bias=finish.bias, post=finish.post, norm=finish.norm)
        kernels.route(normed)

    launches = [(c, in_turn(layers, lambda k, c=c: norm_route(k, finish, partials, c)))
                for c in candidates(first.num_experts, H)]
    best, best_ms, separate_ms = fastest_fused(device, in_turn(layers, separate), launches, "norming router")
    how = f"in the router ({best.label()})" if best is not None else "a launch of its own"
    logging.getLogger("thin.runtime").info(
        f"router of {first.num_experts} experts x {H}: residual norm {how}: {1e3 * best_ms:.1f} us, add_rmsnorm "
        f"then the router {1e3 * separate_ms:.1f} us ({parts} partial rows; timed over {len(layers)} layers in turn)")
    return best
