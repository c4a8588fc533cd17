"""plan_precision: choose every tensor's format so the model fits its budget at the least predicted error.

The problem is a multiple-choice knapsack: tensor t takes one candidate c with bytes b_tc and
predicted KLD k_tc (score_formats); minimise sum k subject to sum b <= budget. `solve` starts every
tensor at its smallest candidate and spends the remaining bytes on the upgrades that buy the most
KLD per byte, along each tensor's lower convex hull (the greedy that is optimal for the
continuous relaxation), then spends what is left on any single upgrade that still fits. Tensors
the planner does not choose for (norms, routers, biases) count at their stored size.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from math import prod

from thin.ir import MLP, Encoding, Model, MoE, Program, formats

from .memory_ledger import DEFAULT_CTX, ledger
from .runner import PassContext


class BudgetError(ValueError):
    """The budget cannot be met by any choice of formats (or is not given at all)."""


_MAX_COUNT = (1 << 31) - 1  # counts the header stores (--ctx, --max-expert-formats): far past any model's


@dataclass(frozen=True)
class PlanOptions:
    """The budget the planner meets: `--bpw` (bits per weight over every tensor, scales included)
    and/or `--vram` (bytes on the device, the memory ledger's total)."""

    bpw: float | None = None
    vram: int | None = None  # bytes
    ctx: int = DEFAULT_CTX  # tokens of KV cache the --vram ledger reserves
    # Give fused q/k/v and gate/up one format, so they fuse into one matmul (speed over quality).
    tie_fused: bool = False
    # At most this many encodings (format and parameters) among a layer's routed experts, per projection
    # (gate/up, down): the GPU runs one launch per encoding (speed over quality). None: no limit.
    max_expert_formats: int | None = None

    def __post_init__(self):
        if self.bpw is not None and (not isinstance(self.bpw, (int, float)) or not 0 < self.bpw <= 32):
            raise BudgetError(f"--bpw must be a number of bits in (0, 32], got {self.bpw!r}")
        if self.vram is not None and (type(self.vram) is not int or self.vram <= 0):
            raise BudgetError(f"--vram must be a positive number of bytes, got {self.vram!r}")
        if type(self.ctx) is not int or not 1 <= self.ctx <= _MAX_COUNT:
            raise BudgetError(f"--ctx must be a number of tokens in 1..{_MAX_COUNT}, got {self.ctx!r}")
        if type(self.tie_fused) is not bool:
            raise BudgetError("tie_fused must be true or false")
        if self.max_expert_formats is not None and (type(self.max_expert_formats) is not int
                                                    or not 1 <= self.max_expert_formats <= _MAX_COUNT):
            raise BudgetError(f"--max-expert-formats must be a number of formats in 1..{_MAX_COUNT}, got "
                              f"{self.max_expert_formats!r}")

    @property
    def planned(self) -> bool:
        return self.bpw is not None or self.vram is not None


# ---- the knapsack -------------------------------------------------------------------------------

def solve(items: dict[str, list[tuple[int, float]]], budget: int) -> dict[str, int]:
    """{item: index of its chosen option} minimising the summed cost with summed bytes <= `budget`.

    `items` maps a name to its options as (bytes, cost). Raises BudgetError when even the smallest
    options exceed the budget. Exact (dynamic programming over the budget in DP_STATES steps, each
    option's bytes rounded up to a step, then the rounding's leftover spent) when the table is small
    enough, else the greedy along each tensor's lower convex hull; the better of the two is kept."""
    used = sum(min(b for b, _ in options) for options in items.values())
    if used > budget:
        raise BudgetError(f"the smallest formats need {used} bytes, over the budget of {budget}")
    best = _spend(items, _greedy(items, budget), budget)
    if len(items) * min(budget + 1, DP_STATES + 1) <= DP_LIMIT:
        exact = _spend(items, _dynamic(items, budget), budget)
        if _total(items, exact, 1) < _total(items, best, 1):
            best = exact
    return best


DP_STATES = 20_000
DP_LIMIT = 40_000_000  # items x states above which the dynamic programme is skipped


def _total(items, choice, field: int) -> float:
    return sum(items[n][i][field] for n, i in choice.items())


def _greedy(items, budget: int) -> dict[str, int]:
    """Every item at its smallest option, then upgrades along the lower convex hulls, best KLD saved
    per byte first (optimal for the continuous relaxation)."""
    fronts = {name: _pareto(options) for name, options in items.items()}
    choice = {name: front[0] for name, front in fronts.items()}
    used = _total(items, choice, 0)
    hulls = {name: _hull([items[name][i] for i in front], front) for name, front in fronts.items()}
    position = dict.fromkeys(items, 0)
    heap = []
    for name, hull in hulls.items():
        _push_next(heap, name, hull, 0, items)
    while heap:
        _, name, step = heapq.heappop(heap)
        if step != position[name]:
            continue
        hull = hulls[name]
        current, nxt = items[name][hull[step]], items[name][hull[step + 1]]
        if used + nxt[0] - current[0] <= budget:
            used += nxt[0] - current[0]
            position[name] = step + 1
            choice[name] = hull[step + 1]
            _push_next(heap, name, hull, step + 1, items)
    return choice


def _dynamic(items, budget: int) -> dict[str, int]:
    """The multiple-choice knapsack solved exactly over budget steps of `unit` bytes (bytes rounded
    up, so the answer always fits)."""
    import numpy as np

    unit = max(1, -(-budget // DP_STATES))
    cap = budget // unit
    names = list(items)
    best = np.zeros(cap + 1)  # best[c]: least cost of the items so far within c steps
    picks = np.zeros((len(names), cap + 1), dtype=np.int32)
    for k, name in enumerate(names):
        new = np.full(cap + 1, np.inf)
        pick = np.zeros(cap + 1, dtype=np.int32)
        for i, (size, cost) in enumerate(items[name]):
            steps = -(-size // unit)
            if steps > cap:
                continue
            candidate = np.full(cap + 1, np.inf)
            candidate[steps:] = best[:cap + 1 - steps] + cost
            better = candidate < new
            new[better] = candidate[better]
            pick[better] = i
        best, picks[k] = new, pick
    if not np.isfinite(best[cap]):
        raise BudgetError("no choice of formats fits the budget once rounded to the planner's steps")
    choice, c = {}, cap
    for k in range(len(names) - 1, -1, -1):
        i = int(picks[k][c])
        choice[names[k]] = i
        c -= -(-items[names[k]][i][0] // unit)
    return choice


def _spend(items, choice: dict[str, int], budget: int) -> dict[str, int]:
    """Spend what is left of the budget: any single move to a better option that still fits, the
    largest gain first, until none fits."""
    choice = dict(choice)
    used = _total(items, choice, 0)
    while True:
        best = None
        for name, options in items.items():
            cur_bytes, cur_cost = options[choice[name]]
            for i, (b, c) in enumerate(options):
                if c < cur_cost and used + b - cur_bytes <= budget and (best is None or cur_cost - c > best[0]):
                    best = (cur_cost - c, name, i, b - cur_bytes)
        if best is None:
            return choice
        _, name, i, extra = best
        choice[name] = i
        used += extra


def _pareto(options: list[tuple[int, float]]) -> list[int]:
    """Indices of the options no other beats in both bytes and cost, by increasing bytes."""
    order = sorted(range(len(options)), key=lambda i: (options[i][0], options[i][1]))
    front, best = [], float("inf")
    for i in order:
        if options[i][1] < best:
            front.append(i)
            best = options[i][1]
    return front


def _hull(points: list[tuple[int, float]], indices: list[int]) -> list[int]:
    """The lower convex hull of a Pareto front (bytes increasing, cost decreasing), as indices."""
    hull: list[int] = []
    pts: list[tuple[int, float]] = []
    for p, i in zip(points, indices):
        while len(pts) >= 2:
            (x1, y1), (x2, y2) = pts[-2], pts[-1]
            # Drop the middle point when it lies on or above the segment from pts[-2] to p.
            if (y2 - y1) * (p[0] - x1) >= (p[1] - y1) * (x2 - x1):
                pts.pop()
                hull.pop()
            else:
                break
        pts.append(p)
        hull.append(i)
    return hull


def _push_next(heap, name: str, hull: list[int], step: int, items) -> None:
    if step + 1 < len(hull):
        (b0, c0), (b1, c1) = items[name][hull[step]], items[name][hull[step + 1]]
        heapq.heappush(heap, ((c1 - c0) / max(b1 - b0, 1), name, step))


# ---- budgets ------------------------------------------------------------------------------------

def parameters(model: Model) -> int:
    """Elements of every tensor (a tied head shares the embedding, so it counts once)."""
    return sum(prod(t.shape) for t in model.tensors)


def fused_groups(model: Model) -> list[list[str]]:
    """Weights fuse_projections stacks when their encodings agree: q/k/v and each gate/up."""
    groups = []

    def mlp(m: MLP) -> None:
        if m.gated and m.gate is not None and m.up is not None:
            groups.append([m.gate.weight, m.up.weight])

    for layer in model.layers:
        a = layer.attention
        if a.q is not None and a.k is not None and a.v is not None:
            groups.append([a.q.weight, a.k.weight, a.v.weight])
        ffn = layer.ffn
        for m in (ffn.experts + ((ffn.shared_expert,) if ffn.shared_expert else ())) if isinstance(ffn, MoE) \
                else (ffn,):
            mlp(m)
    return groups


def stored_bytes(model: Model, encodings: dict[str, Encoding], fuse: bool) -> int:
    """Bytes of every tensor's data once `encodings` are applied (others as stored), with q/k/v and
    gate/up stacked into one blob where fuse_projections will stack them."""
    records = model.tensor_map()

    def enc(name):
        return encodings.get(name, records[name].encoding)

    total = sum(formats.nbytes(enc(t.name).format, t.shape, enc(t.name).params) for t in model.tensors)
    if not fuse:
        return total
    for group in fused_groups(model):
        encs = {enc(n) for n in group}
        shapes = [records[n].shape for n in group]
        if len(encs) != 1 or len({s[1:] for s in shapes}) != 1:
            continue
        e = encs.pop()
        stacked = (sum(s[0] for s in shapes), *shapes[0][1:])
        total += formats.nbytes(e.format, stacked, e.params) - sum(formats.nbytes(e.format, s, e.params)
                                                                    for s in shapes)
    return total


def weight_budget(model: Model, options: PlanOptions) -> tuple[int, dict]:
    """(bytes the weights may take, the ledger's lines other than the weights)."""
    fixed = ledger(model, 0, ctx=options.ctx)
    budgets = []
    if options.bpw is not None:
        budgets.append(int(options.bpw * parameters(model) / 8))
    if options.vram is not None:
        budgets.append(options.vram - fixed["total"])
    return min(budgets), fixed


# ---- the pass -----------------------------------------------------------------------------------

def plan_precision(program: Program, ctx: PassContext) -> Program:
    """Afterwards annotations['precision_plan'] gives every plannable tensor an encoding such that
    all tensors' bytes (norms and the like at their stored size, fused blobs as fused) fit the
    budget, with the least total predicted KLD the scores allow (and, for a mixture of experts, the
    routed experts' share under "experts"); annotations['memory'] holds the
    memory ledger of that plan. Sensitivities scaled by annotations['plan_adjustments'] (set by
    certify_model's promotion rounds) are used as scaled."""
    options: PlanOptions = ctx.config.plan
    model = program.model
    records = model.tensor_map()
    scores = program.annotations["scores"]["tensors"]
    scale = program.annotations.get("plan_adjustments", {}).get("scale", {})
    budget, _ = weight_budget(model, options)
    encodings = {name: [Encoding(c[0], tuple(tuple(p) for p in c[1])) for c in row["candidates"]]
                 for name, row in scores.items()}
    costs = {name: [(c[2], c[4] * scale.get(name, 1.0)) for c in row["candidates"]] for name, row in scores.items()}
    items, members = _items(model, encodings, costs, options.tie_fused)
    fixed = stored_bytes(model, {}, False) - sum(formats.nbytes(records[n].encoding.format, records[n].shape,
                                                                records[n].encoding.params) for n in scores)
    fuse = ctx.config.fuse_projections
    chosen = _solve_within(model, items, members, budget - fixed, budget, fuse)
    if options.max_expert_formats is not None:
        chosen = _cap_expert_formats(model, items, members, chosen, options.max_expert_formats, budget - fixed,
                                     budget, fuse)
    total_bytes = stored_bytes(model, chosen, fuse)
    choices = {}
    predicted = 0.0
    for name in scores:
        enc = chosen[name]
        index = encodings[name].index(enc)
        kld = scores[name]["candidates"][index][4]
        predicted += kld
        r = records[name]
        choices[name] = {"format": enc.format, "params": [list(p) for p in enc.params],
                         "bytes": scores[name]["candidates"][index][2], "predicted_kld": kld,
                         "layer": r.layer, "role": r.role, "expert": r.expert, "shape": list(r.shape)}
    params_count = parameters(model)
    plan = {"budget": {"bpw": options.bpw, "vram": options.vram, "weight_bytes": budget},
            "weight_bytes": total_bytes, "parameters": params_count,
            "bits_per_weight": round(8 * total_bytes / params_count, 4), "predicted_kld": predicted,
            "method": ctx.config.quantize.method, "tie_fused": options.tie_fused,
            "max_expert_formats": options.max_expert_formats, "choices": choices}
    experts = [name for name in scores if records[name].expert is not None]
    if experts:  # the share of the weights' bytes the routed experts took
        expert_bytes, expert_params = (sum(choices[n]["bytes"] for n in experts),
                                       sum(prod(records[n].shape) for n in experts))
        # The GPU runs one gate/up and one down launch per encoding among a layer's experts.
        per_slot: dict[tuple[int, str], set] = {}
        for name, slot in expert_slots(model).items():
            if name in chosen:
                per_slot.setdefault(slot, set()).add(chosen[name])
        plan["experts"] = {"tensors": len(experts), "parameters": expert_params, "weight_bytes": expert_bytes,
                           "bits_per_weight": round(8 * expert_bytes / expert_params, 4),
                           "most_formats_in_a_layer": max(len(v) for v in per_slot.values()),
                           "launches_per_token": sum(len(v) for v in per_slot.values())}
    memory = ledger(model, total_bytes, ctx=options.ctx)
    memory["budget"] = options.vram
    return program.replace(annotations={**program.annotations, "precision_plan": plan, "memory": memory})


def expert_groups(model: Model) -> list[list[str]]:
    """Each routed expert's gate and up, when stored apart: the GPU engine's gate/up expert kernel
    reads one format for both (runtime/kernels/experts.py), so the planner gives them one. (An
    expert's down may take another format.)"""
    groups = []
    for layer in model.layers:
        if isinstance(layer.ffn, MoE):
            for m in layer.ffn.experts:
                if m.gate is not None and m.up is not None:
                    groups.append([m.gate.weight, m.up.weight])
    return groups


def expert_slots(model: Model) -> dict[str, tuple[int, str]]:
    """{routed expert weight: (layer, "gate_up" or "down")}: the launches the GPU runs a layer's experts in,
    one per encoding among the experts of each (runtime/kernels/experts.py)."""
    slots = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer.ffn, MoE):
            for m in layer.ffn.experts:
                for kind, linears in (("gate_up", (m.gate, m.up)), ("down", (m.down,))):
                    slots.update({lin.weight: (i, kind) for lin in linears if lin is not None})
    return slots


def _cap_expert_formats(model, items, members, chosen: dict[str, Encoding], cap: int, budget: int, total_budget: int,
                        fuse: bool) -> dict[str, Encoding]:
    """`chosen` with at most `cap` encodings among each layer's routed experts per projection: where a plan
    has more, each of that slot's experts may take only the `cap` encodings that held the most of its
    bytes, and the plan is solved again (the rest of the model with it). Should those leave the budget
    unreachable, the slot keeps its smallest encoding in place of the last of them. Solved again until no
    slot has more, since a new solution may spread a slot that was within the cap (the restrictions only
    grow, so at most one round a slot)."""
    slots = expert_slots(model)
    keys: dict[tuple[int, str], list[str]] = {}
    for key, (names, _) in members.items():
        if names[0] in slots:
            keys.setdefault(slots[names[0]], []).append(key)
    kept: dict[tuple[int, str], list[Encoding]] = {}
    for _ in range(len(keys) + 1):
        over = {slot: used for slot, used in ((slot, _held(items, members, ks, chosen)) for slot, ks in keys.items())
                if len(used) > cap}
        if not over:
            return chosen
        new = {slot: sorted(used, key=lambda e: -used[e])[:cap] for slot, used in over.items()}
        try:
            chosen = _solve_within(model, *_restricted(items, members, keys, {**kept, **new}), budget, total_budget,
                                   fuse)
        except BudgetError:
            for slot, keep in new.items():
                smallest = min(over[slot], key=lambda e: min(items[k][members[k][1].index(e)][0] for k in keys[slot]
                                                             if e in members[k][1]))
                if smallest not in keep:
                    keep[-1] = smallest
            chosen = _solve_within(model, *_restricted(items, members, keys, {**kept, **new}), budget, total_budget,
                                   fuse)
        kept.update(new)
    raise BudgetError(f"--max-expert-formats {cap}: some layer's experts cannot be held to {cap} formats (experts of "
                      "different shapes); raise it or drop it")


def _held(items, members, keys: list, chosen: dict[str, Encoding]) -> dict[Encoding, int]:
    """{encoding: bytes} the items `keys` (one slot's experts) take in `chosen`."""
    used: dict[Encoding, int] = {}
    for key in keys:
        names, encs = members[key]
        enc = chosen[names[0]]
        used[enc] = used.get(enc, 0) + items[key][encs.index(enc)][0]
    return used


def _restricted(items, members, keys: dict, kept: dict):
    """(items, members) with each slot of `kept` ({slot: encodings}) offering its experts only those encodings
    (an expert that can take none of them, another shape, keeps its options)."""
    new_items, new_members = dict(items), dict(members)
    for slot, keep in kept.items():
        for key in keys[slot]:
            names, encs = members[key]
            allowed = [i for i, e in enumerate(encs) if e in keep]
            if allowed:
                new_items[key] = [items[key][i] for i in allowed]
                new_members[key] = (names, [encs[i] for i in allowed])
    return new_items, new_members


def _items(model: Model, encodings, costs, tie: bool):
    """Knapsack items: one per tensor, one per routed expert's gate and up (options both can take,
    bytes and cost summed), or per fused group when tied (options every member can take, bytes as
    one stacked blob, cost summed). Returns (items, {item: (members, [encoding per option])})."""
    records = model.tensor_map()
    items, members = {}, {}
    grouped = set()
    for group in expert_groups(model):
        if len(group) < 2 or not all(n in encodings for n in group):
            continue
        common = [e for e in encodings[group[0]] if all(e in encodings[n] for n in group[1:])]
        options = [(sum(costs[n][encodings[n].index(e)][0] for n in group),
                    sum(costs[n][encodings[n].index(e)][1] for n in group)) for e in common]
        key = "+".join(group)
        items[key], members[key] = options, (group, common)
        grouped.update(group)
    if tie:
        for group in fused_groups(model):
            if not all(n in encodings for n in group) or grouped.intersection(group):
                continue
            common = [e for e in encodings[group[0]] if all(e in encodings[n] for n in group[1:])]
            shapes = [records[n].shape for n in group]
            stacked = (sum(s[0] for s in shapes), *shapes[0][1:])
            options = []
            for e in common:
                cost = sum(costs[n][encodings[n].index(e)][1] for n in group)
                options.append((formats.nbytes(e.format, stacked, e.params), cost))
            key = "+".join(group)
            items[key], members[key] = options, (group, common)
            grouped.update(group)
    for name in encodings:
        if name not in grouped:
            items[name], members[name] = costs[name], ([name], encodings[name])
    return items, members


def _solve_within(model, items, members, budget: int, total_budget: int, fuse: bool) -> dict[str, Encoding]:
    """solve(), then demote the cheapest-to-demote item while the real stored bytes (fusion changes
    part padding by a few bytes) exceed the budget."""
    try:
        choice = solve(items, budget)
    except BudgetError:
        smallest = {n: min(range(len(o)), key=lambda i: o[i][0]) for n, o in items.items()}
        need = stored_bytes(model, _encodings(members, smallest), fuse)
        raise BudgetError(f"even the smallest formats need {need} bytes of weights, over the "
                          f"{max(total_budget, 0)} the budget leaves for them") from None
    while True:
        chosen = _encodings(members, choice)
        over = stored_bytes(model, chosen, fuse) - total_budget
        if over <= 0:
            return chosen
        best = None
        for name, i in choice.items():
            b, c = items[name][i]
            for j, (b2, c2) in enumerate(items[name]):
                if b2 < b and (best is None or (c2 - c) / (b - b2) < best[0]):
                    best = ((c2 - c) / (b - b2), name, j)
        if best is None:
            raise BudgetError(f"the plan exceeds its budget by {over} bytes and nothing can shrink")
        choice[best[1]] = best[2]


def _encodings(members, choice) -> dict[str, Encoding]:
    out = {}
    for key, i in choice.items():
        names, encs = members[key]
        for n in names:
            out[n] = encs[i]
    return out


__all__ = ["BudgetError", "PlanOptions", "fused_groups", "parameters", "plan_precision", "solve", "stored_bytes",
           "weight_budget"]
