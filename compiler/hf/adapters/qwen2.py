"""Qwen2 (Qwen2ForCausalLM): Llama with q/k/v biases and optional sliding window layers."""

from __future__ import annotations

from . import register
from .decoder import AttentionOptions, assemble, dense_layers, sliding_windows


def qwen_layer_types(cfg) -> list[str]:
    """Qwen2/Qwen3: layers >= max_window_layers slide when use_sliding_window, unless layer_types says."""
    n = cfg.int("num_hidden_layers")
    slide = cfg.bool("use_sliding_window") and cfg.optional_int("sliding_window") is not None
    first = cfg.int("max_window_layers", n)
    default = ["sliding_attention" if slide and i >= first else "full_attention" for i in range(n)]
    types = cfg.layer_types(default)
    # transformers drops sliding_window when use_sliding_window is false, whatever layer_types says.
    return types if slide else ["full_attention"] * n


@register("Qwen2ForCausalLM", "qwen2")
def build(cfg, b):
    """Qwen2 / Qwen2.5 dense models."""
    n = cfg.int("num_hidden_layers")
    rope = cfg.rope(cfg.rope_parameters())
    layers = dense_layers(b, cfg, ropes=[rope] * n, windows=sliding_windows(cfg, qwen_layer_types(cfg)),
                          opts=AttentionOptions(qkv_bias=True), activation=cfg.activation())
    return assemble(b, cfg, "qwen2", layers, tied_default=False)
