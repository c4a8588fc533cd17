"""Mixtral (MixtralForCausalLM): Mistral attention, a softmax top-k router renormalised over the k, on every layer.

Published checkpoints (and transformers' save_pretrained) keep the original names,
`block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down); transformers
v5's in-memory layout, `mlp.gate` and fused `mlp.experts.gate_up_proj` / `down_proj`, is read too.
"""

from __future__ import annotations

from thin.ir import MLP, Linear, MoE

from . import register
from .decoder import AttentionOptions, assemble, attention, pre_norm_layer, src_layer
from .moe import experts

# Mixtral's expert projection names -> the IR's.
_EXPERT_NAMES = (("w1", "gate"), ("w3", "up"), ("w2", "down"))


def _legacy_experts(b, src: str, dst: str, layer: int, num_experts: int, activation: str) -> tuple[MLP, ...]:
    out = []
    for e in range(num_experts):
        lin = {ir: Linear(b.take(f"{src}{e}.{hf}.weight", f"{dst}{e}.{ir}.weight", f"moe.expert.{ir}", layer,
                                 expert=e)) for hf, ir in _EXPERT_NAMES}
        out.append(MLP(activation, gate=lin["gate"], up=lin["up"], down=lin["down"]))
    return tuple(out)


@register("MixtralForCausalLM", "mixtral")
def build(cfg, b):
    """Mixtral-8x7B style models; `sliding_window` (when set) applies to every layer, as in transformers."""
    rope = cfg.rope(cfg.rope_parameters(default_theta=1_000_000.0))
    window = cfg.get("sliding_window")
    num_experts, activation = cfg.int("num_local_experts", 8), cfg.activation()
    layers = []
    for i in range(cfg.int("num_hidden_layers")):
        dst = f"layers.{i}.ffn."
        legacy = b.has(src_layer(i) + "block_sparse_moe.gate.weight")
        src = src_layer(i) + ("block_sparse_moe." if legacy else "mlp.")
        attn = attention(b, cfg, i, rope, window, AttentionOptions())
        router = Linear(b.take(src + "gate.weight", dst + "router.weight", "moe.router", i))
        make = _legacy_experts if legacy else experts
        ffn = MoE(num_experts=num_experts, top_k=cfg.int("num_experts_per_tok", 2), router=router,
                  experts=make(b, src + "experts.", dst + "experts.", i, num_experts, activation),
                  normalize_top_k=True)
        layers.append(pre_norm_layer(b, cfg, i, attn, ffn))
    return assemble(b, cfg, "mixtral", layers, tied_default=False)
