"""trellis in the planner and the CLI: an expert format, offered to routed experts only and only when
`--expert-formats` names it; its error scored on a sample of 16-row bands; a compile end to end on a
small random Qwen3-MoE whose routed experts come out trellis-coded and run on the CPU."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import pytest
import torch

from thin.artifacts import open_artifact
from thin.compiler.config import CompileConfig, CompileOptionError
from thin.ir import Encoding, Tensor, formats
from thin.passes import QuantizeOptionError, QuantizeOptions, ScoreOptions
from thin.passes.score_formats import candidates, sample_rows, sampled_error

from hf_tiny import build_model
from tiny_tokenizer import write_tokenizer

FAST = ["--calib-tokens", "512", "--device", "cpu"]


def _record(expert):
    return Tensor("w", "moe.expert.up" if expert is not None else "ffn.up", 0, (64, 128), Encoding("f32"), "f32",
                  expert=expert)


def _formats(record, options):
    return {e.format for e in candidates(record, *options.allowed(record))}


def test_trellis_is_offered_to_routed_experts_only_when_expert_formats_names_it():
    expert, dense = _record(0), _record(None)
    assert "trellis" not in _formats(expert, ScoreOptions()) | _formats(dense, ScoreOptions())
    assert "trellis" not in _formats(expert, ScoreOptions(expert_formats=("q2",)))
    assert _formats(expert, ScoreOptions(expert_formats=("trellis",))) == {"trellis"}
    mixed = ScoreOptions(expert_formats=("q2", "trellis"))
    assert _formats(expert, mixed) == {"q2", "trellis"} and "trellis" not in _formats(dense, mixed)
    bits = sorted(dict(e.params)["bits"] for e in candidates(expert, *mixed.allowed(expert)) if e.format == "trellis")
    assert bits == [2, 3]


def test_trellis_anywhere_but_the_experts_is_refused_in_one_line():
    for make in (lambda: ScoreOptions(formats=("int4", "trellis")),
                 lambda: CompileConfig.from_options(bpw=3.0, formats="int4,trellis", device="cpu")):
        with pytest.raises((ValueError, CompileOptionError), match="--expert-formats") as e:
            make()
        assert "\n" not in str(e.value)
    with pytest.raises(QuantizeOptionError, match="--expert-formats trellis"):
        QuantizeOptions(format="trellis")


def test_sampled_error_estimates_the_whole_weights_error_from_a_few_bands():
    """The trellis error of a [256, 128] weight whose rows have different scales, measured on 4 of its 16
    bands and scaled by the weights' own energy, is within a few percent of encoding every row."""
    fmt, params = formats.get("trellis"), (("bits", 2),)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 128, generator=gen) * torch.linspace(0.2, 3.0, 256)[:, None]
    picked = sample_rows(tuple(w.shape))
    assert picked is not None and len(picked) == 64 and len(set(p // 16 for p in picked)) == 4
    hessian = torch.randn(128, 128, generator=gen) / 8
    hessian = hessian @ hessian.T + torch.eye(128)

    def measure(delta, rows):
        return float(((delta @ hessian) * delta).sum())

    exact = measure(w - fmt.decode(fmt.encode(w, params), tuple(w.shape), params, torch.float32), slice(None))
    estimate = sampled_error(w, fmt, params, measure)
    assert estimate == pytest.approx(exact, rel=0.05)
    assert sample_rows((32, 128)) is None  # no larger than the sample: every row is encoded


def _cli(*args):
    exe = shutil.which("thinc")
    cmd = [exe] if exe else [sys.executable, "-m", "thin.compiler.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small Qwen3-MoE (4 experts, expert FFN 32, hidden 64: every projection a whole number of 16 x 16
    tiles), its projections scaled down so a few bits of rounding do not make it chaotic."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    model = build_model("qwen3_moe", num_experts=4, vocab_size=320, num_hidden_layers=2, mlp_only_layers=[])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(0.15)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def test_expert_formats_trellis_compiles_trellis_experts_that_run(checkpoint, tmp_path, monkeypatch):
    from thin.compiler import compile_model
    from thin.compiler.hf import load_checkpoint
    from thin.runtime import load
    from thin.runtime.executor import Executor
    from thin.runtime.quality import compare

    out = tmp_path / "m.thin"
    stages = []
    # one trellis batch (an expert's gate and up, or its down) a sweep, so each reports its progress
    monkeypatch.setattr(importlib.import_module("thin.passes.quantize_weights"), "SEARCH_SWEEP_WEIGHTS", 1)
    compile_model(checkpoint, out, bpw=3.5, expert_formats="trellis", calib_tokens=512, device="cpu",
                  progress=lambda stage, done=0, total=0: stages.append((stage, done, total)))
    with open_artifact(out) as art:
        entries = {n: art.tensor_entry(n) for n in art.tensor_names()}
        plan = art.section("precision_plan")["plan"]
    experts = {n for n, c in plan["choices"].items() if c["expert"] is not None}
    assert experts and all(plan["choices"][n]["format"] == "trellis" for n in experts)
    assert all(c["format"] != "trellis" for n, c in plan["choices"].items() if n not in experts)
    stored = {e.format for e in entries.values() if e.expert is not None and e.role.startswith("moe.expert")}
    assert stored == {"trellis"}
    assert all(e.format != "trellis" for e in entries.values() if e.expert is None)
    assert plan["bits_per_weight"] <= 3.5
    # the trellis sweeps report as they go: a count for each of the 2 x 4 experts' 2 batches at least
    assert len({done for stage, done, _ in stages if stage.startswith("quantize")}) > 2 * 4 * 2
    source = load_checkpoint(checkpoint)
    # Each trellis expert (gate and up fused) decodes near its source: a k-bit code's relative squared
    # error (GPTQ's, above the Gaussian 0.073 / 0.020 of plain Viterbi at k = 2 / 3).
    with open_artifact(out) as art:
        for name, e in entries.items():
            if e.format != "trellis":
                continue
            raw = torch.from_numpy(art.numpy(name).copy()).view(torch.uint8).reshape(-1)
            w = formats.decode("trellis", raw, e.shape, e.params)
            parts = [name.replace("gate_up", "gate"), name.replace("gate_up", "up")] if "gate_up" in name else [name]
            s = torch.cat([source.program.decoded(n) for n in parts])
            assert float(((w - s) ** 2).sum() / (s ** 2).sum()) < {2: 0.15, 3: 0.06}[dict(e.params)["bits"]], name
    model = load(out)  # the artifact runs on the CPU, next to the source
    ids = torch.randint(3, 300, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    result = compare(Executor(source.program.model, source.program.load), model, ids)
    assert result.positions == 95 and result.mean_kld < 0.05, result


def test_formats_or_quant_trellis_is_refused_in_one_line(checkpoint, tmp_path):
    for flags in (["--bpw", "4", "--formats", "int4,trellis"], ["--quant", "trellis"]):
        run = _cli("compile", checkpoint, "-o", tmp_path / "m.thin", *flags, *FAST[2:])
        assert run.returncode == 1 and run.stderr.count("\n") == 1 and "--expert-formats" in run.stderr, run.stderr
    assert not (tmp_path / "m.thin").exists()


def test_formats_reaches_the_planner(checkpoint):
    """--formats is the config's `formats`: it changes the cache key, and only with a budget."""
    keys = [_cli("key", checkpoint, "--bpw", "4", *flags, *FAST) for flags in ([], ["--formats", "int4,q2"])]
    assert all(k.returncode == 0 for k in keys) and keys[0].stdout != keys[1].stdout
    config = CompileConfig.from_options(bpw=4, formats="int4, q2", device="cpu")
    assert config.score.formats == ("int4", "q2")
    alone = _cli("key", checkpoint, "--formats", "int4")
    assert alone.returncode == 1 and "give a budget" in alone.stderr
