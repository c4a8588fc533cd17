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
    assert {scheme for scheme, _, _ in candidates(op)} == {"rows", "nibble"}  # float32: no "trans"
    assert takes(op)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    want = x.cpu() @ dense.T + bias.cpu()
    got = rows_matmul(op, x)
    assert got.shape == (rows, 64)
    assert rel_err(got, want) < tolerance(torch.float32)
    # A row alone gives what it gives among others.
    assert torch.equal(rows_matmul(op, x[1:2].clone()), got[1:2])
    for choice in candidates(op):
        got = rows_matmul(op, x, choice)
        assert rel_err(got, want) < tolerance(torch.float32), choice


@pytest.mark.parametrize("rows", [3, 20])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_transposed_scheme_matches_the_reference(rows, group):
    """Every band and split of the "trans" and "transw" schemes (bfloat16 activations), each step's column
    permutation against the codes' real columns: a wrong order of the code positions, halves or
    lane words fails it."""
    from thin.runtime.kernels.grouped_int_batch import candidates, rows_matmul

    op, dense, bias = make_op("int4", (128, 512), {"group_size": group}, dtype=torch.bfloat16, bias=True, seed=group)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).to(DEVICE)
    want = x.float().cpu() @ dense.T + bias.float().cpu()
    choices = [c for c in candidates(op) if c[0] in ("trans", "transw")]
    for scheme in ("trans", "transw"):
        assert {(bn, s) for name, bn, s in choices if name == scheme} >= {(64, 1), (128, 1), (64, 2), (128, 2)}
    for choice in choices:
        got = rows_matmul(op, x, choice)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 128)
        assert rel_err(got, want) < tolerance(torch.bfloat16), choice
        # A row alone gives what it gives among others.
        assert torch.equal(rows_matmul(op, x[2:3].clone(), choice), got[2:3]), choice


@pytest.mark.parametrize(("rows", "group"), [(1, 32), (7, 64), (16, 128)])
def test_the_register_mma_scheme_matches_the_reference(rows, group):
    """Every band and split of the "mma" scheme (bfloat16 activations, up to 16 rows; codes loaded two
    steps ahead, so splits of two steps read past their end and must not use it): the column order of
    the codes and of the activations' registers against the real columns, and rows past M masked off."""
    from thin.runtime.kernels.grouped_int_batch import candidates, rows_matmul

    op, dense, bias = make_op("int4", (128, 512), {"group_size": group}, dtype=torch.bfloat16, bias=True, seed=group)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).to(DEVICE)
    want = x.float().cpu() @ dense.T + bias.float().cpu()
    choices = [c for c in candidates(op, rows) if c[0] == "mma"]
    assert {(bn, s) for _, bn, s in choices} >= {(32, 1), (64, 1), (32, 2), (64, 2)}
    for choice in choices:
        got = rows_matmul(op, x, choice)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 128)
        assert rel_err(got, want) < tolerance(torch.bfloat16), choice
        # A row alone gives what it gives among others.
        assert torch.equal(rows_matmul(op, x[-1:].clone(), choice), got[-1:]), choice


def test_the_candidates_depend_on_the_row_count():
    """"mma" up to 16 rows only (and never without a row count); "nibble" left out from 16 rows up where
    "trans" runs, kept for float32 activations."""
    from thin.runtime.kernels.grouped_int_batch import MMA_ROWS, candidates, rows_matmul

    op, _, _ = make_op("int4", (128, 256), {"group_size": 32}, dtype=torch.bfloat16)
    schemes = {rows: {c[0] for c in candidates(op, rows)} for rows in (None, 2, MMA_ROWS, MMA_ROWS + 1, 64)}
    assert schemes[None] == {"rows", "nibble", "trans", "transw"}
    assert schemes[2] == {"rows", "nibble", "trans", "transw", "mma"}
    assert schemes[MMA_ROWS] == {"rows", "trans", "transw", "mma"}
    assert schemes[MMA_ROWS + 1] == schemes[64] == {"rows", "trans", "transw"}
    with pytest.raises(ValueError, match="choice"):
        rows_matmul(op, torch.zeros(MMA_ROWS + 1, 256, dtype=torch.bfloat16, device=DEVICE), ("mma", 32, 1))
    with pytest.raises(ValueError, match="choice"):
        rows_matmul(op, torch.zeros(2, 256, device=DEVICE), ("mma", 32, 1))  # float32 activations
    float_op, _, _ = make_op("int4", (128, 256), {"group_size": 32})
    assert {c[0] for c in candidates(float_op, 64)} == {"rows", "nibble"}


