"""Grouped-int (int3-int6) matvecs that finish the residual norm in their last program (matvec_finish)
against their partial sums then add_rmsnorm."""

import pytest
import torch
from kernel_support import DEVICE, poisoned, rel_err
from linear_kernel_cases import make_op

# (format, asymmetric, bf16 pairs): int4 both arithmetics, asymmetric int3 (2-bit low plane + 1-bit
# high) and int5 (4 + 1).
CASES = [("int4", 0, True), ("int4", 0, False), ("int3", 1, False), ("int5", 1, False)]


def _finish_case(fmt, asymmetric, shape, config, *, bias, post, cols=None, launches=1, seed=11):
    """(finishing matvec's (residual, normed), separate partials + add_rmsnorm's, counter after each launch)."""
    from thin.runtime.kernels.norm import Finish, add_rmsnorm

    dtype = torch.bfloat16
    op, _, b = make_op(fmt, shape, {"group_size": 32, "asymmetric": asymmetric}, dtype=dtype, bias=bias, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(shape[1] if cols is None else cols, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(shape[0], generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.2 * torch.randn(shape[0], generator=gen)).to(DEVICE)
    post_norm = (weight.flip(0).contiguous(), 1e-5) if post else None
    norm = (weight, 1e-6)
    want_res, want_out = residual.clone(), poisoned(shape[0], dtype=dtype)
    got_res, got_out = residual.clone(), poisoned(shape[0], dtype=dtype)
    if cols is None:
        op.finish_config = config
    else:  # a prefix's own configuration, the whole weight's unset
        op.finish_prefixes = {cols: config}
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    counts = []
    for _ in range(launches):
        parts = poisoned(8, shape[0], dtype=torch.float32)
        used = op._matvec(x, parts, config, -1, True, cols=cols)
        add_rmsnorm(want_res, want_out, partials=parts[:used], bias=b, post=post_norm, norm=norm)
        op.matvec_finish(x, poisoned(8, shape[0], dtype=torch.float32),
                         Finish(counter, got_res, got_out, b, post_norm, norm), cols=cols)
        counts.append(int(counter))
    return (got_res, got_out), (want_res, want_out), counts


@pytest.mark.parametrize(("fmt", "asymmetric", "packed"), CASES)
@pytest.mark.parametrize(("bias", "post"), [(False, False), (True, True)])
def test_finishing_matvec_is_add_rmsnorm(fmt, asymmetric, packed, bias, post):
    """Bit for bit (the interpreter: the same row function), for split 1, 2 and a ragged 3 (of 8 chunks),
    several programs a split (32-row tiles over 96 rows), twice in a row; the counter zero after each."""
    from thin.runtime.kernels.common import MatvecConfig

    for split in (1, 2, 3):
        config = MatvecConfig(32, 64, split, 4, packed=packed)
        got, want, counts = _finish_case(fmt, asymmetric, (96, 256), config, bias=bias, post=post, launches=2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), split
        assert counts == [0, 0], split


@pytest.mark.parametrize(("fmt", "asymmetric", "packed"), [CASES[0], CASES[2]])
def test_finishing_matvec_over_a_column_prefix(fmt, asymmetric, packed):
    """An elastic FFN level's down (the first `cols` columns, x [cols]): the split cut to divide the
    prefix's chunks exactly as the plain prefix matvec cuts it."""
    from thin.runtime.kernels.common import MatvecConfig

    for split, cols in ((3, 128), (4, 192), (2, 96)):
        config = MatvecConfig(32, 64, split, 4, packed=packed)
        got, want, counts = _finish_case(fmt, asymmetric, (96, 256), config, bias=True, post=False, cols=cols,
                                         launches=2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (split, cols)
        assert counts == [0, 0]


def test_finish_candidates_hold_the_row():
    """Every finishing candidate: a partial-sum candidate of at most max_split splits with 32 values of
    the row a thread at most."""
    op, _, _ = make_op("int4", (96, 256), {"group_size": 32}, dtype=torch.bfloat16)
    candidates = op.finish_candidates(8)
    assert candidates and all(c in op.candidates("partial") and c.num_warps * 1024 >= 96 for c in candidates)
    assert not op.finish_candidates(0)
    op.finish_config = None
    with pytest.raises(ValueError, match="finish_config"):
        op.matvec_finish(torch.zeros(256, dtype=torch.bfloat16, device=DEVICE), torch.zeros(8, 96), None)


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "asymmetric"), [("int4", 0), ("int4", 1), ("int3", 1)])
def test_finishing_matvec_real_shapes_on_gpu(fmt, asymmetric):
    """At llama-8b's o and down shapes (and down's half prefix, a level's), group 32, every finishing
    candidate twice in a row: the residual as the separate launches leave it, the normed row up to the
    sum's order, the counter back to zero."""
    for shape, cols in [((4096, 4096), None), ((4096, 14336), None), ((4096, 14336), 7168)]:
        op, _, _ = make_op(fmt, shape, {"group_size": 32, "asymmetric": asymmetric}, dtype=torch.bfloat16)
        candidates = op.finish_candidates(8, cols)
        assert candidates and all(c.num_warps >= 4 for c in candidates)
        for config in candidates:
            got, want, counts = _finish_case(fmt, asymmetric, shape, config, bias=True, post=False, cols=cols,
                                             launches=2)
            assert torch.equal(got[0], want[0]), config
            assert rel_err(got[1], want[1]) < 1e-2 and counts == [0, 0], config


def test_choose_finish_times_a_column_prefix(monkeypatch):
    """norm.choose_finish over an elastic prefix (cols): both the separate launches and every finishing
    candidate run over the prefix (each launch called, its result checked against the separate one's),
    and the faster is kept (the timing replaced by a count of the calls: separate slower here)."""
    from thin.runtime.kernels import tuning
    from thin.runtime.kernels.norm import choose_finish

    monkeypatch.setattr(tuning, "small_weight", lambda op: False)
    monkeypatch.setattr(tuning, "compile_launches", lambda jobs, report=True: None)
    ran = []

    def timed(launch, **timing):
        launch()
        ran.append(launch)
        return 2.0 if len(ran) == 1 else 1.0  # the separate launches first

    ops = [make_op("int4", (96, 256), {"group_size": 32}, dtype=torch.bfloat16, seed=s)[0] for s in (1, 2)]
    for op in ops:  # the prefix's partial-sum configuration first: on a GPU choosing it times candidates too
        op.config("partial", None, 128)
    monkeypatch.setattr(tuning, "median_ms", timed)
    config = choose_finish(ops, 8, False, True, cols=128)
    assert config in ops[0].finish_candidates(8, 128) and len(ran) == 1 + len(ops[0].finish_candidates(8, 128))
