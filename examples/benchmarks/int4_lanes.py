"""Lane-level pieces and benchmark inputs that the int4 kernel experiments share (exp_int4_fragments.py,
exp_int4_imma.py, exp_flat_step.py): the thread of each element for inline mma, loads of a lane's whole run held
as one register tensor (`load_run`, `pick`), a lane's 4 words apart (`split4`), the warps' sums, enough shipped int4
weights not to fit in L2, llama-8b's matvec shapes, and the scripts' mode dispatch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def threads(NW: tl.constexpr, ASM: tl.constexpr):
    """[32 * NW]: the thread that holds each element. ASM: read from %tid.x (the mma reads registers by lane, so
    the lane must be the thread's own); in the interpreter's twin, the element's index."""
    e = tl.arange(0, 32 * NW)
    if ASM:
        e = tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [e], dtype=tl.int32, is_pure=True, pack=1)
    return e


@triton.jit
def split4(t):
    """[..., 4] (4 words a lane holds in its registers, the last axis) -> the 4 words, each [...], in order."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _step(ptrs, first, s: tl.constexpr, RUN: tl.constexpr, STEPS: tl.constexpr, STRIDE: tl.constexpr):
    """A lane's words (or scales) of step (group) s of its run, masked past the run and the row."""
    ok = (first + s < STEPS) & (s < RUN)
    if len(ptrs.shape) == 2:
        out = tl.load(ptrs + s * STRIDE, mask=ok[:, None], other=0)
    else:
        out = tl.load(ptrs + s * STRIDE, mask=ok, other=0)
    return out


# _run2 .. _run16: one rung a power of two, each joining two of the rung below. Triton's JIT has no recursion, and a
# loop cannot grow a tensor's shape, so the ladder is written out.
@triton.jit
def _run2(ptrs, first, s: tl.constexpr, RUN: tl.constexpr, STEPS: tl.constexpr, STRIDE: tl.constexpr):
    return tl.join(_step(ptrs, first, s, RUN, STEPS, STRIDE), _step(ptrs, first, s + 1, RUN, STEPS, STRIDE))


@triton.jit
def _run4(ptrs, first, s: tl.constexpr, RUN: tl.constexpr, STEPS: tl.constexpr, STRIDE: tl.constexpr):
    return tl.join(_run2(ptrs, first, s, RUN, STEPS, STRIDE), _run2(ptrs, first, s + 2, RUN, STEPS, STRIDE))


@triton.jit
def _run8(ptrs, first, s: tl.constexpr, RUN: tl.constexpr, STEPS: tl.constexpr, STRIDE: tl.constexpr):
    return tl.join(_run4(ptrs, first, s, RUN, STEPS, STRIDE), _run4(ptrs, first, s + 4, RUN, STEPS, STRIDE))


@triton.jit
def _run16(ptrs, first, s: tl.constexpr, RUN: tl.constexpr, STEPS: tl.constexpr, STRIDE: tl.constexpr):
    return tl.join(_run8(ptrs, first, s, RUN, STEPS, STRIDE), _run8(ptrs, first, s + 8, RUN, STEPS, STRIDE))


@triton.jit
def load_run(ptrs, first, S: tl.constexpr, RUN: tl.constexpr, STEPS: tl.constexpr, STRIDE: tl.constexpr):
    """Every step s < S of a lane's run loaded at once (`_step`), each a load of its own, held in registers as one
    tensor [*ptrs.shape, 2, ..., 2] whose last axis is the step's highest bit (tl.join: nothing moves)."""
    if S == 1:
        out = _step(ptrs, first, 0, RUN, STEPS, STRIDE)
    elif S == 2:
        out = _run2(ptrs, first, 0, RUN, STEPS, STRIDE)
    elif S == 4:
        out = _run4(ptrs, first, 0, RUN, STEPS, STRIDE)
    elif S == 8:
        out = _run8(ptrs, first, 0, RUN, STEPS, STRIDE)
    else:
        out = _run16(ptrs, first, 0, RUN, STEPS, STRIDE)
    return out


@triton.jit
def pick(t, s: tl.constexpr, S: tl.constexpr):
    """Step s of a `load_run` tensor of S steps: its last axes split from the highest bit down."""
    if S >= 16:
        t = tl.split(t)[(s >> 3) & 1]
    if S >= 8:
        t = tl.split(t)[(s >> 2) & 1]
    if S >= 4:
        t = tl.split(t)[(s >> 1) & 1]
    if S >= 2:
        t = tl.split(t)[s & 1]
    return t


@triton.jit
def warps_sum(acc, NW: tl.constexpr):
    """[32 * NW] lane values -> [32]: the sum over the warps, lane by lane."""
    return tl.sum(tl.reshape(acc, [NW, 32]), axis=0)


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
