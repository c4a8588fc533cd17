"""Decode end to end with the residual norms folded into the next matvec's input or not, in one process on one
artifact: no pair folded (o and down finish the norm as warm-up chose: their last program, or an add_rmsnorm
launch), every pair that can fold folded (kernels/fold.py, engine_fold.py), and what the engine's warm-up
timing chose (fold_norm None).

    python examples/benchmarks/bench_fold_step.py MODEL.thin [--rounds 3] [--runs 3] [--gen 128]
                                                  [--prompt-len 512]

Loads the artifact once on the GPU (the engine's warm-up times the choice and logs it), then measures
each path with runtime/bench.run, `thin-exec bench`'s own measurement and checks (positions attended
== position at every step, graphed == eager tokens), taking turns for --rounds rounds: the same engine,
kernels and launch configurations, only the folded pairs switched (each bench.run captures its own graph;
the slots are zeroed at each switch). Prints one row per round, then the median over rounds against the
unfolded path, and whether each path's greedy tokens equal the unfolded path's (they may part where the
rounding differs: the sum of squares added in another order, the producer's rows not split-K).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a compiled .thin artifact")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3, help="timed runs a measurement (its median)")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    args = ap.parse_args()

    import torch

    from thin.runtime import bench, load
    from thin.runtime.engine import generate as engine_generate
    from thin.runtime.engine_fold import choose_folding
    from thin.runtime.sampling import GenerationOptions

    if not torch.cuda.is_available():
        sys.exit("bench_fold_step measures the CUDA decode engine: no CUDA device here")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    started = time.perf_counter()
    model = load(args.model, device="cuda", context=args.prompt_len + args.gen)
    engine = model.engine
    if engine is None:
        sys.exit("the decode engine does not take this model")
    print(f"loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    chosen = dict(engine._folding)
    choose_folding(engine, timed=False)
    every = dict(engine._folding)
    if not every:
        sys.exit("no residual norm of this model can fold (post-norms, experts, elastic FFN levels, formats)")
    paths = {"not folded": {}, "every pair folded": every, "warm-up's choice": chosen}
    print(f"warm-up's choice: {len(chosen)} of {len(every)} producers fold", file=sys.stderr)

    def use(folding):
        engine._folding = folding
        engine.norm_sums.zero_()  # the rotation starts from zero slots (kernels/fold.py)

    prompt = torch.randint(0, model.ir.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    options = GenerationOptions(max_new_tokens=32, stop_token_ids=())
    tokens = {}
    for name, folding in paths.items():
        use(folding)
        tokens[name] = list(engine_generate(engine, prompt, options))
    rows = []
    for r in range(args.rounds):
        for name, folding in paths.items():
            use(folding)
            result = bench.run(model, prompt_len=args.prompt_len, new_tokens=args.gen, runs=args.runs)
            rows.append((r, name, result))
            print(f"[{time.perf_counter() - started:6.1f} s] round {r} {name}: {result.decode_tokens_per_second:.1f} "
                  f"tok/s", file=sys.stderr, flush=True)
    use(paths["warm-up's choice"])

    first = rows[0][2]
    print(f"{first.model} ({', '.join(f'{k} x{n}' for k, n in sorted(first.formats.items()))}) on {first.device}, "
          f"{first.bytes_per_token / 1e9:.3f} GB read per token, {args.prompt_len}-token prompt, {args.gen} new "
          f"tokens, median of {args.runs} per measurement")
    print("| round | residual norms | decode tok/s (min-max) | step ms | of roofline |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for r, name, res in rows:
        print(f"| {r} | {name} | {res.decode_tokens_per_second:.1f} ({res.decode_min:.1f}-{res.decode_max:.1f}) | "
              f"{1e3 / res.decode_tokens_per_second:.3f} | {100 * res.roofline_fraction:.1f}% |")
    bandwidth = statistics.median(res.bandwidth_bytes_per_second for _, _, res in rows)
    roofline = bandwidth / first.bytes_per_token
    medians = {n: statistics.median(res.decode_tokens_per_second for _, m, res in rows if m == n) for n in paths}
    base = medians["not folded"]
    print(f"\nmedian over {args.rounds} rounds (roofline {roofline:.0f} tok/s at the median copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s)")
    print("| residual norms | decode tok/s | step ms | step change | of roofline | greedy tokens (32) as not folded |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name in paths:
        pairs = list(zip(tokens[name], tokens["not folded"], strict=True))
        same = all(a == b for a, b in pairs)
        where = "" if same else f" (from token {next(i for i, (a, b) in enumerate(pairs) if a != b)})"
        print(f"| {name} | {medians[name]:.1f} | {1e3 / medians[name]:.3f} | "
              f"{1e3 / medians[name] - 1e3 / base:+.3f} ms | {100 * medians[name] / roofline:.1f}% | "
              f"{'same' if same else 'differ' + where} |")


if __name__ == "__main__":
    main()
