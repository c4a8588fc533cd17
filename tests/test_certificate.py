"""certify_model: the held-out measurement, the gate, and the promotion loop that re-plans within the
budget. A fake evaluator stands in for the runtime: its "measured" KLD of a program is computed from
the formats the program's tensors got, with one tensor far more sensitive than the scores predicted."""

from __future__ import annotations

import contextlib
import math
import types

import pytest
import torch
from test_planner import _scored

from thin.ir import Encoding, Program, formats
from thin.passes import (
    CertificationError,
    CertifyOptions,
    PassContext,
    PlanOptions,
    QuantizeOptions,
    ScoreOptions,
    Scratch,
    certify_model,
    plan_precision,
    quantize_weights,
)
from thin.passes.certify_model import DEFAULT_MAX_KLD, heldout_prompts

from ir_fixtures import tiny_model

CULPRIT = "layers.1.attn.v.weight"


class FakeSession:
    """Two-token logits whose KLD from the exact model's is the true KLD of the overridden weights."""

    def __init__(self, program, evaluator=None):
        self.program, self.evaluator, self.overrides = program, evaluator, {}
        self.model = program.model

    def greedy(self, prompt, n):
        return [1] * n

    @contextlib.contextmanager
    def overriding(self, weights):
        self.overrides = weights
        try:
            yield self
        finally:
            self.overrides = {}

    def forward(self, ids):
        target = sum(self.evaluator.true_kld(name) for name in self.overrides)
        a = math.acosh(math.exp(target))  # KL(uniform || softmax(a, -a)) = log cosh a
        return torch.tensor([[a, -a]] * len(ids))


class FakeEvaluator:
    """compare() reports sum over tensors of the predicted KLD of the format each got, the culprit's
    counted `factor` times: what a real model does when the scores underrate one tensor."""

    device = "cpu"

    def __init__(self, scores, factor):
        self.scores, self.factor, self.compared = scores, factor, 0
        self.latest = None  # the last compiled program a session was made for

    def session(self, program):
        if "quantize" in program.annotations:
            self.latest = program
        return FakeSession(program, self)

    def true_kld(self, name):
        """What the latest compiled program's encoding of `name` really costs."""
        encoding = self.latest.model.tensor(name).encoding
        for c in self.scores[name]["candidates"]:
            if Encoding(c[0], tuple(tuple(p) for p in c[1])) == encoding:
                return c[4] * (self.factor if name == CULPRIT else 1.0)
        raise KeyError(name)

    def encode(self, text):
        return list(range(len(text)))

    def compare(self, reference, candidate, prompts):
        self.compared += 1
        self.latest = candidate.program
        kld = sum(self.true_kld(t.name) for t in candidate.program.model.tensors if t.name in self.scores)
        positions = sum(len(p) - 1 for p in prompts)
        return {"mean_kld": kld, "max_kld": kld, "kld_p99": kld, "top1_agreement": 0.9, "mean_cosine": 0.99,
                "min_cosine": 0.9, "perplexity_reference": 10.0, "perplexity_candidate": 10.0 + kld,
                "positions": positions}


def _setup(factor, **certify):
    model = tiny_model(num_layers=2, hidden=64, vocab=64, inter=128)
    gen = torch.Generator().manual_seed(0)
    weights = {t.name: formats.encode("f32", torch.randn(t.shape, generator=gen) * 0.1) for t in model.tensors}
    source = Program(model, {n: (lambda v=v: v) for n, v in weights.items()})
    scored = _scored(model, lambda name: 1.0)
    program = source.replace(annotations=scored.annotations)
    config = types.SimpleNamespace(plan=PlanOptions(bpw=4.0), fuse_projections=True, score=ScoreOptions(),
                                   quantize=QuantizeOptions(method="rtn"), certify=CertifyOptions(**certify))
    evaluator = FakeEvaluator(scored.annotations["scores"]["tensors"], factor)
    scratch = Scratch()
    scratch.save("calibration/ids", {"ids": torch.arange(2048)})
    ctx = PassContext(config=config, evaluator=evaluator, source=source, heldout_text="x" * 5000, scratch=scratch)
    quantized = quantize_weights(plan_precision(program, ctx), ctx)
    return quantized, ctx, evaluator


def test_a_passing_compile_gets_its_certificate_without_promotions():
    program, ctx, evaluator = _setup(factor=1.0)
    out = certify_model(program, ctx)
    cert = out.annotations["certificate"]
    assert cert["status"] == "PASSED" and cert["rounds"] == [] and evaluator.compared == 1
    assert cert["gate"] == {"max_kld": DEFAULT_MAX_KLD, "default": True}
    assert cert["prompts"]["count"] == 8 and cert["prompts"]["positions"] == 127  # the fixture has 128 positions
    assert cert["measured"]["greedy_agreement"] == 1.0
    assert cert["predicted_kld"] == pytest.approx(out.annotations["precision_plan"]["predicted_kld"])
    assert out.annotations["precision_plan"] == program.annotations["precision_plan"]


def test_promotion_gives_the_underrated_tensor_more_bits_until_the_gate_passes():
    first, _, _ = _setup(factor=1.0)
    measured_plain = FakeEvaluator(first.annotations["scores"]["tensors"], 40.0).compare(
        None, FakeSession(first), [[0] * 10])["mean_kld"]  # the first plan, with the culprit's true cost
    gate = measured_plain * 0.7
    program, ctx, evaluator = _setup(factor=40.0, max_kld=gate)
    out = certify_model(program, ctx)
    cert = out.annotations["certificate"]
    assert cert["status"] == "PASSED" and cert["measured"]["mean_kld"] <= gate
    assert 1 <= len(cert["rounds"]) <= 4 and CULPRIT in cert["rounds"][0]["promoted"]
    before = program.annotations["precision_plan"]["choices"][CULPRIT]["bytes"]
    after = out.annotations["precision_plan"]["choices"][CULPRIT]["bytes"]
    assert after > before
    # Still within the same budget.
    assert out.annotations["precision_plan"]["weight_bytes"] <= program.annotations["precision_plan"]["budget"][
        "weight_bytes"]


def test_an_unreachable_gate_fails_naming_the_best_reached_unless_allowed():
    program, ctx, _ = _setup(factor=5.0, max_kld=1e-9)
    with pytest.raises(CertificationError, match=r"best reached is mean KLD [0-9.]+ .*--allow-uncertified"):
        certify_model(program, ctx)
    program, ctx, _ = _setup(factor=5.0, max_kld=1e-9, allow_uncertified=True)
    out = certify_model(program, ctx)
    cert = out.annotations["certificate"]
    assert cert["status"] == "FAILED" and cert["measured"]["mean_kld"] > 1e-9
    assert cert["measured"]["mean_kld"] == min([r["mean_kld"] for r in cert["rounds"]] + [cert["measured"][
        "mean_kld"]])


def test_heldout_prompts_are_spread_over_the_text():
    prompts = heldout_prompts(list(range(1000)), 8, 99)
    assert len(prompts) == 8 and all(len(p) == 100 for p in prompts)
    assert prompts[0][0] == 0 and prompts[-1][-1] == 999
    with pytest.raises(ValueError, match="a prompt needs 100"):
        heldout_prompts(list(range(50)), 8, 99)
