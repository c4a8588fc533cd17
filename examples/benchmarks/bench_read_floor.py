"""What one decode kernel that only reads its weight bytes costs on this GPU: the floor under each matvec.

    python3 examples/benchmarks/bench_read_floor.py            # one GPU

For each of llama-8b's int4 (group 128) matvec sizes (o 8.7 MB, qkv 13.0 MB, down 30.3 MB, gate/up 60.6 MB,
codes and scales) a Triton kernel reads that many bytes, every lane's 16-byte loads issued at once (no
arithmetic but an xor a load), and stores one word a program, so nothing is left out. It is timed as
bench_kernels.py times the matvecs (20 launches captured in a CUDA graph over copies that do not fit in L2,
median of 7 replays), over a grid of warps a program and loads a lane, plainly and as programmatic dependents
(each launch's loads before its wait for the one before, as the step's matvecs do). An empty kernel of as many
programs gives the launch alone. Against the matvecs' own times (bench_kernels.py) this says how much of a
matvec is reading its bytes at the best a kernel can, and how much is its arithmetic and its tiling.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

SIZES = {"o": 4096 * 4096, "qkv": 6144 * 4096, "down": 4096 * 14336, "gate_up": 28672 * 4096}  # weights


@triton.jit
def _read(src_ptr, out_ptr, PER: tl.constexpr, NW: tl.constexpr, PDL: tl.constexpr):
    """Program i reads PER 16-byte vectors a lane (32 * NW lanes, the warp's vectors adjacent) and stores the xor
    of all it read. PDL: launched as a programmatic dependent, waiting after its loads are issued."""
    lanes: tl.constexpr = 32 * NW
    base = tl.program_id(0).to(tl.int64) * (lanes * PER * 4)
    offs = base + (tl.arange(0, PER)[None, :, None] * lanes + tl.arange(0, lanes)[:, None, None]) * 4
    words = tl.load(src_ptr + offs + tl.arange(0, 4)[None, None, :])
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(tl.xor_sum(tl.xor_sum(words, axis=2), axis=1), axis=0))


@triton.jit
def _empty(out_ptr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(out_ptr + tl.program_id(0), tl.program_id(0))


def main() -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_kernels import time_graph

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows = []
    for name, weights in SIZES.items():
        nbytes = weights // 2 + weights // 128 * 2  # 4-bit codes and a float16 scale a group of 128
        copies = max(2, min(24, 256 * 2**20 // nbytes))
        best = {}
        for nw in (1, 2, 4, 8):
            for per in (1, 2, 4, 8, 16):
                chunk = 32 * nw * per * 16
                programs = -(-nbytes // chunk)
                srcs = [torch.randint(-2**31, 2**31 - 1, (programs * chunk // 4,), dtype=torch.int32, device="cuda")
                        for _ in range(copies)]
                out = torch.empty(programs, dtype=torch.int32, device="cuda")
                for pdl in (0, 1):
                    extra = {"launch_pdl": True} if pdl else {}
                    calls = [partial(_read[(programs,)], s, out, per, nw, pdl, num_warps=nw, **extra)
                             for s in srcs] * max(1, 20 // copies)
                    t = time_graph(calls)
                    key = "dependent" if pdl else "plain"
                    if key not in best or t < best[key][0]:
                        best[key] = (t, nw, per, programs)
                    print(f"{name} {nbytes / 1e6:.1f} MB warps {nw} loads {per} ({programs} programs) {key}: "
                          f"{t * 1e6:.2f} us, {nbytes / t / bandwidth:.0%} of copy", flush=True)
                del srcs
        for key, (t, nw, per, programs) in best.items():
            extra = {"launch_pdl": True} if key == "dependent" else {}
            out = torch.empty(programs, dtype=torch.int32, device="cuda")  # a word for each of its programs
            empty = time_graph([partial(_empty[(programs,)], out, key == "dependent", num_warps=nw, **extra)] * 20)
            rows.append((name, nbytes, key, t, nw, per, programs, empty))
    print("\n| matvec | MB | launch | best read us | of copy | warps | loads a lane | programs | empty kernel us |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, nbytes, key, t, nw, per, programs, empty in rows:
        print(f"| {name} | {nbytes / 1e6:.1f} | {key} | {t * 1e6:.2f} | {nbytes / t / bandwidth:.0%} | {nw} | {per} | "
              f"{programs} | {empty * 1e6:.2f} |")


def copy_bandwidth() -> float:
    """The copy bandwidth `thin-exec bench` measures (bytes a second)."""
    from thin.runtime.bench import copy_bandwidth as measure

    return measure(torch.device("cuda"))


if __name__ == "__main__":
    main()
