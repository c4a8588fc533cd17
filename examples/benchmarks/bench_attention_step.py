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

import sys

from step_paths import arguments, compare, load_engine


def main() -> None:
    args = arguments(__doc__)
    model, engine, started = load_engine(args, "bench_attention_step")
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
