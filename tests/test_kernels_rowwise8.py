"""int8 and fp8_e4m3 (one scale a row) kernels against the formats' decode."""

import pytest
import torch
from linear_kernel_cases import check_all, check_matvec, make_op


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
