"""`thin-exec bench` in fresh processes with the decode attention's launch shape changed: the appending split
kernel's warps (attention_append.split_warps) and the positions a split program's tile takes (DecodeAttention's
`tile`, which also sets how many splits there are), the ways taking turns.

    python examples/benchmarks/sweep_attention_launch.py MODEL.thin [--warps 4,8] [--tiles 32] [--rounds 2]
        [--runs 3] [--prompt-len 512] [--gen 128]

Why fresh processes and the whole step: the warm-up's timing of the attention alone (`choose_appending`) preferred
4 warps where the step ran 1.3% faster with 8 (BENCHMARKS Round 23), and a captured step timed in one process reads
a few percent below a fresh `thin-exec bench`. "shipped" in the table is the committed choice (warps from
`split_warps`, tile 32). The launch-choice cache (THIN_CACHE_DIR) is shared: only the attention changes.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tune_in_step import checks, fresh_bench, rate  # noqa: E402


def patch(warps: str, tile: str) -> None:
    """This process's attention launched with `warps` warps ("shipped": split_warps' choice) and tiles of `tile`
    positions ("shipped": DecodeAttention's own)."""
    import thin.runtime.kernels.attention as attention
    import thin.runtime.kernels.attention_append as appending

    if warps != "shipped":
        appending.split_warps = lambda _tile, _head_dim, _rows=1: int(warps)
    if tile != "shipped":
        init = attention.DecodeAttention.__init__

        def with_tile(self, *args, **kwargs):
            kwargs["tile"] = int(tile)
            init(self, *args, **kwargs)

        attention.DecodeAttention.__init__ = with_tile


def _child(warps: str, tile: str, bench_args: list[str]) -> None:
    """Run thin-exec bench --json in this process with the attention's launch shape patched."""
    from thin.runtime.cli import main

    patch(warps, tile)
    sys.argv = ["thin-exec", "bench", *bench_args, "--json"]
    main()


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2], sys.argv[3], sys.argv[4:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a compiled .thin artifact")
    ap.add_argument("--warps", default="4,8", help="the appending split kernel's warps, comma-separated")
    ap.add_argument("--tiles", default="32", help="positions a split program's tile takes, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3, help="timed runs a process (thin-exec bench --runs)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    args = ap.parse_args()
    bench_args = [args.model, "--runs", str(args.runs), "--prompt-len", str(args.prompt_len), "--gen", str(args.gen)]
    ways = [("shipped", "shipped")] + [(w, t) for t in args.tiles.split(",") for w in args.warps.split(",")]
    print("| round | warps | tile | decode tok/s (min-max) | of roofline | checks |")
    print("| ---: | --- | --- | ---: | ---: | --- |")
    for r in range(args.rounds):
        for warps, tile in ways:
            got = fresh_bench([sys.executable, os.path.abspath(__file__), "--child", warps, tile, *bench_args])
            if isinstance(got, str):
                print(f"| {r} | {warps} | {tile} | failed: {got} | | |", flush=True)
                continue
            print(f"| {r} | {warps} | {tile} | {rate(got)} | {100 * got['roofline_fraction']:.1f}% | {checks(got)} |",
                  flush=True)


if __name__ == "__main__":
    main()
