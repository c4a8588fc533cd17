"""The expert down launch whose last program also runs the residual norm after its MoE layer
(expert_finish.py) against the same down launch then add_rmsnorm."""

import pytest
import torch
from kernel_support import DEVICE, HAS_CUDA, poisoned, rel_err
from test_kernels_experts import _plan


def _case(fmts, *, dtype=torch.bfloat16, top_k=2, post=False, norm=True, hidden=64, inter=64, seed=0, **extra):
    """(MoEKernels routed and gate/up run on a random x, residual, post-norm, norm) of random values."""
    from thin.runtime.kernels.experts import MoEKernels

    plan = _plan(fmts, hidden=hidden, inter=inter, top_k=top_k, seed=seed, dtype=dtype, **extra)
    kernels = MoEKernels(plan, DEVICE, dtype, tune=False)
    gen = torch.Generator().manual_seed(seed + 1)
    kernels(torch.randn(hidden, generator=gen).to(dtype).to(DEVICE), poisoned(top_k, hidden, dtype=torch.float32))
    residual = torch.randn(hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(DEVICE)
    return kernels, residual, (weight.flip(0).contiguous(), 1e-5) if post else None, (weight, 1e-6) if norm else None


def _both(kernels, residual, post, norm, config, launches):
    """((rows, residual, normed) after `launches` finishing down launches with `config`, the same of that
    down launch then add_rmsnorm, the arrival counter after)."""
    from thin.runtime.kernels.norm import Finish, add_rmsnorm

    top_k, H = kernels.top_k, kernels.hidden
    want_rows, want_res, want_out = poisoned(top_k, H, dtype=torch.float32), residual.clone(), \
        poisoned(H, dtype=residual.dtype)
    for _ in range(launches):
        kernels._down(0, want_rows, config)
        add_rmsnorm(want_res, want_out, partials=want_rows, post=post, norm=norm)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got_rows, got_res, got_out = poisoned(top_k, H, dtype=torch.float32), residual.clone(), \
        poisoned(H, dtype=residual.dtype)
    for _ in range(launches):
        kernels._down(0, got_rows, config, finish=Finish(counter, got_res, got_out, None, post, norm))
    return (got_rows, got_res, got_out), (want_rows, want_res, want_out), counter


@pytest.mark.parametrize(("fmt", "params", "extra"), [
    ("int4", {"group_size": 32}, {}),
    ("bf16", {}, {}),
    ("mxfp4", {}, dict(bias=True, clamp=True, router_bias=True)),  # GPT-OSS: the rows hold down's bias
])
@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("post", [False, True])
def test_finishing_down_is_down_then_add_rmsnorm(fmt, params, extra, top_k, post):
    """The rows as the plain launch writes them, residual and normed bit for bit (add_rmsnorm's row
    arithmetic, norm.residual_norm_row, over the same rows in the same order), every tiling the timing
    may pick; a launch of top_k x 2 programs (hidden 64 in rows of 32 and fewer), only one of which
    norms; twice in a row, the counter back at zero after each."""
    from thin.runtime.kernels import expert_finish

    kernels, residual, post_norm, norm = _case([(fmt, params)] * 6, top_k=top_k, post=post, seed=top_k, **extra)
    configs = expert_finish.candidates(kernels)
    assert configs and any(c.words for c in configs) == (fmt != "bf16")
    for config in configs:
        for launches in (1, 2):
            got, want, counter = _both(kernels, residual, post_norm, norm, config, launches)
            for g, w in zip(got, want):
                assert torch.equal(g, w), (config, launches)
            assert int(counter) == 0


def test_finishing_down_without_a_norm_and_with_idle_lanes():
    """No next norm (normed is the residual), and a whole-word tiling of more chunks a step than the row
    has (expert_finish's wider tilings on a GPU: lanes past the row's chunks idle)."""
    from thin.runtime.kernels.expert_tiles import ExpertConfig

    kernels, residual, post_norm, _ = _case([("int4", {"group_size": 32})] * 5, top_k=3, post=True, seed=7)
    for config in (ExpertConfig(16, 4, 2, words=True), ExpertConfig(32, 4, 2, words=True, packed=True)):
        got, want, counter = _both(kernels, residual, post_norm, None, config, 2)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), config
        assert torch.equal(got[1], got[2]) and int(counter) == 0


def test_the_layer_call_finishes_and_refuses_what_it_cannot():
    """MoEKernels(x, partials, finish=...) is the plain call then add_rmsnorm; it needs chosen tiles, and a
    layer of two down formats (two launches) has no finishing tilings."""
    from thin.runtime.kernels import expert_finish
    from thin.runtime.kernels.norm import Finish, add_rmsnorm

    kernels, residual, post_norm, norm = _case([("int4", {"group_size": 32})] * 4, top_k=2, post=True, seed=3)
    x = torch.randn(kernels.hidden, generator=torch.Generator().manual_seed(9)).to(residual.dtype).to(DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got_res, got_out = residual.clone(), poisoned(kernels.hidden, dtype=residual.dtype)
    finish = Finish(counter, got_res, got_out, None, post_norm, norm)
    with pytest.raises(ValueError, match="finish_down tiles"):
        kernels(x, poisoned(4, kernels.hidden, dtype=torch.float32), finish=finish)
    kernels.finish_down = kernels._configs[(0, "down")] = expert_finish.candidates(kernels)[0]
    rows = kernels(x, poisoned(4, kernels.hidden, dtype=torch.float32), finish=finish)
    want_res, want_out = residual.clone(), poisoned(kernels.hidden, dtype=residual.dtype)
    want_rows = kernels(x, poisoned(4, kernels.hidden, dtype=torch.float32))
    add_rmsnorm(want_res, want_out, partials=want_rows, post=post_norm, norm=norm)
    assert torch.equal(rows, want_rows) and torch.equal(got_res, want_res) and torch.equal(got_out, want_out)
    assert int(counter) == 0
    with pytest.raises(ValueError, match="top_k rows"):
        kernels._down(0, poisoned(3, kernels.hidden, dtype=torch.float32), kernels.finish_down, finish=finish)
    mixed, *_ = _case([("int4", {"group_size": 32})] * 3 + [("q2", {"group_size": 16})] * 3, seed=4)
    assert len(mixed.down_groups) == 2 and expert_finish.candidates(mixed) == []


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("fmt", "params", "hidden", "inter", "top_k", "extra"), [
    ("int4", {"group_size": 128}, 2048, 768, 8, {}),
    ("bf16", {}, 2048, 768, 8, {}),
    ("mxfp4", {}, 2880, 2880, 4, dict(bias=True, clamp=True, router_bias=True)),
])
def test_finishing_down_real_shapes_on_gpu(fmt, params, hidden, inter, top_k, extra):
    """moe-a3b's and gpt-oss-20b's expert down, every finishing tiling: the rows and the residual bit for
    bit, normed to rounding (the row's sum of squares is reduced over other thread counts than
    add_rmsnorm's)."""
    from thin.runtime.kernels import expert_finish

    kernels, residual, post_norm, norm = _case([(fmt, params)] * 16, top_k=top_k, hidden=hidden, inter=inter,
                                               seed=5, **extra)
    configs = expert_finish.candidates(kernels)
    assert configs and all(expert_finish.holds_row(c, hidden) for c in configs)
    for config in configs:
        got, want, counter = _both(kernels, residual, post_norm, norm, config, 2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), config
        assert rel_err(got[2], want[2]) < 4e-3 and int(counter) == 0, config
