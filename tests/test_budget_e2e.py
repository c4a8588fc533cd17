"""`--bpw`, `--vram`, `thinc plan`, the certificate, the precision map and the key, end to end
through the CLIs, on a small random Llama whose projections are scaled down (a random model at
full scale is chaotic: any rounding flips its argmax, which tells nothing about the planner)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from thin.artifacts import open_artifact

from hf_tiny import build_model
from tiny_tokenizer import TEXT, write_tokenizer

FAST = ["--calib-tokens", "512", "--device", "cpu"]


def _cli(name: str, *args):
    exe = shutil.which(name)
    cmd = [exe] if exe else [sys.executable, "-m", {"thinc": "thin.compiler.cli",
                                                       "thin-exec": "thin.runtime.cli"}[name]]
    # One torch thread per compile: the suite runs two workers on two cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = build_model("llama", hidden_size=128, intermediate_size=256, head_dim=32, vocab_size=320)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(0.15)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def planned(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("bpw") / "m.thin"
    run = _cli("thinc", "compile", checkpoint, "-o", out, "--bpw", "4.5", *FAST)
    assert run.returncode == 0, run.stderr
    return out, run


def test_bpw_compile_meets_its_budget_and_carries_a_passing_certificate(planned):
    out, run = planned
    with open_artifact(out) as art:
        sizes = sum(art.tensor_entry(n).size for n in art.tensor_names())
        params = sum(torch.Size(t.shape).numel() for t in art.model.tensors)
        plan, cert, memory = art.section("precision_plan"), art.section("certificate"), art.section("memory")
    assert 8 * sizes / params <= 4.5
    assert plan["plan"]["weight_bytes"] == sizes == memory["lines"]["weights"]
    assert plan["quantize"]["method"] == "gptq" and plan["calibration"]["tokens"] == 512
    assert cert["status"] == "PASSED" and cert["gate"] == {"max_kld": 1.0, "default": True}
    assert cert["prompts"]["count"] == 8 and cert["measured"]["positions"] == 8 * cert["prompts"]["positions"]
    assert 0 <= cert["measured"]["mean_kld"] < 1.0 and 0 < cert["measured"]["top1_agreement"] <= 1
    # The summary names the plan, the ledger and the certificate; the time of each pass.
    assert re.search(r"^plan +--bpw 4\.5: 4\.\d+ bits per weight, predicted KLD", run.stdout, re.M)
    assert re.search(r"^certificate +PASSED: mean KLD", run.stdout, re.M)
    assert "calibrate_inputs" in run.stdout and "certify_model" in run.stdout
    assert "calibrate 1/1" in run.stderr or "calibrate" in run.stderr


def test_inspect_shows_certificate_ledger_and_draws_the_precision_map(planned, tmp_path):
    out, _ = planned
    run = _cli("thinc", "inspect", out)
    assert run.returncode == 0, run.stderr
    assert "certificate\n  PASSED: mean KLD" in run.stdout
    assert "memory ledger (--ctx" in run.stdout and "kv cache" in run.stdout and "cuda context" in run.stdout
    assert _cli("thinc", "inspect", out, "--precision-map", tmp_path / "map.svg").returncode == 0
    svg = ET.parse(tmp_path / "map.svg").getroot()
    labels = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "layer 0" in labels and "layer 1" in labels and "embed" in labels and "attn.q" in labels
    assert _cli("thinc", "inspect", out, "--precision-map", tmp_path / "map.png").returncode == 0
    png = (tmp_path / "map.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    bad = _cli("thinc", "inspect", out, "--precision-map", tmp_path / "map.gif")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and ".svg or .png" in bad.stderr


def test_thin_exec_prints_the_quality_line(planned):
    out, _ = planned
    run = _cli("thin-exec", out, "--raw", "--prompt", "def f", "--max-new-tokens", "2")
    assert run.returncode == 0, run.stderr
    assert re.search(r"^thin-exec: quality: PASSED: mean KLD [0-9.]+ \(gate 1\)", run.stderr, re.M)


def test_vram_below_the_smallest_model_fails_before_calibrating(checkpoint, tmp_path):
    run = _cli("thinc", "compile", checkpoint, "-o", tmp_path / "m.thin", "--vram", "100M", *FAST)
    assert run.returncode == 1 and not (tmp_path / "m.thin").exists()
    assert "calibrate" not in run.stderr.replace("thinc: error", "")
    need = re.search(r"smallest budget that works is --vram (\d+)M at --ctx 4096", run.stderr)
    assert need, run.stderr
    # That budget works: `thinc plan` (which writes nothing) plans within it.
    plan = _cli("thinc", "plan", checkpoint, "--vram", f"{need.group(1)}M,{int(need.group(1)) - 1}M", "--json",
                *FAST)
    assert plan.returncode == 0, plan.stderr
    rows = json.loads(plan.stdout)["rows"]
    assert "error" not in rows[0] and rows[0]["memory"]["total"] <= int(need.group(1)) * 2**20
    assert "below the smallest model" in rows[1]["error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_vram_compile_fits_its_own_ledger(checkpoint, tmp_path):
    out = tmp_path / "m.thin"
    run = _cli("thinc", "compile", checkpoint, "-o", out, "--vram", "832M", "--ctx", "256", *FAST)
    assert run.returncode == 0, run.stderr
    with open_artifact(out) as art:
        memory, cert = art.section("memory"), art.section("certificate")
        sizes = sum(art.tensor_entry(n).size for n in art.tensor_names())
    assert memory["budget"] == 832 * 2**20 and memory["total"] <= memory["budget"]
    assert memory["lines"]["weights"] == sizes and memory["ctx"] == 256
    assert cert["status"] == "PASSED"


def test_plan_prints_a_table_per_budget(checkpoint, tmp_path):
    run = _cli("thinc", "plan", checkpoint, "--vram", "832M", "--bpw", "3,6", *FAST)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].split()[:3] == ["budget", "weights", "kv"]
    assert lines[1].startswith("--vram 832M") and lines[2].startswith("--bpw 3.0")
    predicted = [float(line.split()[-1]) for line in lines[1:4]]
    assert predicted[1] > predicted[2]  # fewer bits, more predicted error


def test_key_follows_calibration_text_planner_options_and_thresholds(checkpoint, planned, tmp_path):
    def key(*args):
        run = _cli("thinc", "key", checkpoint, *args)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    base = key("--bpw", "4.5", *FAST)
    with open_artifact(planned[0]) as art:
        assert art.key == base  # thinc key gives what compile stored
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(TEXT + "# one more line\n")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
    keys = [base, key("--bpw", "4.6", *FAST), key("--bpw", "4.5", "--calib-tokens", "600", "--device", "cpu"),
            key("--bpw", "4.5", "--max-kld", "0.5", *FAST), key("--bpw", "4.5", "--method", "rtn", *FAST),
            key("--bpw", "4.5", "--calib", tmp_path / "a.txt", *FAST),
            key("--bpw", "4.5", "--calib", tmp_path / "b.txt", *FAST),
            key("--vram", "900M", *FAST), key("--vram", "900M", "--ctx", "256", *FAST),
            key("--bpw", "4.5", "--tie-fused", *FAST)]
    assert len(set(keys)) == len(keys)
    # The same text as JSON lines is the same calibration text.
    assert key("--bpw", "4.5", "--calib", tmp_path / "c.jsonl", *FAST) == keys[5]


def test_flags_that_would_do_nothing_are_refused(checkpoint, tmp_path):
    for args, message in ((["--calib-tokens", "512"], "need calibration"),
                          (["--max-kld", "0.1"], "need a quantized compile"),
                          (["--quant", "int4", "--allow-uncertified"], "needs a certificate"),
                          (["--ctx", "100"], "need a budget"),
                          (["--max-expert-formats", "2"], "need a budget"),
                          (["--bpw", "4", "--quant", "int4"], "not both"),
                          (["--bpw", "4", "--method", "fast"], "--method takes")):
        run = _cli("thinc", "compile", checkpoint, "-o", tmp_path / "m.thin", *args)
        assert run.returncode == 1 and message in run.stderr, (args, run.stderr)
        assert run.stderr.count("\n") == 1


def test_quant_with_max_kld_is_certified(checkpoint, tmp_path):
    out = tmp_path / "m.thin"
    run = _cli("thinc", "compile", checkpoint, "-o", out, "--quant", "int8", "--max-kld", "0.05", "--device", "cpu")
    assert run.returncode == 0, run.stderr
    with open_artifact(out) as art:
        cert = art.section("certificate")
    assert cert["status"] == "PASSED" and cert["gate"] == {"max_kld": 0.05, "default": False}
    failing = _cli("thinc", "compile", checkpoint, "-o", out, "--quant", "q1", "--max-kld", "0.0001",
                   "--device", "cpu")
    assert failing.returncode == 1 and "above 0.0001 (--max-kld)" in failing.stderr, failing.stderr


@pytest.mark.gpu
def test_tiny_coder_planned_on_the_gpu_meets_the_bar(tmp_path):
    """Calibration, GPTQ, scoring and the certificate on CUDA (bf16 activations): the --bpw 5.06 bar
    of the issue (0.75x llama.cpp's Q4_K_M KLD on tiny-coder) on the certificate's held-out prompts."""
    from pathlib import Path

    out = tmp_path / "m.thin"
    model = Path(__file__).resolve().parent.parent / "examples/models/tiny-coder"
    run = _cli("thinc", "compile", model, "-o", out, "--bpw", "5.06", "--device", "cuda")
    assert run.returncode == 0, run.stderr
    with open_artifact(out) as art:
        cert, plan = art.section("certificate"), art.section("precision_plan")["plan"]
    assert plan["bits_per_weight"] <= 5.06 and cert["status"] == "PASSED"
    assert cert["measured"]["mean_kld"] <= 0.0088
