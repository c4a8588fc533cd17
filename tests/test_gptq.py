"""GPTQ through the GridQuantizer protocol: blobs the formats decode, never worse than round-to-nearest
on the Hessian-weighted error, better on the shipped model, and the planner's estimate of its error."""

from __future__ import annotations

import itertools
import types
from pathlib import Path

import pytest
import torch

from thin.ir import formats
from thin.passes import CalibrateOptions, PassContext, Scratch, calibrate_inputs
from thin.passes.calibrate_inputs import load_statistics
from thin.passes.gptq import gptq, gptq_many, inverse_cholesky, output_error
from thin.passes.quantize_weights import split_rows

ROOT = Path(__file__).resolve().parent.parent
QUANTIZED = [f for f in formats.FORMATS.values() if not f.dense]


def _variants(fmt):
    keys = sorted(fmt.params)
    for values in itertools.product(*(fmt.params[k].choices for k in keys)):
        yield tuple(zip(keys, values))


def _problem(rows=48, cols=256, seed=0):
    """A weight and the second moments of correlated inputs with a few loud channels."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=gen) / cols**0.5 + torch.eye(cols)
    x = torch.randn(2048, cols, generator=gen) @ mix
    x[:, :4] *= 8  # outlier channels, as real activations have
    return torch.randn(rows, cols, generator=gen) * 0.05, x.T @ x / x.shape[0]


def _rtn(fmt, w, params):
    return fmt.decode(fmt.encode(w, params), tuple(w.shape), params)


@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.name)
def test_gptq_blob_decodes_to_its_weights_and_beats_round_to_nearest(fmt):
    w, h = _problem()
    for params in _variants(fmt):
        blob, w_hat = gptq(w, h, fmt, params)
        assert torch.equal(fmt.decode(blob, tuple(w.shape), params), w_hat), (fmt.name, params)
        gptq_error, rtn_error = output_error(w, w_hat, h), output_error(w, _rtn(fmt, w, params), h)
        assert gptq_error <= rtn_error, (fmt.name, params, gptq_error, rtn_error)
        if fmt.name in ("int4", "q2", "q1"):  # the formats the issue names: a real gain, not a tie
            assert gptq_error < 0.8 * rtn_error, (fmt.name, params, gptq_error / rtn_error)


@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.name)
def test_gptq_many_is_gptq_of_each_weight_under_its_own_hessian(fmt):
    """One batched sweep over three weights with three different input statistics: each weight's rows
    of the stacked blob and of w_hat are what gptq() gives it alone (on the CPU bit for bit; a GPU's
    batched products may only reorder a sum)."""
    problems = [_problem(seed=s) for s in (2, 3, 4)]
    variants = list(_variants(fmt))
    for params in {variants[0], variants[-1]}:  # symmetric and asymmetric, smallest and largest group
        blob, w_hat = gptq_many([w for w, _ in problems], [h for _, h in problems], fmt, params)
        rows, cols = problems[0][0].shape
        assert torch.equal(fmt.decode(blob, (3 * rows, cols), params), w_hat)
        blobs = split_rows(fmt, blob, (3 * rows, cols), params, [(rows, cols)] * 3)
        for k, (w, h) in enumerate(problems):
            alone_blob, alone = gptq(w, h, fmt, params)
            assert torch.equal(w_hat[k * rows:(k + 1) * rows], alone), (fmt.name, params, k)
            assert torch.equal(blobs[k], alone_blob), (fmt.name, params, k)


def test_act_order_also_decodes_and_beats_round_to_nearest():
    w, h = _problem(seed=1)
    fmt = formats.get("int4")
    params = (("asymmetric", 0), ("group_size", 32))
    blob, w_hat = gptq(w, h, fmt, params, act_order=True)
    assert torch.equal(fmt.decode(blob, tuple(w.shape), params), w_hat)
    assert output_error(w, w_hat, h) < output_error(w, _rtn(fmt, w, params), h)


def test_diagonal_hessian_is_importance_weighted_rounding():
    # Uncorrelated inputs leave nothing to compensate: GPTQ rounds each column on its group's grid.
    w, _ = _problem()
    h = torch.diag(torch.rand(w.shape[1]) + 0.5)
    fmt = formats.get("int4")
    params = (("asymmetric", 0), ("group_size", 64))
    _, w_hat = gptq(w, h, fmt, params)
    upper, damped = inverse_cholesky(h)
    q = fmt.quantizer(tuple(w.shape), params)
    q.start(w)
    torch.testing.assert_close(w_hat, q.project(w, q.fit(w, torch.diagonal(damped))))


def test_split_rows_undoes_stack_rows():
    w, h = _problem(rows=40)
    for name in ("int4", "q2", "q1", "int8"):
        fmt = formats.get(name)
        params = fmt.normalize()
        shapes = [(16, 256), (8, 256), (16, 256)]
        blobs = [fmt.encode(part, params) for part in torch.split(w, [s[0] for s in shapes])]
        stacked = fmt.stack_rows(blobs, shapes, params)
        for got, want in zip(split_rows(fmt, stacked, (40, 256), params, shapes), blobs):
            assert torch.equal(got, want)


@pytest.fixture(scope="module")
def tiny_coder_statistics():
    """tiny-coder calibrated on 2048 tokens of the standard-library sample."""
    from thin.compiler.corpus import calibration_text
    from thin.compiler.evaluate import make_evaluator
    from thin.compiler.hf import load_checkpoint

    source = load_checkpoint(ROOT / "examples/models/tiny-coder")
    config = types.SimpleNamespace(calibrate=CalibrateOptions(tokens=2048))
    ctx = PassContext(config=config, evaluator=make_evaluator("cpu", dict(source.tokenizer_files)),
                      calibration_text=calibration_text(20_000), scratch=Scratch())
    return calibrate_inputs(source.program, ctx), ctx


@pytest.mark.parametrize("name", ["int4", "q2", "q1"])
def test_gptq_beats_round_to_nearest_on_tiny_coder(tiny_coder_statistics, name):
    program, ctx = tiny_coder_statistics
    fmt = formats.get(name)
    params = fmt.normalize()
    for tensor in ("layers.1.attn.q.weight", "layers.4.ffn.down.weight", "embed.weight"):
        r = program.model.tensor(tensor)
        w = formats.get(r.encoding.format).decode(program.load(tensor), r.shape, r.encoding.params, torch.float32)
        w = w[:192]  # GPTQ treats rows independently: a slice of rows is a faithful, cheaper test
        h = load_statistics(ctx, program, tensor)["hessian"]
        _, w_hat = gptq(w, h, fmt, params)
        assert output_error(w, w_hat, h) < 0.9 * output_error(w, _rtn(fmt, w, params), h), tensor


def test_quantize_weights_batched_sweeps_write_what_gptq_gives_each_input(tiny_coder_statistics, monkeypatch):
    """A plan with one format for the layers' attention and another for their MLPs: quantize_weights
    sweeps every layer's q/k/v together (gptq_many), yet each weight's blob is gptq() of its own
    input's batch alone; a small sweep budget splits the layers into several sweeps, same bytes."""
    import dataclasses
    import sys

    from thin.passes import QuantizeOptions, quantize_weights
    from thin.passes.calibrate_inputs import statistics_key

    program, ctx = tiny_coder_statistics
    module = sys.modules["thin.passes.quantize_weights"]
    int4, q2 = formats.get("int4"), formats.get("q2")
    p4, p2 = (("asymmetric", 1), ("group_size", 32)), q2.normalize()
    choices = {}
    for layer in range(3):  # three layers keep the test fast
        for part, fmt, params in (("attn.q", int4, p4), ("attn.k", int4, p4), ("attn.v", int4, p4),
                                  ("ffn.gate", q2, p2), ("ffn.up", q2, p2)):
            choices[f"layers.{layer}.{part}.weight"] = {"format": fmt.name, "params": [list(p) for p in params]}
    planned = program.replace(annotations={**program.annotations, "precision_plan": {"choices": choices}})
    config = types.SimpleNamespace(quantize=QuantizeOptions(method="gptq"))
    calls = []
    many = module.gptq_many
    monkeypatch.setattr(module, "gptq_many", lambda *a, **k: calls.append(len(a[0])) or many(*a, **k))
    shapes = [(sum(program.model.tensor(f"layers.0.{p}.weight").shape[0] for p in parts),
               program.model.tensor(f"layers.0.{parts[0]}.weight").shape[1])
              for parts in (("attn.q", "attn.k", "attn.v"), ("ffn.gate", "ffn.up"))]
    sizes = [module.sweep_bytes(*shape) for shape in shapes]
    runs = {}
    for budget in (None, 2 * max(sizes)):  # all three layers in one sweep, then at most two
        if budget is not None:
            monkeypatch.setattr(module, "CPU_SWEEP_BYTES", budget)
        calls.clear()
        scratch = Scratch()  # the statistics, and none of the blobs of the run before
        for key in set(program.annotations["calibration"]["inputs"].values()):
            if ctx.scratch.has(statistics_key(key)):
                scratch.save(statistics_key(key), ctx.scratch.load(statistics_key(key)))
        each = dataclasses.replace(ctx, config=config, scratch=scratch, device="cpu")
        out = quantize_weights(planned, each)
        runs[budget] = ({n: out.load(n) for n in choices}, list(calls))
    (blobs, calls_all), (split_blobs, calls_split) = runs.values()
    assert calls_all == [3, 3]  # attention, MLP
    # under the smaller budget a sweep takes what fits; a run of one weight goes through gptq() itself
    per_sweep = [min(3, 2 * max(sizes) // size) for size in sizes]
    assert sorted(calls_split) == sorted(n for n in per_sweep + [3 - n for n in per_sweep] if n > 1)
    assert 2 in calls_split
    for layer in range(3):
        for parts, fmt, params in ((("attn.q", "attn.k", "attn.v"), int4, p4), (("ffn.gate", "ffn.up"), q2, p2)):
            names = [f"layers.{layer}.{p}.weight" for p in parts]
            records = [program.model.tensor(n) for n in names]
            w = torch.cat([formats.get(r.encoding.format).decode(program.load(r.name), r.shape, r.encoding.params,
                                                                  torch.float32) for r in records])
            blob, _ = gptq(w, load_statistics(ctx, program, names[0])["hessian"], fmt, params)
            want = split_rows(fmt, blob, tuple(w.shape), params, [r.shape for r in records])
            for n, b in zip(names, want):
                assert torch.equal(blobs[n], b) and torch.equal(split_blobs[n], b), n
