"""What the int4 kernel experiments share (exp_int4_fragments.py, exp_int4_imma.py, exp_flat_step.py): the lane-level
pieces (the thread of each element for inline mma, a lane's whole run of loads, its 4 words apart, the warps' sums:
thin.runtime.kernels.lanes, where the runtime's int8 mma kernels keep them), enough shipped int4 weights not to fit
in L2, llama-8b's matvec shapes, and the scripts' mode dispatch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import triton

from thin.runtime.kernels.lanes import load_run, pick, split4, threads, warps_sum  # noqa: F401  (the scripts' imports)


def shipped_weights(n, k):
    """[(shipped op, its raw bytes)] of enough random int4 weights [n, k] (encoded on the GPU) that they do not fit
    in L2."""
    from thin.ir import Encoding, Tensor, formats
    from thin.runtime.linear import make_linear

    params = formats.get("int4").normalize({})
    out = []
    for _ in range(max(2, min(24, 256 * 2**20 // (n * k // 2)))):
        raw = formats.encode("int4", 0.02 * torch.randn(n, k, device="cuda"), params)
        record = Tensor("w", "ffn.down", 0, (n, k), Encoding("int4", params), "bf16")
        out.append((make_linear(record, raw.cpu(), None, torch.device("cuda"), torch.bfloat16), raw))
    return out


SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]  # llama-8b's


def chosen_shapes() -> list[tuple[str, int, int]]:
    """SHAPES, or those of them named (comma-separated) after the mode on the command line."""
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    return [shape for shape in SHAPES if only is None or shape[0] in only]


SASS_CASES = [("qkv", 6144, 4096, 4, 1), ("qkv", 6144, 4096, 4, 2), ("qkv", 6144, 4096, 8, 2),
              ("down", 4096, 14336, 16, 1), ("down", 4096, 14336, 8, 1)]  # llama-8b's, (warps, row tiles)


def print_sass_counts(warmup: Callable) -> None:
    """Compile a 16-row-tile matvec kernel for sm_90 (sass_budget.py's stand-in driver, no GPU) at SASS_CASES as a
    dependent, `warmup(n, k, warps, groups a warp, row tiles)` giving the compiled kernel, and print its SASS
    instructions after the wait (griddepcontrol.wait), in all and a weight and lane."""
    from sass_budget import ADDRESS, _Sm90, disassemble
    from triton.runtime import driver

    driver.set_active(_Sm90())
    print("| shape | warps | row tiles | instructions after the wait | a weight |\n| --- | ---: | ---: | ---: | ---: |")
    for name, n, k, nw, t in SASS_CASES:
        gpw = triton.next_power_of_2(-(-(k // 128) // nw))
        code = [found.group(2) for found in map(ADDRESS.match, disassemble(warmup(n, k, nw, gpw, t)).splitlines())
                if found]
        after = len(code) - next(i for i, text in enumerate(code) if "ACQBULK" in text)
        print(f"| {name} | {nw} | {t} | {after} | {after / (16 * t * gpw * 4):.2f} |")


def print_shipped(name: str, ops, x, reps: int) -> None:
    """Print the shipped matvec's time alone over `ops` (copies of one weight), plain and as a dependent."""
    from functools import partial

    from bench_kernels import time_graph

    from thin.runtime.kernels import dependent

    line = f"{name}: shipped ({ops[0].config('direct')})"
    for pdl in (0, 1):
        with dependent.launching(bool(pdl)):
            took = time_graph([partial(op.matvec, x) for op in ops] * reps)
        line += f" {'dependent' if pdl else 'plain'} {took * 1e6:.2f}"
    print(line + " us", flush=True)


def bench_alone(label: str, activations: Callable, matvec: Callable) -> None:
    """Time a 16-row-tile matvec alone against the shipped one at the shapes asked (`chosen_shapes`), each plain
    and as a programmatic dependent (bench_kernels.time_graph over enough copies not to fit in L2): `activations(x)`
    gives its x arguments from bfloat16 x, `matvec(words, scales, *xargs, n, k, warps, tiles, asm, pdl, out)`."""
    from functools import partial

    from bench_kernels import time_graph

    for name, n, k in chosen_shapes():
        ops = [op for op, _ in shipped_weights(n, k)]
        planes = [(op.low32.reshape(n, k // 8), op.scales.reshape(n, k // 128)) for op in ops]
        reps = max(1, 20 // len(ops))
        x = torch.randn(k, device="cuda").bfloat16()
        xargs = activations(x)
        want = ops[0](x[None])[0].float()
        print_shipped(name, ops, x, reps)
        for nw, t in ([(4, 1), (4, 2), (8, 1), (8, 2)] if k <= 4096 else [(8, 1), (16, 1)]):
            out = torch.empty(n, device="cuda")
            err = ((matvec(*planes[0], *xargs, n, k, nw, t, True, 0, out) - want).norm() / want.norm()).item()
            times = [time_graph([partial(matvec, *p, *xargs, n, k, nw, t, True, pdl, out) for p in planes] * reps)
                     for pdl in (0, 1)]
            print(f"  {label}, warps={nw} row tiles {t}: plain {times[0] * 1e6:.2f} us, dependent "
                  f"{times[1] * 1e6:.2f} us, error against shipped {err:.1e}", flush=True)


def run_mode(modes: dict[str, Callable[[], None]], usage: str) -> None:
    """Run the mode named first on the command line ("check" without one), or exit with `usage`."""
    name = sys.argv[1] if len(sys.argv) > 1 else "check"
    if name not in modes:
        raise SystemExit(usage)
    modes[name]()
