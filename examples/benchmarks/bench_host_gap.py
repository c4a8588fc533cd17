"""Does anything outside the captured decode step cost time per token? For one artifact on the GPU:
`thin-exec bench`'s decode rate (runtime/bench.run), then decode_n_tokens' own loop timed token by
token, then the captured step replayed back to back with nothing else (GPU time), and the host time
to launch one replay.

    python3 examples/benchmarks/bench_host_gap.py MODEL.thin [--prompt-lens 64,512] [--gen 64]

A median step from decode_n_tokens near the bare replay says the host keeps up (the device never waits
for it); a gap of a millisecond says where a slow decode is lost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def measure(model, prompt_len: int, gen: int, replays: int) -> None:
    import torch

    from thin.runtime import bench
    from thin.runtime.sampling import GenerationOptions

    engine = model.engine
    result = bench.run(model, prompt_len=prompt_len, new_tokens=gen, runs=3)
    print(f"prompt {prompt_len}: bench decode {result.decode_tokens_per_second:.1f} tok/s "
          f"({result.decode_min:.1f}-{result.decode_max:.1f})")
    options = GenerationOptions(max_new_tokens=gen, stop_token_ids=())
    sampler = engine.sampler(options)
    cache = engine.new_cache(prompt_len + gen)
    prompt = torch.randint(0, model.ir.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    for rep in range(2):  # the first captures the step
        cache.reset()
        cache.reserve(prompt_len + gen)
        engine.start(cache, prompt.tolist(), options)
        engine.prefill(cache, prompt, sampler)
        int(engine.token)
        stamps = [time.perf_counter()]
        for _ in engine.decode_n_tokens(cache, gen - 1, sampler, graph=True):
            stamps.append(time.perf_counter())
        steps = [1e6 * (b - a) for a, b in zip(stamps, stamps[1:])]
        print(f"  decode_n_tokens, pass {rep + 1}: median step {statistics.median(steps):.0f} us, "
              f"first {steps[0]:.0f}, max {max(steps):.0f}; captured steps {len(cache.graphs)}")
    graph = next(iter(cache.graphs.values()))
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    print(f"  bare replays: {1e6 * (time.perf_counter() - began) / replays:.0f} us a step")
    began = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    launched = time.perf_counter() - began
    torch.cuda.synchronize()
    print(f"  host time to launch a replay: {1e6 * launched / replays:.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt-lens", default="64,512")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_host_gap: needs a CUDA GPU")
    if args.gen < 2:
        sys.exit("bench_host_gap: --gen must be at least 2")
    from thin.runtime import load

    model = load(args.model, device="cuda")
    if model.engine is None:
        sys.exit("bench_host_gap: the decode engine did not take this model")
    for n in (int(v) for v in args.prompt_lens.split(",")):
        measure(model, n, args.gen, args.replays)


if __name__ == "__main__":
    main()
