"""`thinc plan`: the memory ledger and predicted quality of a model at several budgets, written nowhere.

Calibration and scoring run once (they do not depend on the budget); check_budget and
plan_precision then run per budget on the scored program, exactly as a compile would.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

from thin.passes import BudgetError, PassContext, Scratch, calibrate_inputs, check_budget, plan_precision, score_formats

from .config import CompileConfig, CompileOptionError
from .inputs import evaluation_texts


def plan_budgets(model_dir, budgets: list[dict], *, progress=None, calib=None, **options) -> dict:
    """{"rows": [one per budget], "seconds": {...}} for `budgets` (each {"bpw": B} or {"vram": SIZE}),
    with the other compile `options` (ctx, calib_tokens, method, device, tie_fused, ...) shared."""
    from .evaluate import make_evaluator
    from .hf import load_checkpoint

    if not budgets:
        raise CompileOptionError("give at least one budget: --vram SIZE[,SIZE...] and/or --bpw B[,B...]")
    progress = progress or (lambda stage, done, total: None)
    if calib is not None:
        options["calib_source"] = "file"
    configs = [CompileConfig.from_options(**budget, **options) for budget in budgets]
    first = configs[0]
    source = load_checkpoint(Path(model_dir))
    # What check_budget refuses needs no calibration: when it refuses every budget, say so before any runs.
    refused = {}
    for i, config in enumerate(configs):
        try:
            check_budget(source.program, PassContext(config=config, source=source.program))
        except BudgetError as e:
            refused[i] = str(e)
    if len(refused) == len(configs):
        raise CompileOptionError(refused[0] if len(configs) == 1 else f"no budget can be met; the first: {refused[0]}")
    calibration, _ = evaluation_texts(first, calib)
    seconds = {}
    with tempfile.TemporaryDirectory(prefix="thin-plan-") as scratch:
        ctx = PassContext(config=first, evaluator=make_evaluator(first.device, source.tokenizer_files),
                          source=source.program, calibration_text=calibration, scratch=Scratch(scratch),
                          device=first.device, progress=progress)
        started = time.perf_counter()
        program = calibrate_inputs(source.program, ctx)
        seconds["calibrate"] = time.perf_counter() - started
        started = time.perf_counter()
        scored = score_formats(program, ctx)
        seconds["score"] = time.perf_counter() - started
        rows = []
        for i, (budget, config) in enumerate(zip(budgets, configs)):
            each = dataclasses.replace(ctx, config=config)
            row = {"budget": {k: v for k, v in budget.items()}}
            if i in refused:
                rows.append({**row, "error": refused[i]})
                continue
            try:
                planned = plan_precision(check_budget(scored, each), each)
            except BudgetError as e:
                row["error"] = str(e)
                rows.append(row)
                continue
            plan, memory = planned.annotations["precision_plan"], planned.annotations["memory"]
            mix: dict[str, int] = {}
            for choice in plan["choices"].values():
                label = choice["format"] + "".join(f"/{k[0]}{v}" for k, v in choice["params"] if k == "group_size")
                mix[label] = mix.get(label, 0) + 1
            row.update(memory=memory, bits_per_weight=plan["bits_per_weight"], weight_bytes=plan["weight_bytes"],
                       predicted_kld=plan["predicted_kld"], formats=dict(sorted(mix.items())))
            if "experts" in plan:
                row["expert_bits_per_weight"] = plan["experts"]["bits_per_weight"]
                row["expert_formats"] = {k: plan["experts"][k] for k in ("most_formats_in_a_layer",
                                                                         "launches_per_token")}
            rows.append(row)
    return {"model": str(model_dir), "method": first.quantize.method, "device": first.device, "rows": rows,
            "seconds": {k: round(v, 2) for k, v in seconds.items()}}


def describe_experts(experts: dict) -> str:
    """A MoE plan's routed experts in words (precision_plan's "experts": bits per weight, the most formats in
    a layer, the expert launches a decoded token takes on the GPU)."""
    return (f"routed experts {experts['bits_per_weight']:.2f} bits per weight, up to "
            f"{experts['most_formats_in_a_layer']} formats in a layer, {experts['launches_per_token']} expert "
            "launches a token")


def render_plan(result: dict) -> str:
    """The rows of `plan_budgets` as a text table."""
    from thin.artifacts import human_size

    header = ("budget", "weights", "kv cache", "activations", "workspace", "CUDA context", "total", "bits/weight",
              "predicted KLD")
    rows = [header]
    notes = []
    for r in result["rows"]:
        b = r["budget"]
        name = f"--vram {b['vram']}" if "vram" in b else f"--bpw {b['bpw']}"
        if "error" in r:
            rows.append((name, *["-"] * 7, "-"))
            notes.append(f"{name}: {r['error']}")
            continue
        lines = r["memory"]["lines"]
        sizes = [human_size(lines[k]) for k in ("weights", "kv_cache", "activations", "workspace", "cuda_context")]
        rows.append((name, *sizes, human_size(r["memory"]["total"]), f"{r['bits_per_weight']:.3f}",
                     f"{r['predicted_kld']:.5f}"))
        experts = "" if "expert_bits_per_weight" not in r else \
            f" ({describe_experts({'bits_per_weight': r['expert_bits_per_weight'], **r['expert_formats']})})"
        notes.append(f"{name}: " + ", ".join(f"{k} x{v}" for k, v in r["formats"].items()) + experts)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    ctx = next((r["memory"]["ctx"] for r in result["rows"] if "memory" in r), None)
    out.append("")
    out.append(f"KV cache for --ctx {ctx}; predicted KLD is the planner's estimate ({result['method']}), the "
               "certificate of a compile measures it. Calibration "
               f"{result['seconds']['calibrate']:.1f}s, scoring {result['seconds']['score']:.1f}s on "
               f"{result['device']}.")
    out += notes
    return "\n".join(out)
