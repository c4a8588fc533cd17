"""Experiment: down starting on the FFN's hidden row while gate/up still runs.

    python3 examples/benchmarks/exp_ffn_flow.py [--layers 8] [--replays 9] [--fmt int4]

llama-8b's FFN (gate/up 28672x4096 with SiLU, down 4096x14336) over --layers layers of their own
weights, in one CUDA graph, three ways:

    plain      every launch in stream order (the shipped step);
    dependent  down a programmatic dependent that loads its first two steps' words, then waits for
               gate/up to finish (Round 11's way);
    flow       down a programmatic dependent that never waits for gate/up as a whole: each gate/up
               program counts its rows into a counter per segment of the hidden row (one down step
               wide), and down waits, step by step, only for the segment it is about to read.

Checks every way's outputs against plain's (the same arithmetic: equal bit for bit), then times
(median of --replays graph replays, us a layer).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replays", type=int, default=9)
    parser.add_argument("--fmt", default="int4")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    args = parser.parse_args()

    sys.path.insert(0, "examples/benchmarks")
    from bench_kernels import build

    from thin.runtime.kernels import dependent

    L, H, F = args.layers, args.hidden, args.ffn
    ups = [build(args.fmt, 2 * F, H)[0][0] for _ in range(L)]
    downs = [build(args.fmt, H, F)[0][0] for _ in range(L)]
    up_cfg = ups[0].config("glu")
    down_cfg = downs[0].config("direct")
    seg = down_cfg.chunk
    nseg = 1 << (-(-F // seg) - 1).bit_length()
    assert seg % up_cfg.block_n == 0 and F % seg == 0, (seg, up_cfg)
    print(f"gate/up {up_cfg}; down {down_cfg}; segments of {seg} columns, {F // seg} of them ({nseg} counters)")
    x = torch.randn(H, device="cuda").bfloat16()
    h = torch.empty(L, F, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(L, H, dtype=torch.bfloat16, device="cuda")
    counters = torch.zeros(L, nseg, dtype=torch.int32, device="cuda")

    def layer(i, way):
        flow_up = flow_down = None
        if way == "flow":
            flow_up = dict(flow_ptr=counters[i], flow_next_ptr=counters[(i + 1) % L], FLOW=1, SEG=seg, NSEG=nseg)
            flow_down = dict(flow_ptr=counters[i], flow_target=seg // up_cfg.block_n, FLOW=2, SEG=seg, NSEG=nseg)
        with dependent.section("gate/up"):
            ups[i]._matvec(x, h[i], up_cfg, 0, False, flow=flow_up)
        with dependent.section("down"):
            downs[i]._matvec(h[i], y[i], down_cfg, -1, False, flow=flow_down)

    def step(way):
        on = False if way == "plain" else frozenset({"down"})
        with dependent.launching(on):
            for i in range(L):
                layer(i, way)

    ways = ["plain", "dependent", "flow"]
    ref = None
    for way in ways:
        h.fill_(float("nan"))
        y.fill_(float("nan"))
        step(way)
        torch.cuda.synchronize()
        if ref is None:
            ref = y.clone()
        same = torch.equal(y, ref)
        print(f"{way}: outputs {'equal to plain' if same else 'DIFFER from plain'}"
              f" (max |diff| {(y.float() - ref.float()).abs().max().item():.3g})")

    graphs = {}
    for way in ways:
        step(way)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(way)
        g.replay()
        torch.cuda.synchronize()
        graphs[way] = g
    times = {w: [] for w in ways}
    for _ in range(args.replays):
        for way in ways:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[way].replay()
            b.record()
            b.synchronize()
            times[way].append(a.elapsed_time(b) * 1e3 / L)
    y_graph = y.clone()
    print(f"graph outputs equal to plain: {torch.equal(y_graph, ref)}")
    base = statistics.median(times["plain"])
    print("| way | us a layer (gate/up + down) | vs plain |")
    print("| --- | ---: | ---: |")
    for way in ways:
        t = statistics.median(times[way])
        print(f"| {way} | {t:.2f} | {100 * (t / base - 1):+.1f}% |")


if __name__ == "__main__":
    main()
