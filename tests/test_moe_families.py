"""Mixtral and GPT-OSS beyond the shared parity tests: what reaches the IR, YaRN against transformers,
sliding-window layers that keep only their window, and GPT-OSS's MXFP4 experts read as published.

(Logit and greedy parity of both families on random tiny checkpoints is in test_executor_parity and
test_parity, which run every entry of hf_tiny.FAMILIES.)
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from thin.compiler import compile_model
from thin.compiler.hf import UnsupportedConfigError, load_checkpoint
from thin.compiler.hf.config import Config
from thin.ir import IRVerificationError, MoE, RoPE, formats, verify
from thin.runtime import load
from thin.runtime.executor import Executor
from thin.runtime.generate import ConversationCache
from thin.runtime.rope import RotaryTables, inverse_frequencies

from hf_tiny import build_model, make_checkpoint

transformers = pytest.importorskip("transformers")

SEQ = 48


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = make_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))
    return path, load_checkpoint(path)


def test_gpt_oss_features_reach_the_ir(gpt_oss):
    _, source = gpt_oss
    model = source.program.model
    assert [layer.attention.sliding_window for layer in model.layers] == [8, None, 8]
    for layer in model.layers:
        a, moe = layer.attention, layer.ffn
        assert a.sinks == f"layers.{layer.index}.attn.sinks" and a.q.bias and a.o.bias
        assert a.rope.kind == "yarn" and a.rope.truncate is False
        assert a.rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
        assert isinstance(moe, MoE) and moe.router.bias and moe.normalize_top_k and moe.top_k == 2
        for expert in moe.experts:
            assert (expert.alpha, expert.limit, expert.up_offset) == (1.702, 3.0, 1.0)
            assert expert.gate_up.bias and expert.down.bias and expert.gate is None


def test_gpt_oss_gate_up_is_regrouped_from_interleaved_rows(gpt_oss):
    """transformers reads gate from the even columns of gate_up_proj [E, hidden, 2I], up from the odd."""
    path, source = gpt_oss
    reference = build_model("gpt_oss")
    stored = reference.model.layers[1].mlp.experts
    raw = source.program.load("layers.1.ffn.experts.2.gate_up.weight")
    gate_up = formats.decode("f32", raw, (64, 64))
    torch.testing.assert_close(gate_up[:32], stored.gate_up_proj[2][:, 0::2].T, rtol=0, atol=0)
    torch.testing.assert_close(gate_up[32:], stored.gate_up_proj[2][:, 1::2].T, rtol=0, atol=0)
    bias = formats.decode("f32", source.program.load("layers.1.ffn.experts.2.gate_up.bias"), (64,))
    torch.testing.assert_close(bias, torch.cat((stored.gate_up_proj_bias[2][0::2], stored.gate_up_proj_bias[2][1::2])))


def test_mixtral_reads_the_fused_in_memory_layout_too(tmp_path):
    """transformers v5 keeps Mixtral's experts as one gate_up_proj / down_proj; both layouts give one IR."""
    from safetensors.torch import save_file

    model = build_model("mixtral")
    legacy = load_checkpoint(make_checkpoint("mixtral", tmp_path / "legacy"))
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"))
    (fused / "config.json").write_text((tmp_path / "legacy" / "config.json").read_text())
    source = load_checkpoint(fused)
    assert source.program.model == legacy.program.model
    for t in source.program.model.tensors:
        assert torch.equal(source.program.load(t.name), legacy.program.load(t.name)), t.name


@pytest.mark.parametrize("params", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 4.0, "original_max_position_embeddings": 64},  # defaults: betas 32 / 1, truncate true
    {"factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5,
     "original_max_position_embeddings": 512},
    {"factor": 2.0, "attention_factor": 0.75, "original_max_position_embeddings": 128},
    {"factor": 4.0, "original_max_position_embeddings": 64, "top_level": 256},  # the top-level key wins
])
def test_yarn_matches_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **params}
    top = {"original_max_position_embeddings": params.pop("top_level")} if "top_level" in params else {}
    hf = transformers.GptOssConfig(hidden_size=128, head_dim=64, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=2048, rope_parameters=dict(params), **top)
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    raw = {"head_dim": 64, "hidden_size": 128, "num_attention_heads": 2, "max_position_embeddings": 2048, **top}
    rope = Config(raw, "GptOssForCausalLM").rope(params)
    assert torch.equal(inverse_frequencies(rope), want_freq)
    assert rope.attention_factor == want_scale
    cos, sin = RotaryTables(rope, torch.device("cpu"), torch.float32).get(0, 100)
    freqs = torch.arange(100, dtype=torch.float32)[:, None] * want_freq[None, :]
    assert torch.equal(cos[:, :32], freqs.cos() * want_scale) and torch.equal(sin[:, 32:], freqs.sin() * want_scale)


