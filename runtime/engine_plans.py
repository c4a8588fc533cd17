"""The plans' side of the decode engines (engine.py, batch_engine.py): what the engine refuses, and
the arguments its kernels take from a layer's plans (norm weights, RoPE tables, q/k norms, block
tables, elastic-FFN prefixes, the expert kernels)."""

from __future__ import annotations

import torch

from .ffn import ACTIVATIONS, MLPPlan, MoEPlan
from .linear import LinearOp


class EngineUnsupported(NotImplementedError):
    """The model has a feature the decode engine has no kernel path for."""


def check_supported(executor) -> None:
    problems = []
    norms = [executor.final_norm] + [n for layer in executor.layers for n in
                                     (layer.attn_norm, layer.attn_post_norm, layer.ffn_norm, layer.ffn_post_norm)]
    if any(n is not None and (n.kind != "rms" or n.bias is not None) for n in norms):
        problems.append("layer norms or norm biases")
    shapes = {(layer.attention.num_heads, layer.attention.num_kv_heads, layer.attention.head_dim)
              for layer in executor.layers}
    if len(shapes) > 1:
        problems.append("attention shapes that differ between layers")
    mlps = [layer.ffn for layer in executor.layers if isinstance(layer.ffn, MLPPlan)]
    if any(m.activation not in ACTIVATIONS for m in mlps):
        problems.append("an unknown activation")
    if any(getattr(m, "limit", None) is not None or getattr(m, "alpha", 1.0) != 1.0 or getattr(m, "up_offset", 0.0)
           for m in mlps):
        problems.append("clamped SwiGLU (GPT-OSS)")
    if problems:
        raise EngineUnsupported(f"the decode engine does not run {', '.join(problems)} yet")


def block_table(cache, index: int) -> torch.Tensor:
    """The block table of layer `index` (a sliding layer's ring has its own; a cache without rings,
    such as the batch engine's slot view, has one table)."""
    table = getattr(cache, "table", None)
    return table(index) if table is not None else cache.block_table


def level_rows(op: LinearOp, x: torch.Tensor, width: int | None, halves: int) -> torch.Tensor:
    """op(x), or at an elastic FFN level its first `width` rows of each of `halves` blocks."""
    return op(x) if width is None else op.prefix(x, rows=width, halves=halves)


def level_uses(executor) -> list[tuple]:
    """(op, mode, rows, cols) of the matvecs over a prefix that a decode step runs at the executor's
    certified elastic FFN levels: gate/up's first rows, down's first columns."""
    uses = []
    for level in executor.ffn_levels:
        for layer, (width, _, _) in zip(executor.layers, level):
            mlp = layer.ffn
            if not isinstance(mlp, MLPPlan) or width is None or width == mlp.down.in_features:
                continue
            mode = "glu" if mlp.gated and len(mlp.up) == 1 else "direct"
            uses += [(op, mode, width, None) for op in mlp.up] + [(mlp.down, "partial", None, width)]
    return uses


def moe_kernels(executor) -> dict:
    """{layer index: MoEKernels} for the mixture-of-experts layers; EngineUnsupported (naming what)
    for a layer the expert kernels cannot take."""
    from .kernels.experts import MoEKernels

    out = {}
    for index, layer in enumerate(executor.layers):
        if isinstance(layer.ffn, MoEPlan):
            try:
                out[index] = MoEKernels(layer.ffn, executor.device, executor.dtype)
            except NotImplementedError as e:
                raise EngineUnsupported(f"the decode engine does not run {e} in mixture-of-experts layers yet") \
                    from None
    return out


def norm_args(plan):
    """(float32 weight, eps) of an RMSNorm plan, or None."""
    if plan is None:
        return None
    weight = plan.weight if plan.weight is not None else None
    if weight is None:
        raise EngineUnsupported("norms without a weight are not supported by the decode engine")
    return weight, plan.eps


def rope_tables(a):
    return None if a.rope is None else (a.rope.cos, a.rope.sin)


def qk_norm_args(a) -> dict:
    if a.q_norm is None or not a.qk_norm_per_head:
        return {}
    return {"q_norm": norm_args(a.q_norm), "k_norm": norm_args(a.k_norm)}


def appending_layers(executor, timed: bool) -> dict[int, bool]:
    """{layer index: `repeat`} of the layers whose decode attention runs rope_append's work inside its
    split kernel (kernels/attention_append.py); the others keep rope_append + split + merge. Timed
    (attention_append.choose_appending, once per kind of layer: rotary dims, q/k norms, window, softcap,
    sinks; on the first such layer's tables and weights), else every layer with the first variant."""
    from .kernels.attention_append import VARIANTS, choose_appending

    kinds: dict[tuple, list[int]] = {}
    for index, layer in enumerate(executor.layers):
        a = layer.attention
        rope = rope_tables(a)
        key = (None if rope is None else rope[0].shape[-1], bool(qk_norm_args(a)), a.sliding_window,
               a.logit_softcap, getattr(a, "sinks", None) is None)
        kinds.setdefault(key, []).append(index)
    chosen = {}
    for indices in kinds.values():
        a = executor.layers[indices[0]].attention
        repeat = VARIANTS[0] if not timed else choose_appending(
            a.num_heads, a.num_kv_heads, a.head_dim, executor.dtype, executor.device, scale=a.scale,
            rope=rope_tables(a), **qk_norm_args(a), window=a.sliding_window, softcap=a.logit_softcap,
            sinks=getattr(a, "sinks", None))
        chosen |= {index: repeat for index in indices if repeat is not None}
    return chosen
