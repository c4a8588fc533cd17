"""The residual norm left to the projection after it (`Deferred`), the kernels' side of it: the decode step's o
(or down) matvec adds its rows into the residual and writes residual * norm weight and its programs' sums of
squares (`store_deferred`); the next projection (gate/up, the next layer's qkv, the LM head) reads that row as
its input and multiplies its sums by 1 / rms (`deferred_scale`). RMSNorm(r) = (r * w) / rms(r) and the
projection is linear, so there is no norm launch and no last program between the two (norm.py's add_rmsnorm
and Finish are the other two ways). Used by the deferrable families' matvec kernels (grouped_int.py,
rowwise8.py: `deferred_reads` before their loop, `deferred_epilogue` after it, `deferred_args` at launch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import next_power_of_2


@triton.jit
def deferred_rows(res_ptr, norm_ptr, n, BN: tl.constexpr):
    """(residual, norm weight) float32 [BN] of a deferring producer's rows (`store_deferred`): loaded by the
    caller before its loop where nothing before it writes them, so their latency is not the program's last."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = rows < n
    res = tl.load(res_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    return res, tl.load(norm_ptr + rows, mask=mask, other=0.0)


@triton.jit
def deferred_reads(slots_ptr, n_slots, H_rows, eps, res_ptr, norm_ptr, n, BN: tl.constexpr, SCALED: tl.constexpr,
                   DEFER: tl.constexpr, SLOTS: tl.constexpr):
    """(1 / rms, residual rows, norm weight rows): what a deferred norm's consumer (SCALED: `deferred_scale`)
    or producer (DEFER: `deferred_rows`) matvec reads of the kernel before it; 1.0 and zeros for the rest.
    Called before the matvec's loop, so their latency passes under its loads; in a programmatic dependent,
    whose wait for that kernel is inside the loop, after it."""
    rstd = tl.full([], 1.0, tl.float32)
    res = tl.zeros([BN], dtype=tl.float32)
    w = res
    if SCALED:
        rstd = deferred_scale(slots_ptr, n_slots, H_rows, eps, SLOTS)
    if DEFER:
        res, w = deferred_rows(res_ptr, norm_ptr, n, BN)
    return rstd, res, w


@triton.jit
def deferred_epilogue(total, rstd, res, w, n, BN: tl.constexpr, bias_ptr, HAS_BIAS: tl.constexpr, res_ptr, out_ptr,
                      slots_ptr, SCALED: tl.constexpr, DEFER: tl.constexpr):
    """A deferred norm's side of a matvec's epilogue (`deferred_reads` gave rstd, res, w): a consumer's
    (SCALED) sums times 1 / rms, returned for its own stores; a producer's (DEFER) rows stored
    (`store_deferred`), whose caller then stores nothing else."""
    if SCALED:
        total *= rstd
    if DEFER:
        store_deferred(total, n, BN, bias_ptr, HAS_BIAS, res_ptr, out_ptr, slots_ptr, res, w)
    return total


@triton.jit
def store_deferred(total, n, BN: tl.constexpr, bias_ptr, HAS_BIAS: tl.constexpr, res_ptr, out_ptr, slots_ptr, res,
                   w):
    """The epilogue of a producer matvec (one split, plain rows) whose residual norm is deferred (`Deferred`):
    for its BN rows of the projection h = `total` (+ bias), residual += h and out = residual * norm weight
    (`res`, `w`: the rows' residual and norm weight, `deferred_rows`), each rounded as add_rmsnorm rounds
    them, and its rows' sum of squares of the new residual into slots[program]. The 1 / rms the norm still
    owes is applied by the consumers (`deferred_scale`)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = rows < n
    dtype = res_ptr.dtype.element_ty
    if HAS_BIAS:
        total += tl.load(bias_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    h = total.to(dtype).to(tl.float32)
    res = (res + h).to(dtype).to(tl.float32)
    tl.store(res_ptr + rows, res.to(dtype), mask=mask)
    tl.store(out_ptr + rows, (res * w).to(dtype), mask=mask)
    tl.store(slots_ptr + tl.program_id(0), tl.sum(tl.where(mask, res * res, 0.0), axis=0))


@triton.jit
def deferred_scale(slots_ptr, n_slots, H, eps, SLOTS: tl.constexpr):
    """1 / rms of the row whose per-program sums of squares a deferring producer left in slots[:n_slots]
    (`store_deferred`; SLOTS a power of two >= n_slots): what a consumer multiplies its sums by."""
    i = tl.arange(0, SLOTS)
    # Cached in L1 (the default load): every program of the consumer reads the same slots, and the others an SM
    # runs (llama-8b, Round 10's tilings: 12 of qkv's, 27 of gate/up's) take them from L1 instead of L2 (int4:
    # +0.7% a step over ".cg"). The producer is a launch before this one (or a programmatic primary whose
    # completion the caller waited for), so L1 holds nothing older than its stores.
    squares = tl.load(slots_ptr + i, mask=i < n_slots, other=0.0)
    return 1.0 / tl.sqrt(tl.sum(squares, axis=0) / H + eps)


@dataclass(frozen=True)
class Deferred:
    """A residual norm left to the projection after it: the decode step's o (or down) adds its rows into the
    residual and writes out = residual * norm weight and its programs' sums of squares (`store_deferred`), with
    no last program and no launch for the norm; the next projection (gate/up, the next layer's qkv, the LM head)
    reads `out` as its input and multiplies its sums by 1 / rms (`deferred_scale`). As norm(residual) =
    (residual * w) / rms and a projection is linear, the consumer's outputs are the norm's but for where the
    rounding to the compute dtype falls (residual * w rounded, then scaled in float32, where add_rmsnorm rounds
    residual * w / rms). `slots`: float32 [>= programs] of the producer's launch; `programs`: how many it
    writes (the producer's row blocks)."""

    residual: torch.Tensor
    out: torch.Tensor
    slots: torch.Tensor
    norm: tuple
    programs: int

    def producer_args(self, programs: int, H: int) -> dict:
        """The producer matvec's arguments (its launch has `programs` row blocks over H rows)."""
        if programs != self.programs or programs > self.slots.numel():
            raise ValueError(f"a deferring matvec of {programs} programs, but {self.programs} were counted "
                             f"(slots for {self.slots.numel()})")
        if self.residual.numel() != H or self.out.numel() != H:
            raise ValueError(f"a deferring matvec adds {H} rows into a residual of {self.residual.numel()}")
        return dict(res_ptr=self.residual, norm_ptr=self.norm[0], normed_ptr=self.out, slots_ptr=self.slots,
                    DEFER=True)

    def consumer_args(self) -> dict:
        """A consumer matvec's arguments."""
        return dict(slots_ptr=self.slots, n_slots=self.programs, H_rows=self.residual.numel(),
                    eps=float(self.norm[1]), SCALED=True, SLOTS=next_power_of_2(self.programs))


def deferred_args(defer: Deferred | None, rstd: Deferred | None, config, programs: int, n: int, act: int,
                  partial: bool) -> dict:
    """A deferrable family's matvec kernel arguments: `defer` where the launch (of `programs` row blocks
    over n rows, `config`) is the producer (one split, plain rows, whole), `rstd` where its x is the
    deferred row."""
    args = {}
    if defer is not None:
        if act >= 0 or partial or config.split != 1:
            raise ValueError(f"a matvec that defers the residual norm runs plain rows in one split, got {config}")
        args.update(defer.producer_args(programs, n))
    if rstd is not None:
        args.update(rstd.consumer_args())
    return args