def test_new_ir_fields_are_verified(gpt_oss):
    model = gpt_oss[1].program.model
    layer = model.layers[0]
    bad_rope = dataclasses.replace(layer.attention.rope, beta_fast=float("nan"), attention_factor=-1.0)
    bad_expert = dataclasses.replace(layer.ffn.experts[0], limit=0.0, alpha=float("inf"))
    plain_with_yarn_fields = dataclasses.replace(layer.ffn.experts[1], activation="gelu")
    ffn = dataclasses.replace(layer.ffn, experts=(bad_expert, plain_with_yarn_fields, *layer.ffn.experts[2:]))
    broken = dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, rope=bad_rope), ffn=ffn)
    with pytest.raises(IRVerificationError) as info:
        verify(dataclasses.replace(model, layers=(broken, *model.layers[1:])))
    text = str(info.value)
    assert "yarn's beta_fast" in text and "limit must be" in text and "alpha must be" in text
    assert "belong to a gated silu MLP" in text
    default = RoPE("default", 10000.0, 16, beta_fast=32.0)
    assert "are for yarn" in str(pytest.raises(IRVerificationError, verify, dataclasses.replace(
        model, layers=(dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, rope=default)),
                       *model.layers[1:]))).value)


def test_sliding_layers_hold_only_their_window(gpt_oss):
    """A sliding layer's cache is a ring of `window` positions; chunked prefill and decode over it give
    the full forward's logits, and rolling back further than the ring allows starts over."""
    _, source = gpt_oss
    executor = Executor(source.program.model, source.program.load)
    ids = _ids(SEQ, seed=3)
    full = executor.forward(ids)
    cache = executor.new_cache(SEQ)
    assert [k.shape[1] for k in cache.keys] == [8, SEQ, 8]
    steps, at = [], 0
    for size in (5, 9, 3, 1, 1, 13, 1, 15):
        steps.append(executor.forward(ids[at:at + size], cache))
        at += size
    assert at == SEQ and cache.length == SEQ
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-4, rtol=1e-4)
    # One token back is still in every ring; more is not, so keepable says start over.
    assert cache.keepable(SEQ - 1) == SEQ - 1 and cache.keepable(SEQ - 2) == 0
    with pytest.raises(ValueError, match="sliding-window"):
        cache.truncate(SEQ - 5)
    cache.truncate(SEQ - 1)
    torch.testing.assert_close(executor.forward(ids[SEQ - 1:], cache), full[SEQ - 1:], atol=1e-4, rtol=1e-4)


def test_a_conversation_rolls_back_past_the_window_by_starting_over(gpt_oss):
    _, source = gpt_oss
    executor = Executor(source.program.model, source.program.load)
    conversation = ConversationCache(executor, 256, min_tokens=64)
    first = _ids(30, seed=4).tolist()
    cache = conversation.prepare(first, 4)
    executor.forward(torch.tensor(first), cache)
    conversation.record(first, [])
    second = first[:20] + _ids(6, seed=5).tolist()  # shares 20 tokens, 10 behind the ring's reach
    cache = conversation.prepare(second, 4)
    assert cache.length == 0
    got = executor.forward(torch.tensor(second), cache)
    torch.testing.assert_close(got, executor.forward(torch.tensor(second)), atol=1e-4, rtol=1e-4)


