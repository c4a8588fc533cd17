"""Fused residual add + RMSNorm against the executor's norm arithmetic."""

import pytest
import torch
from kernel_support import DEVICE, poisoned, rel_err


def _weight(h, seed):
    return (1 + 0.2 * torch.randn(h, generator=torch.Generator().manual_seed(seed))).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("post", [False, True])
def test_partials_bias_post_norm(dtype, post):
    from thin.runtime.kernels.norm import add_rmsnorm, reference

    H = 96
    gen = torch.Generator().manual_seed(0)
    residual = torch.randn(H, generator=gen).to(dtype).to(DEVICE)
    parts = torch.randn(3, H, generator=gen).to(DEVICE)
    bias = torch.randn(H, generator=gen).to(dtype).to(DEVICE)
    norm, post_norm = (_weight(H, 1), 1e-6), ((_weight(H, 2), 1e-5) if post else None)
    want_res, want_out = reference(residual.cpu(), (parts.sum(0) + bias.float()).cpu(),
                                   None if post_norm is None else (post_norm[0].cpu(), post_norm[1]),
                                   (norm[0].cpu(), norm[1]))
    out = poisoned(H, dtype=dtype)
    add_rmsnorm(residual, out, partials=parts, bias=bias, post=post_norm, norm=norm)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert rel_err(residual, want_res) < tol and rel_err(out, want_out) < tol


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize(("bias", "post"), [(False, False), (True, True)])
def test_partials_of_several_rows(splits, bias, post):
    """Split-K partial sums [splits, rows, H] of a batched step (grouped_int_batch.rows_matmul's
    `partial`): each row sums its own, plus the bias; one row's [splits, H] is its [splits, 1, H]."""
    from thin.runtime.kernels.norm import add_rmsnorm, reference

    H, rows, dtype = 96, 3, torch.bfloat16
    gen = torch.Generator().manual_seed(10 + splits)
    residual = torch.randn(rows, H, generator=gen).to(dtype).to(DEVICE)
    parts = torch.randn(splits, rows, H, generator=gen).to(DEVICE)
    b = torch.randn(H, generator=gen).to(dtype).to(DEVICE) if bias else None
    norm, post_norm = (_weight(H, 1), 1e-6), ((_weight(H, 2), 1e-5) if post else None)
    h = parts.sum(0) + (b.float() if bias else 0)
    want_res, want_out = reference(residual.cpu(), h.cpu(), None if post_norm is None else (post_norm[0].cpu(), 1e-5),
                                   (norm[0].cpu(), norm[1]))
    got_res, out = residual.clone(), poisoned(rows, H, dtype=dtype)
    add_rmsnorm(got_res, out, partials=parts, bias=b, post=post_norm, norm=norm)
    assert rel_err(got_res, want_res) < 8e-3 and rel_err(out, want_out) < 8e-3
    # Each row alone, from its own partial sums, gives the same row.
    for r in range(rows):
        one_res, one_out = residual[r].clone(), poisoned(H, dtype=dtype)
        add_rmsnorm(one_res, one_out, partials=parts[:, r].contiguous(), bias=b, post=post_norm, norm=norm)
        assert torch.equal(one_res, got_res[r]) and torch.equal(one_out, out[r])
    with pytest.raises(ValueError, match="partial sums"):
        add_rmsnorm(residual.clone(), out, partials=parts[:, :2].contiguous(), bias=b, norm=norm)


def test_unrolled_sum_equals_the_loop(monkeypatch):
    """Up to MAX_UNROLLED partial rows are summed by an unrolled loop, more by a runtime loop: the same
    sum in the same order, bit for bit."""
    from thin.runtime.kernels import norm as module

    H, dtype = 96, torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    residual = torch.randn(H, generator=gen).to(dtype).to(DEVICE)
    parts = torch.randn(4, H, generator=gen).to(DEVICE)
    b = torch.randn(H, generator=gen).to(dtype).to(DEVICE)
    norm, post = (_weight(H, 1), 1e-6), (_weight(H, 2), 1e-5)
    got = []
    for unrolled in (module.MAX_UNROLLED, 0):
        monkeypatch.setattr(module, "MAX_UNROLLED", unrolled)
        res, out = residual.clone(), poisoned(H, dtype=dtype)
        module.add_rmsnorm(res, out, partials=parts, bias=b, post=post, norm=norm)
        got.append((res, out))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def test_rows_with_a_dense_delta_and_without_a_norm():
    from thin.runtime.kernels.norm import add_rmsnorm, reference

    gen = torch.Generator().manual_seed(3)
    residual = torch.randn(5, 64, generator=gen).to(DEVICE)
    delta = torch.randn(5, 64, generator=gen).to(DEVICE)
    want_res, want_out = reference(residual.cpu(), delta.cpu(), None, (_weight(64, 4).cpu(), 1e-5))
    out = poisoned(5, 64, dtype=torch.float32)
    add_rmsnorm(residual, out, dense=delta, norm=(_weight(64, 4), 1e-5))
    assert rel_err(residual, want_res) < 1e-6 and rel_err(out, want_out) < 1e-6
    plain = poisoned(5, 64, dtype=torch.float32)
    add_rmsnorm(residual, plain)  # no delta, no norm: a copy
    assert torch.equal(plain, residual)


@pytest.mark.gpu
def test_real_shape_on_gpu():
    test_partials_bias_post_norm(torch.bfloat16, True)


def test_fastest_fused_keeps_the_separate_launches_unless_a_fused_one_beats_them(monkeypatch):
    """norm.fastest_fused, the choice behind the finishing matvec, the norming router and the finishing
    expert down: every fused candidate compiled first, one that does not compile skipped, None when the
    separate launches are as fast."""
    from thin.runtime.kernels import tuning
    from thin.runtime.kernels.norm import fastest_fused

    compiled = []
    monkeypatch.setattr(tuning, "compile_launches", lambda jobs, report=True: compiled.extend(jobs))

    def timed(launch, **timing):
        if launch.ms is None:
            raise RuntimeError("PassManager::run failed")  # what a tiling Triton rejects raises
        return launch.ms

    monkeypatch.setattr(tuning, "median_ms", timed)

    def launch(ms):
        run = lambda: None  # noqa: E731
        run.ms = ms
        return run

    fused = [("a", launch(3.0)), ("broken", launch(None)), ("b", launch(1.5)), ("c", launch(2.0))]
    assert fastest_fused("cpu", launch(2.5), fused, "test") == ("b", 1.5, 2.5)
    assert [job[1] for job in compiled] == [f for _, f in fused]
    assert fastest_fused("cpu", launch(1.0), fused, "test") == (None, 1.0, 1.0)
