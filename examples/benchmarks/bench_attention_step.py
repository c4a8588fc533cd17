"""Decode end to end with each attention path, in one process on one artifact: rope_append + split-KV +
merge (3 launches a layer), the split kernel that norms, rotates and appends itself (2 launches,
kernels/attention_append.py; both of its variants), and what the engine's warm-up timing chose.

    python examples/benchmarks/bench_attention_step.py MODEL.thin [--rounds 3] [--runs 3] [--gen 128]
                                                       [--prompt-len 512]

Loads the artifact once on the GPU (the engine's warm-up times the choice and logs it), then measures
each path with runtime/bench.run, `thin-exec bench`'s own measurement and checks (positions attended
== position at every step, graphed == eager tokens), taking turns for --rounds rounds: the same engine,
kernels and launch configurations, only the layers' attention path switched. Prints one row per round,
then the median over rounds against the three-launch path, and whether each path's greedy tokens equal
the three-launch path's (they may part where the rounding differs: the new token's product with its
value in float32 rather than bf16, summed last).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time


def arguments(doc: str, add=None) -> argparse.Namespace:
    """The A/B scripts' arguments (this one's and bench_pdl.py's); `add(parser)` adds a script's own."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("model", help="a compiled .thin artifact")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3, help="timed runs a measurement (its median)")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    if add is not None:
        add(ap)
    return ap.parse_args()


def load_engine(args):
    """(model, engine, start time) of args.model loaded on the GPU; exits with one line where it cannot."""
    import torch

    from thin.runtime import load

    if not torch.cuda.is_available():
        sys.exit(f"{os.path.basename(sys.argv[0])} measures the CUDA decode engine: no CUDA device here")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    started = time.perf_counter()
    model = load(args.model, device="cuda", context=args.prompt_len + args.gen)
    if model.engine is None:
        sys.exit("the decode engine does not take this model")
    print(f"loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return model, model.engine, started


def compare(args, model, engine, paths: dict, use, column: str, started: float, strict: bool = False) -> None:
    """Measure each of `paths` ({name: what `use` switches the engine to}); the first is the baseline.
    `column` names the paths' column in the tables. Leaves the engine on the last path. `strict`: exit
    before timing where a path's greedy tokens differ from the baseline's (paths meant to compute the same)."""
    import torch

    from thin.runtime import bench
    from thin.runtime.generate import engine_generate
    from thin.runtime.sampling import GenerationOptions

    base = next(iter(paths))
    prompt = torch.randint(0, model.ir.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    options = GenerationOptions(max_new_tokens=32, stop_token_ids=())
    tokens = {}
    for name, path in paths.items():
        use(path)
        tokens[name] = list(engine_generate(engine, prompt, options))
    if strict and any(t != tokens[base] for t in tokens.values()):
        sys.exit(f"greedy tokens differ from {base}'s: {[n for n, t in tokens.items() if t != tokens[base]]}")
    rows = []
    for r in range(args.rounds):
        for name, path in paths.items():
            use(path)
            result = bench.run(model, prompt_len=args.prompt_len, new_tokens=args.gen, runs=args.runs)
            rows.append((r, name, result))
            print(f"[{time.perf_counter() - started:6.1f} s] round {r} {name}: {result.decode_tokens_per_second:.1f} "
                  f"tok/s", file=sys.stderr, flush=True)
    use(list(paths.values())[-1])

    first = rows[0][2]
    print(f"{first.model} ({', '.join(f'{k} x{n}' for k, n in sorted(first.formats.items()))}) on {first.device}, "
          f"{first.bytes_per_token / 1e9:.3f} GB read per token, {args.prompt_len}-token prompt, {args.gen} new "
          f"tokens, median of {args.runs} per measurement")
    print(f"| round | {column} | decode tok/s (min-max) | step ms | of roofline |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for r, name, res in rows:
        print(f"| {r} | {name} | {res.decode_tokens_per_second:.1f} ({res.decode_min:.1f}-{res.decode_max:.1f}) | "
              f"{1e3 / res.decode_tokens_per_second:.3f} | {100 * res.roofline_fraction:.1f}% |")
    bandwidth = statistics.median(res.bandwidth_bytes_per_second for _, _, res in rows)
    roofline = bandwidth / first.bytes_per_token
    medians = {n: statistics.median(res.decode_tokens_per_second for _, m, res in rows if m == n) for n in paths}
    print(f"\nmedian over {args.rounds} rounds (roofline {roofline:.0f} tok/s at the median copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s)")
    print(f"| {column} | decode tok/s | step ms | step change | of roofline | greedy tokens (32) as {base} |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name in paths:
        pairs = list(zip(tokens[name], tokens[base], strict=True))
        same = all(a == b for a, b in pairs)
        where = "" if same else f" (from token {next(i for i, (a, b) in enumerate(pairs) if a != b)})"
        print(f"| {name} | {medians[name]:.1f} | {1e3 / medians[name]:.3f} | "
              f"{1e3 / medians[name] - 1e3 / medians[base]:+.3f} ms | {100 * medians[name] / roofline:.1f}% | "
              f"{'same' if same else 'differ' + where} |")


def main() -> None:
    args = arguments(__doc__)
    model, engine, started = load_engine(args)
    layers = range(len(model.executor.layers))
    paths = {"three launches": {}, "fused": dict.fromkeys(layers, False), "fused, repeat": dict.fromkeys(layers, True),
             "warm-up's choice": dict(engine._appending)}
    print(f"warm-up's choice: {sorted(set(engine._appending.values())) or 'three launches'} on "
          f"{len(engine._appending)} of {len(layers)} layers", file=sys.stderr)

    def use(appending):
        engine._appending = appending

    compare(args, model, engine, paths, use, "attention", started)


if __name__ == "__main__":
    main()
