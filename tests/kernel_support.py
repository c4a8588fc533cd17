"""Shared by the kernel tests: where kernels run, and the comparisons they make.

On a machine without CUDA the kernels run through Triton's interpreter on CPU tensors (set before
any kernel module is imported: the tests import them inside functions or after this module); with
CUDA they run on the GPU, at the same small shapes, and the `gpu`-marked tests add real ones.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| over the whole tensor (float64); inf for NaN."""
    got, want = got.double().cpu(), want.double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    """What an output rounded to `dtype` (plus float32 accumulation) may miss by."""
    return {torch.float32: 2e-5, torch.bfloat16: 1.2e-2, torch.float16: 2e-3}[dtype]


def poisoned(*shape, dtype, device=DEVICE) -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel fails to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
