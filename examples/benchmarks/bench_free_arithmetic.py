"""A bound on what the int4 matvecs' arithmetic costs a decode step: `thin-exec bench` (or, with --kernels,
bench_kernels.py's int4 timings) with the bf16-pair arithmetic of every grouped-int matvec cut to a few integer adds
a packed word, in a fresh process.

    python examples/benchmarks/bench_free_arithmetic.py MODEL.thin [--runs 5]     # the whole step, cut
    python examples/benchmarks/bench_free_arithmetic.py MODEL.thin --shipped      # the same command, uncut
    python examples/benchmarks/bench_free_arithmetic.py --kernels                 # each int4 shape, cut

The cut (`word_dot` replaced before any kernel compiles) keeps every load, the tilings, the launch tuner and the
step's other kernels, and adds each word and its activations into the running pairs (sm_90: 0.89 instructions a
weight in gate/up's loop against 2.28, `sass_budget.py`'s count): the sums are wrong, so the tokens are too (the
run's checks compare the cut step with itself), and the result is a bound on any cheaper arithmetic, never a way
to run. Use a launch-configuration cache of its own (THIN_CACHE_DIR): the tuner times the cut kernels.
BENCHMARKS.md Round 19: llama-8b int4 on an H200, 688.5 tok/s cut against 629.2 shipped.
"""

from __future__ import annotations

import os
import sys

import triton
import triton.language as tl


@triton.jit
def added_words(acc, word, xp, ZERO_BITS: tl.constexpr, ASM: tl.constexpr):
    """pairs.word_dot's signature; each word and its activations' pairs added, kept to finite bf16 pairs."""
    return acc ^ ((word + xp[0][None, :] + xp[1][None, :] + xp[2][None, :] + xp[3][None, :]) & 0x007F007F)


if "--shipped" not in sys.argv:  # at import: bench_kernels' compile workers import this module again
    import thin.runtime.kernels.grouped_int as grouped_int

    grouped_int.word_dot = added_words


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--shipped"]
    if args[:1] == ["--kernels"]:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_kernels

        shipped = bench_kernels.configs
        bench_kernels.configs = lambda op, mode, sweep: [c for c in shipped(op, mode, sweep) if c.packed]
        sys.argv = ["bench_kernels", "--formats", "int4", "--shapes", "qkv,o,gate_up,down", *args[1:]]
        bench_kernels.main()
        return
    if not args:
        raise SystemExit(__doc__)
    from thin.runtime.cli import main as thin_exec

    sys.argv = ["thin-exec", "bench", *args, "--json"]
    thin_exec()


if __name__ == "__main__":
    main()
