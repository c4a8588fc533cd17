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
