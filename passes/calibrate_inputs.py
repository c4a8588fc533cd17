"""calibrate_inputs: run the source model on calibration text and keep each linear input's statistics."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from thin.ir import MLP, Model, MoE, Program

from .expert_statistics import MIN_EXPERT_TOKENS, RoutingWeights, fill_starved_experts, routed_counts, routing_weights
from .runner import PassContext

DEFAULT_TOKENS = 16384
WINDOW = 512  # tokens per forward pass (capped at the model's positions)


class CalibrationError(ValueError):
    """Calibration cannot run as asked (no text, too little of it, no evaluator)."""


@dataclass(frozen=True)
class CalibrateOptions:
    """Where calibration text comes from and how much of it is used."""

    tokens: int = DEFAULT_TOKENS  # --calib-tokens: tokens run through the model
    source: str = "stdlib"  # "stdlib" (corpus.calibration_text) or "file" (--calib FILE)

    def __post_init__(self):
        if type(self.tokens) is not int or not 64 <= self.tokens < 1 << 31:
            raise CalibrationError(f"--calib-tokens must be an integer in 64..{(1 << 31) - 1}, got {self.tokens!r}")
        if self.source not in ("stdlib", "file"):
            raise CalibrationError(f"calibration source must be 'stdlib' or 'file', got {self.source!r}")


def input_groups(model: Model) -> dict[str, str]:
    """{weight name: input key} for every linear weight: weights that multiply the same activation
    (q/k/v, gate/up, one expert's gate/up) share one key, so their statistics are kept once."""
    groups: dict[str, str] = {}

    def share(names: list[str], key: str) -> None:
        for name in names:
            groups[name] = key

    def mlp(m: MLP, prefix: str) -> None:
        share([lin.weight for lin in (m.gate, m.up, m.gate_up) if lin is not None], f"{prefix}.in")
        groups[m.down.weight] = f"{prefix}.down.in"

    for layer in model.layers:
        a, p = layer.attention, f"layers.{layer.index}"
        share([lin.weight for lin in (a.q, a.k, a.v, a.qkv) if lin is not None], f"{p}.attn.in")
        groups[a.o.weight] = f"{p}.attn.o.in"
        if isinstance(layer.ffn, MoE):
            for e, expert in enumerate(layer.ffn.experts):
                mlp(expert, f"{p}.expert.{e}")
            if layer.ffn.shared_expert is not None:
                mlp(layer.ffn.shared_expert, f"{p}.shared_expert")
        else:
            mlp(layer.ffn, f"{p}.ffn")
    groups[model.lm_head.weight] = "lm_head.in"
    return groups


def statistics_key(input_key: str) -> str:
    """The scratch key under which an input's statistics are stored."""
    return f"calibration/{input_key}"


def calibrate_inputs(program: Program, ctx: PassContext) -> Program:
    """Afterwards, for every linear weight's input (see `input_groups`), the scratch store holds its
    statistics over the calibration tokens: `hessian` = sum(x x^T) / N (the second-moment matrix
    GPTQ and the scores use), `mean`, `absmean` and `absmax` per input channel, and `count`, the tokens that
    reached it (an expert sees only those routed to it; N counts every calibration token, so a
    rarely used expert weighs less); also the token ids used and each token's frequency (for the
    embedding). An expert routed fewer than MIN_EXPERT_TOKENS tokens gets estimated statistics
    (expert_statistics.py) instead of none. Within a routed expert, each token counts in its
    `hessian` in proportion to the square of its routing weight (the expert's share of the layer's
    output for that token), scaled so the matrix keeps the mass of the expert's token count: GPTQ
    minimises the error the layer's output gets, and the planner prices an expert by how often it
    is routed. (Pricing by the squared weight as well measured worse: at tight budgets it sent
    lightly weighted experts to q1, whose cost the first-order prediction understates; BENCHMARKS.md.)
    annotations['calibration'] records the text's hash and the counts, tokens routed to each expert
    among them and their mean squared routing weight, and which experts were starved."""
    import torch

    options: CalibrateOptions = ctx.config.calibrate
    if ctx.evaluator is None:
        raise CalibrationError("calibration needs an evaluator to run the model (the compiler provides one)")
    text = ctx.calibration_text
    if not text:
        raise CalibrationError("calibration needs text: give --calib FILE or leave the default")
    ids = ctx.evaluator.encode(text)[:options.tokens]
    if len(ids) < 64:
        raise CalibrationError(f"the calibration text gives only {len(ids)} tokens; at least 64 are needed")
    window = min(WINDOW, program.model.max_position_embeddings)
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) >= 2]

    groups = input_groups(program.model)
    leaders = {}  # the first weight of each group: the one whose input is accumulated
    for name, key in groups.items():
        leaders.setdefault(key, name)
    leader_of = {name: key for key, name in leaders.items()}
    sums: dict[str, dict] = {}
    routing = RoutingWeights(program)

    def observe(name: str, x) -> None:
        key = leader_of.get(name)
        if key is None:
            return
        x = x.float()
        slot = sums.get(key)
        if slot is None:
            k = x.shape[-1]
            slot = sums[key] = {"hessian": torch.zeros(k, k, device=x.device), "sum": torch.zeros(k, device=x.device),
                                "abssum": torch.zeros(k, device=x.device),
                                "absmax": torch.zeros(k, device=x.device), "count": 0, "weight2": 0.0}
        g = routing(key, x)
        if g is None:
            slot["hessian"].addmm_(x.T, x)
            slot["weight2"] += x.shape[0]
        else:  # a routed expert's error reaches the layer output scaled by its routing weight
            slot["hessian"].addmm_(x.T, x * (g * g).unsqueeze(1))
            # Summed in float64 on the device (the same additions as a Python float), so the forward
            # pass doesn't wait for the device at every expert of every layer; read once at the end.
            slot["weight2"] = slot["weight2"] + (g * g).sum().double()
        slot["sum"] += x.sum(0)
        slot["abssum"] += x.abs().sum(0)
        slot["absmax"] = torch.maximum(slot["absmax"], x.abs().amax(0))
        slot["count"] += x.shape[0]

    session = ctx.evaluator.session(program)
    with session.observing(observe):
        for i, w in enumerate(windows):
            ctx.report("calibrate", i, len(windows))
            session.forward(w)
    ctx.report("calibrate", len(windows), len(windows))
    del session
    summed = [slot for slot in sums.values() if torch.is_tensor(slot["weight2"])]
    if summed:
        for slot, value in zip(summed, torch.stack([slot["weight2"] for slot in summed]).tolist()):
            slot["weight2"] = value
    unreached = sorted(k for k in leaders if k not in sums)
    routed = routed_counts(program.model, sums)
    weights = routing_weights(program.model, sums)
    starved = fill_starved_experts(program, sums)
    total = sum(len(w) for w in windows)
    used = torch.tensor([t for w in windows for t in w], dtype=torch.long)
    ctx.scratch.save("calibration/ids", {"ids": used})
    # The embedding is a lookup, not a product: its rows weigh by how often their token occurs.
    frequency = torch.bincount(used, minlength=program.model.vocab_size)[:program.model.vocab_size]
    ctx.scratch.save("calibration/token_frequency", {"frequency": frequency.double() / total})
    for key in leaders:
        # Taken out of `sums` as it is saved: the running sums go as their scaled copies are kept (on a
        # CPU compile both are host memory, and gpt-oss-20b's are ~52 GB each).
        slot = sums.pop(key, None)
        if slot is None:  # an expert no calibration token was routed to
            continue
        count = max(slot["count"], 1)
        # Routing-weighted tokens: back to the mass of the token count (1 for every other input).
        mass = count / slot["weight2"] if slot.get("weight2") else 1.0
        ctx.scratch.save(statistics_key(key), {
            "hessian": slot["hessian"] * (mass / total), "mean": slot["sum"] / count, "absmax": slot["absmax"],
            "count": torch.tensor(slot["count"]), "tokens": torch.tensor(total),
            # (estimated statistics of a starved expert have no mean |x|)
            **({"absmean": slot["abssum"] / count} if "abssum" in slot else {})})
    note = {"source": options.source, "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "tokens": total, "windows": len(windows), "window": window,
            "inputs": dict(sorted(groups.items())),
            "unreached": unreached, "expert_tokens": routed, "expert_weight2": weights,
            "min_expert_tokens": MIN_EXPERT_TOKENS,
            "starved_experts": starved}
    return program.replace(annotations={**program.annotations, "calibration": note})


def load_statistics(ctx: PassContext, program: Program, weight: str) -> dict | None:
    """The calibration statistics of `weight`'s input, or None when no calibration token reached it
    (or the weight is not multiplied by anything: an untied embedding)."""
    key = program.annotations["calibration"]["inputs"].get(weight)
    if key is None:
        return None
    try:
        return ctx.scratch.load(statistics_key(key))
    except KeyError:
        return None
