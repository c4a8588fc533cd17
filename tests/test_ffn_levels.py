"""Elastic FFN levels on small random checkpoints: ordering the channels changes nothing (logits and
calibration statistics), a compiled level runs exactly the truncated, corrected FFN it describes,
the certificate carries every level, and the runtime refuses what was not certified."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
from kernel_support import DEVICE, rel_err  # before anything imports triton: its interpreter on a CPU

from thin.compiler.evaluate import make_evaluator
from thin.compiler.hf import load_checkpoint
from thin.ir import Encoding, Linear, Program, Tensor, formats
from thin.passes import (
    CalibrateOptions,
    CertifyOptions,
    FFNLevelOptions,
    PassContext,
    Scratch,
    calibrate_inputs,
    order_superblocks,
)
from thin.passes.calibrate_inputs import load_statistics
from thin.passes.order_superblocks import apply_ffn_order
from thin.runtime.executor import Executor

from hf_tiny import build_model
from tiny_tokenizer import TEXT, write_tokenizer

SIZES = dict(hidden_size=64, intermediate_size=512, head_dim=16, vocab_size=320)


def _checkpoint(path, family="llama", **overrides):
    model = build_model(family, **{**SIZES, **overrides})
    with torch.no_grad():  # calmer than hf_tiny's scale, so a cut layer changes the output without chaos
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(0.3)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def _ordered(path, importance="output"):
    source = load_checkpoint(path)
    config = types.SimpleNamespace(calibrate=CalibrateOptions(tokens=512), ffn=FFNLevelOptions((0.5,), importance),
                                   certify=CertifyOptions())
    ctx = PassContext(config=config, evaluator=make_evaluator("cpu", dict(source.tokenizer_files)),
                      calibration_text=TEXT * 8, scratch=Scratch(), source=source.program)
    calibrated = calibrate_inputs(source.program, ctx)
    return source.program, calibrated, order_superblocks(calibrated, ctx), ctx


@pytest.mark.parametrize("family,importance", [("llama", "output"), ("phi3", "magnitude"), ("qwen3", "energy")])
def test_ordering_the_channels_keeps_the_function(tmp_path, family, importance):
    source, calibrated, ordered, ctx = _ordered(_checkpoint(tmp_path, family), importance)
    ids = torch.tensor(ctx.evaluator.encode(TEXT)[:96])
    before = Executor(source.model, source.load).forward(ids)
    after = Executor(ordered.model, ordered.load).forward(ids)
    assert torch.allclose(before, after, atol=1e-4, rtol=1e-4)
    permutations = ordered.annotations["ffn_order"]["permutations"]
    assert all(sorted(p) == list(range(512)) and p != list(range(512)) for p in permutations)
    mlp = ordered.model.layers[0].ffn
    assert all(ordered.model.tensor(lin.weight).align == 4096 for lin in (mlp.gate, mlp.up, mlp.gate_up, mlp.down)
               if lin is not None)
    # The down input's statistics were permuted with the weights: calibrating the ordered model again
    # measures the same (GPTQ and the scores read them).
    fresh_ctx = dataclasses.replace(ctx, scratch=Scratch())
    again = calibrate_inputs(ordered.replace(annotations={}), fresh_ctx)
    moved = load_statistics(ctx, ordered, mlp.down.weight)
    fresh = load_statistics(fresh_ctx, again, mlp.down.weight)
    assert torch.allclose(moved["hessian"], fresh["hessian"], atol=1e-4, rtol=1e-3)
    assert torch.allclose(moved["mean"], fresh["mean"], atol=1e-5, rtol=1e-3)


def test_the_recorded_order_replays_on_the_source(tmp_path):
    source, _, ordered, _ = _ordered(_checkpoint(tmp_path))
    replayed = apply_ffn_order(source.replace(annotations=ordered.annotations))
    for t in ordered.model.tensors:
        assert torch.equal(replayed.load(t.name), ordered.load(t.name)), t.name
    assert replayed.model == ordered.model


def test_backward_elimination_orders_every_channel_once_when_it_drops_several_a_step(monkeypatch):
    # A wide FFN (llama-8b's 14336 channels: 7 a step) drops several channels per elimination step; the
    # order must still name each channel once, the first step's cheapest channels last.
    module = importlib.import_module("thin.passes.order_superblocks")
    monkeypatch.setattr(module, "ELIMINATION_STEPS", 16)
    n = 100  # 6 channels a step, then the 4 left
    a = torch.randn(n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cost = a @ a.T
    order = module._eliminate(cost)
    assert sorted(order.tolist()) == list(range(n))
    assert set(order[-6:].tolist()) == set(torch.sort(cost.diagonal()).indices[:6].tolist())


# ---- compiled artifacts ------------------------------------------------------------------------

def _cli(name: str, *args):
    exe = shutil.which(name)
    cmd = [exe] if exe else [sys.executable, "-m", {"thinc": "thin.compiler.cli",
                                                       "thin-exec": "thin.runtime.cli"}[name]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = _checkpoint(tmp_path_factory.mktemp("llama"))
    out = tmp_path_factory.mktemp("levels") / "m.thin"
    run = _cli("thinc", "compile", path, "-o", out, "--quant", "int4", "--group-size", "32", "--ffn-levels",
               "1,0.75,1/2", "--calib-tokens", "512", "--device", "cpu")
    assert run.returncode == 0, run.stderr
    return path, out, run


def _truncated(model_ir, load, level):
    """An independent reference for a level: every FFN weight decoded, cut to the level's channels, the
    scale folded into down's columns and the shift as down's bias, run as an ordinary dense model."""
    tensors, weights = model_ir.tensor_map(), {}
    layers = []
    for layer, k, shift, scale in zip(model_ir.layers, level.channels, level.shift, level.scale):
        mlp = layer.ffn

        def dense(name):
            r = tensors[name]
            return formats.decode(r.encoding.format, load(name), r.shape, r.encoding.params, torch.float32)

        width = tensors[mlp.down.weight].shape[1]
        gate_up = dense(mlp.gate_up.weight).reshape(2, width, -1)[:, :k].reshape(2 * k, -1)
        down = dense(mlp.down.weight)[:, :k] * (dense(scale) if scale else 1)
        for name, w in ((mlp.gate_up.weight, gate_up), (mlp.down.weight, down)):
            tensors[name] = dataclasses.replace(tensors[name], shape=tuple(w.shape), encoding=Encoding("f32"))
            weights[name] = formats.encode("f32", w.contiguous())
        bias = None
        if shift:
            bias = f"layers.{layer.index}.ffn.down.bias"
            tensors[bias] = Tensor(bias, "ffn.down.bias", layer.index, (model_ir.hidden_size,), Encoding("f32"), "f32")
            weights[bias] = formats.encode("f32", dense(shift))
        layers.append(dataclasses.replace(layer, ffn=dataclasses.replace(mlp, down=Linear(mlp.down.weight, bias))))
    model = dataclasses.replace(model_ir, layers=tuple(layers), ffn_levels=(),
                                tensors=tuple(t for t in tensors.values() if not t.role.startswith("ffn.level")))
    return Program(model, {n: (lambda n=n: weights[n] if n in weights else load(n)) for n in
                           (t.name for t in model.tensors)})


def test_a_level_runs_the_truncated_corrected_ffn_it_describes(compiled):
    from thin.runtime import FFNLevelError, load

    _, out, _ = compiled
    model = load(out)
    full, three_quarters, half = model.ir.ffn_levels
    assert [lv.keep for lv in model.ir.ffn_levels] == [1.0, 0.75, 0.5]
    assert all(k % 128 == 0 for lv in (three_quarters, half) for k in lv.channels)
    ids = torch.tensor(model.encode(TEXT)[:64])
    logits = {}
    for level in (full, three_quarters, half):
        model.set_ffn_keep(level.keep)
        logits[level.keep] = model.forward(ids)
        if level.keep < 1:
            reference = _truncated(model.ir, _raw(model), level)
            want = Executor(reference.model, reference.load).forward(ids)
            assert torch.allclose(logits[level.keep], want, atol=1e-4, rtol=1e-4)
            assert any(s is not None for s in level.scale) and any(s is not None for s in level.shift)
    assert not torch.allclose(logits[1.0], logits[0.5], atol=1e-3)
    with pytest.raises(FFNLevelError, match="not a level this artifact certified"):
        model.set_ffn_keep(0.6)
    model.set_ffn_keep(0.6, uncertified=True)
    assert model.ffn_certified is False and model.ffn_level.channels == (384, 384)
    assert model.ffn_share == pytest.approx(0.75, abs=0.01)  # 3 of 4 superblocks: 0.6 rounded up, and said so
    model.set_ffn_keep(0.55, uncertified=True)
    assert model.ffn_level.channels == (384, 384) and model.ffn_share == pytest.approx(0.75, abs=0.01)
    model.set_ffn_keep(1.0)
    assert torch.equal(model.forward(ids), logits[1.0])


def _raw(model):
    from thin.runtime.loader import _raw_getter

    return _raw_getter(model.artifact)


def test_the_certificate_holds_every_level_within_its_bytes(compiled):
    from thin.artifacts import open_artifact

    _, out, run = compiled
    with open_artifact(out) as art:
        cert = art.section("certificate")
    block = cert["ffn_levels"]
    assert block["method"] == {"importance": "output", "per_layer": True, "correction": "scale", "superblock": 128}
    levels = block["levels"]
    assert [lv["keep"] for lv in levels] == [1.0, 0.75, 0.5]
    assert levels[0]["measured"] == cert["measured"]
    for lv in levels:
        assert lv["ffn_bytes"] <= lv["keep"] * lv["ffn_bytes_full"]
        assert lv["measured"]["positions"] == cert["measured"]["positions"] > 0
    assert levels[0]["bytes_per_token"] > levels[1]["bytes_per_token"] > levels[2]["bytes_per_token"]
    assert levels[0]["measured"]["mean_kld"] <= levels[2]["measured"]["mean_kld"]
    assert "ffn level 0.5" in run.stdout and "certify_ffn_levels" in run.stdout
    shown = _cli("thinc", "inspect", out)
    assert shown.returncode == 0 and "elastic FFN levels (correction scale" in shown.stdout


def test_thin_exec_runs_a_certified_level_and_refuses_others(compiled):
    _, out, _ = compiled
    ok = _cli("thin-exec", out, "--raw", "-p", "def f(", "--max-new-tokens", "4", "--ffn-keep", "1/2")
    assert ok.returncode == 0, ok.stderr
    assert "FFN level 0.5: mean KLD" in ok.stderr
    bad = _cli("thin-exec", out, "--raw", "-p", "def f(", "--max-new-tokens", "4", "--ffn-keep", "0.6")
    assert bad.returncode == 1 and "--uncertified" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    forced = _cli("thin-exec", out, "--raw", "-p", "def f(", "--max-new-tokens", "4", "--ffn-keep", "0.55",
                  "--uncertified")
    assert forced.returncode == 0 and "UNCERTIFIED" in forced.stderr
    assert "superblocks make it read 0.75 of the FFN bytes" in forced.stderr, forced.stderr
    whole = _cli("thin-exec", out, "--raw", "-p", "def f(", "--max-new-tokens", "4", "--ffn-keep", "0.95",
                 "--uncertified")
    assert whole.returncode == 0 and "it reads the whole FFN" in whole.stderr, whole.stderr


@contextlib.contextmanager
def _kernel_engine(path, fmt: str, family: str):
    """(model, engine): the artifact at `path` on the Triton kernels of `fmt` (thin.runtime.kernels.`family`,
    registered for the CPU's interpreter while the block runs) and a decode engine on it, warmed up (each
    level's prefixes have launch configurations of their own)."""
    from thin.runtime import linear, load
    from thin.runtime.engine import DecodeEngine

    added = DEVICE.type == "cpu"
    if added:
        linear.register(fmt, "cpu", linear.Implementation("triton", f"thin.runtime.kernels.{family}:make"))
    try:
        model = load(path, device=DEVICE.type)
        assert {op.implementation for op in model.executor.linear_ops()} == {"triton"}
        engine = DecodeEngine(model.executor)
        engine.warm_up()
        yield model, engine
    finally:
        if added:
            linear.unregister(fmt, "cpu", "triton")


def test_the_kernels_and_the_decode_engine_run_each_level_like_the_executor(compiled):
    """Every level through the Triton kernels (the interpreter on a CPU) and the decode engine: the
    prefill's last logits and the greedy tokens are the executor's at the same level, switching levels
    back and forth on one engine (the CUDA graph is captured again per level on a GPU)."""
    from thin.runtime.generate import engine_generate, generate
    from thin.runtime.sampling import GenerationOptions

    _, out, _ = compiled
    with _kernel_engine(out, "int4", "grouped_int") as (model, engine):
        for level in model.executor.ffn_levels[1:]:
            for layer, (width, _, _) in zip(model.executor.layers, level):
                mlp = layer.ffn
                if width != mlp.down.in_features:
                    assert {("partial", None, width), ("glu", width, None)} <= set(mlp.down._configs) | set(
                        mlp.up[0]._configs)
                    assert engine.partials.shape[0] >= mlp.down.config("partial", None, width).split
        prompt = model.encode(TEXT)[:12]
        opts = GenerationOptions(max_new_tokens=6, stop_token_ids=())
        shared = engine.new_cache(len(prompt) + opts.max_new_tokens)  # its captured steps are per level
        seen = {}
        for keep in (0.5, 1.0, 0.75, 0.5):
            model.set_ffn_keep(keep)
            want = model.executor.forward(torch.tensor(prompt, device=DEVICE))[-1].float().cpu()
            shared.reset()
            tokens = list(engine_generate(engine, prompt, opts, cache=shared))
            assert tokens == list(generate(model.executor, prompt, opts)), keep
            cache = engine.new_cache(len(prompt) + 1)
            engine.start(cache, prompt, opts)
            engine.prefill(cache, torch.tensor(prompt), engine.sampler(opts))
            assert torch.allclose(engine.logits.float().cpu(), want, atol=1e-3, rtol=1e-3), keep
            seen[keep] = want
        assert not torch.allclose(seen[1.0], seen[0.5], atol=1e-2)


def test_fp8_levels_decode_on_the_engine_like_the_executor(tmp_path):
    """Levels over fp8_e4m3 weights (rowwise8's prefix matvecs; an fp8 down finishes the norm at no level):
    the decode engine's greedy tokens are the executor's at every level, switching levels on one engine."""
    from thin.runtime.generate import engine_generate, generate
    from thin.runtime.sampling import GenerationOptions

    path = _checkpoint(tmp_path / "src")
    out = tmp_path / "m.thin"
    run = _cli("thinc", "compile", path, "-o", out, "--quant", "fp8_e4m3", "--ffn-levels", "1,0.75,1/2",
               "--calib-tokens", "512", "--device", "cpu")
    assert run.returncode == 0, run.stderr
    with _kernel_engine(out, "fp8_e4m3", "rowwise8") as (model, engine):
        prompt = model.encode(TEXT)[:12]
        opts = GenerationOptions(max_new_tokens=6, stop_token_ids=())
        seen = {}
        for keep in (0.5, 1.0, 0.75):
            model.set_ffn_keep(keep)
            seen[keep] = list(engine_generate(engine, prompt, opts))
            assert seen[keep] == list(generate(model.executor, prompt, opts)), keep
        assert seen[0.5] != seen[1.0]


def test_a_levels_model_finishes_the_residual_norm_at_every_level(compiled):
    """finish_norm=True on a model with levels (int4 down: grouped-int finishes over a column prefix): o's
    and down's matvecs finish the residual norm, down's at each level over its prefix with a configuration
    of its own; tokens and (under the interpreter) logits as the separate launches give, at the levels and
    at every channel."""
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.generate import engine_generate
    from thin.runtime.sampling import GenerationOptions

    with _int4_kernels_model(compiled) as model:
        finishing = DecodeEngine(model.executor, finish_norm=True, defer_norm=False)
        plain = DecodeEngine(model.executor, finish_norm=False, defer_norm=False)
        layers = model.executor.layers
        assert finishing._finishing == {id(op) for layer in layers for op in (layer.attention.o, layer.ffn.down)}
        prefixes = {(id(layer.ffn.down), width) for level in model.executor.ffn_levels
                    for layer, (width, _, _) in zip(layers, level) if width not in (None, layer.ffn.down.in_features)}
        assert prefixes and finishing._finishing_prefixes == prefixes
        assert all(layer.ffn.down.finish_prefixes[w] is not None for layer in layers for i, w in prefixes
                   if i == id(layer.ffn.down))
        prompt = model.encode(TEXT)[:12]
        opts = GenerationOptions(max_new_tokens=4, stop_token_ids=())
        for keep in (0.5, 1.0, 0.75):
            model.set_ffn_keep(keep)
            tokens = list(engine_generate(finishing, prompt, opts))
            assert tokens == list(engine_generate(plain, prompt, opts)), keep
            if DEVICE.type == "cpu":
                assert torch.equal(finishing.logits, plain.logits), keep


@contextlib.contextmanager
def _int4_kernels_model(compiled):
    """The levels model loaded with its int4 linears on the Triton kernels (the interpreter's on a CPU)."""
    from thin.runtime import linear, load

    _, out, _ = compiled
    added = DEVICE.type == "cpu"
    if added:
        linear.register("int4", "cpu", linear.Implementation("triton", "thin.runtime.kernels.grouped_int:make"))
    try:
        yield load(out, device=DEVICE.type)
    finally:
        if added:
            linear.unregister("int4", "cpu", "triton")


def test_a_levels_model_defers_the_residual_norm_at_every_level(compiled):
    """defer_norm (the default) on a model with levels: o and down leave the norm to the next projection,
    down also over a level's prefix of its columns where the level adds no shift (with one it norms as
    before); tokens as the full norms give at the levels and at every channel, logits within rounding."""
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.generate import engine_generate
    from thin.runtime.sampling import GenerationOptions

    with _int4_kernels_model(compiled) as model:
        deferring = DecodeEngine(model.executor)
        full = DecodeEngine(model.executor, defer_norm=False)
        layers = model.executor.layers
        assert {id(layer.attention.o) for layer in layers} <= deferring._deferring
        prompt = model.encode(TEXT)[:12]
        opts = GenerationOptions(max_new_tokens=4, stop_token_ids=())
        for keep in (0.5, 1.0, 0.75):
            model.set_ffn_keep(keep)
            assert list(engine_generate(deferring, prompt, opts)) == list(engine_generate(full, prompt, opts)), keep
            assert rel_err(deferring.logits, full.logits) < 1e-2, keep


def test_a_level_adds_a_biased_down_and_its_shift_once_not_in_every_step(compiled):
    """A down with a bias at a level: the bias plus the level's shift is added once (engine._level_bias) and
    kept, so a decode step runs no torch add (a launch in the captured graph) either way the residual norm
    is done; the greedy tokens are the executor's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from thin.runtime import linear, load
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.generate import engine_generate, generate
    from thin.runtime.sampling import GenerationOptions

    class Adds(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Adds.count += func.__name__.startswith("add")
            return func(*args, **(kwargs or {}))

    _, out, _ = compiled
    added = DEVICE.type == "cpu"
    if added:
        linear.register("int4", "cpu", linear.Implementation("triton", "thin.runtime.kernels.grouped_int:make"))
    try:
        model = load(out, device=DEVICE.type)
        for layer in model.executor.layers:
            down = layer.ffn.down
            down.bias = 0.05 * torch.randn(down.out_features, generator=torch.Generator().manual_seed(1)).to(
                device=DEVICE, dtype=model.executor.dtype)
        model.set_ffn_keep(0.5)
        prompt = model.encode(TEXT)[:8]
        opts = GenerationOptions(max_new_tokens=3, stop_token_ids=())
        want = list(generate(model.executor, prompt, opts))
        for finish in (True, False):
            engine = DecodeEngine(model.executor, finish_norm=finish, graphs=False)
            assert list(engine_generate(engine, prompt, opts)) == want, finish
            assert len(engine._level_biases) == len(model.executor.layers)
            cache = engine.new_cache(len(prompt) + 2)
            sampler = engine.sampler(opts)
            engine.start(cache, prompt, opts)
            engine.prefill(cache, torch.tensor(prompt), sampler)
            Adds.count = 0
            with Adds():
                engine.decode_one_token(cache, sampler)
            assert Adds.count == 0, finish
    finally:
        if added:
            linear.unregister("int4", "cpu", "triton")
