"""The router that also runs the residual norm before its MoE layer (norm_router.py) against add_rmsnorm
then the router, launched apart."""

import pytest
import torch
from kernel_support import DEVICE, poisoned, rel_err
from test_kernels_experts import _plan


def _case(num_experts, hidden, parts, *, bias, post, router_bias, dtype=torch.bfloat16, seed=0):
    """(MoEKernels, residual, partials [parts, hidden], o's bias, post-norm, norm) of random values."""
    from thin.runtime.kernels.experts import MoEKernels

    plan = _plan([("f32", {})] * num_experts, hidden=hidden, router_bias=router_bias, seed=seed, dtype=dtype)
    kernels = MoEKernels(plan, DEVICE, dtype, tune=False)
    gen = torch.Generator().manual_seed(seed + 1)
    residual = torch.randn(hidden, generator=gen).to(dtype).to(DEVICE)
    partials = torch.randn(parts, hidden, generator=gen).to(DEVICE)
    b = (0.5 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE) if bias else None
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(DEVICE)
    post_norm = (weight.flip(0).contiguous(), 1e-5) if post else None
    return kernels, residual, partials, b, post_norm, (weight, 1e-6)


def _both(kernels, residual, partials, b, post_norm, norm, config, launches=1):
    """((residual, normed, logits) of `launches` norming-router launches with `config`, the same of
    add_rmsnorm + router, the arrival counter after)."""
    from thin.runtime.kernels.norm import Finish, add_rmsnorm

    want_res, want_out = residual.clone(), poisoned(residual.numel(), dtype=residual.dtype)
    for _ in range(launches):
        add_rmsnorm(want_res, want_out, partials=partials, bias=b, post=post_norm, norm=norm)
        kernels.route(want_out)
    want_logits = kernels.logits.clone()
    kernels.logits.fill_(float("nan"))
    kernels.norm_router = config
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got_res, got_out = residual.clone(), poisoned(residual.numel(), dtype=residual.dtype)
    for _ in range(launches):
        kernels.route_norm(Finish(counter, got_res, got_out, b, post_norm, norm), partials)
    return (got_res, got_out, kernels.logits.clone()), (want_res, want_out, want_logits), counter


@pytest.mark.parametrize("parts", [1, 3, 10])  # 10: past the unrolled sums (norm.MAX_UNROLLED), a loop
@pytest.mark.parametrize(("bias", "post", "router_bias"), [(False, False, False), (True, True, True),
                                                           (True, False, True)])
def test_norming_router_is_add_rmsnorm_then_the_router(parts, bias, post, router_bias):
    """Residual and normed bit for bit (the same row arithmetic, norm.residual_norm_values), the logits
    the router's; 7 experts 2 a program: 4 programs, the last one's tile half empty, and only one of
    them stores. Twice in a row: the counter is back at zero after each launch."""
    from thin.runtime.kernels import norm_router

    case = _case(7, 96, parts, bias=bias, post=post, router_bias=router_bias, seed=parts)
    for config in norm_router.candidates(7, 96):
        for launches in (1, 2):
            got, want, counter = _both(*case, config, launches)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (config, launches)
            assert torch.allclose(got[2], want[2], rtol=1e-5, atol=1e-5), (config, launches)
            assert int(counter) == 0


def test_norming_router_refuses_what_it_cannot_take():
    from thin.runtime.kernels.expert_tiles import RouterConfig
    from thin.runtime.kernels.norm import Finish

    kernels, residual, partials, b, post_norm, norm = _case(4, 64, 2, bias=True, post=False, router_bias=False)
    finish = Finish(torch.zeros(1, dtype=torch.int32, device=DEVICE), residual, residual.clone(), b, post_norm, norm)
    with pytest.raises(ValueError, match="norm_router tiles"):
        kernels.route_norm(finish, partials)
    kernels.norm_router = RouterConfig(2, 64)
    with pytest.raises(ValueError, match="float32 partial sums"):
        kernels.route_norm(finish, partials.to(torch.bfloat16))
    kernels.norm_router = RouterConfig(2, 32)
    with pytest.raises(ValueError, match="whole rows"):
        kernels.route_norm(finish, partials)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_experts", "hidden", "router_bias"), [(128, 2048, False), (32, 2880, True)])
def test_norming_router_real_shapes_on_gpu(num_experts, hidden, router_bias):
    """moe-a3b's and gpt-oss-20b's routers, every tiling the timing may pick: the residual bit for bit
    (elementwise), normed and logits to rounding (the row's sum of squares is reduced over other
    thread counts than add_rmsnorm's)."""
    from thin.runtime.kernels import norm_router

    case = _case(num_experts, hidden, 4, bias=router_bias, post=False, router_bias=router_bias, seed=5)
    configs = norm_router.candidates(num_experts, hidden)
    assert len(configs) > 1
    for config in configs:
        got, want, counter = _both(*case, config, launches=2)
        assert torch.equal(got[0], want[0]), config
        assert rel_err(got[1], want[1]) < 4e-3 and rel_err(got[2], want[2]) < 4e-3, config
        assert int(counter) == 0
