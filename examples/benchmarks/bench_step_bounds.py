"""Bounds on what the decode attention costs a captured decode step: the step timed as shipped, with the appending
split kernel rotating nothing (no RoPE of q and of the new key), without the attention's merge launch, and without any
attention launch, in one process on one artifact.

    python examples/benchmarks/bench_step_bounds.py MODEL.thin [--rounds 3] [--runs 3] [--gen 128]
                                                    [--prompt-len 512]

The ways without launches compute wrong tokens (o reads whatever the attention's output buffer holds), and the one
without RoPE attends with unrotated queries and stores unrotated keys, so they are bounds on what a faster attention
could gain, never ways to run: no check is made of their tokens. Each way captures its own graph on a new cache and
is timed as `decode_n_tokens` under that graph (the median of --runs runs after one untimed), the ways taking turns
for --rounds rounds. Prints one row per way: tokens a second, the step in us, and the change per layer against the
shipped step. In one process the shipped step reads a few
percent below a fresh `thin-exec bench` (BENCHMARKS.md, Round 10's method note): compare the rows with each other.
"""

from __future__ import annotations

import statistics
import sys
import time

from bench_attention_step import arguments, load_engine


def main() -> None:
    args = arguments(__doc__)
    model, engine, started = load_engine(args)
    import torch

    import thin.runtime.kernels.attention as attention
    import thin.runtime.kernels.attention_append as appending
    import thin.runtime.kernels.rope as rope
    from thin.runtime.sampling import GenerationOptions

    shipped = (appending.append_attend, attention.DecodeAttention.merge, attention.DecodeAttention.__call__,
               rope.rope_append)

    def nothing(*_args, **_kwargs):
        return None

    def unrotated(*args, **kwargs):
        return shipped[0](*args, **{**kwargs, "rope": None})

    def use(way: str) -> None:
        appending.append_attend, attention.DecodeAttention.merge, attention.DecodeAttention.__call__, \
            rope.rope_append = shipped
        if way == "no rope":  # what RoPE costs the split kernel after its wait (were it made before, by qkv)
            appending.append_attend = unrotated
        if way in ("no merge launch", "no attention launch"):
            attention.DecodeAttention.merge = nothing
        if way == "no attention launch":
            appending.append_attend = attention.DecodeAttention.__call__ = rope.rope_append = nothing

    prompt = torch.randint(0, model.ir.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    options = GenerationOptions(max_new_tokens=args.gen, stop_token_ids=())
    sampler = engine.sampler(options)

    def measure() -> float:
        cache = engine.new_cache(args.prompt_len + args.gen)
        rates = []
        for run in range(args.runs + 1):
            cache.reset()
            cache.reserve(args.prompt_len + args.gen)
            engine.start(cache, prompt.tolist(), options)
            engine.prefill(cache, prompt, sampler)
            int(engine.token)  # synchronises
            begin = time.perf_counter()
            for _ in engine.decode_n_tokens(cache, args.gen - 1, sampler, graph=True):
                pass
            if run:  # the first run captures the graph
                rates.append((args.gen - 1) / (time.perf_counter() - begin))
        return statistics.median(rates)

    ways = ("shipped", "no rope", "no merge launch", "no attention launch")
    found: dict[str, list[float]] = {way: [] for way in ways}
    try:
        for r in range(args.rounds):
            for way in ways:
                use(way)
                found[way].append(measure())
                print(f"[{time.perf_counter() - started:6.1f} s] round {r} {way}: {found[way][-1]:.1f} tok/s",
                      file=sys.stderr, flush=True)
    finally:
        use("shipped")
    layers = len(model.executor.layers)
    base = 1e6 / statistics.median(found["shipped"])
    print(f"{model.artifact.path.name}: {args.prompt_len}-token prompt, {args.gen} new tokens, median of {args.rounds} "
          f"rounds of {args.runs} runs, {layers} layers")
    print("| way | decode tok/s | step us | us a layer against shipped |")
    print("| --- | ---: | ---: | ---: |")
    for way in ways:
        rate = statistics.median(found[way])
        print(f"| {way} | {rate:.1f} | {1e6 / rate:.1f} | {(1e6 / rate - base) / layers:+.2f} |")


if __name__ == "__main__":
    main()
