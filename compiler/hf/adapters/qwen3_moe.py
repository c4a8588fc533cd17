"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention, softmax top-k routed experts on most layers."""

from __future__ import annotations

from thin.ir import Linear, MoE

from . import register
from .decoder import AttentionOptions, assemble, attention, mlp, pre_norm_layer, src_layer
from .moe import experts


def _sparse_layers(cfg, num_experts: int) -> set[int]:
    """transformers' rule: MoE unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
    step = cfg.int("decoder_sparse_step", 1)
    dense = set(cfg.int_list("mlp_only_layers"))  # read once: the list is as long as the config makes it
    n = cfg.int("num_hidden_layers")
    return {i for i in range(n) if i not in dense and num_experts > 0 and (i + 1) % step == 0}


@register("Qwen3MoeForCausalLM", "qwen3_moe")
def build(cfg, b):
    """Qwen3-30B-A3B style models; use_sliding_window slides every layer, as in transformers."""
    bias = cfg.bool("attention_bias")
    rope = cfg.rope(cfg.rope_parameters())
    window = cfg.optional_int("sliding_window") if cfg.bool("use_sliding_window") else None
    num_experts = cfg.int("num_experts", cfg.int("num_local_experts", 0))
    activation = cfg.activation()
    opts = AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm="head")
    layers = []
    sparse = _sparse_layers(cfg, num_experts)
    for i in range(cfg.int("num_hidden_layers")):
        src, dst = src_layer(i) + "mlp.", f"layers.{i}.ffn."
        attn = attention(b, cfg, i, rope, window, opts)
        if i in sparse:
            ffn = MoE(
                num_experts=num_experts, top_k=cfg.int("num_experts_per_tok"),
                router=Linear(b.take(src + "gate.weight", dst + "router.weight", "moe.router", i)),
                experts=experts(b, src + "experts.", dst + "experts.", i, num_experts, activation),
                normalize_top_k=cfg.bool("norm_topk_prob"),
            )
        else:
            ffn = mlp(b, src, dst, i, activation)
        layers.append(pre_norm_layer(b, cfg, i, attn, ffn))
    return assemble(b, cfg, "qwen3_moe", layers, tied_default=False)
