"""How good the planner's predictions are, tensor by tensor: the GPTQ error score_formats predicts
without running GPTQ against the error GPTQ then leaves, for every plannable tensor and format, and
the time scoring takes.

    python examples/benchmarks/bench_scores.py examples/models/tiny-coder [--formats int3,int4,q2,q1]

Prints, per format (at its default parameters), the ratio measured / predicted over the tensors:
median, 10th and 90th percentile. (Whole-model predicted vs measured KLD per budget is in
bench_quality.py's table.)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--formats", default="int3,int4,int5,int6,mxfp4,q2,q1,int8")
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=1 << 30, help="rows of each tensor GPTQ runs on (default all)")
    args = parser.parse_args()

    import torch

    from thin.compiler.config import CompileConfig
    from thin.compiler.evaluate import make_evaluator
    from thin.compiler.hf import load_checkpoint
    from thin.compiler.inputs import evaluation_texts
    from thin.ir import Encoding, formats
    from thin.passes import PassContext, Scratch, calibrate_inputs, plannable, score_formats
    from thin.passes.calibrate_inputs import load_statistics
    from thin.passes.gptq import gptq, output_error

    config = CompileConfig.from_options(bpw=4.0, calib_tokens=args.calib_tokens, device="cpu")
    source = load_checkpoint(args.model_dir)
    calibration, _ = evaluation_texts(config)
    ctx = PassContext(config=config, evaluator=make_evaluator("cpu", dict(source.tokenizer_files)),
                      source=source.program, calibration_text=calibration, scratch=Scratch(), device="cpu")
    t0 = time.perf_counter()
    program = calibrate_inputs(source.program, ctx)
    t1 = time.perf_counter()
    scored = score_formats(program, ctx)
    t2 = time.perf_counter()
    print(f"calibration {t1 - t0:.1f}s, scoring {t2 - t1:.1f}s (candidates, GPTQ corrections, probes)")
    scores = scored.annotations["scores"]["tensors"]
    print("| format | tensors | measured / predicted GPTQ error: median | p10 | p90 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in args.formats.split(","):
        fmt = formats.get(name)
        enc = Encoding(name, fmt.normalize())
        ratios = []
        for tensor in plannable(program.model):
            row = next((c for c in scores[tensor]["candidates"] if c[0] == name and
                        tuple(tuple(p) for p in c[1]) == enc.params), None)
            stats = load_statistics(ctx, program, tensor)
            if row is None or stats is None:
                continue
            r = program.model.tensor(tensor)
            w = formats.get(r.encoding.format).decode(program.load(tensor), r.shape, r.encoding.params, torch.float32)
            rows = min(args.rows, w.shape[0])
            _, w_hat = gptq(w[:rows], stats["hessian"], fmt, enc.params)
            measured = output_error(w[:rows], w_hat, stats["hessian"]) * w.shape[0] / rows
            ratios.append(measured / row[3])
        if ratios:
            q = statistics.quantiles(ratios, n=10)
            print(f"| {name} | {len(ratios)} | {statistics.median(ratios):.3f} | {q[0]:.3f} | {q[-1]:.3f} |")


if __name__ == "__main__":
    main()
