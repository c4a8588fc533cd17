"""OLMo-2 (Olmo2ForCausalLM): norms on the sublayer outputs only, qk-norm over the whole projection."""

from __future__ import annotations

from thin.ir import DecoderLayer

from . import register
from .decoder import AttentionOptions, assemble, attention, mlp, src_layer


@register("Olmo2ForCausalLM", "olmo2")
def build(cfg, b):
    """OLMo-2: x += post_norm(attn(x)); x += post_norm(mlp(x)); no pre-norms."""
    bias = cfg.bool("attention_bias")
    rope = cfg.rope(cfg.rope_parameters())
    eps = cfg.float("rms_norm_eps", 1e-6)
    opts = AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm="full")
    layers = []
    for i in range(cfg.int("num_hidden_layers")):
        src, dst = src_layer(i), f"layers.{i}."
        layers.append(DecoderLayer(
            i, attention(b, cfg, i, rope, None, opts),
            mlp(b, src + "mlp.", dst + "ffn.", i, cfg.activation()),
            attn_post_norm=b.rms_norm(src + "post_attention_layernorm", dst + "attn_post_norm",
                                      "norm.attn_post", i, eps),
            ffn_post_norm=b.rms_norm(src + "post_feedforward_layernorm", dst + "ffn_post_norm",
                                     "norm.ffn_post", i, eps),
        ))
    return assemble(b, cfg, "olmo2", layers, tied_default=False)
