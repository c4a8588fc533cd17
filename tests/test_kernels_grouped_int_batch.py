"""The batched-decode int4 kernel (runtime/kernels/grouped_int_batch.py) against the format's
reference decode: row counts the batched step uses, every band width, symmetric and asymmetric, with a bias;
each row's output depends on its own activations only."""

import pytest
import torch
from kernel_support import DEVICE, rel_err, tolerance
from linear_kernel_cases import make_op


@pytest.mark.parametrize("rows", [2, 5, 16, 33])
@pytest.mark.parametrize("params", [{"group_size": 32}, {"group_size": 128, "asymmetric": 1}])
def test_rows_matmul_matches_the_reference(rows, params):
    from thin.runtime.kernels.grouped_int_batch import candidates, rows_matmul, takes

    op, dense, bias = make_op("int4", (64, 256), params, bias=True, seed=rows)
    assert {scheme for scheme, _ in candidates(op)} == {"rows", "nibble"}
    assert takes(op)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    want = x.cpu() @ dense.T + bias.cpu()
    got = rows_matmul(op, x)
    assert got.shape == (rows, 64)
    assert rel_err(got, want) < tolerance(torch.float32)
    # A row alone gives what it gives among others.
    assert torch.equal(rows_matmul(op, x[1:2].clone()), got[1:2])
    for scheme, block_n in candidates(op):
        got = rows_matmul(op, x, block_n, scheme)
        assert rel_err(got, want) < tolerance(torch.float32), (scheme, block_n)


def test_rows_matmul_refuses_what_it_does_not_take():
    from thin.runtime.kernels.grouped_int_batch import rows_matmul, takes

    op, _, _ = make_op("int5", (32, 64), {"group_size": 32})
    assert not takes(op)
    with pytest.raises(ValueError, match="int4"):
        rows_matmul(op, torch.zeros(2, 64, device=DEVICE))