def test_the_transposed_scheme_is_offered_only_where_it_runs():
    from thin.runtime.kernels.grouped_int_batch import candidates, rows_matmul

    asym, _, _ = make_op("int4", (128, 256), {"group_size": 32, "asymmetric": 1}, dtype=torch.bfloat16)
    narrow, _, _ = make_op("int4", (96, 256), {"group_size": 32}, dtype=torch.bfloat16)
    assert not [c for c in candidates(asym, 2) if c[0] in ("trans", "transw", "mma")]
    # 96 rows: no band of 64 for the transposed schemes; "mma" in bands of 32.
    assert {(c[0], c[1]) for c in candidates(narrow, 2) if c[0] in ("trans", "transw", "mma")} == {("mma", 32)}
    op, _, _ = make_op("int4", (128, 256), {"group_size": 32}, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="choice"):
        rows_matmul(op, torch.zeros(2, 256, device=DEVICE), ("trans", 64, 1))  # float32 activations
    with pytest.raises(ValueError, match="choice"):
        rows_matmul(op, torch.zeros(2, 256, dtype=torch.bfloat16, device=DEVICE), ("trans", 64, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("rows", [2, 16, 64])
def test_every_candidate_at_a_real_shape_on_gpu(shape, rows):
    """The inline-PTX dequantization and the tensor-core layouts of every candidate at that row count
    ("mma" at 2 and 16 rows), on the GPU."""
    from thin.runtime.kernels.grouped_int_batch import candidates, rows_matmul

    op, dense, _ = make_op("int4", shape, {"group_size": 128}, dtype=torch.bfloat16, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).to(DEVICE)
    want = x.float().cpu() @ dense.T
    for choice in candidates(op, rows):
        assert rel_err(rows_matmul(op, x, choice), want) < tolerance(torch.bfloat16), choice


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 64])
def test_the_fused_glu_and_partial_sums_at_real_shapes_on_gpu(rows):
    """llama-8b's gate_up (the GLU epilogue, or the partial sums summed with the activation) and down
    (partial sums into the fused norm) against the plain output, every candidate, on the GPU."""
    from thin.runtime.kernels.activation import glu
    from thin.runtime.kernels.grouped_int_batch import candidates, rows_matmul
    from thin.runtime.kernels.norm import add_rmsnorm

    gen = torch.Generator().manual_seed(rows)
    gate_up, _, _ = make_op("int4", (28672, 4096), {"group_size": 128}, dtype=torch.bfloat16, seed=rows)
    x = torch.randn(rows, 4096, generator=gen).to(torch.bfloat16).to(DEVICE)
    for choice in candidates(gate_up, rows):
        want = glu(rows_matmul(gate_up, x, choice), "silu")
        assert rel_err(rows_matmul(gate_up, x, choice, activation="silu"), want) < 1e-2, choice
    down, _, bias = make_op("int4", (4096, 14336), {"group_size": 128}, dtype=torch.bfloat16, bias=True, seed=rows)
    x = torch.randn(rows, 14336, generator=gen).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(rows, 4096, generator=gen).to(torch.bfloat16).to(DEVICE)
    norm = ((1 + 0.1 * torch.randn(4096, generator=gen)).to(DEVICE), 1e-5)
    for choice in candidates(down, rows):
        h = rows_matmul(down, x, choice, partial=True)
        got_res, got = residual.clone(), torch.empty_like(residual)
        if h.dim() == 3:
            add_rmsnorm(got_res, got, partials=h, bias=bias, norm=norm)
        else:
            add_rmsnorm(got_res, got, dense=h, norm=norm)
        want_res, want = residual.clone(), torch.empty_like(residual)
        add_rmsnorm(want_res, want, dense=rows_matmul(down, x, choice), norm=norm)
        assert torch.equal(got_res, want_res) and torch.equal(got, want), choice


