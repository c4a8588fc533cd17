"""The planner across budgets: bits per weight reached, KLD, top-1 and perplexity on held-out text, and
the planner's predicted KLD, for many `--bpw` budgets at the cost of one calibration.

    python examples/benchmarks/bench_budgets.py examples/models/tiny-coder --bpw 8.5,6.5,5.06,5.0,4.2,3.61,3.6,3.0

Calibration and scoring run once (they do not depend on the budget); per budget the compile's own
passes then run as `thinc compile --bpw B` runs them (check_budget, plan_precision, quantize_weights
with `--method`), and the quantized program, the bytes the artifact would hold, is measured in
bench_quality.py's harness: the source in float32 through thin's executor against the quantized
weights, teacher-forced on the first --tokens held-out tokens in windows of --context scoring --stride
new positions each. The certificate pass is left out: its gate (mean KLD 1.0 by default) never
fires at these budgets, and bench_quality.py's `--config bpw=B` runs the whole compile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--bpw", required=True, help="comma-separated budgets")
    parser.add_argument("--method", default="gptq", choices=("gptq", "rtn"))
    parser.add_argument("--calib-tokens", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=4224)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--stride", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    from thin.compiler.config import CompileConfig
    from thin.compiler.corpus import heldout_text
    from thin.compiler.evaluate import make_evaluator
    from thin.compiler.hf import load_checkpoint
    from thin.compiler.inputs import evaluation_texts
    from thin.ir import formats
    from thin.passes import (
        PassContext,
        Scratch,
        calibrate_inputs,
        check_budget,
        plan_precision,
        quantize_weights,
        score_formats,
    )
    from thin.runtime.quality import compare

    torch.manual_seed(0)
    budgets = [float(b) for b in args.bpw.split(",")]
    options = {"method": args.method, "device": args.device}
    if args.calib_tokens:
        options["calib_tokens"] = args.calib_tokens
    configs = [CompileConfig.from_options(bpw=b, **options) for b in budgets]
    source = load_checkpoint(args.model_dir)
    evaluator = make_evaluator(args.device, dict(source.tokenizer_files))
    calibration, _ = evaluation_texts(configs[0])
    ctx = PassContext(config=configs[0], evaluator=evaluator, source=source.program, calibration_text=calibration,
                      scratch=Scratch(), device=args.device)
    t0 = time.perf_counter()
    calibrated = calibrate_inputs(source.program, ctx)
    t1 = time.perf_counter()
    scored = score_formats(calibrated, ctx)
    t2 = time.perf_counter()
    print(f"calibration {t1 - t0:.1f}s ({calibrated.annotations['calibration']['tokens']} tokens), "
          f"scoring {t2 - t1:.1f}s, method {args.method}", flush=True)
    reference = evaluator.session(source.program)
    ids = evaluator.tokenizer.encode(heldout_text())[:args.tokens]
    parameters = sum(torch.Size(t.shape).numel() for t in source.program.model.tensors)
    rows = []
    for budget, config in zip(budgets, configs):
        each = dataclasses.replace(ctx, config=config)
        t3 = time.perf_counter()
        planned = plan_precision(check_budget(scored, each), each)
        quantized = quantize_weights(planned, each)
        t4 = time.perf_counter()
        plan = planned.annotations["precision_plan"]
        stored = sum(formats.nbytes(t.encoding.format, t.shape, t.encoding.params) for t in quantized.model.tensors)
        result = compare(reference, evaluator.session(quantized), ids, context=args.context, stride=args.stride)
        mix: dict[str, int] = {}
        for c in plan["choices"].values():
            mix[c["format"]] = mix.get(c["format"], 0) + 1
        rows.append({"bpw_budget": budget, "bits_per_weight": 8 * stored / parameters,
                     "predicted_kld": plan["predicted_kld"], "plan_quantize_s": t4 - t3, "formats": mix,
                     **result.to_plain()})
        print(f"--bpw {budget}: {rows[-1]['bits_per_weight']:.3f} bpw, predicted KLD {plan['predicted_kld']:.5f}, "
              f"{result.summary()}", flush=True)
    print()
    print("| --bpw | bits per weight | mean KLD | predicted KLD | top-1 | ppl (source) | formats |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        mix = ", ".join(f"{k} {v}" for k, v in sorted(r["formats"].items(), key=lambda kv: -kv[1]))
        print(f"| {r['bpw_budget']} | {r['bits_per_weight']:.3f} | {r['mean_kld']:.5f} | {r['predicted_kld']:.5f} | "
              f"{100 * r['top1_agreement']:.1f}% | {r['perplexity_candidate']:.3f} ({r['perplexity_reference']:.3f}) "
              f"| {mix} |")
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
