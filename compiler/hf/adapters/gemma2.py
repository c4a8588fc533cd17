"""Gemma-2 (Gemma2ForCausalLM): sandwich norms with +1 weights, softcaps, alternating sliding window."""

from __future__ import annotations

from . import register
from .decoder import AttentionOptions, assemble, dense_layers, sliding_windows


def gemma_common(cfg, attn_softcap_default: float | None) -> dict:
    """Attention settings shared by Gemma-2 and Gemma-3 text models (defaults: transformers' configs)."""
    cfg.refuse("use_bidirectional_attention", False)
    bias = cfg.bool("attention_bias")
    return {
        "qkv_bias": bias, "o_bias": bias, "norm_offset": 1.0,
        "scale": cfg.float("query_pre_attn_scalar", 256) ** -0.5,
        "logit_softcap": cfg.optional_float("attn_logit_softcapping", attn_softcap_default),
    }


@register("Gemma2ForCausalLM", "gemma2")
def build(cfg, b):
    """Gemma-2: every other layer (even indices) slides unless layer_types says otherwise."""
    n = cfg.int("num_hidden_layers")
    rope = cfg.rope(cfg.rope_parameters())
    types = cfg.layer_types(["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
    opts = AttentionOptions(**gemma_common(cfg, attn_softcap_default=50.0))
    layers = dense_layers(b, cfg, ropes=[rope] * n, windows=sliding_windows(cfg, types, default=4096),
                          opts=opts, activation=cfg.activation("hidden_activation", "gelu_pytorch_tanh"),
                          sandwich=True)
    return assemble(b, cfg, "gemma2", layers, tied_default=True, norm_offset=1.0,
                    embed_scale=cfg.int("hidden_size") ** 0.5,
                    final_softcap=cfg.optional_float("final_logit_softcapping", 30.0))
