"""The decode engine's choices of launches that also run the residual add + RMSNorm beside their own
work (engine.py), so that no add_rmsnorm launch is needed: o's and down's matvecs (kernels/norm.py
`Finish`, the formats' `matvec_finish`), and in mixture-of-experts layers the router, the norm before
the experts (kernels/norm_router.py), and the experts' down launch, the norm after them
(kernels/expert_finish.py); each timed once per kind of weight or layer on a GPU against the separate
launches, and kept only where faster. Ahead of all of these, where both sides' kernels can, o and down
leave the norm to the projection after them (`deferring_producers`, kernels/deferred_norm.py `Deferred`), and
o takes the attention's output as int8 a head where its weight can (`int8_o_layers`, kernels/int8_heads.py)."""

from __future__ import annotations

import torch

from .engine_plans import level_uses
from .ffn import MLPPlan


def deferring_producers(engine) -> set[int]:
    """ids of the o and down matvecs that leave the residual norm to the projection after them (deferred_norm.Deferred):
    they add their rows into the residual and write residual * norm weight and their programs' sums of squares,
    with no last program finishing the norm, and gate/up (after o), the next layer's qkv or the LM head (after
    down) apply the norm's 1 / rms to their sums. Where both sides are deferrable kernels (deferred_norm.Deferred's
    families), the layer is dense, o's and down's outputs have no post-norm (Gemma, OLMo-2: that norm needs
    the whole row first) and a norm follows; bfloat16 or float32 models only (residual * weight, unnormed,
    could leave float16's range)."""
    if engine.dtype not in (torch.bfloat16, torch.float32):
        return set()

    def gives(op) -> bool:
        return getattr(op, "deferrable", False) and op.out_features == engine.hidden

    def takes(ops) -> bool:
        return all(getattr(op, "deferrable", False) for op in ops)

    layers, out = engine.ex.layers, set()
    for index, layer in enumerate(layers):
        mlp = layer.ffn
        if index in engine.moe or not isinstance(mlp, MLPPlan):
            continue
        o = layer.attention.o
        if (mlp.gated and len(mlp.up) == 1 and layer.attn_post_norm is None and layer.ffn_norm is not None
                and gives(o) and takes(mlp.up)):
            out.add(id(o))
        last = index + 1 == len(layers)
        consumers = [engine.ex.lm_head] if last else layers[index + 1].attention.qkv
        following = engine.ex.final_norm if last else layers[index + 1].attn_norm
        if layer.ffn_post_norm is None and following is not None and gives(mlp.down) and takes(consumers):
            out.add(id(mlp.down))
    return out


def choose_finishing(engine, timed: bool) -> None:
    """Which o and down matvecs finish the residual norm themselves (engine.py `_add_norm`): timed (norm.choose_finish,
    once per kind of weight: format, shape, norms, over all the weights of that kind), else every one
    that can. In a model with elastic FFN levels, a level's down (over a prefix of its columns) is timed
    and chosen on its own, per prefix, where its kind of weight finishes over a prefix
    (`finish_prefixes`); where not, down finishes at no level, the whole weight included, so that no
    level is favoured."""
    from .kernels.norm import choose_finish

    kinds: dict[tuple, list] = {}
    prefixes = [(op, cols) for op, mode, _, cols in level_uses(engine.ex) if mode == "partial"]
    plain = {id(op) for op, _ in prefixes if not hasattr(op, "finish_prefixes")}
    posts = {id(layer.ffn.down): layer.ffn_post_norm for layer in engine.ex.layers if isinstance(layer.ffn, MLPPlan)}
    uses = []
    for layer in engine.ex.layers:  # the whole weights that defer their norm need no finishing
        if id(layer.attention.o) not in engine._deferring:
            uses.append((layer.attention.o, layer.attn_post_norm, layer.ffn_norm, None))
        if isinstance(layer.ffn, MLPPlan) and id(layer.ffn.down) not in plain | engine._deferring:
            uses.append((layer.ffn.down, layer.ffn_post_norm, True, None))
    uses += [(op, posts[id(op)], True, cols) for op, cols in prefixes if id(op) not in plain]
    for op, post, norm, cols in uses:
        if hasattr(op, "matvec_finish") and op.out_features == engine.hidden:
            key = (type(op), op.format, op.out_features, op.in_features, cols, post is not None, norm is not None)
            kinds.setdefault(key, []).append(op)
    engine._finishing.clear()
    engine._finishing_prefixes.clear()
    for (*_, cols, post, norm), ops in kinds.items():
        prefix = {} if cols is None else {"cols": cols}
        if timed:
            config = choose_finish(ops, engine.partials.shape[0], post, norm, **prefix)
        else:
            candidates = ops[0].finish_candidates(engine.partials.shape[0], **prefix)
            config = candidates[0] if candidates else None
        for op in ops:
            if cols is None:
                op.finish_config = config
                if config is not None:
                    engine._finishing.add(id(op))
            else:
                op.finish_prefixes = {**(op.finish_prefixes or {}), cols: config}
                if config is not None:
                    engine._finishing_prefixes.add((id(op), cols))



