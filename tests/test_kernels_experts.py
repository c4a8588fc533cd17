"""The mixture-of-experts decode kernels (router top-k, selected experts' gate/up + activation, weighted
down) against the executor's torch path (ffn.run_moe) on the same plan, for every expert format they
read; on the CPU through Triton's interpreter at tiny shapes."""

from __future__ import annotations

import pytest
import torch
from kernel_support import DEVICE, HAS_CUDA, poisoned, rel_err, tolerance

from thin.ir import Encoding, Tensor, formats
from thin.runtime.ffn import MLPPlan, MoEPlan, run_moe
from thin.runtime.linear import make_linear

HIDDEN, INTER = 64, 32


def _op(fmt: str, shape, params, gen, dtype, bias: bool):
    """A LinearOp (the device's own implementation: Triton on CUDA, torch on the CPU) of a random weight."""
    params = formats.get(fmt).normalize(params)
    w = 0.3 * torch.randn(*shape, generator=gen)
    record = Tensor("layers.0.mlp.experts.0.w", "moe.expert.up", 0, tuple(shape), Encoding(fmt, params), "f32")
    b = (0.1 * torch.randn(shape[0], generator=gen)).to(dtype).to(DEVICE) if bias else None
    return make_linear(record, formats.encode(fmt, w.to(DEVICE), params).cpu(), b, DEVICE, dtype)


def _plan(fmts, *, dtype=torch.float32, top_k=2, fused=True, bias=False, clamp=False, normalize=True,
          router_bias=False, seed=0, hidden=HIDDEN, inter=INTER, down_fmts=None):
    """A MoEPlan of len(fmts) random experts, expert e stored in fmts[e] = (format, params) (its down
    projection in down_fmts[e] when given)."""
    gen = torch.Generator().manual_seed(seed)
    experts = []
    for e, (fmt, params) in enumerate(fmts):
        up = [_op(fmt, (2 * inter, hidden), params, gen, dtype, bias)] if fused else \
            [_op(fmt, (inter, hidden), params, gen, dtype, bias) for _ in range(2)]
        down_fmt, down_params = down_fmts[e] if down_fmts else (fmt, params)
        down = _op(down_fmt, (hidden, inter), down_params, gen, dtype, bias)
        extra = dict(alpha=1.702, limit=1.5, up_offset=1.0) if clamp else {}
        experts.append(MLPPlan("silu", True, up, down, **extra))
    router = torch.randn(len(fmts), hidden, generator=gen).to(DEVICE)
    rbias = (0.5 * torch.randn(len(fmts), generator=gen)).to(DEVICE) if router_bias else None
    return MoEPlan(top_k, normalize, "softmax", router, rbias, experts, None, None)


def _check(plan, dtype=torch.float32, seed=1, tol=None):
    from thin.runtime.kernels.experts import MoEKernels

    kernels = MoEKernels(plan, DEVICE, dtype, tune=False)
    gen = torch.Generator().manual_seed(seed)
    # The tilings the tuner picks from (under the interpreter: one step a row, and steps with the next
    # one prefetched; on a GPU the default and the first prefetching one), each on its own tokens.
    tilings = {(i, kind): _tilings(kernels.candidates(g, kind)) for kind in ("gate_up", "down")
               for i, g in enumerate(kernels.groups(kind))}
    tilings["router"] = kernels.router_candidates()
    for trial in range(max(3, *map(len, tilings.values()))):
        for key, options in tilings.items():
            kernels._configs[key] = options[trial % len(options)]
        x = torch.randn(kernels.hidden, generator=gen).to(dtype).to(DEVICE)
        partials = poisoned(kernels.top_k + 1, kernels.hidden, dtype=torch.float32)
        got = kernels(x, partials)
        assert got.shape == (plan.top_k, kernels.hidden)
        want = run_moe(x[None], plan)[0].float()
        err = rel_err(got.sum(0), want)
        assert err < (tol or 4 * tolerance(dtype)), f"{err}"
        # The chosen experts are torch's top-k, in its order (best first).
        probs = torch.softmax(torch.nn.functional.linear(x.float(), plan.router_weight, plan.router_bias), -1)
        chosen = torch.topk(probs, plan.top_k).indices.tolist()
        assert kernels.chosen.tolist() == chosen
        weights = [_weight(probs, chosen, slot, plan) for slot in range(plan.top_k)]
        assert torch.allclose(kernels.weights.cpu(), torch.tensor(weights), rtol=1e-5)
        for slot, e in enumerate(chosen):
            alone = run_moe_single(x, plan, e)
            assert rel_err(got[slot], alone * _weight(probs, chosen, slot, plan)) < (tol or 4 * tolerance(dtype))