def test_rows_matmul_refuses_what_it_does_not_take():
    from thin.runtime.kernels.grouped_int_batch import rows_matmul, takes

    op, _, _ = make_op("int5", (32, 64), {"group_size": 32})
    assert not takes(op)
    with pytest.raises(ValueError, match="int4"):
        rows_matmul(op, torch.zeros(2, 64, device=DEVICE))


def _sequential_sum(part, bias):
    """The partial sums' total in float32: split 0, 1, ..., then the bias."""
    total = part[0].clone()
    for s in range(1, part.shape[0]):
        total += part[s]
    return total + bias.float() if bias is not None else total


@pytest.mark.parametrize(("rows", "bias"), [(3, True), (16, False)])
def test_partial_sums_and_the_fused_glu(rows, bias):
    """rows_matmul's `partial` (split-K partial sums as they are, for the fused norm) and `activation`
    (act(gate) * up of a fused [gate; up] weight: in each scheme's epilogue, or from the partial sums
    with activation.glu_partials) give what the plain output and activation.glu give, for every
    candidate (splits 1, 2 and 4)."""
    from thin.runtime.kernels.activation import glu
    from thin.runtime.kernels.grouped_int_batch import candidates, rows_matmul
    from thin.runtime.kernels.norm import add_rmsnorm

    op, dense, b = make_op("int4", (256, 512), {"group_size": 64}, dtype=torch.bfloat16, bias=bias, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).to(DEVICE)
    choices = candidates(op, rows)
    assert {c[2] for c in choices} == {1, 2, 4} and {c[0] for c in choices} >= {"rows", "trans", "transw", "mma"}
    want = x.float().cpu() @ dense.T + (b.float().cpu() if bias else 0)
    residual = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    norm = ((1 + 0.1 * torch.randn(256, generator=torch.Generator().manual_seed(2))).to(DEVICE), 1e-5)
    for choice in choices:
        plain = rows_matmul(op, x, choice)
        assert rel_err(plain, want) < tolerance(torch.bfloat16), choice
        part = rows_matmul(op, x, choice, partial=True)
        if choice[2] > 1:
            assert part.dtype == torch.float32 and part.shape == (choice[2], rows, 256), choice
            assert rel_err(_sequential_sum(part, b), want) < tolerance(torch.bfloat16), choice
            # The fused norm over the partial sums gives what it gives over the summed output.
            summed, normed = residual.clone(), torch.empty_like(residual)
            add_rmsnorm(summed, normed, partials=part, bias=b, norm=norm)
            dense_res, dense_out = residual.clone(), torch.empty_like(residual)
            add_rmsnorm(dense_res, dense_out, dense=plain, norm=norm)
            assert torch.equal(summed, dense_res) and torch.equal(normed, dense_out), choice
        else:
            assert torch.equal(part, plain), choice
        fused = rows_matmul(op, x, choice, activation="silu")
        assert fused.dtype == torch.bfloat16 and fused.shape == (rows, 128), choice
        assert torch.equal(fused, glu(plain, "silu")), choice
    with pytest.raises(ValueError, match="activation"):
        rows_matmul(op, x, choices[0], partial=True, activation="silu")
    with pytest.raises(ValueError, match="activation"):
        rows_matmul(op, x, choices[0], activation="swish")


@pytest.mark.parametrize("params", [{"group_size": 32}, {"group_size": 128, "asymmetric": 1}])
def test_the_fused_glu_in_float32(params):
    """The "rows" and "nibble" schemes' GLU epilogue (float32 activations, asymmetric codes, a bias)."""
    from thin.runtime.kernels.activation import glu
    from thin.runtime.kernels.grouped_int_batch import candidates, rows_matmul

    op, _, _ = make_op("int4", (128, 256), params, bias=True, seed=7)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    for choice in candidates(op, 5):
        want = glu(rows_matmul(op, x, choice), "gelu_tanh")
        assert rel_err(rows_matmul(op, x, choice, activation="gelu_tanh"), want) < 1e-6, choice
        assert torch.equal(rows_matmul(op, x, choice, partial=True), rows_matmul(op, x, choice)), choice
