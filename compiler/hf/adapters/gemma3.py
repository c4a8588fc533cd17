"""Gemma-3 text (Gemma3ForCausalLM): Gemma-2's layout plus qk-norm and a separate RoPE for local layers."""

from __future__ import annotations

from thin.ir import RoPE

from . import register
from .decoder import AttentionOptions, assemble, dense_layers, sliding_windows
from .gemma2 import gemma_common


def _ropes(cfg, types: list[str]) -> list[RoPE]:
    """Global layers use rope_theta (+ rope_scaling); sliding layers rope_local_base_freq, unscaled."""
    nested = cfg.raw.get("rope_parameters")
    if isinstance(nested, dict) and any(isinstance(nested.get(t), dict) for t in ("full_attention",
                                                                                   "sliding_attention")):
        by_type = {t: cfg.rope(cfg.rope_parameters(t, 1_000_000.0 if t == "full_attention" else 10_000.0))
                   for t in set(types)}
    else:  # transformers v4 spelling: top-level rope_theta/rope_scaling plus rope_local_base_freq
        local = {"rope_type": "default", "rope_theta": cfg.float("rope_local_base_freq", 10_000.0)}
        by_type = {"full_attention": cfg.rope(cfg.rope_parameters(default_theta=1_000_000.0)),
                   "sliding_attention": cfg.rope(local)}
    return [by_type[t] for t in types]


@register("Gemma3ForCausalLM", "gemma3")
def build(cfg, b):
    """Gemma-3 text-only models (Gemma3TextConfig); sliding_window_pattern 6 unless layer_types says."""
    n = cfg.int("num_hidden_layers")
    pattern = cfg.int("sliding_window_pattern", 6)
    rule = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    types = cfg.layer_types(rule)
    opts = AttentionOptions(qk_norm="head", **gemma_common(cfg, attn_softcap_default=None))
    layers = dense_layers(b, cfg, ropes=_ropes(cfg, types), windows=sliding_windows(cfg, types, default=4096),
                          opts=opts, activation=cfg.activation("hidden_activation", "gelu_pytorch_tanh"),
                          sandwich=True)
    return assemble(b, cfg, "gemma3", layers, tied_default=True, norm_offset=1.0,
                    embed_scale=cfg.int("hidden_size") ** 0.5,
                    final_softcap=cfg.optional_float("final_logit_softcapping", None))
