"""The decode engine's choice of residual norms folded into the next matvec's input (kernels/fold.py): o's or
down's matvec adds its rows into the residual and their sum of squares into a slot, and the matvec after it
(gate/up after o; the next layer's qkv, or the LM head, after down) norms the residual where it loads it, so
no launch and no last program runs add_rmsnorm's row. Timed once per kind of pair (producer and consumers:
formats, shapes, how the producer finishes today) on a GPU against the current launches (the finishing
matvec, or partial sums then add_rmsnorm, then the plain consumer), and kept only where faster."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .engine_plans import norm_args
from .ffn import MLPPlan


@dataclass(frozen=True)
class FoldPair:
    """A producer (o or down), the matvecs that read its residual norm (`consumers`, in `mode` "direct" or
    "glu" with `activation`) and that norm's plan."""

    producer: object
    consumers: list
    activation: str | None
    norm: object


def fold_pairs(engine) -> list[FoldPair]:
    """The decode step's pairs that can fold, in launch order: none in a model with elastic FFN levels (a
    level's down runs a column prefix, and the rotation of slots needs one launch order for every graph),
    mixtures of experts or post-norms (Gemma's sandwich norm needs the whole row before the add); a pair
    where every launch is a folding-capable kernel (kernels/fold.Folding) over the hidden row, gate/up a
    fused [gate; up] weight."""
    ex, hidden = engine.ex, engine.hidden
    layers = ex.layers
    if ex.ffn_levels or engine.moe or any(not isinstance(layer.ffn, MLPPlan) or layer.attn_post_norm is not None
                                          or layer.ffn_post_norm is not None for layer in layers):
        return []
    pairs = []
    for index, layer in enumerate(layers):
        mlp = layer.ffn
        if mlp.gated and len(mlp.up) == 1 and mlp.width is None and mlp.scale is None and mlp.shift is None:
            pairs.append(FoldPair(layer.attention.o, list(mlp.up), mlp.activation, layer.ffn_norm))
        if index + 1 < len(layers):
            pairs.append(FoldPair(mlp.down, list(layers[index + 1].attention.qkv), None, layers[index + 1].attn_norm))
        else:
            pairs.append(FoldPair(mlp.down, [ex.lm_head], None, ex.final_norm))

    def can(pair):
        p, norm = pair.producer, norm_args(pair.norm)
        return (hasattr(p, "matvec_accumulate") and p.out_features == hidden and norm is not None
                and norm[0].dtype == torch.float32 and norm[0].numel() == hidden
                and all(hasattr(c, "matvec_normed") and c.in_features == hidden for c in pair.consumers))

    pairs = [pair for pair in pairs if can(pair)]
    producers = [id(pair.producer) for pair in pairs]
    return [pair for pair in pairs if producers.count(id(pair.producer)) == 1]


def choose_folding(engine, timed: bool) -> None:
    """Which pairs fold (engine.py `_add_norm` then the consumer's launch): timed (`_time_kind`, once per kind
    of pair), else every one that can; then their slots (fold.slot_plan; none when fewer than two fold) into
    engine._folding {id(producer): (fold.Accumulate, fold.NormedInput)}, the slots zeroed."""
    from .kernels.fold import Accumulate, NormedInput, slot_plan

    pairs = fold_pairs(engine)
    kinds: dict[tuple, list] = {}
    for pair in pairs:
        p = pair.producer
        key = (type(p), p.format, p.out_features, p.in_features, p.bias is not None, id(p) in engine._finishing,
               pair.activation, tuple((type(c), c.format, c.out_features, c.bias is not None) for c in pair.consumers))
        kinds.setdefault(key, []).append(pair)
    folding = set()
    for group in kinds.values():
        if not timed or _time_kind(engine, group):
            folding |= {id(pair) for pair in group}
    chosen = [pair for pair in pairs if id(pair) in folding]
    plan = slot_plan(len(chosen))
    engine._folding.clear()
    engine.norm_sums.zero_()
    sums = engine.norm_sums
    for pair, (slot, following) in zip(chosen, plan):
        engine._folding[id(pair.producer)] = (Accumulate(engine.residual, sums[slot:slot + 1],
                                                         sums[following:following + 1]),
                                              NormedInput(engine.residual, sums[slot:slot + 1], norm_args(pair.norm)))
    if chosen and not plan:
        logging.getLogger("thin.runtime").info("one residual norm would fold: it needs a second to rotate its sum "
                                               "of squares' slot, so it keeps its launches")


