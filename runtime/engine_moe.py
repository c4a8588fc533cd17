"""The decode engine's choices for its mixture-of-experts layers (engine.py): which layers' launches also
run the residual norm beside them, the router the one before the experts (kernels/norm_router.py) and the
down launch the one after (kernels/expert_finish.py), each timed once per kind of layer on a GPU."""

from __future__ import annotations


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
