"""A decode layer's matvecs as a chain of launches against one persistent kernel with grid barriers: the
question bench_boundary asks on copies, asked on real phases (a prototype; the engine does not use it).

    python3 examples/benchmarks/bench_persistent_chain.py [--layers 8] [--ks 1,2] [--rows 4] [--chunk 512]
                                                          [--warps 4] [--stages 0,4] [--replays 15]

Weights: int8 with a float32 scale per row (the bytes of fp8_e4m3 or int8), random, `--layers` layers of
llama-8b's shapes, each layer's its own, so that a step reads them from DRAM (8 layers: 1.7 GB). A layer's
phases: qkv (6144x4096), o (4096x4096, over the first 4096 of qkv's output: the attention left out),
gate/up (28672x4096, SiLU(gate) * up -> 14336), down (4096x14336, into the next layer's input). Every path
runs the same program code a phase (`_phase`: BN rows a row block over K in chunks, row blocks dealt out
round-robin, float32 sums, bf16 between phases):

1. launches: one launch a phase (4 a layer, one row block a program), all the layers in one CUDA graph;
2. persistent: one launch of SMs x k programs for all the layers, a grid barrier between phases
   (bench_boundary's: an acq_rel arrival, acquire polls; a poll gives up after --max-spin tries and sets
   an error flag, reported instead of a hang; k is capped by the kernel's occupancy so all programs are
   resident);
3. persistent + prefetch: as 2, each program asking L2 for its first row block of the next phase
   (cp.async.bulk.prefetch.L2, one thread) between its arrival at the barrier and its wait.

With --stages S > 0 each path runs the phase as `_phase_flat` instead: the same sums, a program's row
blocks and their steps one flat loop that Triton software-pipelines over S steps, so its weight loads stay
in flight across row blocks (the unpipelined phase waits on each step's loads in turn: with one or two
programs an SM, too few bytes in flight, which is what held the persistent paths back in Round 10). The
launches then also run with at most SMs x k programs a launch (k of --ks), each streaming several blocks.

Prints microseconds a layer (CUDA-graph replays, median of --replays) and the weight bytes a second against
a device-to-device copy, after checking each path's output against torch on a chain of two layers of their
own (the same int8 weights, float32 math, bf16 between phases; over more random layers without norms, an ulp
of difference between phases grows to several percent on every path alike).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import time_graph  # noqa: E402
from bench_boundary import _grid_arrive, _grid_wait, blocks_per_sm  # noqa: E402

from thin.runtime.kernels.norm import l2_prefetch  # noqa: E402

LLAMA_8B = (4096, 6144, 14336)  # hidden, qkv rows, FFN channels


@triton.jit
def _phase(w_ptr, s_ptr, x_ptr, y_ptr, N, K, pid, grid, GLU: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y = (W x) * scale for row blocks pid, pid + grid, ... of N rows (BN a block), K a multiple of BK;
    GLU: W holds 2N rows (gate, then up) and y = SiLU(gate) * up. x is read past L1 (.cg): in a
    persistent kernel other programs wrote it before the barrier."""
    rows = tl.arange(0, BN)
    cols = tl.arange(0, BK)
    for rb in range(pid, tl.cdiv(N, BN), grid):
        r = rb * BN + rows
        ok = r < N
        acc = tl.zeros([BN], dtype=tl.float32)
        acc_up = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = tl.load(x_ptr + k0 + cols, cache_modifier=".cg").to(tl.float32)
            w = tl.load(w_ptr + r[:, None].to(tl.int64) * K + k0 + cols[None, :], mask=ok[:, None], other=0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            if GLU:
                u = tl.load(w_ptr + (r + N)[:, None].to(tl.int64) * K + k0 + cols[None, :], mask=ok[:, None],
                            other=0)
                acc_up += tl.sum(u.to(tl.float32) * x[None, :], axis=1)
        _store_rows(acc, acc_up, s_ptr, y_ptr, r, N, GLU)


@triton.jit
def _store_rows(acc, acc_up, s_ptr, y_ptr, r, N, GLU: tl.constexpr):
    """A row block's epilogue: y[r] = acc * scale[r], or with GLU SiLU(that) * acc_up * scale[N + r]."""
    ok = r < N
    out = acc * tl.load(s_ptr + r, mask=ok, other=0.0)
    if GLU:
        up = acc_up * tl.load(s_ptr + N + r, mask=ok, other=0.0)
        out = out / (1.0 + tl.exp(-out)) * up
    tl.store(y_ptr + r, out.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _phase_flat(w_ptr, s_ptr, x_ptr, y_ptr, N, K, pid, grid, GLU: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr):
    """_phase's sums (N a multiple of BN), its row blocks' steps as one flat loop software-pipelined by
    Triton over STAGES steps (cp.async copies of each step's weight tile into shared memory, STAGES - 1
    in flight while one is summed; across row blocks too, so a program's loads never stop in a phase)."""
    rows = tl.arange(0, BN)
    cols = tl.arange(0, BK)
    steps = K // BK
    mine = tl.cdiv(tl.cdiv(N, BN) - pid, grid)  # row blocks pid, pid + grid, ...
    acc = tl.zeros([BN], dtype=tl.float32)
    acc_up = tl.zeros([BN], dtype=tl.float32)
    if TMA:  # the tiles as bulk tensor copies (sm_90's TMA): one thread issues a step's tile
        desc = tl.make_tensor_descriptor(w_ptr, shape=[2 * N if GLU else N, K], strides=[K, 1],
                                         block_shape=[BN, BK])
    for t in tl.range(0, mine * steps, num_stages=STAGES):
        r0 = (pid + (t // steps) * grid) * BN
        r = r0 + rows
        k0 = (t % steps) * BK
        x = tl.load(x_ptr + k0 + cols, cache_modifier=".cg").to(tl.float32)
        if TMA:  # noqa: SIM108  (constexpr branches: only one is compiled)
            w = desc.load([r0, k0])
        else:
            w = tl.load(w_ptr + r[:, None].to(tl.int64) * K + k0 + cols[None, :])
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if GLU:
            if TMA:
                u = desc.load([r0 + N, k0])
            else:
                u = tl.load(w_ptr + (r + N)[:, None].to(tl.int64) * K + k0 + cols[None, :])
            acc_up += tl.sum(u.to(tl.float32) * x[None, :], axis=1)
        if t % steps == steps - 1:
            _store_rows(acc, acc_up, s_ptr, y_ptr, r, N, GLU)
            acc = tl.zeros([BN], dtype=tl.float32)
            acc_up = tl.zeros([BN], dtype=tl.float32)


@triton.jit
def _any_phase(w_ptr, s_ptr, x_ptr, y_ptr, N, K, pid, grid, GLU: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               STAGES: tl.constexpr, TMA: tl.constexpr):
    """_phase (STAGES 0) or _phase_flat."""
    if STAGES == 0:
        _phase(w_ptr, s_ptr, x_ptr, y_ptr, N, K, pid, grid, GLU, BN, BK)
    else:
        _phase_flat(w_ptr, s_ptr, x_ptr, y_ptr, N, K, pid, grid, GLU, BN, BK, STAGES, TMA)


@triton.jit
def _phase_kernel(w_ptr, s_ptr, x_ptr, y_ptr, N, K, GLU: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  STAGES: tl.constexpr, TMA: tl.constexpr):
    """One phase as a launch of its own: its row blocks dealt out over the programs."""
    _any_phase(w_ptr, s_ptr, x_ptr, y_ptr, N, K, tl.program_id(0), tl.num_programs(0), GLU, BN, BK, STAGES, TMA)


@triton.jit
def _between(counter_ptr, err_ptr, max_spin, w_next, K_next, pid, BN: tl.constexpr, BARRIER: tl.constexpr,
             PREFETCH: tl.constexpr):
    """The grid barrier between two phases; with PREFETCH the program's first row block of the next
    phase's weight (BN rows of K_next int8) is asked of L2 after its arrival, before its wait."""
    if BARRIER:
        seen, target = _grid_arrive(counter_ptr)
        if PREFETCH:  # one thread's cp.async.bulk.prefetch.L2 (sm_90): returns at once
            l2_prefetch(w_next + pid.to(tl.int64) * BN * K_next, BN * K_next)
        _grid_wait(counter_ptr, err_ptr, seen, target, max_spin, False)


@triton.jit
def _chain_kernel(wq_ptr, sq_ptr, wo_ptr, so_ptr, wg_ptr, sg_ptr, wd_ptr, sd_ptr, x_ptr, q_ptr, a_ptr, h_ptr,
                  counter_ptr, err_ptr, layers, H, NQ, F, max_spin, BN: tl.constexpr, BK: tl.constexpr,
                  BARRIER: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
                  TMA: tl.constexpr):
    """Every layer's four phases in one launch (x: the layer's input and the last one's output)."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    wq, wo, wg, wd = wq_ptr, wo_ptr, wg_ptr, wd_ptr  # this layer's weights (pointers moved a layer at a time)
    sq, so, sg, sd = sq_ptr, so_ptr, sg_ptr, sd_ptr
    for layer in range(0, layers):
        _any_phase(wq, sq, x_ptr, q_ptr, NQ, H, pid, grid, False, BN, BK, STAGES, TMA)
        _between(counter_ptr, err_ptr, max_spin, wo, H, pid, BN, BARRIER, PREFETCH)
        _any_phase(wo, so, q_ptr, a_ptr, H, H, pid, grid, False, BN, BK, STAGES, TMA)
        _between(counter_ptr, err_ptr, max_spin, wg, H, pid, BN, BARRIER, PREFETCH)
        _any_phase(wg, sg, a_ptr, h_ptr, F, H, pid, grid, True, BN, BK, STAGES, TMA)
        _between(counter_ptr, err_ptr, max_spin, wd, F, pid, BN, BARRIER, PREFETCH)
        _any_phase(wd, sd, h_ptr, x_ptr, H, F, pid, grid, False, BN, BK, STAGES, TMA)
        wq, wo, wg, wd = wq + NQ * H, wo + H * H, wg + 2 * F * H, wd + H * F
        sq, so, sg, sd = sq + NQ, so + H, sg + 2 * F, sd + H
        # the next layer's qkv weight (after the last layer the first's: an address inside the weights)
        _between(counter_ptr, err_ptr, max_spin, tl.where(layer + 1 < layers, wq, wq_ptr), H, pid, BN, BARRIER,
                 PREFETCH)


class Chain:
    """Random int8 weights and float32 row scales of `layers` layers of shape (H, NQ, F), the activation
    buffers (`dtype`: bf16 as in a decode step; the tests take float32, which Triton's interpreter does not
    round), and the two ways of running them."""

    def __init__(self, layers: int, H: int, NQ: int, F: int, device, seed: int = 0, dtype=torch.bfloat16):
        gen = torch.Generator(device=device).manual_seed(seed)

        def weight(n, k):
            w = torch.randint(-127, 128, (layers, n, k), dtype=torch.int8, device=device, generator=gen)
            # outputs of about unit size for inputs of unit size
            s = torch.full((layers, n), 1.0 / (73.0 * k ** 0.5), device=device)
            return w, s * (0.5 + torch.rand(layers, n, device=device, generator=gen))

        self.layers, self.H, self.NQ, self.F = layers, H, NQ, F
        self.wq, self.sq = weight(NQ, H)
        self.wo, self.so = weight(H, H)
        self.wg, self.sg = weight(2 * F, H)
        self.wd, self.sd = weight(H, F)
        self.dtype = dtype
        self.x0 = torch.randn(H, device=device, generator=gen).to(dtype)
        self.x = self.x0.clone()
        self.q = torch.empty(NQ, dtype=dtype, device=device)
        self.a = torch.empty(H, dtype=dtype, device=device)
        self.h = torch.empty(F, dtype=dtype, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)

    def weight_bytes(self) -> int:
        return sum(w.numel() + 4 * s.numel() for w, s in ((self.wq, self.sq), (self.wo, self.so),
                                                         (self.wg, self.sg), (self.wd, self.sd)))

    def launches(self, bn: int, bk: int, warps: int, stages: int = 0, grid: int | None = None,
                 tma: bool = False) -> None:
        """Path 1: four launches a layer, each of one program a row block or (`grid`) at most `grid`
        programs dealing the row blocks out; `stages` > 0: the pipelined phase (_phase_flat)."""
        for layer in range(self.layers):
            for w, s, x, y, n, k, glu in ((self.wq, self.sq, self.x, self.q, self.NQ, self.H, False),
                                         (self.wo, self.so, self.q, self.a, self.H, self.H, False),
                                         (self.wg, self.sg, self.a, self.h, self.F, self.H, True),
                                         (self.wd, self.sd, self.h, self.x, self.H, self.F, False)):
                programs = triton.cdiv(n, bn) if grid is None else min(grid, triton.cdiv(n, bn))
                _phase_kernel[(programs,)](w[layer], s[layer], x, y, n, k, GLU=glu, BN=bn, BK=bk, STAGES=stages,
                                           TMA=tma, num_warps=warps)

    def persistent(self, grid: int, bn: int, bk: int, warps: int, barrier: bool = True, prefetch: bool = False,
                   max_spin: int = 1 << 20, stages: int = 0, tma: bool = False) -> None:
        """Paths 2 and 3: one launch of `grid` programs (`stages`: as in launches)."""
        _chain_kernel[(grid,)](self.wq, self.sq, self.wo, self.so, self.wg, self.sg, self.wd, self.sd, self.x,
                               self.q, self.a, self.h, self.counter, self.err, self.layers, self.H, self.NQ, self.F,
                               max_spin, BN=bn, BK=bk, BARRIER=barrier, PREFETCH=prefetch, STAGES=stages,
                               TMA=tma, num_warps=warps)

    def reference(self) -> torch.Tensor:
        """The last layer's output from x0, in torch (float32 sums, `dtype` between phases)."""
        x = self.x0.float()
        bf = self.dtype
        for i in range(self.layers):
            q = ((self.wq[i].float() @ x) * self.sq[i]).to(bf).float()
            a = ((self.wo[i].float() @ q[:self.H]) * self.so[i]).to(bf).float()
            gu = (self.wg[i].float() @ a) * self.sg[i]
            h = (torch.nn.functional.silu(gu[:self.F]) * gu[self.F:]).to(bf).float()
            x = ((self.wd[i].float() @ h) * self.sd[i]).to(bf).float()
        return x


def use_scratch_allocator() -> None:
    """Give Triton the global scratch its in-kernel tensor descriptors (--tma) are written to."""
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda" if torch.cuda.is_available() else "cpu"))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def occupancy(chain: Chain, bn: int, bk: int, warps: int, prefetch: bool, stages: int = 0, tma: bool = False) -> int:
    """Programs of the persistent kernel an SM holds at once (from its compiled registers and shared
    memory)."""
    kernel = _chain_kernel.warmup(chain.wq, chain.sq, chain.wo, chain.so, chain.wg, chain.sg, chain.wd, chain.sd,
                                  chain.x, chain.q, chain.a, chain.h, chain.counter, chain.err, chain.layers, chain.H,
                                  chain.NQ, chain.F, 1, BN=bn, BK=bk, BARRIER=True, PREFETCH=prefetch,
                                  STAGES=stages, TMA=tma, num_warps=warps, grid=(1,))
    kernel._init_handles()
    return blocks_per_sm(kernel.n_regs, warps, kernel.metadata.shared)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="layers, each with its own weights")
    parser.add_argument("--ks", default="1,2", help="persistent programs an SM (capped by occupancy)")
    parser.add_argument("--rows", type=int, default=4, help="rows a row block (BN)")
    parser.add_argument("--chunk", type=int, default=512, help="columns a loop step (BK)")
    parser.add_argument("--warps", type=int, default=4, help="num_warps of every kernel")
    parser.add_argument("--stages", default="0",
                        help="0: each step's loads waited on in turn; S > 0: the flat loop pipelined over S steps")
    parser.add_argument("--tma", action="store_true",
                        help="the pipelined phases load their tiles as bulk tensor copies (--chunk <= 256)")
    parser.add_argument("--replays", type=int, default=15, help="timed replays (median)")
    parser.add_argument("--max-spin", type=int, default=1 << 20, help="polls before a barrier gives up")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_persistent_chain needs a CUDA GPU", file=sys.stderr)
        return 2
    H, NQ, F = LLAMA_8B
    bn, bk, warps = args.rows, args.chunk, args.warps
    if bn < 1 or bn & (bn - 1) or bk < 16 or bk & (bk - 1) or H % bk or F % bk or args.layers < 1:
        print("--rows and --chunk must be powers of two (--chunk >= 16 and dividing 4096 and 14336), --layers >= 1",
              file=sys.stderr)
        return 2
    if args.tma and bk > 256:
        print("--tma needs --chunk <= 256 (a bulk tensor copy's box is at most 256 elements a side)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    from thin.runtime.bench import copy_bandwidth

    use_scratch_allocator()

    chain = Chain(args.layers, H, NQ, F, dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bandwidth = copy_bandwidth(dev)
    layer_bytes = chain.weight_bytes() / args.layers
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, triton {triton.__version__}; {args.layers} layers of llama-8b "
          f"matvecs, int8 + row scales, {layer_bytes / 1e6:.1f} MB a layer; BN {bn}, BK {bk}, {warps} warps; "
          f"copy {bandwidth / 1e9:.0f} GB/s")
    # Checked on two layers of their own: over --layers random layers without norms an ulp of bf16
    # between phases (torch sums in another order) grows to several percent on every path alike.
    probe = Chain(2, H, NQ, F, dev, seed=1)
    want = probe.reference()
    rows, bad = [], []

    def measure(name: str, run) -> None:
        for c in (probe, chain):
            c.x.copy_(c.x0)
            c.err.zero_()
        run(probe)
        torch.cuda.synchronize()
        err = rel_err(probe.x, want)
        if int(probe.err.item()):
            rows.append((name, "barrier timed out", "", ""))
            return
        if not err < 2e-2:  # bf16 roundings between phases may differ by an ulp; a race gives ~1
            bad.append(name)
        run = functools.partial(run, chain)
        us = time_graph(run, launches=1, replays=args.replays) / args.layers
        rate = layer_bytes / us * 1e6  # bytes a second
        rows.append((name, f"{us:.2f}", f"{rate / 1e9:.0f} ({100 * rate / bandwidth:.0f}%)", f"{err:.1e}"))

    ks = sorted({int(x) for x in args.ks.split(",")})
    for stages in sorted({int(x) for x in args.stages.split(",")}):
        tma = args.tma and stages > 0
        tag = f", pipelined over {stages} steps{' (TMA)' if tma else ''}" if stages else ""
        measure(f"launches (4 a layer){tag}", lambda c, st=stages, tm=tma: c.launches(bn, bk, warps, st, tma=tm))
        for k in ks if stages else ():
            measure(f"launches (4 a layer) of at most {sms} x {k} programs{tag}",
                    lambda c, k=k, st=stages, tm=tma: c.launches(bn, bk, warps, st, grid=sms * k, tma=tm))
        for k in ks:
            for prefetch in (False, True):
                name = f"persistent, {sms} x {k} programs{', L2 prefetch at each barrier' if prefetch else ''}{tag}"
                fit = occupancy(chain, bn, bk, warps, prefetch, stages, tma)
                if k > fit:
                    rows.append((name, f"k > {fit} (occupancy)", "", ""))
                    continue
                measure(name, lambda c, k=k, p=prefetch, st=stages, tm=tma: c.persistent(
                    sms * k, bn, bk, warps, prefetch=p, max_spin=args.max_spin, stages=st, tma=tm))
    print("\n| path | us a layer | weight GB/s (of copy) | rel err vs torch |\n| --- | ---: | ---: | ---: |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if bad:
        print(f"FAILED (output off torch's): {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
