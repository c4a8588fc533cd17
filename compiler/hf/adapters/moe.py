"""Mixture-of-experts pieces shared by MoE adapters: router and experts in either checkpoint layout.

transformers v5 keeps experts fused in memory (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) but `save_pretrained` converts Qwen3-MoE back to one tensor
per expert (`experts.{e}.gate_proj.weight`). Both layouts map to per-expert IR tensors; a
fused tensor is sliced lazily, one expert at a time, so no expert is read twice.
"""

from __future__ import annotations

from thin.ir import MLP, Linear

from ..builder import Builder
from .decoder import mlp


def experts(b: Builder, src: str, dst: str, layer: int, num_experts: int, activation: str) -> tuple[MLP, ...]:
    """Per-expert gated MLPs `{dst}{e}.{gate,up,down}.weight` from `{src}` (".../mlp.experts.")."""
    if b.has(f"{src}gate_up_proj"):
        return tuple(_fused_expert(b, src, dst, layer, e, activation) for e in range(num_experts))
    return tuple(mlp(b, f"{src}{e}.", f"{dst}{e}.", layer, activation, role="moe.expert", expert=e)
                 for e in range(num_experts))


def _fused_expert(b: Builder, src: str, dst: str, layer: int, e: int, activation: str) -> MLP:
    gate_up = f"{src}gate_up_proj"
    inter = b.source_shape(gate_up)[1] // 2  # [gate; up] halves along the output dimension

    def take(source: str, name: str, index: tuple) -> Linear:
        return Linear(b.take(source, f"{dst}{e}.{name}.weight", f"moe.expert.{name}", layer, expert=e,
                             index=index))

    return MLP(activation,
               gate=take(gate_up, "gate", (e, slice(0, inter))),
               up=take(gate_up, "up", (e, slice(inter, 2 * inter))),
               down=take(f"{src}down_proj", "down", (e,)))