def _time_kind(engine, pairs: list[FoldPair]) -> bool:
    """Whether a kind of pair runs faster folded (the producer's accumulating matvec, then the consumers' normed
    input matvecs) than as the step runs it otherwise (the finishing matvec, or partial sums then add_rmsnorm,
    then the plain consumers); timed as norm.choose_finish times (the folded launches compiled first, on host
    threads; a folded launch that does not compile is never faster), back to back over the kind's pairs in
    turn, the consumers with configurations tuned for a normed input (`_tune_normed`). Weights the tuner does
    not time (common._small, LinearOp.tune) keep their launches."""
    from .kernels.common import _small, compile_launches, in_turn, median_ms, median_ms_or_inf, precompile
    from .kernels.fold import Accumulate, NormedInput
    from .kernels.norm import Finish, add_rmsnorm

    first = pairs[0]
    producer, device, dtype, H = first.producer, engine.device, engine.dtype, engine.hidden
    if _small(producer) or not producer.tune:  # weights the tuner does not time keep their launches
        return False
    mode = "direct" if first.activation is None else "glu"
    precompile([(pair.producer, "direct") for pair in pairs])
    for pair in pairs:  # the configurations both ways, chosen before either is timed
        pair.producer.config("direct")
        pair.producer.config("partial")
        for c in pair.consumers:
            c.config(mode)
    x = torch.randn(producer.in_features, device=device).to(dtype)
    residual, normed = torch.randn(H, device=device).to(dtype), torch.empty(H, dtype=dtype, device=device)
    outs = [torch.empty(c.out_features // (1 if mode == "direct" else 2), dtype=dtype, device=device)
            for c in first.consumers]
    norm = (torch.ones(H, device=device), norm_args(first.norm)[1])
    sums, counter = torch.zeros(3, device=device), torch.zeros(1, dtype=torch.int32, device=device)
    parts = torch.empty(engine.partials.shape[0], H, dtype=torch.float32, device=device)
    finishing = id(producer) in engine._finishing

    def separate(pair):
        p = pair.producer
        if finishing:
            p.matvec_finish(x, parts, Finish(counter, residual, normed, p.bias, None, norm))
        else:
            add_rmsnorm(residual, normed, partials=p.matvec(x, partials=parts), bias=p.bias, norm=norm)
        for c, out in zip(pair.consumers, outs):
            c.matvec(normed, out=out, activation=pair.activation)

    def folded(pair):
        pair.producer.matvec_accumulate(x, Accumulate(residual, sums[0:1], sums[1:2]))
        for c, out in zip(pair.consumers, outs):
            c.matvec_normed(NormedInput(residual, sums[0:1], norm), out, pair.activation)

    for i in range(len(first.consumers)):
        _tune_normed([pair.consumers[i] for pair in pairs], mode, first.activation, outs[i],
                     NormedInput(residual, sums[0:1], norm))
    compile_launches([(device, in_turn(pairs, folded))], report=False)
    separate_ms, folded_ms = median_ms(in_turn(pairs, separate)), median_ms_or_inf(in_turn(pairs, folded),
                                                                                   "folded residual norm")
    consumers = " + ".join(f"{c.format} {c.out_features}x{c.in_features}" for c in first.consumers)
    logging.getLogger("thin.runtime").info(
        f"{producer.format} {producer.out_features}x{producer.in_features} -> {consumers} ({mode}): residual norm "
        f"folded into the next matvec's input: {1e3 * folded_ms:.1f} us, "
        f"{'finishing matvec' if finishing else 'partial sums, add_rmsnorm'} then matvec: {1e3 * separate_ms:.1f} us "
        f"(timed over {len(pairs)} pairs in turn)")
    return folded_ms < separate_ms


def _tune_normed(ops: list, mode: str, activation: str | None, out: torch.Tensor, normed) -> None:
    """The configuration with which `ops` (weights of one kind, each a consumer of a folded norm) run fastest
    with a normed input (`normed`, a fold.NormedInput), into each one's `normed_configs[mode]`: the normed loads
    shift a tiling's balance of memory and instructions, so the plain mode's choice may not be theirs. Timed
    among their `mode` candidates, back to back over `ops` in turn (compiled first on host threads; one that
    does not compile is skipped). Weights the tuner does not time keep the plain mode's configuration."""
    from .kernels.common import ACTIVATION_CODES, _small, compile_launches, in_turn, median_ms_or_inf

    op = ops[0]
    if _small(op) or not op.tune:
        return
    act = -1 if activation is None else ACTIVATION_CODES[activation]

    def launch(config):
        return in_turn(ops, lambda o: o._matvec(normed.residual, out, config, act, False, normed=normed))

    candidates = op.candidates(mode)
    compile_launches([(op.device, launch(c)) for c in candidates], report=False)
    times = [median_ms_or_inf(launch(c), "normed-input matvec") for c in candidates]
    best = candidates[min(range(len(candidates)), key=times.__getitem__)]
    for o in ops:
        o.normed_configs = {**(o.normed_configs or {}), mode: best}
    plain = op.config(mode)
    plain_ms = f"{1e3 * times[candidates.index(plain)]:.1f} us" if plain in candidates else "not a candidate"
    logging.getLogger("thin.runtime").info(
        f"{op.format} {op.out_features}x{op.in_features} ({mode}) with a normed input: {best} {1e3 * min(times):.1f} "
        f"us; the plain mode's {plain}: {plain_ms} (timed over {len(ops)} weights in turn)")
