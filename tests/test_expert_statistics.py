"""Calibration covers every expert: routing counts per expert, and estimated statistics (never none) for
experts the calibration text starves."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from thin.compiler.config import CompileConfig
from thin.compiler.evaluate import make_evaluator
from thin.compiler.hf import load_checkpoint
from thin.ir import Program, formats
from thin.passes import PassContext, Scratch, calibrate_inputs, quantize_weights, run_passes
from thin.passes.calibrate_inputs import load_statistics
from thin.passes.expert_statistics import MIN_EXPERT_TOKENS, fill_starved_experts

from hf_tiny import load_reference, make_checkpoint
from tiny_tokenizer import TEXT, write_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral_path(tmp_path_factory):
    path = make_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"), vocab_size=320)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def mixtral(mixtral_path):
    return load_checkpoint(mixtral_path)


def _with_router(program: Program, rows: torch.Tensor) -> Program:
    """`program` with layer 0's router replaced by `rows` [experts, hidden]."""
    name = program.model.layers[0].ffn.router.weight
    raw = formats.encode("f32", rows)
    return program.replace(weights={**program.weights, name: lambda: raw})


def test_a_starved_expert_pools_its_nearest_neighbour(mixtral):
    program = mixtral.program
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 64, generator=gen)
    rows[0] = 3 * rows[1]  # expert 0's router row points exactly where expert 1's does
    program = _with_router(program, rows)
    x1 = torch.randn(200, 64, generator=gen) + 0.5
    x2 = torch.randn(5, 64, generator=gen)

    def slot(x):
        return {"hessian": x.T @ x, "sum": x.sum(0), "absmax": x.abs().amax(0), "count": x.shape[0]}

    sums = {"layers.0.expert.1.in": slot(x1), "layers.0.expert.2.in": slot(x2),
            "layers.0.expert.3.in": slot(torch.randn(300, 64, generator=gen))}
    for layer in (1,):
        for e in range(4):
            sums[f"layers.{layer}.expert.{e}.in"] = slot(torch.randn(MIN_EXPERT_TOKENS, 64, generator=gen))
    starved = fill_starved_experts(program, sums)
    assert starved == ["layers.0.expert.0", "layers.0.expert.2"]
    zero = sums["layers.0.expert.0.in"]
    assert zero["count"] == 0  # the routing count stays the real one
    torch.testing.assert_close(zero["hessian"], x1.T @ x1 / 200)  # expert 1's tokens, weighed as one token
    torch.testing.assert_close(zero["sum"], x1.mean(0))
    down = sums["layers.0.expert.0.down.in"]
    assert down["hessian"].shape == (32, 32) and torch.linalg.eigvalsh(down["hessian"]).min() > -1e-4
    assert down["hessian"].diagonal().min() > 0
    assert sums["layers.0.expert.2.in"]["count"] == 5
    assert sums["layers.0.expert.1.in"]["count"] == 200  # experts with enough tokens are left alone
    assert torch.equal(sums["layers.0.expert.1.in"]["hessian"], x1.T @ x1)


def test_calibration_counts_routing_and_leaves_no_expert_blind(mixtral, tmp_path):
    """64 tokens top-2 over 4 experts: some experts get fewer than MIN_EXPERT_TOKENS, yet every expert
    input has statistics, so GPTQ rounds every expert (no round-to-nearest fallback)."""
    config = CompileConfig.from_options(quant="int4", group_size=32, method="gptq", calib_tokens=64, device="cpu")
    ctx = PassContext(config=config, evaluator=make_evaluator("cpu", mixtral.tokenizer_files),
                      source=mixtral.program, calibration_text=TEXT, scratch=Scratch(tmp_path), device="cpu")
    program = run_passes(mixtral.program, [calibrate_inputs, quantize_weights], ctx)
    note = program.annotations["calibration"]
    assert note["min_expert_tokens"] == MIN_EXPERT_TOKENS
    assert sorted(note["expert_tokens"]) == ["layers.0", "layers.1"]
    for counts in note["expert_tokens"].values():
        assert sum(counts) == 2 * note["tokens"]  # every token reaches its top-2
    starved = [f"{layer}.expert.{e}" for layer, counts in sorted(note["expert_tokens"].items())
               for e, c in enumerate(counts) if c < MIN_EXPERT_TOKENS]
    assert starved and note["starved_experts"] == starved
    for t in program.model.tensors:
        if t.role.startswith("moe.expert") and not t.role.endswith(".bias"):
            assert load_statistics(ctx, program, t.name) is not None, t.name
    assert program.annotations["quantize"]["round_to_nearest_fallback"] == []


def test_only_moe_layers_are_touched(mixtral):
    """A dense model has nothing to fill; a MoE layer with no tokens at all keeps nothing to pool from."""
    model = mixtral.program.model
    dense = dataclasses.replace(model, layers=())
    assert fill_starved_experts(mixtral.program.replace(model=dense), {}) == []
    assert fill_starved_experts(mixtral.program, {}) == []


def test_expert_inputs_weigh_each_token_by_its_routing_weight(mixtral, mixtral_path, tmp_path, monkeypatch):
    """An expert's second moment is sum g^2 x x^T / N over the tokens routed to it, g the token's
    renormalised top-k weight: checked against transformers' own router on the same tokens."""
    calibration = importlib.import_module("thin.passes.calibrate_inputs")  # the module, not the pass
    monkeypatch.setattr(calibration, "fill_starved_experts", lambda program, sums: [])  # real statistics only
    config = CompileConfig.from_options(quant="int4", group_size=32, method="gptq", calib_tokens=64, device="cpu")
    ctx = PassContext(config=config, evaluator=make_evaluator("cpu", mixtral.tokenizer_files),
                      source=mixtral.program, calibration_text=TEXT, scratch=Scratch(tmp_path), device="cpu")
    program = calibrate_inputs(mixtral.program, ctx)
    ids = ctx.scratch.load("calibration/ids")["ids"]
    reference = load_reference(mixtral_path)
    seen = {}
    router = reference.model.layers[0].mlp.gate
    router.register_forward_hook(lambda module, args, out: seen.update(x=args[0].reshape(-1, 64), g=out[1], e=out[2]))
    with torch.no_grad():
        reference(ids[None])
    note = program.annotations["calibration"]
    checked = 0
    for e, expert in enumerate(program.model.layers[0].ffn.experts):
        rows, slot = torch.where(seen["e"] == e)
        if len(rows) == 0:
            continue
        g = seen["g"][rows, slot]
        x = seen["x"][rows]
        stats = load_statistics(ctx, program, expert.gate.weight)
        # Weighted by g^2 within the expert, with the mass of its token count (len(rows) of len(ids)).
        expected = (x * (g * g)[:, None]).T @ x * (len(rows) / float((g * g).sum())) / len(ids)
        torch.testing.assert_close(stats["hessian"], expected, rtol=1e-3, atol=1e-6)
        assert note["expert_weight2"]["layers.0"][e] == pytest.approx(float((g * g).mean()), abs=1e-4)
        # The down projection's input is the same tokens' hidden activations, weighed the same way.
        down = load_statistics(ctx, program, expert.down.weight)["hessian"]
        torch.testing.assert_close(float(load_statistics(ctx, program, expert.down.weight)["count"]), float(len(rows)))
        assert down.trace() > 0
        checked += 1
    assert checked >= 2