def test_other_pre_quantized_checkpoints_stay_refused(tmp_path):
    path = make_checkpoint("mixtral", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}  # Mixtral's adapter reads no mxfp4
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedConfigError, match="pre-quantized"):
        load_checkpoint(path)
    gpt = make_checkpoint("gpt_oss", tmp_path / "gpt")
    config = json.loads((gpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq"}
    (gpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedConfigError, match="gptq"):
        load_checkpoint(gpt)


# ---- GPT-OSS's published MXFP4 experts -----------------------------------------------------------------

def _published_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] float -> the published layout: blocks uint8 [E, out, in / 32, 16], scales [E, out, in / 32],
    quantized with thin's mxfp4 reference (the same OCP MXFP4 bytes; only the shapes differ)."""
    fmt = formats.get("mxfp4")
    parts = [fmt.split(fmt.encode(we.float()), tuple(we.shape)) for we in w]
    out, cols = w.shape[1], w.shape[2]
    return (torch.stack([p["values"].reshape(out, cols // 32, 16) for p in parts]),
            torch.stack([p["scales"] for p in parts]))


def write_mxfp4_gpt_oss(path) -> dict[str, torch.Tensor]:
    """A random tiny GPT-OSS checkpoint whose experts are stored as OpenAI publishes them; returns its tensors."""
    from safetensors.torch import save_file

    model = build_model("gpt_oss", vocab_size=320)  # room for the 300 ids of the tokenizer written beside it
    model.save_pretrained(path, safe_serialization=True)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # transformers holds them [E, in, out]; the published blocks are [E, out, ...] like any weight.
        tensors[name + "_blocks"], tensors[name + "_scales"] = _published_blocks(tensors.pop(name).transpose(1, 2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory):
    from tiny_tokenizer import write_tokenizer

    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tensors = write_mxfp4_gpt_oss(path)
    write_tokenizer(path)
    # Without accelerate transformers refuses mxfp4 unless told to dequantize, which is what it does
    # on a CPU anyway: the experts become float32 copies of exactly what the blocks say.
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    return path, tensors, reference


def test_mxfp4_experts_are_read_as_stored(mxfp4_gpt_oss):
    path, tensors, _ = mxfp4_gpt_oss
    source = load_checkpoint(path)
    records = source.program.model.tensor_map()
    for name, shape in (("gate_up", (64, 64)), ("down", (64, 32))):
        t = records[f"layers.2.ffn.experts.3.{name}.weight"]
        assert (t.encoding.format, t.source_dtype, t.shape) == ("mxfp4", "mxfp4", shape)
    # down: the published bytes unchanged; gate_up: the same bytes, even rows (gate) first.
    blocks, scales = tensors["model.layers.2.mlp.experts.down_proj_blocks"][3], \
        tensors["model.layers.2.mlp.experts.down_proj_scales"][3]
    parts = formats.get("mxfp4").split(source.program.load("layers.2.ffn.experts.3.down.weight"), (64, 32))
    assert torch.equal(parts["values"], blocks.reshape(64, 16)) and torch.equal(parts["scales"], scales)
    blocks = tensors["model.layers.2.mlp.experts.gate_up_proj_blocks"][3].reshape(64, 32)
    parts = formats.get("mxfp4").split(source.program.load("layers.2.ffn.experts.3.gate_up.weight"), (64, 64))
    assert torch.equal(parts["values"], torch.cat((blocks[0::2], blocks[1::2])))


def test_mxfp4_checkpoint_matches_transformers_through_the_artifact(mxfp4_gpt_oss, tmp_path):
    path, _, reference = mxfp4_gpt_oss
    model = load(compile_model(path, tmp_path / "gpt-oss.thin"))
    experts = [t for t in model.ir.tensors if t.role.startswith("moe.expert") and not t.role.endswith("bias")]
    assert {t.encoding.format for t in experts} == {"mxfp4"}
    ids = _ids(SEQ)
    with torch.no_grad():
        want = reference(ids[None]).logits[0].float()
    got = model.forward(ids)
    assert F.cosine_similarity(got, want, dim=-1).min() > 0.9999
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    prompt = _ids(6, seed=2)
    reference.generation_config.eos_token_id = None
    with torch.no_grad():
        greedy = reference.generate(prompt[None], max_new_tokens=32, do_sample=False,
                                    attention_mask=torch.ones(1, 6, dtype=torch.long))[0, 6:].tolist()
    assert list(model.generate(prompt.tolist(), max_new_tokens=32, temperature=0.0, stop_token_ids=())) == greedy


def test_quant_reencodes_mxfp4_experts_from_their_decoded_values(mxfp4_gpt_oss, tmp_path):
    """--quant int4 decodes each mxfp4 expert and encodes int4 from those values (never from bf16)."""
    path, tensors, _ = mxfp4_gpt_oss
    model = load(compile_model(path, tmp_path / "int4.thin", quant="int4", group_size=32))
    record = model.ir.tensor("layers.0.ffn.experts.1.down.weight")
    assert record.encoding.format == "int4"
    mx = formats.get("mxfp4")
    blob = mx.join({"values": tensors["model.layers.0.mlp.experts.down_proj_blocks"][1].reshape(64, 16),
                    "scales": tensors["model.layers.0.mlp.experts.down_proj_scales"][1]}, (64, 32))
    want = formats.get("int4").encode(mx.decode(blob, (64, 32)), record.encoding.params)
    assert torch.equal(torch.from_numpy(model.artifact.numpy(record.name).copy()), want)


@pytest.mark.parametrize("shape", ["moe-a3b", "gpt-oss-20b"])
def test_synth_moe_shapes_write_what_thin_and_transformers_read(shape, tmp_path):
    """examples/synth_checkpoint.py's MoE shapes at toy dimensions (same code path): thin reads the
    checkpoint (GPT-OSS's experts as mxfp4) and computes what transformers does."""
    import importlib.util
    from pathlib import Path

    from safetensors.torch import save_file

    script = Path(__file__).resolve().parent.parent / "examples" / "synth_checkpoint.py"
    spec = importlib.util.spec_from_file_location("synth_checkpoint", script)
    synth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(synth)
    config = {**synth.SHAPES[shape], "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
              "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 256}
    if config.get("sliding_window"):
        config["sliding_window"] = 8
    save_file(dict(synth.moe_tensors(config, 0, torch.device("cpu"))), str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    source = load_checkpoint(tmp_path)
    mxfp4 = {t.encoding.format for t in source.program.model.tensors if t.role == "moe.expert.down"}
    assert mxfp4 == ({"mxfp4"} if shape == "gpt-oss-20b" else {"bf16"})
    extra = {"quantization_config": transformers.Mxfp4Config(dequantize=True)} if shape == "gpt-oss-20b" else {}
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager", **extra).eval()
    ids = _ids(40)
    with torch.no_grad():
        want = reference(ids[None]).logits[0].float()
    got = Executor(source.program.model, source.program.load).forward(ids)
    assert F.cosine_similarity(got, want, dim=-1).min() > 0.9999 and torch.equal(got.argmax(-1), want.argmax(-1))


def test_prefill_runs_each_expert_on_the_tokens_that_chose_it():
    """run_moe over many tokens (the (token, slot) pairs grouped by expert with one sort): bit for bit each
    chosen expert run once on its tokens in token order, and what it gives token by token (the decode
    path: each token's k experts in turn; the router's float32 products may round apart), with an expert
    no token chooses and experts many do."""
    from thin.runtime.ffn import MLPPlan, MoEPlan, run_moe

    gen = torch.Generator().manual_seed(0)
    hidden, inter, n, top_k = 16, 24, 8, 2

    def linear(fan_in, fan_out):
        layer = torch.nn.Linear(fan_in, fan_out, bias=False).double()
        layer.weight.data.copy_(0.3 * torch.randn(fan_out, fan_in, generator=gen, dtype=torch.float64))
        return layer

    experts = [MLPPlan("silu", True, [linear(hidden, 2 * inter)], linear(inter, hidden)) for _ in range(n)]
    bias = torch.zeros(n)
    bias[5] = -1e4  # never among the top k
    plan = MoEPlan(top_k, True, "softmax", torch.randn(n, hidden, generator=gen), bias, experts, None, None)
    x = torch.randn(37, hidden, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        got = run_moe(x, plan)
        want = torch.cat([run_moe(x[t:t + 1], plan) for t in range(x.shape[0])])
        probs = torch.softmax(torch.nn.functional.linear(x.float(), plan.router_weight, bias), -1)
        weights, chosen = torch.topk(probs, top_k)
        weights = (weights / weights.sum(-1, keepdim=True)).double()
        each = torch.zeros_like(x)
        for e in range(n):
            token, slot = torch.where(chosen == e)
            if token.numel():
                each.index_add_(0, token, experts[e].down(torch.nn.functional.silu(
                    experts[e].up[0](x[token])[:, :inter]) * experts[e].up[0](x[token])[:, inter:])
                    * weights[token, slot, None])
    assert 5 not in chosen.tolist() and torch.bincount(chosen.reshape(-1)).max() > 4
    assert torch.equal(got, each)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
