"""The residual norm folded into the next matvec's input: no program of any launch runs add_rmsnorm's row.

    producer (o or down, split-K 1):  residual[rows] += y[rows] (+ bias)       each program its own rows
                                      sums[slot] += sum(residual[rows]^2)      one float32 atomic a program
    consumer (the next matvec):       x = residual * rsqrt(sums[slot] / H + eps) * norm_weight
                                      computed where it loads x, chunk by chunk, rounded to the compute dtype

Both round as add_rmsnorm does (norm.py: the projection's output, the add, the normed value each to the
compute dtype; statistics in float32), so the consumer's input matches add_rmsnorm's `out` up to the order
of the float32 sum of squares. What it saves: the serial tail of a finishing matvec (norm.finish_partials:
one program, a few dependent global round trips, after every other program of the launch).

The sums need no host work between CUDA graph replays. A step's folding producers P_0 .. P_{m-1} (in launch
order, a cycle across steps: P_{m-1}'s next is the next step's P_0) each own a slot s_j of float32 [3], with
s_{j+1} != s_j around the cycle (`slot_plan`: s_j = j % 2, and s_{m-1} = 2 when m is odd; m >= 2). P_j adds
into s_j; its program (0, 0) stores zero into s_{j+1}. In stream order a step runs
... C_{j-1}, P_j, C_j, P_{j+1}, ... where C_j (the consumers of P_j's norm) reads s_j and nothing else reads a
slot. Race-free by that order alone:
  - while P_j zeroes s_{j+1}, its other programs add into s_j, a different slot, and no consumer runs;
  - the value zeroed is needed by no one: the next reader of s_{j+1} is C_{j+1}, after P_{j+1} refills it
    (C_j reads s_j != s_{j+1});
  - P_{j+1} starts adding into a zero slot: between P_j and P_{j+1} only C_j runs, which only reads;
  - C_j reads exactly P_j's sum: P_{j-1} zeroed s_j before P_j began, and P_j's own zero goes elsewhere.
All slots start zero (the engine zeroes them whenever it assigns them), so s_0 is zero at the first step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .tiles import octet_columns, octet_split


@triton.jit
def accumulate_rows(res_ptr, bias_ptr, total, rows, row_mask, sums_ptr, next_ptr, HAS_BIAS: tl.constexpr):
    """A producer's epilogue (split-K 1: `total` [rows] are whole row sums): residual[rows] += total (+ bias),
    each rounded to the compute dtype as add_rmsnorm rounds them; the new rows' float32 sum of squares added
    to sums_ptr[0]; program (0, 0) zeroes next_ptr[0] (the next producer's slot, see the module)."""
    dtype = res_ptr.dtype.element_ty
    if HAS_BIAS:
        total += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    h = total.to(dtype).to(tl.float32)
    res = tl.load(res_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    new = (res + h).to(dtype)
    tl.store(res_ptr + rows, new, mask=row_mask)
    v = tl.where(row_mask, new.to(tl.float32), 0.0)
    tl.atomic_add(sums_ptr, tl.sum(v * v, axis=0), sem="relaxed", scope="gpu")
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(next_ptr, 0.0)


@triton.jit
def norm_scale(sums_ptr, H, eps):
    """rsqrt(mean of squares + eps) of the residual row whose sum of squares sums_ptr[0] holds (float32),
    as add_rmsnorm computes it (1 / sqrt, not the approximate rsqrt)."""
    return 1.0 / tl.sqrt(tl.load(sums_ptr) / H + eps)


@triton.jit
def normed_load(res_ptr, offs, mask, norm_ptr, inv, MASKED: tl.constexpr):
    """The consumer's x at `offs`: residual * inv * norm weight (float32 weight), rounded to the residual's
    dtype (add_rmsnorm's `out`); zero where `mask` is false (MASKED)."""
    return _normed(res_ptr, offs, mask, norm_ptr, inv, MASKED).to(res_ptr.dtype.element_ty)


@triton.jit
def _normed(res_ptr, offs, mask, norm_ptr, inv, MASKED: tl.constexpr):
    """`normed_load` in float32, not rounded yet."""
    if MASKED:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        w = tl.load(norm_ptr + offs, mask=mask, other=0.0)
    else:
        r = tl.load(res_ptr + offs)
        w = tl.load(norm_ptr + offs)
    return r.to(tl.float32) * inv * w


@dataclass(frozen=True)
class Accumulate:
    """A folding producer's outputs: `residual` [H] (updated in place), `sums` (float32 [1]: its slot, to which
    the new row's sum of squares is added), `next` (float32 [1]: the next producer's slot, zeroed)."""

    residual: torch.Tensor
    sums: torch.Tensor
    next: torch.Tensor

    def launch_args(self, n: int) -> dict:
        if self.residual.numel() != n:
            raise ValueError(f"a folding matvec adds {n} rows into the residual, which has {self.residual.numel()}")
        return dict(res_ptr=self.residual, sums_ptr=self.sums, next_ptr=self.next, ACCUMULATE=True)


@dataclass(frozen=True)
class NormedInput:
    """A consumer's input, normed where it is loaded: norm(residual) with `norm` = (float32 weight [H], eps)
    and the residual's sum of squares in `sums` (float32 [1], left there by the producer)."""

    residual: torch.Tensor
    sums: torch.Tensor
    norm: tuple

    def launch_args(self) -> dict:
        weight, eps = self.norm
        if weight.dtype != torch.float32 or weight.numel() != self.residual.numel():
            raise ValueError(f"a normed input needs a float32 norm weight of {self.residual.numel()} values, got "
                             f"{weight.numel()} {weight.dtype}")
        return dict(x_sums_ptr=self.sums, x_norm_ptr=weight, x_eps=float(eps), NORMED=True)


def slot_plan(m: int) -> list[tuple[int, int]]:
    """(slot, next slot) of each of a step's m folding producers in launch order (the module's rotation): the
    next of the last is the first's. None for m < 2 (one producer would zero its own slot)."""
    if m < 2:
        return []
    slots = [j % 2 for j in range(m)]
    if m % 2:
        slots[-1] = 2
    return [(slots[j], slots[(j + 1) % m]) for j in range(m)]


def reference(residual: torch.Tensor, y: torch.Tensor, bias, norm) -> tuple[torch.Tensor, torch.Tensor, float]:
    """What a producer then its consumer's input load compute, in torch: (new residual, the normed input, sum of
    squares). y: the producer's float32 row sums."""
    dtype = residual.dtype
    h = y.float() + (bias.float() if bias is not None else 0.0)
    new = (residual.float() + h.to(dtype).float()).to(dtype)
    ss = float(new.float().pow(2).sum())
    weight, eps = norm
    x = (new.float() * (1.0 / torch.sqrt(torch.tensor(ss / new.numel() + eps))) * weight).to(dtype)
    return new, x, ss


@triton.jit
def x_octet_normed(res_ptr, first, cmask, EVEN: tl.constexpr, norm_ptr, inv):
    """tiles.x_octet of the normed residual (`normed_load`): eight float32 [C], columns first + 0..7."""
    offs = first[:, None] + tl.arange(0, 8)[None, :]
    return octet_split(normed_load(res_ptr, offs, cmask[:, None], norm_ptr, inv, not EVEN))


@triton.jit
def x_pairs_normed(res_ptr, first, cmask, EVEN: tl.constexpr, ASM: tl.constexpr, norm_ptr, inv):
    """pairs.x_pairs of the normed residual (bfloat16): the pairs (x_k, x_{k+4}) as int32 [C], x_k's bf16 bits
    in the low half; each pair rounded and packed at once (`_bf16_pair`)."""
    offs = first[:, None] + tl.arange(0, 8)[None, :]
    x = octet_columns(_normed(res_ptr, offs, cmask[:, None], norm_ptr, inv, not EVEN))
    return (_bf16_pair(x[0], x[4], ASM), _bf16_pair(x[1], x[5], ASM), _bf16_pair(x[2], x[6], ASM),
            _bf16_pair(x[3], x[7], ASM))


@triton.jit
def _bf16_pair(lo, hi, ASM: tl.constexpr):
    """bf16(lo) in the low half of an int32 and bf16(hi) in the high half, each rounded to nearest even (as
    `.to(tl.bfloat16)`). ASM: one conversion instruction for both."""
    if ASM:
        out = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.int32,
                                        is_pure=True, pack=1)
    else:
        low = lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        out = low | (hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16)
    return out


def fold_args(config, n: int, act: int, partial: bool, accumulate: Accumulate | None,
              normed: NormedInput | None) -> dict:
    """A matvec kernel's folding arguments (`Folding`): none, a producer's (split-K 1 over plain rows), a
    consumer's, or both."""
    args = {}
    if accumulate is not None:
        if act >= 0 or partial or config.split != 1:
            raise ValueError(f"a folding matvec writes whole plain rows (split-K 1, no activation), got {config} "
                             f"(activation {act}, partial sums {partial})")
        args.update(accumulate.launch_args(n))
    if normed is not None:
        args.update(normed.launch_args())
    return args


class Folding:
    """The two halves of a folded residual norm, for a KernelLinear whose `_matvec` takes `accumulate` and
    `normed` (grouped_int.py, rowwise8.py)."""

    # {mode: MatvecConfig} a consumer runs with a normed input (engine_fold._tune_normed, on a GPU); else the
    # mode's own configuration.
    normed_configs: dict | None = None

    def matvec_accumulate(self, x: torch.Tensor, accumulate: Accumulate) -> None:
        """residual += x @ W.T (+ bias), its sum of squares into the producer's slot (`Accumulate`), with the
        direct mode's configuration (split-K 1): the producer of a folded norm."""
        self._matvec(x.reshape(self.in_features), accumulate.residual, self.config("direct"), -1, False,
                     accumulate=accumulate)

    def matvec_normed(self, normed: NormedInput, out: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """matvec(norm(residual), out=out, activation=activation) with the input normed where it is loaded
        (`NormedInput`): the consumer of a folded norm, with `normed_configs`' configuration for its mode, else
        the mode's own."""
        from .common import ACTIVATION_CODES

        mode = "direct" if activation is None else "glu"
        config = (self.normed_configs or {}).get(mode) or self.config(mode)
        self._matvec(normed.residual, out, config, -1 if activation is None else ACTIVATION_CODES[activation], False,
                     normed=normed)
        return out
