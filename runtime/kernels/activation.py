"""act(gate) * up over rows of a fused [gate; up] projection's output: the prefill half of the
gated MLP (decode fuses it into the matvec's epilogue, tiles.store_glu)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ACTIVATION_CODES, next_power_of_2
from .tiles import activate


@triton.jit
def _glu_kernel(x_ptr, out_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """Row r, columns c*BLOCK..: out[r, c] = act(x[r, c]) * x[r, n + c], rounded as torch rounds."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = activate(gate, ACT).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (act * up).to(dtype), mask=mask)


def glu(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[rows, 2n] -> [rows, n]: act(gate) * up."""
    rows, width = gate_up.reshape(-1, gate_up.shape[-1]).shape
    n = width // 2
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_power_of_2(n))
    _glu_kernel[(rows, -(-n // block))](gate_up.contiguous(), out, n, ACT=ACTIVATION_CODES[activation], BLOCK=block)
    return out
