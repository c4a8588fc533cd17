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

import sys

from step_paths import arguments, compare, load_engine


def main() -> None:
    args = arguments(__doc__)
    model, engine, started = load_engine(args, "bench_fold_step")
    from thin.runtime.engine_fold import choose_folding

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

    compare(args, model, engine, paths, use, "residual norms", started)


if __name__ == "__main__":
    main()
