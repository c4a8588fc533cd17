"""act(gate) * up over rows of a fused [gate; up] projection's output: the prefill half of the
gated MLP (decode fuses it into the matvec's epilogue, tiles.store_glu), and in a batched decode
step the sum of a split projection's float32 partial sums with it (`glu_partials`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ACTIVATION_CODES, next_power_of_2
from .tiles import activate, split_sum


@triton.jit
def _glu_kernel(x_ptr, bias_ptr, out_ptr, n, rows, ACT: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr = 0,
                HAS_BIAS: tl.constexpr = False):
    """Row r, columns c*BLOCK..: out[r, c] = act(x[r, c]) * x[r, n + c], rounded as torch rounds.
    SPLITS > 0: x is float32 partial sums [SPLITS, rows, 2 n], each of gate and up summed in split order
    (plus the bias) and rounded to out's dtype first, as grouped_int_batch's `_sum_splits` rounds it."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    if SPLITS == 0:
        gate = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        stride = rows * 2 * n
        gate = split_sum(x_ptr, row * 2 * n + cols, mask, stride, bias_ptr, cols, SPLITS, HAS_BIAS)
        up = split_sum(x_ptr, row * 2 * n + n + cols, mask, stride, bias_ptr, n + cols, SPLITS, HAS_BIAS)
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
    act = activate(gate, ACT).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (act * up).to(dtype), mask=mask)


def glu(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[rows, 2n] -> [rows, n]: act(gate) * up."""
    rows, width = gate_up.reshape(-1, gate_up.shape[-1]).shape
    n = width // 2
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_power_of_2(n))
    _glu_kernel[(rows, -(-n // block))](gate_up.contiguous(), out, out, n, rows, ACT=ACTIVATION_CODES[activation],
                                        BLOCK=block)
    return out


def glu_partials(part: torch.Tensor, activation: str, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """float32 partial sums [splits, rows, 2n] of a fused [gate; up] projection (its bias not yet
    added) -> act(gate) * up [rows, n] in `dtype`, one launch: what glu gives for the summed output."""
    splits, rows, width = part.shape
    n = width // 2
    if part.dtype != torch.float32 or width % 2 or not part.is_contiguous():
        raise ValueError(f"glu_partials takes contiguous float32 [splits, rows, 2n], got {tuple(part.shape)} "
                         f"{part.dtype}")
    out = torch.empty(rows, n, dtype=dtype, device=part.device)
    block = min(1024, next_power_of_2(n))
    _glu_kernel[(rows, -(-n // block))](part, bias if bias is not None else out, out, n, rows,
                                        ACT=ACTIVATION_CODES[activation], BLOCK=block, SPLITS=splits,
                                        HAS_BIAS=bias is not None)
    return out
