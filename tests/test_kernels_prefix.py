"""Elastic FFN prefixes on the Triton kernels (thin.ir.FFNLevel): the first rows of each half of a
[gate; up] weight and the first columns of a down weight, read in place, against the format's
reference decode (under TRITON_INTERPRET=1 on the CPU)."""

import pytest
import torch
from kernel_support import DEVICE, poisoned, rel_err, tolerance
from linear_kernel_cases import make_op

from thin.runtime.ffn import activate

CASES = [
    ("int4", {"group_size": 32, "asymmetric": 1}, True),
    ("int3", {"group_size": 128}, False),
    ("int8", {}, True),
    ("fp8_e4m3", {}, False),
    ("mxfp4", {}, False),
    ("q2", {"group_size": 16}, False),
    ("q1", {"group_size": 128}, False),
    ("bf16", {}, True),
]
N, K, ROWS, COLS = 512, 384, 128, 256  # a [gate; up] of two 256-row halves; prefixes of whole superblocks


@pytest.mark.parametrize("fmt,params,bias", CASES, ids=[c[0] for c in CASES])
def test_prefix_matvec_and_matmul_match_the_decoded_prefix(fmt, params, bias):
    dtype = torch.float32 if fmt != "bf16" else torch.bfloat16
    op, dense, b = make_op(fmt, (N, K), params, dtype=dtype, bias=bias)
    weights = {name: t.data_ptr() for name, t in op.parts.items()}
    bias_f = b.float().cpu() if b is not None else torch.zeros(N)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(K, generator=gen).to(dtype).to(DEVICE)
    h = torch.randn(COLS, generator=gen).to(dtype).to(DEVICE)
    tol = tolerance(dtype)
    # Rows: the first ROWS outputs.
    got = op.matvec(x, out=poisoned(ROWS, dtype=dtype), rows=ROWS)
    assert got.shape == (ROWS,)
    assert rel_err(got, x.float().cpu() @ dense[:ROWS].T + bias_f[:ROWS]) < tol
    # Columns: the first COLS of every row, as the output and as split-K partial sums.
    want = h.float().cpu() @ dense[:, :COLS].T
    assert rel_err(op.matvec(h, cols=COLS), want + bias_f) < tol
    sums = op.matvec(h, partials=poisoned(8, N, dtype=torch.float32), cols=COLS)
    assert rel_err(sums.sum(0), want) < 2e-5
    # Gate/up: act(gate) * up over the first ROWS of each half.
    y = (x.float().cpu() @ dense.T + bias_f).to(dtype)
    gate, up = y[:ROWS], y[N // 2:N // 2 + ROWS]
    got = op.matvec(x, out=poisoned(ROWS, dtype=dtype), activation="silu", rows=ROWS)
    assert rel_err(got, activate("silu", gate) * up) < 2 * tol
    # Prefill (several rows of activations): rows of both halves side by side, and leading columns.
    w = dense.to(dtype).float()
    xs = torch.randn(5, K, generator=gen).to(dtype).to(DEVICE)
    halves = torch.cat([w[:ROWS], w[N // 2:N // 2 + ROWS]])
    both = torch.cat([bias_f[:ROWS], bias_f[N // 2:N // 2 + ROWS]])
    assert rel_err(op.prefix(xs, rows=ROWS, halves=2), xs.float().cpu() @ halves.T + both) < tol
    hs = torch.randn(5, COLS, generator=gen).to(dtype).to(DEVICE)
    assert rel_err(op.prefix(hs, cols=COLS), hs.float().cpu() @ w[:, :COLS].T + bias_f) < tol
    # One row through prefix() is the matvec; nothing was copied or re-laid.
    assert rel_err(op.prefix(h[None], cols=COLS)[0], want + bias_f) < tol
    assert {name: t.data_ptr() for name, t in op.parts.items()} == weights


def test_a_prefix_that_does_not_fit_is_refused():
    op, _, _ = make_op("int4", (N, K), {"group_size": 32})
    with pytest.raises(ValueError):
        op.prefix(torch.zeros(2, K, device=DEVICE), rows=300, halves=2)
    with pytest.raises(ValueError):
        op.prefix(torch.zeros(2, 512, device=DEVICE), cols=512)


@pytest.mark.parametrize("fmt,params", [("int4", {"group_size": 32}), ("int8", {}), ("q2", {"group_size": 16}),
                                        ("fp8_e4m3", {}), ("f32", {})])
def test_a_column_prefix_takes_a_split_k_that_divides_it(fmt, params):
    from thin.runtime.kernels.common import MatvecConfig, prefix_split

    op, dense, _ = make_op(fmt, (64, K), params)
    base = op.config("partial")
    # Three programs along the 384 columns, which do not split a 256-column prefix in three.
    op._configs["partial"] = MatvecConfig(base.block_n, base.chunk, 3, base.num_warps)
    h = torch.randn(COLS, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    sums = op.matvec(h, partials=poisoned(8, 64, dtype=torch.float32), cols=COLS)
    assert 1 <= sums.shape[0] <= 3 and torch.isfinite(sums).all()
    assert rel_err(sums.sum(0), h.cpu() @ dense[:, :COLS].T) < 2e-5
    full = op.matvec(torch.randn(K, generator=torch.Generator().manual_seed(8)).to(DEVICE),
                     partials=poisoned(8, 64, dtype=torch.float32))
    assert full.shape[0] == 3
    assert prefix_split(MatvecConfig(4, 64, 4), 14, 2).split == 2  # 14 = 2 x 7: whole steps of 2 each
    assert prefix_split(MatvecConfig(4, 64, 8), 12, 2).split == 6
    assert prefix_split(MatvecConfig(4, 64, 8), 7, 2).split == 7 and prefix_split(MatvecConfig(4, 64, 4), 7).split == 1