def _tilings(candidates):
    from thin.runtime.kernels import interpreting

    if interpreting():
        return candidates
    # On a GPU: the default, the first prefetching tiling, and one whole-word tiling of each kind (warps,
    # chunks a step, bf16 pairs or not).
    kinds = {}
    for c in candidates:
        if c.words:
            kinds.setdefault((c.num_warps, c.groups, c.packed), c)
    return [candidates[0], next(c for c in candidates if c.prefetch), *kinds.values()]


def run_moe_single(x, plan, e):
    from thin.runtime.ffn import run_mlp

    return run_mlp(x[None], plan.experts[e])[0].float()


def _weight(probs, chosen, slot, plan):
    top = probs[chosen]
    return float(top[slot] / top.sum()) if plan.normalize_top_k else float(top[slot])


FORMATS = {
    "f32": {}, "int8": {}, "fp8_e4m3": {}, "int4": {"group_size": 32}, "int4-asym": {"group_size": 32, "asymmetric": 1},
    "int3": {"group_size": 32}, "int5": {"group_size": 32}, "int6-asym": {"group_size": 32, "asymmetric": 1},
    "int6": {"group_size": 32}, "mxfp4": {}, "q2": {"group_size": 16}, "q1": {"group_size": 32},
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_experts_match_the_torch_path(name):
    fmt = name.split("-")[0]
    _check(_plan([(fmt, FORMATS[name])] * 4, seed=list(FORMATS).index(name)))


def test_clamped_swiglu_with_biases_and_router_bias():
    """GPT-OSS: biases on every expert projection and the router, silu with a gain, clamps, up + 1."""
    _check(_plan([("mxfp4", {})] * 4, bias=True, clamp=True, router_bias=True, seed=3))
    _check(_plan([("f32", {})] * 4, bias=True, clamp=True, router_bias=True, seed=4))


def test_separate_gate_and_up_without_renormalising():
    _check(_plan([("int4", {"group_size": 32})] * 6, fused=False, normalize=False, top_k=3, seed=5))


def test_experts_of_different_formats_in_one_layer():
    """Routing-aware bits: one launch per format, each writing only the slots of its experts."""
    fmts = [("int4", {"group_size": 32}), ("q2", {"group_size": 16}), ("mxfp4", {}), ("f32", {}),
            ("q1", {"group_size": 32}), ("int8", {}), ("int5", {"group_size": 32}), ("int3", {"group_size": 32})]
    _check(_plan(fmts, top_k=4, seed=6))


def test_an_experts_down_in_another_format_than_its_gate_up():
    """Routing-aware bits per projection: gate/up launches grouped by gate/up's format, down launches by
    down's, so an expert may keep its down finer (or coarser) than its gate/up."""
    from thin.runtime.kernels.experts import MoEKernels

    fmts = [("q2", {"group_size": 16}), ("q1", {"group_size": 32}), ("q2", {"group_size": 16}), ("mxfp4", {}),
            ("int4", {"group_size": 32})]
    downs = [("int4", {"group_size": 32}), ("q2", {"group_size": 16}), ("q2", {"group_size": 32}), ("mxfp4", {}),
             ("q1", {"group_size": 32})]
    plan = _plan(fmts, down_fmts=downs, top_k=3, bias=True, clamp=True, router_bias=True, seed=12)
    kernels = MoEKernels(plan, DEVICE, torch.float32, tune=False)
    assert (len(kernels.groups("gate_up")), len(kernels.groups("down"))) == (4, 5)
    _check(plan)


def test_bf16_experts_round_like_the_torch_path():
    _check(_plan([("bf16", {})] * 4, dtype=torch.bfloat16, bias=True, seed=7), dtype=torch.bfloat16)


def test_uneven_shapes_mask_their_tails():
    """Rows and columns that the tiles do not divide (gpt-oss-20b's 2880 is 90 groups of 32)."""
    _check(_plan([("mxfp4", {})] * 3, hidden=96, inter=160, seed=8))
    _check(_plan([("f32", {})] * 3, hidden=96, inter=48, seed=9))


def test_grouped_ints_read_as_whole_words():
    """The whole-word tilings (expert_words.py), bf16 pairs included, are among the candidates every
    _check runs: int4 under bf16 activations, fused and separate gate/up, rows and chunks the tiles do
    not divide (3 chunks of 32 columns, steps of 2); asymmetric int4 in float32 (the FORMATS test runs the
    other grouped ints' whole-word tilings)."""
    from thin.runtime.kernels.experts import MoEKernels

    plan = _plan([("int4", {"group_size": 32})] * 4, dtype=torch.bfloat16, hidden=96, inter=96, seed=13)
    kernels = MoEKernels(plan, DEVICE, torch.bfloat16, tune=False)
    for kind in ("gate_up", "down"):
        labels = [c.label() for c in kernels.candidates(kernels.groups(kind)[0], kind)]
        assert any(label.endswith("+words") for label in labels) and any("+pairs" in label for label in labels)
    _check(plan, dtype=torch.bfloat16)
    _check(_plan([("int4", {"group_size": 64})] * 4, dtype=torch.bfloat16, fused=False, top_k=3, hidden=64,
                 inter=64, bias=True, seed=14), dtype=torch.bfloat16)
    _check(_plan([("int4", {"group_size": 32, "asymmetric": 1})] * 3, hidden=96, inter=160, seed=15))


def test_mxfp4_read_as_whole_words():
    """mxfp4's whole-word tilings, its codes as 2^-126 times their values (subnormal where the exponent
    is 0) in float32 and, under bf16 activations, in bf16 pairs: GPT-OSS's clamped SwiGLU with biases, odd
    chunks and rows the tiles do not divide."""
    from thin.runtime.kernels.experts import MoEKernels

    plan = _plan([("mxfp4", {})] * 4, dtype=torch.bfloat16, hidden=96, inter=96, bias=True, clamp=True,
                 router_bias=True, seed=18)
    kernels = MoEKernels(plan, DEVICE, torch.bfloat16, tune=False)
    labels = [c.label() for c in kernels.candidates(kernels.groups("down")[0], "down")]
    assert any(label.endswith("+words") for label in labels) and any("+pairs" in label for label in labels)
    _check(plan, dtype=torch.bfloat16)


def test_the_timings_routings_pick_each_groups_experts_in_turn():
    """The launch tuner times each kernel over routings that read other experts launch after launch
    (expert_tiles.routings): the gate/up kernel, given routing r's logits, chooses routing r's experts."""
    from thin.runtime.kernels.expert_tiles import routings
    from thin.runtime.kernels.experts import MoEKernels

    fmts = [("int4", {"group_size": 32})] * 6 + [("q2", {"group_size": 16})] * 3
    kernels = MoEKernels(_plan(fmts, top_k=2, seed=17), DEVICE, torch.float32, tune=False)
    x = torch.randn(HIDDEN).to(DEVICE)
    for index, group in enumerate(kernels.groups("gate_up")):
        logits, chosen, weights = routings(group, len(fmts), 2, True, DEVICE)
        assert logits.shape[0] == -(-len(group.members) // 2)
        seen = set()
        for r in range(logits.shape[0]):
            kernels._gate_up(index, x, kernels.candidates(group, "gate_up")[0], logits=logits[r])
            assert kernels.chosen.tolist() == chosen[r].tolist()
            assert torch.allclose(kernels.weights, weights[r])
            seen |= set(chosen[r].tolist())
        assert seen >= set(group.members)
    for index, group in enumerate(kernels.groups("down")):  # and the down kernel reads the routing it is given
        logits, chosen, weights = routings(group, len(fmts), 2, True, DEVICE)
        out = poisoned(kernels.top_k, HIDDEN, dtype=torch.float32)
        kernels._down(index, out, kernels.candidates(group, "down")[0], chosen=chosen[-1], weights=weights[-1])
        written = [slot for slot, e in enumerate(chosen[-1].tolist()) if e in group.members]
        assert written and not out[written].isnan().any()


def test_tiles_timed_inside_a_call_leave_the_calls_routing(monkeypatch):
    """Tiles chosen by timing on first use, inside a call (an engine's first decode step when its kernels
    were not warmed up, as DecodeEngine(executor) without warm_up; on a GPU): the timing's launches route
    their own x through the same logits, chosen experts, weights and h the call is using, which must be
    the call's again after (a GPU run of the trellis engine test took the timing's experts). Here the
    timing runs off a GPU too, its launches real, its times made up (each candidate faster than the last,
    so none is the default)."""
    from thin.runtime.kernels import experts, tuning

    ticks = iter(range(10**6, 0, -1))

    def timing(launch, **_):
        launch()
        launch()
        return float(next(ticks))

    monkeypatch.setattr(tuning, "median_ms", timing)  # median_ms_or_inf's: a tiling that fails to compile is skipped
    monkeypatch.setattr(experts, "_CHOSEN", {})
    monkeypatch.setattr(experts.MoEKernels, "timed", lambda self: True)
    plan = _plan([("q2", {"group_size": 16})] * 4, top_k=2, bias=True, clamp=True, router_bias=True, seed=23)
    kernels = experts.MoEKernels(plan, DEVICE, torch.float32)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):  # timed in the first call, chosen in the second
        x = torch.randn(HIDDEN, generator=gen).to(DEVICE)
        got = kernels(x, poisoned(kernels.top_k, HIDDEN, dtype=torch.float32))
        assert rel_err(got.sum(0), run_moe(x[None], plan)[0].float()) < 4 * tolerance(torch.float32)
        probs = torch.softmax(torch.nn.functional.linear(x, plan.router_weight, plan.router_bias), -1)
        assert kernels.chosen.tolist() == torch.topk(probs, 2).indices.tolist()
    for kind in ("gate_up", "down"):
        for index, group in enumerate(kernels.groups(kind)):
            assert kernels.config(index, kind) != kernels.candidates(group, kind)[0]  # chosen by the timing


def test_what_the_kernels_do_not_run_is_refused():
    import dataclasses

    from thin.runtime.kernels.experts import MoEKernels

    plan = _plan([("int4", {"group_size": 32})] * 2)
    with pytest.raises(NotImplementedError, match="shared experts"):
        MoEKernels(dataclasses.replace(plan, shared_expert=plan.experts[0]), DEVICE, torch.float32)
    with pytest.raises(NotImplementedError, match="scoring"):
        MoEKernels(dataclasses.replace(plan, scoring="sigmoid"), DEVICE, torch.float32)
    split = _plan([("int4", {"group_size": 32})] * 2, fused=False)
    mixed = dataclasses.replace(split.experts[0], up=[split.experts[0].up[0], _plan([("q2", {"group_size": 16})] * 2,
                                                                                     fused=False).experts[0].up[1]])
    with pytest.raises(NotImplementedError, match="gate and up differ"):
        MoEKernels(dataclasses.replace(split, experts=[mixed, split.experts[1]]), DEVICE, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt,params", [("bf16", {}), ("int4", {"group_size": 128}), ("mxfp4", {})])
def test_real_shapes_on_the_gpu(fmt, params):
    """moe-a3b's expert shape (hidden 2048, FFN 768, top-8 of 16 here) and gpt-oss-20b's (2880)."""
    _check(_plan([(fmt, params)] * 16, dtype=torch.bfloat16, top_k=8, hidden=2048, inter=768, seed=10),
           dtype=torch.bfloat16)
    _check(_plan([(fmt, params if fmt != "int4" else {"group_size": 32})] * 4, dtype=torch.bfloat16, top_k=2,
                 hidden=2880, inter=2880, bias=True, clamp=True, router_bias=True, seed=11), dtype=torch.bfloat16)
