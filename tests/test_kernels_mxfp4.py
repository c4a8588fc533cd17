"""mxfp4 kernels against the format's decode (every E2M1 code, subnormal 0.5 included)."""

import pytest
import torch
from linear_kernel_cases import check_all, check_matvec, make_op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_decode(dtype):
    check_all("mxfp4", (96, 192), dtype=dtype, bias=dtype == torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336)])
def test_real_shapes_on_gpu(shape):
    op, dense, _ = make_op("mxfp4", shape, dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)
