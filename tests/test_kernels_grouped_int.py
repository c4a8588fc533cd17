"""int3-int6 kernels (one family, bits constexpr) against the format's decode."""

import pytest
import torch
from kernel_support import DEVICE
from linear_kernel_cases import check_all, check_glu, check_matvec, make_op

FORMATS = ["int3", "int4", "int5", "int6"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("asymmetric", [0, 1])
def test_matches_decode_float32(fmt, asymmetric):
    check_all(fmt, (96, 256), {"group_size": 64, "asymmetric": asymmetric}, torch.float32, bias=asymmetric == 1)


@pytest.mark.parametrize("fmt", ["int4", "int5"])
def test_matches_decode_bfloat16(fmt):
    check_all(fmt, (64, 128), {"group_size": 32}, torch.bfloat16, activation="gelu_tanh")


def test_rows_not_a_multiple_of_the_block():
    op, dense, _ = make_op("int4", (40, 128), {"group_size": 128})
    check_matvec(op, dense, None, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_real_shapes_on_gpu(fmt, shape):
    assert DEVICE.type == "cuda"
    op, dense, _ = make_op(fmt, shape, {"group_size": 128}, dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4", "int5"])
def test_glu_real_shape_on_gpu(fmt):
    op, dense, _ = make_op(fmt, (28672, 4096), {"group_size": 128}, dtype=torch.bfloat16)
    check_glu(op, dense, None, torch.bfloat16, "silu")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,asymmetric", [("int4", 0), ("int3", 1), ("int6", 0)])
def test_plain_path_on_gpu(fmt, asymmetric, monkeypatch):
    """The path without inline assembly (the interpreter's) compiled for the GPU gives the same."""
    from thin.runtime.kernels import common

    monkeypatch.setattr(common, "INLINE_ASM", False)
    op, dense, _ = make_op(fmt, (4096, 14336), {"group_size": 128, "asymmetric": asymmetric}, dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)
