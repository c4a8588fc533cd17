"""Decode with and without L2 prefetch of the small weights, in one process on one artifact.

    python examples/benchmarks/bench_prefetch.py MODEL.thin [--variants o+qkv,o+qkv-early+side] \\
        [--rounds 3] [--runs 3] [--gen 128] [--prompt-len 512] [--profile]

Loads the artifact once on the GPU, then builds one decode engine per variant over the same weights
(DecodeEngine(prefetch=...): "off" and each '+'-joined set of runtime.engine.PREFETCH_POINTS, with
"side" for prefetch_stream: the launches on a second stream, a branch of the captured step) and
measures each with runtime/bench.run, `thin-exec bench`'s own measurement (graphed decode, median of
--runs, the positions-attended and graph-vs-eager checks, the copy bandwidth), the variants taking
turns for --rounds rounds so a drifting clock or temperature hits them alike. Before timing, every
variant's greedy tokens must equal the plain engine's. Prints one row per round and variant, and the
median over rounds with its change against "off". --profile adds each variant's eager decode step by
section in the last round (bench --profile: the GPU time of qkv, o, ... and of the prefetch launches),
which shows whether a prefetched matvec got faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a compiled .thin artifact")
    ap.add_argument("--variants", default="o,o+qkv,o+qkv-early,o+side,o+qkv+side,o+qkv-early+side",
                    help="comma list of '+'-joined prefetch points, measured next to 'off'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3, help="timed runs a measurement (its median)")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--profile", action="store_true", help="time each variant's eager step by section, last round")
    args = ap.parse_args()

    import torch

    from thin.runtime import bench, load
    from thin.runtime.engine import PREFETCH_POINTS, DecodeEngine
    from thin.runtime.engine import generate as engine_generate
    from thin.runtime.sampling import GenerationOptions

    variants = ["off"] + [v for v in args.variants.split(",") if v and v != "off"]
    for v in variants[1:]:
        unknown = set(v.split("+")) - set(PREFETCH_POINTS) - {"side"}
        if unknown or v == "side":
            sys.exit(f"variant {v!r}: '+'-joined prefetch points ({', '.join(PREFETCH_POINTS)}), optionally with "
                     "'side'" + (f"; unknown: {', '.join(sorted(unknown))}" if unknown else ""))
    if not os.path.isfile(args.model):
        sys.exit(f"{args.model}: no such artifact")
    if not torch.cuda.is_available():
        sys.exit("bench_prefetch measures the CUDA decode engine: no CUDA device here")
    started = time.perf_counter()
    model = load(args.model, device="cuda", context=args.prompt_len + args.gen)
    if model.engine is None:
        sys.exit("the decode engine does not take this model")
    print(f"loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    engines = {"off": model.engine}
    for v in variants[1:]:
        points = v.split("+")
        engines[v] = DecodeEngine(model.executor, prefetch=tuple(p for p in points if p != "side"),
                                  prefetch_stream="side" in points)

    prompt = torch.randint(0, model.ir.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    options = GenerationOptions(max_new_tokens=32, stop_token_ids=())
    tokens = {v: list(engine_generate(e, prompt, options)) for v, e in engines.items()}
    for v in variants[1:]:
        if tokens[v] != tokens["off"]:
            sys.exit(f"greedy tokens with prefetch {v} differ from those without")
    print("check: greedy tokens (32, graphed) with every prefetch variant == without", file=sys.stderr)

    rows = []
    for r in range(args.rounds):
        for v in variants:
            model.engine = engines[v]
            result = bench.run(model, prompt_len=args.prompt_len, new_tokens=args.gen, runs=args.runs,
                               profile=args.profile and r == args.rounds - 1)
            rows.append((r, v, result))
            print(f"[{time.perf_counter() - started:6.1f} s] round {r} {v}: {result.decode_tokens_per_second:.1f} "
                  f"tok/s", file=sys.stderr, flush=True)
    model.engine = engines["off"]

    first = rows[0][2]
    print(f"\n{first.model} ({', '.join(f'{k} x{n}' for k, n in sorted(first.formats.items()))}) on {first.device}, "
          f"{first.bytes_per_token / 1e9:.3f} GB read per token, {args.prompt_len}-token prompt, {args.gen} new "
          f"tokens, median of {args.runs} per measurement")
    print("| round | prefetch | decode tok/s (min-max) | step ms | copy GB/s | of roofline |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for r, v, res in rows:
        print(f"| {r} | {v} | {res.decode_tokens_per_second:.1f} ({res.decode_min:.1f}-{res.decode_max:.1f}) | "
              f"{1e3 / res.decode_tokens_per_second:.3f} | {res.bandwidth_bytes_per_second / 1e9:.0f} | "
              f"{100 * res.roofline_fraction:.1f}% |")
    bandwidth = statistics.median(res.bandwidth_bytes_per_second for _, _, res in rows)
    roofline = bandwidth / first.bytes_per_token
    medians = {v: statistics.median(res.decode_tokens_per_second for _, w, res in rows if w == v) for v in variants}
    print(f"\nmedian over {args.rounds} rounds (roofline {roofline:.0f} tok/s at the median copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s)")
    print("| prefetch | decode tok/s | step ms | of roofline | vs off |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for v in variants:
        print(f"| {v} | {medians[v]:.1f} | {1e3 / medians[v]:.3f} | {100 * medians[v] / roofline:.1f}% | "
              f"{100 * (medians[v] / medians['off'] - 1):+.1f}% |")
    profiles = {v: {k["kernel"]: k["us"] for k in res.kernels} for _, v, res in rows if res.kernels}
    if profiles:
        sections = list(dict.fromkeys(name for p in profiles.values() for name in p))
        print("\none eager decode step by section, us (GPU time; last round)")
        print("| section | " + " | ".join(profiles) + " |\n| --- |" + " ---: |" * len(profiles))
        for name in sections:
            print(f"| {name} | " + " | ".join(f"{p.get(name, 0.0):.1f}" for p in profiles.values()) + " |")


if __name__ == "__main__":
    main()
