"""Qwen3 (Qwen3ForCausalLM): Qwen2 without q/k/v biases, with RMSNorm per head on q and k."""

from __future__ import annotations

from . import register
from .decoder import AttentionOptions, assemble, dense_layers, sliding_windows
from .qwen2 import qwen_layer_types


@register("Qwen3ForCausalLM", "qwen3")
def build(cfg, b):
    """Qwen3 dense models; attention_bias is honoured when set."""
    n = cfg.int("num_hidden_layers")
    bias = cfg.bool("attention_bias")
    rope = cfg.rope(cfg.rope_parameters())
    layers = dense_layers(b, cfg, ropes=[rope] * n, windows=sliding_windows(cfg, qwen_layer_types(cfg)),
                          opts=AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm="head"),
                          activation=cfg.activation())
    return assemble(b, cfg, "qwen3", layers, tied_default=False)
