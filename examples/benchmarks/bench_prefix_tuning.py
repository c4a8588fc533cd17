"""Does the launch tuner pick the right configuration for a weight that fits in L2? One GPU, llama-8b's
int4 down (4096 x 14336, split-K partial sums) and gate/up (28672 x 4096, fused SiLU) whole and over the
elastic FFN prefixes of keep 0.75 and 0.5 (the first 10752 / 7168 columns of down, rows of each gate/up
half):

    python examples/benchmarks/bench_prefix_tuning.py [--format int4] [--widths 10752,7168] [--copies 24]

For every candidate configuration the engine's tuner would time (KernelLinear.candidates) it takes three
times: "alone", tuning.median_ms launching one weight again and again (how the tuner timed before
choose_together: a weight under the 50 MB L2 is then read from L2); "in turn", the same over --copies
weights of the shape, each launch on the next (the tuner now, `choose`'s peers); "graph", 20 launches over
the copies captured in a CUDA graph, as the decode step runs them (bench_kernels.py's timing, the
reference). Prints per shape the choice each way of timing makes and its graph time, and the graph's best.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import build, time_graph  # noqa: E402


def candidates_times(ops, mode: str, rows, cols) -> list[dict]:
    from thin.runtime.kernels.tuning import _launcher, median_ms_or_inf, precompile

    precompile([(ops[0], mode, rows, cols)])  # the candidates compiled on host threads first
    rows_out = []
    for config in ops[0].candidates(mode, rows, cols):
        alone = median_ms_or_inf(_launcher(ops[0], config, mode, rows, cols))
        in_turn = median_ms_or_inf(_launcher(ops[0], config, mode, rows, cols, ops=ops))
        try:
            launch = _launcher(ops[0], config, mode, rows, cols, ops=ops)
            graph = time_graph([launch] * max(20, len(ops))) * 1e3
        except Exception:  # noqa: BLE001  (a candidate that does not compile: infinity, as the tuner skips it)
            graph = float("inf")
        rows_out.append({"config": config, "alone": alone, "in turn": in_turn, "graph": graph})
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="int4")
    ap.add_argument("--widths", default="10752,7168", help="FFN level widths (channels kept of 14336)")
    ap.add_argument("--copies", type=int, default=24, help="weights of each shape timed in turn")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefix_tuning needs a CUDA GPU")
    widths = [None] + [int(w) for w in args.widths.split(",") if w]
    print(f"{torch.cuda.get_device_name()}, {args.format}, {args.copies} weights a shape; us a launch")
    print("| weight | prefix | chosen alone (its graph us) | chosen in turn (its graph us) | graph best | "
          "candidates |")
    print("| --- | --- | --- | --- | --- | ---: |")
    for name, (n, k, mode) in (("down", (4096, 14336, "partial")), ("gate_up", (28672, 4096, "glu"))):
        ops, _ = build(args.format, n, k, args.copies)
        for width in widths:
            rows, cols = (None, width) if name == "down" else (width, None)
            times = candidates_times(ops, mode, rows, cols)
            picks = {how: min(times, key=lambda t, how=how: t[how]) for how in ("alone", "in turn", "graph")}
            cell = {how: f"{p['config']} ({1e3 * p['graph']:.2f})" for how, p in picks.items()}
            print(f"| {name} | {width or 'whole'} | {cell['alone']} | {cell['in turn']} | {cell['graph']} | "
                  f"{len(times)} |", flush=True)
        del ops
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
