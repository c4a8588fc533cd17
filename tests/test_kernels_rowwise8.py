"""int8 and fp8_e4m3 (one scale a row) kernels against the formats' decode."""

import pytest
import torch
from linear_kernel_cases import check_all, check_glu, check_matvec, make_op


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_decode(fmt, dtype):
    check_all(fmt, (96, 192), dtype=dtype, bias=dtype == torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336)])
def test_real_shapes_on_gpu(fmt, shape):
    op, dense, _ = make_op(fmt, shape, dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_glu_real_shape_on_gpu(fmt):
    op, dense, _ = make_op(fmt, (28672, 4096), dtype=torch.bfloat16)
    check_glu(op, dense, None, torch.bfloat16, "silu")


@pytest.mark.gpu
def test_plain_path_on_gpu(monkeypatch):
    """int8 without inline assembly (the interpreter's path) compiled for the GPU gives the same."""
    from thin.runtime.kernels import common

    monkeypatch.setattr(common, "INLINE_ASM", False)
    op, dense, _ = make_op("int8", (6144, 4096), dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)
