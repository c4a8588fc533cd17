"""Decode with the decode attention asking L2 for o's weight while it runs, against not, in one process.

    python examples/benchmarks/bench_next_weights.py MODEL.thin [--rounds 3] [--runs 3] [--gen 128] [--prompt-len 512]

Loads the artifact once on the GPU, then runs the decode engine with DecodeEngine.next_weights 0 (off), 1 (each
split program of the attention asks L2 for its share of o's packed weight first), 2 (last) and 3 (each merge
program, first) - kernels/attention.Prefetch: the attention reads a few MB in a latency-bound launch, so the
memory is idle enough to bring the next matvec's weight (fp8 o: 16.8 MB) into the 50 MB L2 before o runs.
Checks that every way gives the same greedy tokens (graphed), then measures each with runtime/bench.run,
`thin-exec bench`'s own measurement, taking turns for --rounds rounds; prints the median per way and the
change against off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

WAYS = {0: "off", 1: "split programs, first", 2: "split programs, last", 3: "merge programs, first"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a compiled .thin artifact")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3, help="timed runs a measurement (its median)")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    args = ap.parse_args()

    import torch

    from thin.runtime import bench, load
    from thin.runtime.engine import generate as engine_generate
    from thin.runtime.sampling import GenerationOptions

    if not torch.cuda.is_available():
        sys.exit("bench_next_weights measures the CUDA decode engine: no CUDA device here")
    started = time.perf_counter()
    model = load(args.model, device="cuda", context=args.prompt_len + args.gen)
    engine = model.engine
    if engine is None:
        sys.exit("the decode engine does not take this model")
    prompt = torch.randint(0, model.ir.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    options = GenerationOptions(max_new_tokens=32, stop_token_ids=())
    tokens = {}
    for way in WAYS:
        engine.next_weights = way
        tokens[way] = list(engine_generate(engine, prompt, options))
    if any(t != tokens[0] for t in tokens.values()):
        sys.exit("greedy tokens differ between the ways: " + ", ".join(WAYS[w] for w, t in tokens.items()
                                                                       if t != tokens[0]))
    print("check: greedy tokens (32, graphed) the same every way", file=sys.stderr)
    results: dict[int, list] = {way: [] for way in WAYS}
    for r in range(args.rounds):
        for way in WAYS:
            engine.next_weights = way
            res = bench.run(model, prompt_len=args.prompt_len, new_tokens=args.gen, runs=args.runs)
            results[way].append(res)
            print(f"[{time.perf_counter() - started:6.1f} s] round {r} {WAYS[way]}: {res.decode_tokens_per_second:.1f} "
                  f"tok/s", file=sys.stderr, flush=True)
    engine.next_weights = 0
    first = results[0][0]
    bandwidth = statistics.median(res.bandwidth_bytes_per_second for rs in results.values() for res in rs)
    roofline = bandwidth / first.bytes_per_token
    print(f"\n{first.model} on {first.device}, {first.bytes_per_token / 1e9:.3f} GB read per token, {args.prompt_len}-"
          f"token prompt, {args.gen} new tokens; median over {args.rounds} rounds of the median of {args.runs} runs; "
          f"roofline {roofline:.0f} tok/s at the median copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print("| o's weight asked of L2 | decode tok/s (rounds) | step ms | of roofline | vs off |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = statistics.median(res.decode_tokens_per_second for res in results[0])
    for way, rs in results.items():
        tps = statistics.median(res.decode_tokens_per_second for res in rs)
        each = ", ".join(f"{res.decode_tokens_per_second:.1f}" for res in rs)
        print(f"| {WAYS[way]} | {tps:.1f} ({each}) | {1e3 / tps:.3f} | {100 * tps / roofline:.1f}% | "
              f"{100 * (tps / base - 1):+.1f}% |")


if __name__ == "__main__":
    main()
