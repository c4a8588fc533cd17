"""Write a random Llama-shaped bf16 checkpoint of about a given size, tensor by tensor, in shards.

Used by the compile/hash benchmarks: big enough to show streaming, cheap to make.
    python examples/benchmarks/make_checkpoint.py /tmp/big --size-gb 2.1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def llama_config(hidden: int, layers: int, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": hidden * 11 // 4, "num_hidden_layers": layers, "num_attention_heads": hidden // 128,
        "num_key_value_heads": max(1, hidden // 512), "head_dim": 128, "vocab_size": vocab,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "attention_bias": False, "mlp_bias": False,
    }


def tensor_shapes(cfg: dict):
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * 128, cfg["num_key_value_heads"] * 128
    yield "model.embed_tokens.weight", (v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (h,)
        for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
            yield p + f"self_attn.{name}.weight", shape
        yield p + "post_attention_layernorm.weight", (h,)
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            yield p + f"mlp.{name}.weight", shape
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def layer_bytes(cfg: dict) -> int:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * 128, cfg["num_key_value_heads"] * 128
    return 2 * (2 * q * h + 2 * kv * h + 3 * i * h + 2 * h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--size-gb", type=float, default=2.1)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--shard-gb", type=float, default=0.5)
    args = ap.parse_args()
    vocab = 32000
    cfg = llama_config(args.hidden, 1, vocab)
    budget = args.size_gb * 1e9 - 2 * 2 * vocab * args.hidden
    cfg = llama_config(args.hidden, max(1, round(budget / layer_bytes(cfg))), vocab)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator().manual_seed(0)
    shard, shard_bytes, index, total, n = {}, 0, {}, 0, 0

    def flush():
        nonlocal shard, shard_bytes, n
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(args.out / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
        shard, shard_bytes, n = {}, 0, n + 1

    for name, shape in tensor_shapes(cfg):
        t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        shard[name] = t
        shard_bytes += t.numel() * 2
        total += t.numel() * 2
        if shard_bytes >= args.shard_gb * 1e9:
            flush()
    if shard:
        flush()
    (args.out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2))
    print(f"wrote {total / 1e9:.2f} GB in {n} shards, {cfg['num_hidden_layers']} layers, to {args.out}")


if __name__ == "__main__":
    main()
