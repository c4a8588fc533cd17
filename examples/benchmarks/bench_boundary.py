"""What a kernel boundary costs between two dependent bandwidth-bound phases in a CUDA graph, and
what a grid-wide barrier inside one persistent kernel costs instead.

    python3 examples/benchmarks/bench_boundary.py [--sizes-mb 2,4,8,16,32,64] [--boundary-mb 2,8,32] [--ks 1,2,4]

Every phase streams an int32 buffer from DRAM (each program sums tiles with 16-byte loads and
writes one value). All timings are CUDA-graph replays (median of --replays, CUDA events) of many
units back to back; a unit's time is (T(2R units) - T(R units)) / R, which drops the graph launch
itself but keeps every boundary between consecutive kernels. Units rotate through a --pool-mb
pool (default 256 MB, five times the H200's L2), so no phase reads from L2.

1. one launch of s bytes, for each --sizes-mb: GB/s, and a least-squares line t = intercept +
   bytes / bandwidth (the intercept is the fixed cost of a launch in a graph);
2. two dependent launches of S each (B adds a value A wrote) against one launch of 2S: the
   boundary costs t(A;B) - t(2S); then the same pair as programmatic dependent launches (sm_90: each
   program lets the next launch in at once and loads its tile before it waits for the previous one;
   the last two columns);
3. one persistent kernel of SMs x k programs: phase A over S, a grid barrier, phase B over S (B
   adds a value another program wrote in A), against the same kernel with no barrier: the
   barrier costs the difference. The barrier is an int32 counter: each program adds 1 (acq_rel,
   gpu scope) and polls until it reaches the end of its launch's epoch (the counter grows by the
   grid every launch, so the graph replays without a reset). Two polls: "acquire", one thread
   reads with tl.atomic_add(counter, 0, sem="acquire") (Triton emits ld.acquire.gpu) and a CTA
   barrier shares it, each poll; "volatile", every thread polls with volatile loads, then one
   acquire read. A poll gives up after --max-spin tries and sets an error flag, reported as
   "barrier timed out" instead of a hang; k is capped by the kernel's occupancy (registers,
   warps, shared memory) so that all programs are resident at once.
4. the same persistent kernel with each program's first tile of phase B loaded into registers while
   it waits at the barrier (issued after its arrival, whose release fence would otherwise wait for
   them; acquire poll): B's data does not depend on A, so a kernel made of phases can have the next
   phase's first bytes in flight while it waits; the barrier then costs the difference against the
   kernel without one. (A persistent decode layer would do the same with the next projection's
   weights.)

Every configuration is checked against torch's sums before it is timed (phase A's outputs are
poisoned first, so a barrier that lets B run early shows as a wrong number, not a fast time).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MB = 2**20
POISON = -(2**30)
DEVICE = "cuda"


@triton.jit
def _stream_kernel(src_ptr, out_ptr, prev_ptr, n_prev, BLOCK: tl.constexpr, HAS_PREV: tl.constexpr,
                   PDL: tl.constexpr):
    """One tile of BLOCK int32 a program: out[pid] = its sum (+ prev[(pid + n_prev // 2) % n_prev]).

    PDL 2 (a programmatic dependent launch, sm_90): the program lets the next launch's programs start
    at once, loads its tile (nothing before writes it), then waits for the previous launch to finish
    before it reads `prev` or stores; 1: that order without the grid-dependency instructions (Triton's
    interpreter has none); 0: a plain launch."""
    pid = tl.program_id(0)
    if PDL == 2:
        gdc_launch_dependents()
    # The whole tile in one go: BLOCK / (32 * num_warps) int32 a thread, 16-byte loads.
    tile = tl.load(src_ptr + pid * BLOCK + tl.arange(0, BLOCK))
    if PDL == 2:
        gdc_wait()
    total = tl.sum(tile, axis=0)
    if HAS_PREV:
        # The dependence on the previous launch: a value another program of it wrote.
        total += tl.load(prev_ptr + (pid + n_prev // 2) % n_prev)
    tl.store(out_ptr + pid, total)


@triton.jit
def _grid_barrier(counter_ptr, err_ptr, max_spin, POLL_LOAD: tl.constexpr):
    """Wait until every program of this launch has arrived (see epoch_target for the arithmetic)."""
    seen, target = _grid_arrive(counter_ptr)
    _grid_wait(counter_ptr, err_ptr, seen, target, max_spin, POLL_LOAD)


@triton.jit
def _grid_arrive(counter_ptr):
    """This program's arrival at the grid barrier: (the count it saw, the count that ends the wait)."""
    grid = tl.num_programs(0)
    tl.debug_barrier()  # every thread of the program is past its phase-A stores
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return ticket + 1, (ticket // grid + 1) * grid  # epoch_target(ticket, grid)


@triton.jit
def _grid_wait(counter_ptr, err_ptr, seen, target, max_spin, POLL_LOAD: tl.constexpr):
    """Poll until the counter reaches `target` (or max_spin polls: then the error flag)."""
    spins = 0
    while (seen < target) & (spins < max_spin):
        if POLL_LOAD:
            seen = tl.load(counter_ptr, volatile=True)
        else:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if POLL_LOAD:
        # Volatile loads are relaxed: one acquire read orders phase B after the others' releases.
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    if seen < target:
        tl.store(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(src_ptr, out_a_ptr, out_b_ptr, counter_ptr, err_ptr, tiles, max_spin,
                       BLOCK: tl.constexpr, BARRIER: tl.constexpr, POLL_LOAD: tl.constexpr,
                       PREFETCH: tl.constexpr):
    """Phase A sums tiles [0, tiles), phase B tiles [tiles, 2 tiles), program pid every grid-th tile.

    With BARRIER, the phases are separated by a grid barrier and B adds out_a[(pid + grid // 2) % grid]
    (written by another program in A); without, B adds nothing. PREFETCH: the program's first tile of B
    is loaded between its arrival at the barrier and its wait (it does not depend on A), summed after."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for t in range(pid, tiles, grid):
        acc += tl.load(src_ptr + t * BLOCK + offs)
    tl.store(out_a_ptr + pid, tl.sum(acc, axis=0))
    if PREFETCH:
        # Loaded after the arrival (whose release fence would wait for them) and before the wait.
        if BARRIER:
            seen, target = _grid_arrive(counter_ptr)
        acc = tl.load(src_ptr + (tiles + pid) * BLOCK + offs, mask=(pid + 0 * offs) < tiles, other=0)
        if BARRIER:
            _grid_wait(counter_ptr, err_ptr, seen, target, max_spin, POLL_LOAD)
        first = pid + grid
    else:
        if BARRIER:
            _grid_barrier(counter_ptr, err_ptr, max_spin, POLL_LOAD)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        first = pid
    for t in range(first, tiles, grid):
        acc += tl.load(src_ptr + (tiles + t) * BLOCK + offs)
    total = tl.sum(acc, axis=0)
    if BARRIER:
        # .cg: from L2, never from a line this SM's L1 kept from an earlier replay.
        total += tl.load(out_a_ptr + (pid + grid // 2) % grid, cache_modifier=".cg")
    tl.store(out_b_ptr + pid, total)


def epoch_target(ticket: int, grid: int) -> int:
    """The counter value that ends the barrier of the launch whose arrival drew `ticket`.

    Each launch adds exactly `grid` to the counter (one arrival a program, also after a timeout),
    and launches on a stream do not overlap, so a launch that starts at e * grid draws tickets
    e * grid .. e * grid + grid - 1 and waits for (e + 1) * grid."""
    return (ticket // grid + 1) * grid


def stream(src: torch.Tensor, out: torch.Tensor, block: int, prev: torch.Tensor | None = None, warps: int = 4,
           pdl: bool = False):
    """Launch _stream_kernel over all of `src` (a multiple of `block` int32); out gets a sum a tile.
    `pdl`: as a programmatic dependent launch (on a GPU; its reordered code under the interpreter)."""
    grid = src.numel() // block
    has_prev = prev is not None
    level = (1 if os.environ.get("TRITON_INTERPRET") == "1" else 2) if pdl else 0
    _stream_kernel[(grid,)](src, out, prev if has_prev else out, prev.numel() if has_prev else 1,
                            BLOCK=block, HAS_PREV=has_prev, PDL=level, num_warps=warps,
                            **({"launch_pdl": True} if level == 2 else {}))


def persistent(src: torch.Tensor, out_a: torch.Tensor, out_b: torch.Tensor, counter: torch.Tensor,
               err: torch.Tensor, grid: int, block: int, barrier: bool, poll_load: bool = False,
               max_spin: int = 1 << 20, warps: int = 4, prefetch: bool = False):
    """Launch _persistent_kernel on `grid` programs: phase A over the first half of `src`, B the second
    (with `prefetch`, each program's first tile of B loaded before the barrier)."""
    tiles = src.numel() // (2 * block)
    _persistent_kernel[(grid,)](src, out_a, out_b, counter, err, tiles, max_spin, BLOCK=block,
                                BARRIER=barrier, POLL_LOAD=poll_load, PREFETCH=prefetch, num_warps=warps)


def program_sums(src: torch.Tensor, block: int, grid: int) -> torch.Tensor:
    """What program p of a persistent phase over `src` computes: the tiles p, p + grid, ... summed."""
    tile_sums = src.view(-1, block).sum(1, dtype=torch.int64)
    padded = torch.zeros(math.ceil(tile_sums.numel() / grid) * grid, dtype=torch.int64, device=src.device)
    padded[:tile_sums.numel()] = tile_sums
    return padded.view(-1, grid).sum(0)


def shifted(values: torch.Tensor) -> torch.Tensor:
    """values[(p + n // 2) % n] for every p: the value the dependent phase reads."""
    n = values.numel()
    return values[(torch.arange(n, device=values.device) + n // 2) % n]


def blocks_per_sm(n_regs: int, num_warps: int, shared: int) -> int:
    """Programs an H100/H200 SM holds at once: 64K registers (256 a warp granule), 64 warps,
    32 blocks, 228 KB shared memory (1 KB reserved a block)."""
    regs_per_warp = math.ceil(max(n_regs, 1) * 32 / 256) * 256
    by_regs = (65536 // regs_per_warp) // num_warps
    by_smem = (228 * 1024) // (shared + 1024)
    return max(0, min(by_regs, 64 // num_warps, by_smem, 32))


class Timer:
    """Per-unit time of a launch sequence in a CUDA graph, rotating through one pool."""

    def __init__(self, pool: torch.Tensor, replays: int, min_units: int):
        self.pool, self.replays, self.min_units = pool, replays, min_units

    def _graph(self, launch, unit: int, units: int) -> torch.cuda.CUDAGraph:
        regions = self.pool.numel() // unit
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(units):
                r = i % regions
                launch(self.pool[r * unit:(r + 1) * unit])
        return graph

    def _median_ms(self, graph: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def unit_us(self, launch, unit: int) -> float:
        """Microseconds a unit: launch(region of `unit` int32), captured R and 2R times."""
        r = max(self.min_units, self.pool.numel() // unit)
        t1 = self._median_ms(self._graph(launch, unit, r))
        t2 = self._median_ms(self._graph(launch, unit, 2 * r))
        return (t2 - t1) / r * 1000.0


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got.long().cpu(), want.long().cpu()):
        bad = int((got.long().cpu() != want.long().cpu()).sum())
        sys.exit(f"bench_boundary: {name} gives wrong sums ({bad} of {want.numel()} programs)")


def parse_list(text: str, cast=int) -> list:
    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"bench_boundary: cannot read the list {text!r}")
    if not values or any(v <= 0 for v in values):
        sys.exit(f"bench_boundary: the list {text!r} needs positive numbers")
    return values


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def time_launches(timer: Timer, out: torch.Tensor, sizes: list[int], block: int, warps: int) -> dict[int, float]:
    """1. Microseconds of one launch over s MB, for each size (checked first)."""
    one = {}
    for s in sizes:
        elems = s * MB // 4
        src = timer.pool[:elems]
        stream(src, out, block, warps=warps)
        check(f"one launch of {s} MB", out[:elems // block], src.view(-1, block).sum(1))
        one[s] = timer.unit_us(lambda region: stream(region, out, block, warps=warps), elems)
    return one


def time_dependent_pair(timer: Timer, out_a: torch.Tensor, out_b: torch.Tensor, s: int, block: int,
                        warps: int, pdl: bool = False) -> float:
    """2. Microseconds of launch A over S then launch B over the next S, B adding a value A wrote
    (with `pdl`, both programmatic dependent launches: each loads its tiles before it waits)."""
    elems, n = s * MB // 4, s * MB // 4 // block

    def pair(region):
        stream(region[:elems], out_a, block, warps=warps, pdl=pdl)
        stream(region[elems:], out_b, block, prev=out_a[:n], warps=warps, pdl=pdl)

    src = timer.pool[:2 * elems]
    out_a[:n] = POISON
    pair(src)
    want_a = src[:elems].view(-1, block).sum(1)
    check(f"A;B of {s} MB{' (dependent launches)' if pdl else ''}", out_b[:n],
          src[elems:].view(-1, block).sum(1) + shifted(want_a))
    return timer.unit_us(pair, 2 * elems)


def time_persistent(timer: Timer, out_a: torch.Tensor, out_b: torch.Tensor, s: int, sms: int, k: int,
                    block: int, warps: int, barrier: bool, poll_load: bool, max_spin: int,
                    prefetch: bool = False) -> float | str:
    """3. Microseconds of the persistent kernel over 2S on SMs x k programs, or why it was not timed."""
    elems, grid = s * MB // 4, sms * k
    src = timer.pool[:2 * elems]
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    err = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    try:  # compile without launching, to read the registers a thread
        kernel = _persistent_kernel.warmup(src, out_a, out_b, counter, err, elems // block, max_spin, BLOCK=block,
                                           BARRIER=barrier, POLL_LOAD=poll_load, PREFETCH=prefetch,
                                           num_warps=warps, grid=(1,))
        kernel._init_handles()
        fit = blocks_per_sm(kernel.n_regs, warps, kernel.metadata.shared)
    except Exception:  # noqa: BLE001 - occupancy unknown (the interpreter): one program an SM always fits
        fit = 1
    if k > fit:
        return f"k>{fit}"

    def launch(region):
        persistent(region, out_a, out_b, counter, err, grid, block, barrier, poll_load, max_spin, warps, prefetch)

    out_a[:grid] = POISON
    launch(src)
    if int(err.item()):
        return "barrier timed out"
    sums_a = program_sums(src[:elems], block, grid)
    sums_b = program_sums(src[elems:], block, grid) + (shifted(sums_a) if barrier else 0)
    name = f"persistent {s} MB k={k} barrier={barrier} poll_load={poll_load} prefetch={prefetch}"
    check(name + " (phase A)", out_a[:grid], sums_a)
    check(name + " (phase B)", out_b[:grid], sums_b)
    t = timer.unit_us(launch, 2 * elems)
    if int(err.item()) or int(counter.item()) % grid:
        return "barrier timed out"
    return t


def print_table(rows: list) -> None:
    def us(v):
        return f"{v:.2f}" if isinstance(v, float) else v

    def cost(cells, name):
        both = cells["none"], cells[name]
        return f"{both[1] - both[0]:.2f}" if all(isinstance(v, float) for v in both) else "-"

    print("\nboundary = A;B - one 2S launch; barrier cost = persistent with barrier - without (us)\n")
    print("| S MB | one S | one 2S | A;B | boundary | k | grid | persistent 2S | +barrier, acquire poll | cost "
          "| +barrier, volatile poll | cost | +barrier, B's first tile before it | cost | A;B dependent launches "
          "| boundary |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s, t1, t2, ab, k, grid, cells, ab_pdl in rows:
        polls = " | ".join(f"{us(cells[name])} | {cost(cells, name)}" for name in ("acquire", "volatile", "prefetch"))
        print(f"| {s} | {t1:.2f} | {t2:.2f} | {ab:.2f} | {ab - t2:.2f} | {k} | {grid} | {us(cells['none'])} "
              f"| {polls} | {ab_pdl:.2f} | {ab_pdl - t2:.2f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="2,4,8,16,32,64", help="sizes of one launch for the bandwidth line")
    parser.add_argument("--boundary-mb", default="2,8,32", help="phase sizes S for the boundary and barrier")
    parser.add_argument("--ks", default="1,2,4", help="persistent programs an SM (capped by occupancy)")
    parser.add_argument("--pool-mb", type=int, default=256, help="buffer the units rotate through")
    parser.add_argument("--block-kb", type=int, default=8, help="tile of one program of a launch")
    parser.add_argument("--persistent-block-kb", type=int, default=16, help="tile of one loop step, persistent")
    parser.add_argument("--warps", type=int, default=4, help="num_warps of every kernel")
    parser.add_argument("--replays", type=int, default=15, help="timed replays of each graph (median)")
    parser.add_argument("--min-units", type=int, default=16, help="least units in a graph")
    parser.add_argument("--max-spin", type=int, default=1 << 20, help="polls before a barrier gives up")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_boundary: needs a CUDA GPU (torch.cuda.is_available() is False)")
    sizes, boundary, ks = (sorted(set(parse_list(x))) for x in (args.sizes_mb, args.boundary_mb, args.ks))
    block, pblock = args.block_kb * 1024 // 4, args.persistent_block_kb * 1024 // 4
    for name, elems in (("--block-kb", block), ("--persistent-block-kb", pblock)):
        if elems < 32 * args.warps or elems & (elems - 1):
            sys.exit(f"bench_boundary: {name} must give a power-of-two tile of at least {32 * args.warps} int32")
    largest = max(max(sizes), 2 * max(boundary))
    if args.pool_mb < largest or any((s * MB // 4) % max(block, pblock) for s in sizes + boundary):
        sys.exit(f"bench_boundary: --pool-mb must hold {largest} MB and every size a whole number of tiles")
    if min(args.replays, args.min_units, args.max_spin) < 1:
        sys.exit("bench_boundary: --replays, --min-units and --max-spin must be positive")

    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"{props.name}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}, "
          f"pool {args.pool_mb} MB, tiles {args.block_kb} KB (launch) / {args.persistent_block_kb} KB (persistent), "
          f"{args.warps} warps, median of {args.replays} replays")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    pool = torch.randint(0, 4, (args.pool_mb * MB // 4,), dtype=torch.int32, device=DEVICE, generator=gen)
    timer = Timer(pool, args.replays, args.min_units)
    w = args.warps
    most = max(largest * MB // 4 // min(block, pblock), sms * max(ks))
    out_a = torch.empty(most, dtype=torch.int32, device=DEVICE)
    out_b = torch.empty(most, dtype=torch.int32, device=DEVICE)

    one = time_launches(timer, out_a, sorted(set(sizes) | set(boundary) | {2 * s for s in boundary}), block, w)
    print("\n| MB | us | GB/s |\n|---:|---:|---:|")
    for s in sizes:
        print(f"| {s} | {one[s]:.2f} | {s * MB / one[s] / 1e3 if one[s] > 0 else float('nan'):.0f} |")
    if len(sizes) > 1:  # distinct sizes: the line is defined
        intercept, slope = fit_line([s * MB for s in sizes], [one[s] for s in sizes])
        bandwidth = f"{1e-3 / slope:.0f}" if slope > 0 else "nan"
        print(f"\nfit over {','.join(map(str, sizes))} MB: t = {intercept:.2f} us + bytes / {bandwidth} GB/s")

    rows = []
    for s in boundary:
        ab = time_dependent_pair(timer, out_a, out_b, s, block, w)
        ab_pdl = time_dependent_pair(timer, out_a, out_b, s, block, w, pdl=True)
        for k in ks:
            cells = {name: time_persistent(timer, out_a, out_b, s, sms, k, pblock, w, barrier, poll_load,
                                           args.max_spin, prefetch)
                     for name, barrier, poll_load, prefetch in (("none", False, False, False),
                                                                ("acquire", True, False, False),
                                                                ("volatile", True, True, False),
                                                                ("prefetch", True, False, True))}
            rows.append((s, one[s], one[2 * s], ab, k, sms * k, cells, ab_pdl))
    print_table(rows)


if __name__ == "__main__":
    main()
