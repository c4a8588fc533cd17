"""Phi-3 (Phi3ForCausalLM): fused qkv_proj and gate_up_proj, kept fused in the IR; partial RoPE."""

from __future__ import annotations

from . import register
from .decoder import AttentionOptions, assemble, dense_layers


@register("Phi3ForCausalLM", "phi3")
def build(cfg, b):
    """Phi-3 / Phi-3.5 / Phi-4 dense models with default RoPE (longrope is refused by cfg.rope)."""
    n = cfg.int("num_hidden_layers")
    rope = cfg.rope(cfg.rope_parameters())
    window = cfg.optional_int("sliding_window")  # transformers applies it to every layer when set
    layers = dense_layers(b, cfg, ropes=[rope] * n, windows=[window] * n,
                          opts=AttentionOptions(fused_qkv=True), activation=cfg.activation(), fused_mlp=True)
    return assemble(b, cfg, "phi3", layers, tied_default=False)