def choose_norm_routers(engine, timed: bool) -> None:
    """Which MoE layers' routers add o's partial sums into the residual and norm it themselves
    (norm_router.py), where o's matvec does not: timed (norm_router.choose, once per kind of layer:
    router shape and bias, partial rows, o's bias, post-norm), else every one."""
    from .kernels import norm_router

    kinds: dict[tuple, list] = {}
    for index, kernels in engine.moe.items():
        kernels.norm_router = None
        layer = engine.ex.layers[index]
        o = layer.attention.o
        if id(o) in engine._finishing:
            continue
        parts = min(o.split, engine.partials.shape[0]) if hasattr(o, "matvec") and o.out_features == engine.hidden \
            else 1
        key = (kernels.num_experts, kernels.hidden, kernels.router_bias is not None, parts, o.bias is not None,
               layer.attn_post_norm is not None)
        kinds.setdefault(key, []).append(kernels)
    for (*_, parts, bias, post), group in kinds.items():
        config = norm_router.choose(group, parts, post, bias) if timed else \
            norm_router.candidates(group[0].num_experts, group[0].hidden)[0]
        for kernels in group:
            kernels.norm_router = config


def choose_finishing_downs(engine, timed: bool) -> None:
    """Which MoE layers' down launches add their top_k rows into the residual and norm it in their last
    program (expert_finish.py) instead of an add_rmsnorm launch: timed (expert_finish.choose, once per
    kind of layer: the down group's shape and format, post-norm, next norm), else every one that can
    (one down format)."""
    from .kernels import expert_finish

    layers = engine.ex.layers
    kinds: dict[tuple, list] = {}
    for index, kernels in engine.moe.items():
        kernels.finish_down = None
        if len(kernels.down_groups) != 1:
            continue
        following = layers[index + 1].attn_norm if index + 1 < len(layers) else engine.ex.final_norm
        key = (kernels._shape(0, "down"), layers[index].ffn_post_norm is not None, following is not None)
        kinds.setdefault(key, []).append(kernels)
    for (_, post, norm), group in kinds.items():
        if timed:
            config = expert_finish.choose(group, post, norm)
        else:
            configs = expert_finish.candidates(group[0], post)
            config = configs[0] if configs else None
        for kernels in group:
            kernels.finish_down = config


INT8_O = "o from int8 heads"  # the step's section (and dependent launch) of o's matvec from the merge's codes


def int8_o_layers(engine, on: bool | None) -> tuple[set[int], object]:
    """(indices of the layers whose o runs on the int8 tensor cores from the attention merge's int8 heads, the
    kernels/int8_heads.Int8Heads they share or None): where o defers the residual norm (`deferring_producers`) and
    its weight is symmetric int4 in groups of 128 over heads of 128 features (int8_heads.takes). `on` None: on GPUs
    of compute capability 9 or later, graphs or not, so that the rounding does not depend on --no-graph. Where the
    step launches some sections as dependents, o's section (INT8_O) joins them: o then loads its weight while the
    merge runs (launched plainly it measured slower, BENCHMARKS Round 26). The rounding moves o's output by about
    0.6%, the rounding llama.cpp's int8-activation kernels make."""
    if on is None:
        on = engine.device.type == "cuda" and torch.cuda.get_device_capability(engine.device) >= (9, 0)
    if not on:
        return set(), None
    from .kernels.int8_heads import Int8Heads, takes

    layers = {index for index, layer in enumerate(engine.ex.layers)
              if id(layer.attention.o) in engine._deferring and takes(layer.attention.o, engine.head_dim)}
    if not layers:
        return layers, None
    if isinstance(engine._dependent, frozenset):
        engine._dependent |= {INT8_O}
    return layers, Int8Heads.empty(engine.num_heads, engine.device)
