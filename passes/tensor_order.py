"""The order in which a forward pass first reads each tensor."""

from __future__ import annotations

import dataclasses

from thin.ir import MLP, Attention, Linear, Model, MoE, Norm

# Field order in which a forward pass reads each block's weights (dataclass order is not that).
_READ_ORDER = {
    Attention: ("q", "k", "v", "qkv", "q_norm", "k_norm", "sinks", "o"),
    MLP: ("gate", "up", "gate_up", "down"),
    MoE: ("router", "experts", "shared_expert_gate", "shared_expert"),
}


def execution_order(model: Model) -> list[str]:
    """Tensor names in first-use order: embedding, each layer's blocks in field order, final norm, head.
    Streaming the artifact in this order lets a reader page weights in as decode reaches them."""
    seen: dict[str, None] = {}

    def walk(node) -> None:
        if node is None:
            return
        if isinstance(node, (Linear, Norm)):
            for name in (node.weight, node.bias):
                if name is not None:
                    seen.setdefault(name)
            return
        if isinstance(node, tuple):
            for item in node:
                walk(item)
            return
        if dataclasses.is_dataclass(node):
            names = _READ_ORDER.get(type(node)) or [f.name for f in dataclasses.fields(node)]
            for name in names:
                value = getattr(node, name)
                if name in ("weight", "sinks") and isinstance(value, str):
                    seen.setdefault(value)
                elif not isinstance(value, (str, int, float, bool)):
                    walk(value)

    walk(model.embedding)
    for layer in model.layers:
        walk(layer.attn_norm)
        walk(layer.attention)
        walk(layer.attn_post_norm)
        walk(layer.ffn_norm)
        walk(layer.ffn)
        walk(layer.ffn_post_norm)
    walk(model.final_norm)
    walk(model.lm_head)
    for level in model.ffn_levels:  # elastic FFN corrections: a few small tensors per level, level by level
        for name in (n for pair in zip(level.shift, level.scale) for n in pair):
            if name is not None:
                seen.setdefault(name)
    return list(seen)
