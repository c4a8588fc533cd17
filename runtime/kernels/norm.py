"""Residual add + RMSNorm, fused: the one kernel between two projections.

    h        = sum of the projection's split-K partial sums (+ bias), or its dense output
    h        = post_norm(h)                 Gemma-2/3 and OLMo-2 sandwich norms, when present
    residual = residual + h                 in place, rounded to the compute dtype
    out      = norm(residual)               the next projection's input

Each rounding step is the torch path's (executor.py: the projection's output, the post-norm,
the add, the norm are each rounded to the compute dtype; statistics in float32). One program a
row: a decode step has one row of hidden_size values (a batched step a few rows), summed from at
most a few partial rows each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import dependent, interpreting
from .common import next_power_of_2
from .dependent import release_next, wait_previous
from .tuning import in_turn


@triton.jit
def _rms(x, mask, w, H, eps):
    """x * rsqrt(mean(x^2) + eps) * w over one row (float32 in and out; w: the loaded weight)."""
    x = tl.where(mask, x, 0.0)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    return x * inv * w


@triton.jit
def _add_rmsnorm_kernel(res_ptr, delta_ptr, bias_ptr, post_ptr, norm_ptr, out_ptr, H, n_parts, part_stride,
                        post_eps, eps, DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, POST: tl.constexpr,
                        NORM: tl.constexpr, BLOCK: tl.constexpr, N_PARTS: tl.constexpr, PDL: tl.constexpr = 0):
    """Row r (program r): `residual_norm_row`. PDL: launched as a programmatic dependent (dependent.py)."""
    wait_previous(PDL)
    release_next(PDL)
    residual_norm_row(res_ptr, delta_ptr, bias_ptr, post_ptr, norm_ptr, out_ptr, tl.program_id(0), H, n_parts,
                      part_stride, post_eps, eps, DELTA, HAS_BIAS, POST, NORM, BLOCK, N_PARTS, False)


@triton.jit
def residual_norm_row(res_ptr, delta_ptr, bias_ptr, post_ptr, norm_ptr, out_ptr, row, H, n_parts, part_stride,
                      post_eps, eps, DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, POST: tl.constexpr,
                      NORM: tl.constexpr, BLOCK: tl.constexpr, N_PARTS: tl.constexpr, FRESH: tl.constexpr):
    """Row `row` of add_rmsnorm: `residual_norm_values`, stored (the residual in place, where DELTA)."""
    res, out = residual_norm_values(res_ptr, delta_ptr, bias_ptr, post_ptr, norm_ptr, row, H, n_parts, part_stride,
                                    post_eps, eps, DELTA, HAS_BIAS, POST, NORM, BLOCK, N_PARTS, FRESH)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = res_ptr.dtype.element_ty
    if DELTA > 0:
        tl.store(res_ptr + row * H + cols, res.to(dtype), mask=mask)
    tl.store(out_ptr + row * H + cols, out.to(dtype), mask=mask)


@triton.jit
def residual_norm_values(res_ptr, delta_ptr, bias_ptr, post_ptr, norm_ptr, row, H, n_parts, part_stride,
                         post_eps, eps, DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, POST: tl.constexpr,
                         NORM: tl.constexpr, BLOCK: tl.constexpr, N_PARTS: tl.constexpr, FRESH: tl.constexpr):
    """(new residual, out) of row `row` of add_rmsnorm, float32 [BLOCK] in registers (each holding values
    of the compute dtype; out is not rounded yet), stored by nobody: `residual_norm_row` stores them, a
    kernel that reads the old residual in several programs (norm_router.py) stores them from its last.
    DELTA: 0 none, 1 float32 partials [n_parts, rows, H] (part_stride = rows * H; the decode step's one
    row: [n_parts, H]), summed in split order, then the bias; 2 a dense [rows, H] projection output.
    N_PARTS: n_parts when it is small (the loop unrolled), else 0. FRESH: the partial sums were written
    by other programs of this same launch (a matvec's last program runs this, `last_program`): loaded
    from L2, past this multiprocessor's L1.

    A chain of memory latencies, not a stream of bytes: the partial rows are loaded at once (not one a
    loop step, each waiting for the one before) and the norm weights before the row's sum of squares,
    so their latency overlaps it instead of following it."""
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = res_ptr.dtype.element_ty
    if NORM:
        norm_w = tl.load(norm_ptr + cols, mask=mask, other=0.0)
    if POST:
        post_w = tl.load(post_ptr + cols, mask=mask, other=0.0)
    res = tl.load(res_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    if DELTA > 0:
        if DELTA == 1:
            h = tl.zeros([BLOCK], dtype=tl.float32)
            if N_PARTS > 0:
                for s in tl.static_range(N_PARTS):
                    h += _part(delta_ptr + s * part_stride + row * H + cols, mask, FRESH)
            else:
                for s in range(0, n_parts):
                    h += _part(delta_ptr + s * part_stride + row * H + cols, mask, FRESH)
            if HAS_BIAS:
                h += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            h = tl.load(delta_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        h = h.to(dtype).to(tl.float32)
        if POST:
            h = _rms(h, mask, post_w, H, post_eps).to(dtype).to(tl.float32)
        res = (res + h).to(dtype).to(tl.float32)
    if NORM:  # noqa: SIM108  (constexpr branches: only one is compiled)
        out = _rms(res, mask, norm_w, H, eps)
    else:
        out = res
    return res, out


@triton.jit
def _part(ptrs, mask, FRESH: tl.constexpr):
    """One partial row (float32)."""
    if FRESH:  # noqa: SIM108  (constexpr branches: only one is compiled)
        x = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def l2_prefetch(ptr, nbytes):
    """Ask L2 for the nbytes at ptr (16-byte aligned, a multiple of 16) and return at once: one bulk
    prefetch (sm_90 on), issued by the program's first thread."""
    tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .u32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""", "=r,l,r", [ptr.to(tl.int64), nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_norms(norm_ptr, post_ptr, n, NORM: tl.constexpr, POST: tl.constexpr):
    """Program (0, 0) of a launch whose last program finishes the residual norm (`finish_partials`) asks
    L2 for the n-long float32 norm weights that program reads (`l2_prefetch`, sm_90 on), so they are not a
    DRAM latency at the end."""
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        if NORM:
            l2_prefetch(norm_ptr, 4 * n)
        if POST:
            l2_prefetch(post_ptr, 4 * n)


def holds_row(num_warps: int, n: int) -> bool:
    """Whether a finishing launch's last program of `num_warps` warps holds an n-long row in registers
    (`finish_partials`: at most 32 values a thread, so 4 warps at 4096)."""
    return num_warps * 32 * 32 >= n


@triton.jit
def finish_partials(counter_ptr, res_ptr, parts_ptr, bias_ptr, post_ptr, norm_ptr, normed_ptr, n, n_parts, post_eps,
                    eps, HAS_BIAS: tl.constexpr, POST: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr,
                    N_PARTS: tl.constexpr):
    """Called by every program of a launch after it stored its rows of the float32 partial sums
    [n_parts, n] at parts_ptr: the last to arrive (`last_program`) runs add_rmsnorm's row over them
    (`residual_norm_row`, the partials read past L1), so no residual-norm launch follows (norm.Finish)."""
    if last_program(counter_ptr):
        residual_norm_row(res_ptr, parts_ptr, bias_ptr, post_ptr, norm_ptr, normed_ptr, 0, n, n_parts, n, post_eps,
                          eps, 1, HAS_BIAS, POST, NORM, BLOCK, N_PARTS, True)


@triton.jit
def last_program(counter_ptr):
    """True in the one program of this launch that arrives here last (each program calls it once, after
    its stores): that program then sees every other program's stores. The count goes back to zero, so
    the next launch (or the next replay of a captured graph) starts from zero again.

    Every thread's stores are ordered before the arrival by a barrier, then the arrival is an atomic
    increment with acquire-release semantics at GPU scope (Triton's scalar atomic issues it from one
    thread and hands the old count to the others through shared memory, behind another barrier)."""
    tl.debug_barrier()
    total = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == total - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


def add_rmsnorm(residual: torch.Tensor, out: torch.Tensor, *, partials: torch.Tensor | None = None,
                dense: torch.Tensor | None = None, bias: torch.Tensor | None = None, post=None, norm=None) -> None:
    """residual [rows, H] (or [H]) += h (from `partials` [n, rows, H] float32 summed over n, plus
    `bias`, [n, H] for one row; or `dense` [rows, H]), h first normed by `post` when given; then
    out = norm(residual).

    `post` and `norm` are (float32 weight [H], eps) pairs or None (out = residual)."""
    H = residual.shape[-1]
    rows = residual.numel() // H
    delta = 0 if partials is None and dense is None else 1 if partials is not None else 2
    if delta == 1 and (partials.dtype != torch.float32 or partials.numel() != partials.shape[0] * rows * H
                       or not partials.is_contiguous()):
        raise ValueError(f"partial sums are float32 [n, {rows}, {H}] (or [n, {H}] for one row), got "
                         f"{tuple(partials.shape)} {partials.dtype}")
    source = partials if partials is not None else dense if dense is not None else residual
    post_w, post_eps = post if post is not None else (residual, 0.0)
    norm_w, eps = norm if norm is not None else (residual, 0.0)
    block = next_power_of_2(H)
    _add_rmsnorm_kernel[(rows,)](
        residual, source, bias if bias is not None else residual, post_w, norm_w, out, H,
        partials.shape[0] if partials is not None else 0, rows * H, float(post_eps), float(eps), DELTA=delta,
        HAS_BIAS=bias is not None, POST=post is not None, NORM=norm is not None, BLOCK=block,
        N_PARTS=partials.shape[0] if partials is not None and partials.shape[0] <= MAX_UNROLLED else 0,
        num_warps=min(16, max(1, block // 256)), **dependent.kernel_args())


# Partial rows summed by an unrolled loop (one compiled kernel per count): the split-K factors and a
# mixture's top-k are at most this in practice.
MAX_UNROLLED = 8


@dataclass(frozen=True)
class Finish:
    """add_rmsnorm of one row, done by the last program of the split-K matvec that writes its partial
    sums (a family's `matvec_finish`): residual [H] += their sum + `bias`, post-normed by `post`; normed
    = norm(residual). `counter`: int32 [1], zero, which that program leaves zero again (`last_program`)."""

    counter: torch.Tensor
    residual: torch.Tensor
    normed: torch.Tensor
    bias: torch.Tensor | None = None
    post: tuple | None = None
    norm: tuple | None = None

    def launch_args(self, parts: int, H: int) -> dict:
        """The matvec kernel's finishing arguments for `parts` partial sums of H values."""
        if self.residual.numel() != H or self.normed.numel() != H:
            raise ValueError(f"a finishing matvec norms one row of {H} values, got a residual of "
                             f"{self.residual.numel()} and an output of {self.normed.numel()}")
        post_w, post_eps = self.post if self.post is not None else (None, 0.0)
        norm_w, eps = self.norm if self.norm is not None else (None, 0.0)
        weights = [w for w in (post_w, norm_w) if w is not None]
        # The kernel prefetches each weight's 4 H bytes in one bulk request: float32, 16-byte aligned.
        prefetch = weights and _bulk_prefetch(self.residual.device) and H % 4 == 0 and all(
            w.dtype == torch.float32 and w.is_contiguous() and w.numel() == H and w.data_ptr() % 16 == 0
            for w in weights)
        return dict(PREFETCH=bool(prefetch),
                    counter_ptr=self.counter, res_ptr=self.residual, finish_bias_ptr=self.bias, post_ptr=post_w,
                    norm_ptr=norm_w, normed_ptr=self.normed, post_eps=float(post_eps), eps=float(eps), FINISH=True,
                    FINISH_BIAS=self.bias is not None, POST=self.post is not None, NORM=self.norm is not None,
                    H_BLOCK=next_power_of_2(H), N_PARTS=parts if parts <= MAX_UNROLLED else 0)


def fastest_fused(device, separate, launches, what: str):
    """(config, ms, separate's ms): the fastest of `launches` ((config, launch) pairs: one launch that
    also does the residual norm, compiled first on host threads), or None for config when none beats
    `separate` (the same work in launches of their own); a candidate that does not compile is skipped
    (`median_ms_or_inf`, named by `what` in the log)."""
    from .tuning import compile_launches, median_ms, median_ms_or_inf

    compile_launches([(device, launch) for _, launch in launches], report=False)
    best, best_ms = None, median_ms(separate)
    separate_ms = best_ms
    for config, launch in launches:
        ms = median_ms_or_inf(launch, what)
        if ms < best_ms:
            best, best_ms = config, ms
    return best, best_ms, separate_ms


def choose_finish(ops, max_split: int, post: bool, norm: bool, eps: float = 1e-5, cols: int | None = None):
    """The configuration among `finish_candidates(max_split)` of `ops` (weights of one format and shape,
    e.g. every layer's o) with which their matvec plus the finishing residual norm (`matvec_finish`) runs
    fastest on this device, if that beats their split-K partial sums then an add_rmsnorm launch; else None.
    `cols`: both over the first cols columns (an elastic FFN level's down: its own prefix configurations).
    Timed on scratch rows (random x, norm weights of ones when `post` / `norm`) as the decode step's CUDA
    graph runs them: back to back, each launch on the next of `ops` in turn, so that (with enough of
    them) the weights come from DRAM, not L2. Weights the tuner does not time (too small,
    tuning.small_weight, or not to be tuned, LinearOp.tune) keep the separate launches."""
    from .tuning import small_weight

    op = ops[0]
    if small_weight(op) or not op.tune:
        return None
    H, device = op.out_features, op.device
    x = torch.randn(op.in_features if cols is None else cols, device=device).to(op.dtype)
    residual, normed = torch.randn(H, device=device).to(op.dtype), torch.empty(H, dtype=op.dtype, device=device)
    ones = torch.ones(H, device=device)
    post_norm, final = (ones, eps) if post else None, (ones, eps) if norm else None
    config = op.config("partial", None, cols)
    prefix = {} if cols is None else {"cols": cols}
    parts = torch.empty(max(max_split, config.split), H, dtype=torch.float32, device=device)
    def separate(o):
        view = parts[:config.split]
        used = o._matvec(x, view, config, -1, True, **prefix)
        add_rmsnorm(residual, normed, partials=view if used is None else view[:used], bias=o.bias, post=post_norm,
                    norm=final)

    def finishing(o, c):
        o._matvec(x, parts[:c.split], c, -1, True, finish=replace(finish, bias=o.bias), **prefix)

    finish = Finish(torch.zeros(1, dtype=torch.int32, device=device), residual, normed, None, post_norm, final)
    launches = [(c, in_turn(ops, lambda o, c=c: finishing(o, c))) for c in op.finish_candidates(max_split, **prefix)]
    best, best_ms, separate_ms = fastest_fused(device, in_turn(ops, separate), launches, "finishing matvec")
    how = f"in the matvec's last program ({best})" if best is not None else "a launch of its own"
    logging.getLogger("thin.runtime").info(
        f"{op.format} {op.out_features}x{op.in_features}{'' if cols is None else f' (first {cols} columns)'}: "
        f"residual norm {how}: {1e3 * best_ms:.1f} us, partial sums "
        f"then add_rmsnorm {1e3 * separate_ms:.1f} us (timed over {len(ops)} weights in turn)")
    return best


def reference(residual, h, post, norm):
    """What add_rmsnorm computes, in torch (the executor's NormPlan arithmetic): (new residual, out)."""
    dtype = residual.dtype

    def rms(x, weight_eps):
        w, eps = weight_eps
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(dtype)

    if h is not None:
        h = h.to(dtype)
        if post is not None:
            h = rms(h, post)
        residual = residual + h
    return residual, (rms(residual, norm) if norm is not None else residual)


def _bulk_prefetch(device: torch.device) -> bool:
    """Whether `device` takes `cp.async.bulk.prefetch.L2` (l2_prefetch): a GPU from sm_90 on, not the
    interpreter."""
    return not interpreting() and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
