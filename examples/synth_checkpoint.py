"""Write a deterministic random-weight Hugging Face checkpoint of a real model's shape.

    python examples/synth_checkpoint.py --shape llama-8b --out /tmp/llama-8b
    python examples/synth_checkpoint.py --shape qwen3-8b --out /tmp/qwen3-8b [--layers 4]

Shapes: `llama-8b` (LlamaForCausalLM: hidden 4096, FFN 14336, 32 layers, 32/8 heads, vocab 32000,
rope_theta 500000 with Llama-3.1's rope scaling, untied head) and `qwen3-8b` (Qwen3ForCausalLM
with Qwen3-8B's published dimensions: hidden 4096, FFN 12288, 36 layers, 32/8 heads, head_dim 128,
vocab 151936, q/k norms, rope_theta 1e6, untied head). Mixtures of experts: `moe-a3b`
(MixtralForCausalLM: hidden 2048, 16 layers, 32/4 heads, head_dim 128, 128 experts of FFN 768, top-8,
vocab 32000, rope_theta 1e6) and `gpt-oss-20b` (GptOssForCausalLM with gpt-oss-20b's published
dimensions: hidden 2880, 24 layers, 64/8 heads, head_dim 64, 32 experts of FFN 2880, top-4, 128-token
sliding window on every other layer, sinks, YaRN, vocab 201088; experts stored as MXFP4 blocks and
scales like the published checkpoint). `--layers N` keeps the shape but N layers.

Weights are bf16 safetensors in shards of about 4 GB: linear weights N(0, 0.02^2) like the
models' own initialisation, norms around 1. Each tensor is drawn from a generator seeded by
(--seed, the tensor's name), on the GPU when there is one (seconds instead of minutes): the same
command on the same kind of device writes the same bytes. A byte-level BPE tokenizer.json with
exactly vocab_size entries (specials, the 256 bytes, then fillers) makes the folder compile and
run like a real checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    "llama-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 32000, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
}
SHARD_BYTES = 4 * 10**9
# ---- mixture-of-experts shapes ------------------------------------------------------------------------
SHAPES["moe-a3b"] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 2048,
    "intermediate_size": 768, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_local_experts": 128, "num_experts_per_tok": 8, "vocab_size": 32000,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
SHAPES["gpt-oss-20b"] = {  # layer_types left out: GptOssConfig's default alternates from a sliding layer 0
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "sliding_window": 128, "attention_bias": True, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}


def moe_tensors(cfg: dict, seed: int, device: torch.device):
    """(name, tensor) of a Mixtral or GPT-OSS checkpoint, drawn like `draw`; biases and sinks small. GPT-OSS
    experts are drawn in bf16 then stored as published: MXFP4 blocks uint8 [E, rows, cols / 32, 16] and
    scales [E, rows, cols / 32] (thin's mxfp4 reference encoding, the same bytes), gate and up interleaved."""
    from thin.ir import formats

    h, i, v, d, experts = (cfg[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "head_dim",
                                            "num_local_experts"))
    heads, q, kv = cfg["num_attention_heads"], cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    gpt = cfg["model_type"] == "gpt_oss"

    def w(name, shape):
        return name, draw(name, shape, seed, device)

    def small(name, shape):  # 0.02-scale like a weight, whatever the rank
        return name, draw(name, (1, *shape), seed, device).reshape(shape)

    def mxfp4(name, rows, cols):
        fmt, blocks, scales = formats.get("mxfp4"), [], []
        for e in range(experts):
            parts = fmt.split(fmt.encode(draw(f"{name}[{e}]", (rows, cols), seed, device).to(device).float()),
                              (rows, cols))
            blocks.append(parts["values"].reshape(rows, cols // 32, 16).cpu())
            scales.append(parts["scales"].cpu())
        return [(name + "_blocks", torch.stack(blocks)), (name + "_scales", torch.stack(scales))]

    yield w("model.embed_tokens.weight", (v, h))
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield w(p + "input_layernorm.weight", (h,))
        for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
            yield w(p + f"self_attn.{name}.weight", shape)
            if gpt:
                yield small(p + f"self_attn.{name}.bias", shape[:1])
        yield w(p + "post_attention_layernorm.weight", (h,))
        if gpt:
            yield small(p + "self_attn.sinks", (heads,))
            yield w(p + "mlp.router.weight", (experts, h))
            yield small(p + "mlp.router.bias", (experts,))
            yield from mxfp4(p + "mlp.experts.gate_up_proj", 2 * i, h)
            yield small(p + "mlp.experts.gate_up_proj_bias", (experts, 2 * i))
            yield from mxfp4(p + "mlp.experts.down_proj", h, i)
            yield small(p + "mlp.experts.down_proj_bias", (experts, h))
            continue
        yield w(p + "block_sparse_moe.gate.weight", (experts, h))
        for e in range(experts):
            for name, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
                yield w(p + f"block_sparse_moe.experts.{e}.{name}.weight", shape)
    yield w("model.norm.weight", (h,))
    yield w("lm_head.weight", (v, h))


def tensor_shapes(cfg: dict):
    """(name, shape) of every tensor of the checkpoint, in the order they are written."""
    h, i, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (h,)
        for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
            yield p + f"self_attn.{name}.weight", shape
        if cfg["model_type"] == "qwen3":
            yield p + "self_attn.q_norm.weight", (d,)
            yield p + "self_attn.k_norm.weight", (d,)
        yield p + "post_attention_layernorm.weight", (h,)
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            yield p + f"mlp.{name}.weight", shape
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def draw(name: str, shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """The tensor `name`: its own seeded generator, so any one tensor can be regenerated alone."""
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)
    gen = torch.Generator(device=device).manual_seed(key)
    if len(shape) == 1:  # norms: around 1
        return (1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)).to(torch.bfloat16).cpu()
    return (0.02 * torch.randn(shape, generator=gen, device=device)).to(torch.bfloat16).cpu()


def write_tokenizer(out: Path, vocab_size: int, bos: int, eos: int) -> None:
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens: <unk>, <s>, </s>, the 256 bytes, fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = {0: "<unk>", bos: "<s>", eos: "</s>"}
    vocab = {token: index for index, token in specials.items()}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<|filler_{len(vocab)}|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials.values()))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 131072}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="keep the shape, change the number of layers")
    args = ap.parse_args()
    cfg = dict(SHAPES[args.shape])
    if args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    shard, shard_bytes, index, total, n = {}, 0, {}, 0, 0

    def flush():
        nonlocal shard, shard_bytes, n
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(args.out / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
        shard, shard_bytes, n = {}, 0, n + 1

    tensors = moe_tensors(cfg, args.seed, device) if "num_local_experts" in cfg else \
        ((name, draw(name, shape, args.seed, device)) for name, shape in tensor_shapes(cfg))
    for name, t in tensors:
        shard[name] = t
        shard_bytes += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (args.out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1))
    (args.out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}, indent=1))
    write_tokenizer(args.out, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
    print(f"{args.shape}: {cfg['num_hidden_layers']} layers, {total / 1e9:.2f} GB in {n} shard(s) on {device.type} "
          f"in {time.perf_counter() - started:.1f} s -> {args.out}")


if __name__ == "__main__":
    main()
