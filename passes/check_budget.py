"""check_budget: refuse a budget no choice of formats can meet, before any calibration or quantization."""

from __future__ import annotations

import math

from thin.ir import Program, formats

from .memory_ledger import ledger
from .plan_precision import BudgetError, PlanOptions, parameters, stored_bytes, weight_budget
from .runner import PassContext
from .score_formats import ScoreOptions, candidates, plannable


def smallest_encodings(program: Program, options: ScoreOptions | None = None) -> dict:
    """{tensor: its smallest candidate encoding} over every plannable tensor, among the formats
    `options` allow it. BudgetError when `--expert-formats` leaves a routed expert no candidate or
    the model has no routed expert for it to apply to."""
    options = options or ScoreOptions()
    records = program.model.tensor_map()
    out = {}
    names = plannable(program.model)
    if options.expert_formats is not None and not any(records[n].expert is not None for n in names):
        raise BudgetError("--expert-formats applies to routed experts, and this model has none")
    for name in names:
        r = records[name]
        found = candidates(r, *options.allowed(r))
        if not found:
            raise BudgetError(f"{name} {list(r.shape)}: no variant of --expert-formats "
                              f"{','.join(options.expert_formats)} can store it")
        out[name] = min(found, key=lambda e: formats.nbytes(e.format, r.shape, e.params))
    return out


def check_budget(program: Program, ctx: PassContext) -> Program:
    """Afterwards the budget is known to be reachable: the smallest formats of every plannable tensor
    fit it (else BudgetError naming the smallest budget that would work), and
    annotations['budget'] records the bytes the weights may take and the ledger's other lines."""
    options: PlanOptions = ctx.config.plan
    model = program.model
    if options.max_expert_formats is not None and not any(t.expert is not None for t in model.tensors):
        raise BudgetError("--max-expert-formats applies to routed experts, and this model has none")
    budget, fixed = weight_budget(model, options)
    smallest = stored_bytes(model, smallest_encodings(program, ctx.config.score), ctx.config.fuse_projections)
    if smallest > budget:
        params = parameters(model)
        need = []
        if options.bpw is not None:
            need.append(f"--bpw {_ceil(8 * smallest / params, 3)} (the smallest formats give "
                        f"{8 * smallest / params:.3f} bits per weight)")
        if options.vram is not None:
            total = ledger(model, smallest, ctx=options.ctx)["total"]
            need.append(f"--vram {_mib(total)} at --ctx {options.ctx} (weights {_mib(smallest)}, KV cache "
                        f"{_mib(fixed['lines']['kv_cache'])}, activations and workspace "
                        f"{_mib(fixed['lines']['activations'] + fixed['lines']['workspace'])}, CUDA context "
                        f"{_mib(fixed['lines']['cuda_context'])})")
        raise BudgetError("the budget is below the smallest model: even the smallest formats for every tensor "
                          f"need {smallest} bytes of weights, and the budget leaves {max(budget, 0)}; the smallest "
                          "budget that works is " + " and ".join(need))
    note = {"weight_bytes": budget, "smallest_weight_bytes": smallest, "ledger_without_weights": fixed["lines"]}
    return program.replace(annotations={**program.annotations, "budget": note})


def _ceil(x: float, digits: int) -> float:
    return math.ceil(x * 10**digits) / 10**digits


def _mib(n: int) -> str:
    return f"{-(-n // 2**20)}M"
