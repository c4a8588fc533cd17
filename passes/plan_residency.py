"""plan_residency: which routed experts stay in host memory when the device budget cannot hold them all.

`thinc compile --stream-experts --vram SIZE` makes `--vram` a bound on the device only: the precision
comes from `--bpw` or `--quant` (or the stored formats), and when the whole model, its KV cache and
workspace would exceed SIZE only because of the routed experts, the experts the calibration text
routed the fewest tokens to stay in host memory. The runtime (runtime/expert_cache.py) copies such an
expert's page (one contiguous range, passes/layout_experts.py) into one of `slots` device slots when
a token routes to it, the least recently used slot evicted. The slots are at least the largest top-k
(a decoded token's experts of one layer are all in slots at once); what the budget leaves after the
resident experts becomes more slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from thin.ir import Model, MoE, Program, formats

from .layout_experts import expert_tensors
from .memory_ledger import ledger
from .plan_precision import BudgetError
from .runner import PassContext


@dataclass(frozen=True)
class ResidencyOptions:
    """`--stream-experts` with `--vram`: the device budget the residency plan meets (None: no plan,
    every expert resident)."""

    vram: int | None = None  # bytes

    def __post_init__(self):
        if self.vram is not None and (type(self.vram) is not int or self.vram <= 0):
            raise BudgetError(f"--vram must be a positive number of bytes, got {self.vram!r}")

    @property
    def enabled(self) -> bool:
        return self.vram is not None


def page_length(names: list[str], records: dict, sizes: dict[str, int]) -> int:
    """Bytes of an expert's page as the writer lays it out: from its first tensor (page-aligned) to the
    end of its last, each tensor at its own alignment (every alignment divides the page's)."""
    position = 0
    for name in names:
        align = records[name].align
        position = -(-position // align) * align + sizes[name]
    return position


def check_residency(program: Program, ctx: PassContext) -> Program:
    """The first pass of a --stream-experts compile: BudgetError when the model has no routed experts
    to keep in host memory, before calibration runs the model. Changes nothing."""
    if not any(isinstance(layer.ffn, MoE) for layer in program.model.layers):
        raise BudgetError("--stream-experts keeps routed experts in host memory, and this model has none; "
                          "leave it out (a --vram budget alone plans a dense model)")
    return program


def plan_residency(program: Program, ctx: PassContext) -> Program:
    """Afterwards annotations['memory'] is the ledger of the model as the runtime places it under
    `--vram`: every tensor on the device except the host-resident experts, plus an `expert_cache`
    line (slots x the largest host-resident page); memory['residency'] lists the host-resident
    (layer, expert) pairs, least routed first, the slots and their bytes, and the host bytes. Empty
    `host` when everything fits. BudgetError when the rest of the model and the smallest cache
    (top-k slots) do not fit."""
    check_residency(program, ctx)  # the pipeline ran it first; here for direct callers
    options: ResidencyOptions = ctx.config.residency
    model = program.model
    records = model.tensor_map()
    sizes = {t.name: formats.nbytes(t.encoding.format, t.shape, t.encoding.params) for t in model.tensors}
    experts = {(layer.index, e): expert_tensors(mlp) for layer in model.layers if isinstance(layer.ffn, MoE)
               for e, mlp in enumerate(layer.ffn.experts)}
    in_experts = {name for names in experts.values() for name in names}
    rest = sum(size for name, size in sizes.items() if name not in in_experts)
    held = {key: sum(sizes[n] for n in names) for key, names in experts.items()}
    pages = {key: page_length(names, records, sizes) for key, names in experts.items()}
    ctx_tokens = ctx.config.plan.ctx
    base = ledger(model, rest, ctx=ctx_tokens)
    room = options.vram - base["total"]
    counts = (program.annotations.get("calibration") or {}).get("expert_tokens") or {}
    # Most routed first; ties in layer and expert order, so the plan is deterministic.
    order = sorted(experts, key=lambda key: (-_count(counts, key), key))
    if sum(held.values()) <= room:
        host, slots, slot_bytes = [], 0, 0
    else:
        host, slots, slot_bytes = _place(model, order, held, pages, room, options.vram, base["ctx"], rest)
    resident = rest + sum(held[key] for key in experts if key not in set(host))
    memory = ledger(model, resident, ctx=ctx_tokens)
    memory["lines"]["expert_cache"] = slots * slot_bytes
    memory["total"] += slots * slot_bytes
    memory["budget"] = options.vram
    memory["residency"] = {
        "host": [list(key) for key in reversed(host)],  # least routed first
        "slots": slots, "slot_bytes": slot_bytes, "host_bytes": sum(held[key] for key in host),
        "resident_experts": len(experts) - len(host), "policy": "least recently used",
        "ranked_by": "calibration routing counts" if counts else "layer and expert order (no routing counts)"}
    return program.replace(annotations={**program.annotations, "memory": memory})


def _count(counts: dict, key: tuple[int, int]) -> int:
    row = counts.get(f"layers.{key[0]}") or []
    return row[key[1]] if key[1] < len(row) else 0


def _place(model: Model, order, held, pages, room: int, vram: int, ctx_tokens: int, rest: int):
    """(host-resident experts in routing order, slots, slot bytes): the top-k slots of the largest page
    first, then resident experts, most routed first, while they fit; what is left becomes more slots."""
    least = max(layer.ffn.top_k for layer in model.layers if isinstance(layer.ffn, MoE))
    largest = max(pages.values())
    if room < least * largest:
        need = vram - room + least * largest
        raise BudgetError(
            f"--vram {vram} bytes cannot stream experts: the model without its routed experts, KV cache for "
            f"--ctx {ctx_tokens}, activations, workspace and CUDA context take {vram - room} bytes (weights "
            f"{rest}), and the expert cache needs at least {least} slots (the largest top-k) of {largest} bytes; "
            f"the smallest budget that streams is --vram {need}")
    left = room - least * largest
    resident = []
    for key in order:
        if held[key] <= left:
            resident.append(key)
            left -= held[key]
    chosen = set(resident)
    host = [key for key in order if key not in chosen]
    slot_bytes = max(pages[key] for key in host)
    # The slots may shrink to the largest host-resident page; what that and the leftover buy is more slots.
    spare = room - sum(held[key] for key in resident)
    slots = min(len(host), max(least, spare // slot_bytes))
    return host, slots, slot_bytes
