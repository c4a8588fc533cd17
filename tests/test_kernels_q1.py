"""q1 kernels against the format's decode."""

import pytest
import torch
from linear_kernel_cases import check_all, check_matvec, make_op


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_matches_decode(group_size):
    check_all("q1", (96, 256), {"group_size": group_size}, torch.float32, bias=group_size == 32)


def test_matches_decode_bfloat16():
    check_all("q1", (64, 128), dtype=torch.bfloat16)


@pytest.mark.gpu
def test_real_shape_on_gpu():
    op, dense, _ = make_op("q1", (4096, 14336), dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)


@pytest.mark.gpu
def test_plain_path_on_gpu(monkeypatch):
    """Without inline assembly (the interpreter's path), compiled for the GPU."""
    from thin.runtime.kernels import common

    monkeypatch.setattr(common, "INLINE_ASM", False)
    op, dense, _ = make_op("q1", (4096, 14336), dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)
