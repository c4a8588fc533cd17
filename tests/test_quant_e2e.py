"""Every quantized format end to end: `--quant F` compiles, the artifact runs, and it computes exactly
what the format defines — the same logits as transformers with each linear weight w replaced by
decode(encode(w)) — for a dense family and for Qwen3-MoE."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from thin.compiler import compile_model
from thin.ir import formats
from thin.runtime import load

from hf_tiny import build_model
from tiny_tokenizer import write_tokenizer

# --quant takes every quantized format but the routed-expert ones (trellis), which a plan gives through
# --expert-formats and whose own tests compile them end to end
QUANTIZED = [name for name, fmt in formats.FORMATS.items() if not fmt.dense and not fmt.experts_only]
# Dimensions every format's grouping divides (group 128, mxfp4's 32, q1's 8-bit packing).
SIZES = dict(hidden_size=128, intermediate_size=256, head_dim=32, vocab_size=320)
MOE_SIZES = dict(SIZES, moe_intermediate_size=128)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    out = {}
    for family, sizes in (("llama", SIZES), ("qwen3_moe", MOE_SIZES)):
        model = build_model(family, **sizes)
        model.save_pretrained(root / family, safe_serialization=True)
        write_tokenizer(root / family)
        out[family] = (root / family, model)
    return out


def _round_trip(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """decode(encode(w)) row block by row block; every format groups within a row, so slicing
    rows (one expert of a fused expert tensor, or gate vs up) changes nothing."""
    f = formats.get(fmt)
    return f.decode(f.encode(w.float()), tuple(w.shape)).to(w.dtype)


def _reference_with_round_tripped_weights(model, fmt: str):
    """A copy of the transformers model whose projection weights (not routers, norms, embeddings)
    are replaced by what `fmt` stores for them."""
    import copy

    model = copy.deepcopy(model)
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_router = name.endswith("mlp.gate.weight") and p.dim() == 2 and "experts" not in name
            projection = p.dim() >= 2 and ("proj" in name or (name == "lm_head.weight" and not tied))
            if not projection or is_router or "embed" in name:
                continue
            flat = p.reshape(-1, p.shape[-2], p.shape[-1])  # [experts or 1, out, in]
            p.copy_(torch.stack([_round_trip(w, fmt) for w in flat]).reshape(p.shape))
    return model


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_artifact_computes_what_the_format_defines(checkpoints, tmp_path, family, fmt):
    path, hf_model = checkpoints[family]
    out = compile_model(path, tmp_path / f"{fmt}.thin", quant=fmt)
    model = load(out)
    formats_used = {t.encoding.format for t in model.ir.tensors if t.role.startswith(("attn.", "ffn.", "moe.expert"))
                    and not t.role.endswith(("norm", ".bias")) and len(t.shape) == 2}
    assert formats_used == {fmt}
    ids = torch.arange(5, 69) % hf_model.config.vocab_size
    got = model.forward(ids)
    reference = _reference_with_round_tripped_weights(hf_model, fmt)
    with torch.no_grad():
        want = reference(ids[None]).logits[0].float()
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.min() > 0.99999, f"{family}/{fmt}: min cosine {cosine.min():.6f}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    # The runtime keeps packed bytes for quantized weights: no dense copy of the model.
    assert all(op.implementation == "torch-dequant" for op in model.executor.linear_ops()
               if op.format == fmt)
    tokens = list(model.generate(ids[:8].tolist(), max_new_tokens=6, temperature=0.0, stop_token_ids=()))
    assert len(tokens) == 6


def test_thin_exec_runs_a_quantized_artifact(checkpoints, tmp_path):
    path, _ = checkpoints["llama"]
    out = tmp_path / "int4.thin"
    run = subprocess.run([sys.executable, "-m", "thin.compiler.cli", "compile", str(path), "-o", str(out),
                          "--quant", "int4", "--group-size", "64", "-q"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "bits per weight" in run.stdout
    inspect = subprocess.run([sys.executable, "-m", "thin.compiler.cli", "inspect", str(out)],
                             capture_output=True, text=True)
    assert "int4(asymmetric=0,group_size=64)" in inspect.stdout
    execute = subprocess.run([sys.executable, "-m", "thin.runtime.cli", str(out), "--verbose", "--raw",
                              "--prompt", "def push(self, x):", "--max-new-tokens", "4"],
                             capture_output=True, text=True)
    assert execute.returncode == 0, execute.stderr
    assert "int4 x" in execute.stderr and "torch-dequant" in execute.stderr
    assert "decode:" in execute.stderr and execute.stdout.strip()


def test_bad_quant_options_are_one_line_errors(checkpoints, tmp_path):
    path, _ = checkpoints["llama"]
    for args, message in ((["--quant", "int9"], "--quant takes a quantized format"),
                          (["--quant", "bf16"], "--quant takes a quantized format"),
                          (["--quant", "int8", "--group-size", "32"], "has no groups"),
                          (["--quant", "int4", "--group-size", "48"], "group_size must be one of"),
                          (["--group-size", "32"], "need --quant"),
                          (["--quant", "mxfp4", "--asymmetric"], "no asymmetric")):
        run = subprocess.run([sys.executable, "-m", "thin.compiler.cli", "compile", str(path), "-o",
                              str(tmp_path / "x.thin"), *args], capture_output=True, text=True)
        assert run.returncode != 0 and message in run.stderr, (args, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert not (tmp_path / "x.thin").exists()
