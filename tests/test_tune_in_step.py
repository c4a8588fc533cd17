"""examples/benchmarks/tune_in_step.py: which candidates it tries (the nearest to the tuner's choice), the copies of
the launch-choice cache it runs them with, and a clear exit where the step cannot run (no GPU here)."""

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "benchmarks"))

import tune_in_step as tune  # noqa: E402


def _config(block_n=4, chunk=1024, split=1, num_warps=1, packed=True, ahead=0, stages=0):
    return dict(block_n=block_n, chunk=chunk, split=split, num_warps=num_warps, packed=packed, ahead=ahead,
                stages=stages)


def test_nearest_leaves_the_choice_out_and_orders_by_octaves_and_steps():
    chosen = _config()
    far = _config(block_n=16, chunk=4096, num_warps=4)
    near = _config(ahead=1)
    twice = _config(block_n=8)
    got = tune.nearest(chosen, [far, chosen, twice, near], 2)
    assert got == [twice, near]  # one octave and one step tie: the candidates' order decides
    assert tune.distance(chosen, far) == 2 + 2 + 2


def test_a_try_changes_one_entry_in_a_copy(tmp_path):
    base = tmp_path / "cache"
    base.mkdir()
    (base / "kernel-configs.json").write_text(json.dumps({"a|b|c|6144x4096|bf16|direct in turn": _config(),
                                                          "other": _config(block_n=8)}))
    (base / "other-choices.json").write_text("{}")
    folder = tune.with_entry(base / "kernel-configs.json", "a|b|c|6144x4096|bf16|direct in turn",
                             _config(num_warps=2), tmp_path / "try")
    entries = json.loads((folder / "kernel-configs.json").read_text())
    assert entries["a|b|c|6144x4096|bf16|direct in turn"]["num_warps"] == 2 and entries["other"]["block_n"] == 8
    assert (folder / "other-choices.json").exists()
    assert json.loads((base / "kernel-configs.json").read_text())["a|b|c|6144x4096|bf16|direct in turn"] == _config()
    assert tune.entry_name("a|b|c|6144x4096|bf16|direct in turn") == "6144x4096 direct in turn"


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a run without a GPU prints")
def test_without_a_gpu_it_says_why_and_exits(tmp_path):
    done = subprocess.run([sys.executable, tune.__file__, str(tmp_path / "missing.thin")], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, THIN_CACHE_DIR=str(tmp_path / "c")))
    assert done.returncode != 0
    assert "| baseline | the tuner's | failed:" in done.stdout
    assert done.stderr.strip().splitlines()[-1].startswith("tune_in_step: could not list the choices")
