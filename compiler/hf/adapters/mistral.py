"""Mistral (MistralForCausalLM): Llama with a sliding window on every layer."""

from __future__ import annotations

from . import register
from .decoder import AttentionOptions, assemble, dense_layers


@register("MistralForCausalLM", "mistral")
def build(cfg, b):
    """Mistral-7B style: `sliding_window` (when set) applies to all layers, as in transformers."""
    n = cfg.int("num_hidden_layers")
    rope = cfg.rope(cfg.rope_parameters())
    window = cfg.optional_int("sliding_window", 4096)  # MistralConfig's default when the key is absent
    layers = dense_layers(b, cfg, ropes=[rope] * n, windows=[window] * n, opts=AttentionOptions(),
                          activation=cfg.activation())
    return assemble(b, cfg, "mistral", layers, tied_default=False)
