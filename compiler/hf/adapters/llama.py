"""Llama (LlamaForCausalLM): the baseline pre-norm decoder; RoPE default, linear or llama3."""

from __future__ import annotations

from . import register
from .decoder import AttentionOptions, assemble, dense_layers


@register("LlamaForCausalLM", "llama")
def build(cfg, b):
    """Llama-1/2/3.x; attention_bias and mlp_bias are honoured when set."""
    n = cfg.int("num_hidden_layers")
    attention_bias = cfg.bool("attention_bias")
    rope = cfg.rope(cfg.rope_parameters())
    layers = dense_layers(b, cfg, ropes=[rope] * n, windows=[None] * n,
                          opts=AttentionOptions(qkv_bias=attention_bias, o_bias=attention_bias),
                          activation=cfg.activation(), mlp_bias=cfg.bool("mlp_bias"))
    return assemble(b, cfg, "llama", layers, tied_default=False)
