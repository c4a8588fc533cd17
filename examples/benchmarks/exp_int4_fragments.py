"""Experiment: a symmetric int4 (group 128) matvec whose packed words are the tensor cores' A fragments.

    python3 examples/benchmarks/exp_int4_fragments.py check            # CPU (TRITON_INTERPRET=1) or GPU
    python3 examples/benchmarks/exp_int4_fragments.py sass [SPLIT_K WARPS TILES AHEAD UNROLL]   # sm_90, no GPU
    python3 examples/benchmarks/exp_int4_fragments.py bench [qkv,o,gate_up,down]    # GPU: against the shipped matvec

Why (BENCHMARKS Round 19): with the bf16-pair arithmetic cut to a few integer adds a word (wrong sums, timing
only) llama-8b's int4 step ran 688.5 tok/s against 629.2, so the loop's 2.1-2.6 instructions a weight cost
about 9% of the step. The pairs are at their floor (a logic op, a zero-point FMA and a product FMA a pair);
`mma.sync.m16n8k16` takes the codes as they stand (bf16 subnormals, pairs.py's trick) and sums in float32,
so the zero point can come off as 8 * sum(x) (no per-code FMA) without the bf16 cancellation that sank
Round 16's "linear pairs". Round 17's tensor-core variant kept the chunk layout (a diagonal trick, 1.5-1.6
instructions a weight); here the layout is re-packed so one 32-bit word of a lane is its A fragment:

    lane l = 4g + t of a warp holds, for a 16-row x 16-column slice of its row tile, the word whose nibbles
    0, 4, 2, 6 are row g's columns 2t, 2t+1, 2t+8, 2t+9 and nibbles 1, 5, 3, 7 row g+8's, so
    w & 0x000F000F, (w >> 8) & 0x000F000F  = a0, a2 (row g, units of 2^-133)
    w & 0x00F000F0, (w >> 8) & 0x00F000F0  = a1, a3 (row g + 8, units of 2^-129)

and 4 consecutive slices (64 columns) of a lane are one 16-byte load. x comes pre-scaled by 2^100 (products
stay normal) and permuted so that lane t's B fragments of a 64-column step are 32 contiguous bytes. Every
column of B is x, so D's columns are equal and each lane holds its rows g and g + 8. Per word: one shift,
four logic ops and one mma, against 13 for the pairs; the zero point comes off once a group, from 8 * sum(x)
that `x_fragments` computes with the fragments (in a decode step the kernel before would write both).

Status (BENCHMARKS Round 19, one H200): correct on the GPU (`check`: 9e-8 relative against the format's decode;
`bench`: 4.8e-3 against the shipped bf16 pairs, their own rounding), 1.05 instructions a weight in the loop
(`sass`), and no faster yet in its first form (one row tile a warp, each group's words loaded in the step that
uses them): at its best split qkv 6.29 us against 6.26 shipped, gate/up 18.80 against 18.87, down 14.57 against
12.68. The kernel now also takes MT = 2 row tiles a warp (two independent mma chains sharing the B fragments) and
AHEAD = 1 (the next group's words and x loaded before this group's mma; unrolled by two, still 1.05 instructions
a weight on sm_90): checked on the CPU, not yet timed on a GPU (`bench` sweeps them).
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

from thin.runtime.kernels.pairs import HIGH_NIBBLES as ROW_H  # w & ROW_H: row g + 8's pair
from thin.runtime.kernels.pairs import LOW_NIBBLES as ROW_G  # w & ROW_G: row g's pair
from thin.runtime.kernels.pairs import _high, _low  # a bf16 pair's halves as float32


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, d, ASM: tl.constexpr):
    """d + this lane's D fragment of A @ B for one 16x16 slice (A: this lane's fragment registers, bf16
    pairs; B: every column x, this lane's pairs b0 = (x_2t, x_2t+1), b1 = (x_2t+8, x_2t+9)); d = (dg, dg2,
    dh, dh2): rows g and g + 8, columns 2t and 2t + 1, equal since B's columns are. ASM: one mma.sync, its
    four accumulators carried as they are (no moves into its operand registers). Otherwise the lane's own
    four products and the sum over the four lanes of its quad (plain Triton, the interpreter's)."""
    dg, dg2, dh, dh2 = d
    if ASM:
        dg, dg2, dh, dh2 = tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
            "{$10,$11,$12,$13};", "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3",
            [a0, a1, a2, a3, b0, b1, dg, dg2, dh, dh2], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)
    else:
        pg = _low(a0) * _low(b0) + _high(a0) * _high(b0) + _low(a2) * _low(b1) + _high(a2) * _high(b1)
        ph = _low(a1) * _low(b0) + _high(a1) * _high(b0) + _low(a3) * _low(b1) + _high(a3) * _high(b1)
        lanes: tl.constexpr = pg.shape[0]
        sg = tl.sum(tl.reshape(pg, [lanes // 4, 4]), axis=1)
        sh = tl.sum(tl.reshape(ph, [lanes // 4, 4]), axis=1)
        dg += tl.reshape(tl.broadcast_to(sg[:, None], [lanes // 4, 4]), [lanes])
        dh += tl.reshape(tl.broadcast_to(sh[:, None], [lanes // 4, 4]), [lanes])
        dg2, dh2 = dg, dh
    return dg, dg2, dh, dh2


@triton.jit
def _group(w_lo, w_hi, xa_lo, xb_lo, xa_hi, xb_hi, ASM: tl.constexpr):
    """One row tile's D fragment over one group (128 columns: 8 slices, 8 mma): w_lo / w_hi [L, 4] a lane's words
    of the group's two steps, xa / xb [L, 4] its B fragments of each step's slices 0, 1 and 2, 3."""
    zero = tl.zeros([w_lo.shape[0]], dtype=tl.float32)
    d = (zero, zero, zero, zero)
    for half in tl.static_range(2):
        words = w_lo if half == 0 else w_hi
        xa = xa_lo if half == 0 else xa_hi
        xb = xb_lo if half == 0 else xb_hi
        w02, w13 = tl.split(tl.reshape(words, [words.shape[0], 2, 2]))  # slices (0, 2), (1, 3)
        a0s, a1s = tl.split(tl.reshape(xa, [words.shape[0], 2, 2]))  # b0s, b1s of slices 0, 1
        c0s, c1s = tl.split(tl.reshape(xb, [words.shape[0], 2, 2]))  # of slices 2, 3
        for j in tl.static_range(4):
            w = tl.split(w02 if j % 2 == 0 else w13)[j // 2]
            b0 = tl.split(a0s if j < 2 else c0s)[j % 2]
            b1 = tl.split(a1s if j < 2 else c1s)[j % 2]
            v = w >> 8
            d = _mma(w & ROW_G, w & ROW_H, v & ROW_G, v & ROW_H, b0, b1, d, ASM)
    return d


@triton.jit
def _scaled(acc_g, acc_h, d, z, s_ptrs, groups: tl.constexpr):
    """acc + the group's sums of rows g and g + 8 with the zero point off (z: 8 * sum(x) of the group) and scaled."""
    acc_g += (d[0] - z * 1.1641532182693481e-10) * tl.load(s_ptrs).to(tl.float32)  # 2^-33
    acc_h += (d[2] - z * 1.862645149230957e-09) * tl.load(s_ptrs + 8 * groups).to(tl.float32)  # 2^-29
    return acc_g, acc_h


@triton.jit
def _frag_matvec(w_ptr, s_ptr, x_ptr, z_ptr, out_ptr, N, K: tl.constexpr, SPLIT_K: tl.constexpr, NW: tl.constexpr,
                 ASM: tl.constexpr, MT: tl.constexpr = 1, AHEAD: tl.constexpr = 0, UNROLL: tl.constexpr = 1):
    """Program (i, s): MT row tiles a warp (16 rows each; NW warps) over columns s*SPLIT_K .. + SPLIT_K; out
    [splits, N] float32 partial sums. w_ptr: int32 fragment words [N/16, K/64, 32, 4]; s_ptr: float16 scales
    [N, K/128]; x_ptr: int32 bf16 pairs of x * 2^100, [K/64, 4, 4, 2], z_ptr: 8 * sum(x) a group (x_fragments).
    AHEAD: the next group's words and x are loaded before this group's mma."""
    e = tl.arange(0, 32 * NW)
    if ASM:  # the thread that holds element e: its lane is what the mma reads the registers by
        e = tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [e], dtype=tl.int32, is_pure=True, pack=1)
    tile = (tl.program_id(0) * NW + e // 32) * MT
    lane = e % 32
    g = lane // 4
    t = lane % 4
    row_g = tile * 16 + g
    acc_g = tl.zeros([32 * NW], dtype=tl.float32)
    acc_h = tl.zeros([32 * NW], dtype=tl.float32)
    acc_g1 = tl.zeros([32 * NW], dtype=tl.float32)
    acc_h1 = tl.zeros([32 * NW], dtype=tl.float32)
    j4 = tl.arange(0, 4)
    steps: tl.constexpr = K // 64
    groups: tl.constexpr = K // 128
    count: tl.constexpr = SPLIT_K // 128
    first = tl.program_id(1) * (SPLIT_K // 64)
    # A lane's 16 bytes of fragment words a step (the next row tile's K/64 * 128 words on), and its 2 x 16 bytes
    # of B fragments (the (b0, b1) pairs of the step's 4 slices).
    w_ptrs = w_ptr + ((tile * steps + first) * 32 + lane)[:, None] * 4 + j4[None, :]
    x_ptrs = x_ptr + ((first * 4 + t) * 8)[:, None] + j4[None, :]
    s_ptrs = s_ptr + row_g * groups + tl.program_id(1) * count
    z_ptrs = z_ptr + tl.program_id(1) * count
    TILE: tl.constexpr = steps * 128
    if AHEAD:
        w_lo, w_hi = tl.load(w_ptrs), tl.load(w_ptrs + 128)
        if MT == 2:
            v_lo, v_hi = tl.load(w_ptrs + TILE), tl.load(w_ptrs + TILE + 128)
        xa_lo, xb_lo = tl.load(x_ptrs), tl.load(x_ptrs + 4)
        xa_hi, xb_hi = tl.load(x_ptrs + 32), tl.load(x_ptrs + 36)
    for grp in tl.range(count, loop_unroll_factor=UNROLL):
        if AHEAD:  # this group's, then the next group's (past the last: this group's again, no masks)
            cw_lo, cw_hi, cxa_lo, cxb_lo, cxa_hi, cxb_hi = w_lo, w_hi, xa_lo, xb_lo, xa_hi, xb_hi
            ahead = tl.where(grp + 1 < count, 1, 0)
            w_lo = tl.load(w_ptrs + ahead * 256)
            w_hi = tl.load(w_ptrs + ahead * 256 + 128)
            if MT == 2:
                cv_lo, cv_hi = v_lo, v_hi
                v_lo = tl.load(w_ptrs + TILE + ahead * 256)
                v_hi = tl.load(w_ptrs + TILE + ahead * 256 + 128)
            xa_lo = tl.load(x_ptrs + ahead * 64)
            xb_lo = tl.load(x_ptrs + ahead * 64 + 4)
            xa_hi = tl.load(x_ptrs + ahead * 64 + 32)
            xb_hi = tl.load(x_ptrs + ahead * 64 + 36)
        else:
            cw_lo, cw_hi = tl.load(w_ptrs), tl.load(w_ptrs + 128)
            if MT == 2:
                cv_lo, cv_hi = tl.load(w_ptrs + TILE), tl.load(w_ptrs + TILE + 128)
            cxa_lo, cxb_lo = tl.load(x_ptrs), tl.load(x_ptrs + 4)
            cxa_hi, cxb_hi = tl.load(x_ptrs + 32), tl.load(x_ptrs + 36)
        z = tl.load(z_ptrs + grp)
        d = _group(cw_lo, cw_hi, cxa_lo, cxb_lo, cxa_hi, cxb_hi, ASM)
        acc_g, acc_h = _scaled(acc_g, acc_h, d, z, s_ptrs, groups)
        if MT == 2:  # the second row tile: its own mma chain, the same B fragments
            d1 = _group(cv_lo, cv_hi, cxa_lo, cxb_lo, cxa_hi, cxb_hi, ASM)
            acc_g1, acc_h1 = _scaled(acc_g1, acc_h1, d1, z, s_ptrs + 16 * groups, groups)
        w_ptrs += 256
        x_ptrs += 64
        s_ptrs += 1
    # Units: a code u is u * 2^-133 (row g) or u * 2^-129 (row g + 8), x is x * 2^100.
    base = out_ptr + tl.program_id(1) * N
    tl.store(base + row_g, acc_g * 8589934592.0, mask=(t == 0) & (row_g < N))  # 2^33
    tl.store(base + row_g + 8, acc_h * 536870912.0, mask=(t == 0) & (row_g + 8 < N))  # 2^29
    if MT == 2:
        tl.store(base + row_g + 16, acc_g1 * 8589934592.0, mask=(t == 0) & (row_g + 16 < N))
        tl.store(base + row_g + 24, acc_h1 * 536870912.0, mask=(t == 0) & (row_g + 24 < N))


def repack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> int32 fragment words [N/16, K/64, 32, 4] (see the module docstring)."""
    n, k = codes.shape
    c = codes.to(torch.int64).reshape(n // 16, 2, 8, k // 64, 4, 2, 4, 2)  # tile, half, g, step, slice, hi8, t, pair
    # nibble order in a word: 0 = (g, 2t), 4 = (g, 2t+1), 2 = (g, 2t+8), 6 = (g, 2t+9); 1, 5, 3, 7 the same for g+8
    rows_g, rows_h = c[:, 0], c[:, 1]  # [tile, g, step, slice, hi8, t, pair]
    word = torch.zeros(n // 16, 8, k // 64, 4, 4, dtype=torch.int64, device=codes.device)  # tile, g, step, slice, t
    for hi8 in range(2):
        for pair in range(2):
            shift_g = 4 * (2 * hi8 + 4 * pair)  # nibbles 0, 4 (hi8 = 0) and 2, 6 (hi8 = 1)
            word |= rows_g[:, :, :, :, hi8, :, pair] << shift_g
            word |= rows_h[:, :, :, :, hi8, :, pair] << (shift_g + 4)
    word = word.permute(0, 2, 1, 4, 3).reshape(n // 16, k // 64, 32, 4)  # tile, step, lane = 4g + t, slice
    return ((word + 2**31) % 2**32 - 2**31).to(torch.int32)


def x_fragments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 x [K] -> (int32 [K/64, 4, 4, 2]: x * 2^100 as bf16 pairs, [step, t, slice] lane t's (b0, b1) of that
    slice; float32 [K/128]: 8 * the sum of each group's x, the zero point's term)."""
    k = x.shape[0]
    pairs = (x.float() * 2.0**100).to(torch.bfloat16).view(torch.int32).reshape(k // 64, 4, 2, 4)  # step, slice, h, t
    return pairs.permute(0, 3, 1, 2).contiguous(), 8 * x.float().reshape(-1, 128).sum(1)


def matvec(words, scales, xf, n, k, split_k, nw, asm, mt: int = 1, ahead: int = 0, unroll: int = 1) -> torch.Tensor:
    """The kernel's partial sums [k / split_k, n] (split_k a multiple of 128; n of 16 * nw * mt)."""
    if n % (16 * nw * mt) or split_k % 128 or k % split_k:
        raise ValueError(f"fragments tile n={n} by {16 * nw * mt} rows and k={k} by splits of 128 columns")
    out = torch.empty(k // split_k, n, dtype=torch.float32, device=words.device)
    _frag_matvec[(n // (16 * nw * mt), k // split_k)](words, scales, *xf, out, n, k, split_k, nw, asm, mt, ahead,
                                                      unroll, num_warps=nw)
    return out


def reference(codes, scales, x) -> torch.Tensor:
    w = (codes.float() - 8).reshape(codes.shape[0], -1, 128) * scales.float()[:, :, None]
    return w.reshape(codes.shape) @ x.float()


def relative_error(n, k, split_k, nw, mt, ahead, unroll, device, seed: int = 0) -> float:
    """|kernel - reference| / |reference| on random codes, scales (of both signs) and x: the mma path on a GPU,
    the interpreter twin on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (0.02 * torch.rand(n, k // 128, generator=gen) - 0.01).half()
    x = torch.randn(k, generator=gen).bfloat16()
    want = reference(codes, scales, x)
    xf = tuple(f.to(device) for f in x_fragments(x))
    asm = torch.device(device).type == "cuda"
    got = matvec(repack(codes).to(device), scales.to(device), xf, n, k, split_k, nw, asm, mt, ahead, unroll)
    got = got.sum(0).cpu()
    return ((got - want).norm() / want.norm()).item()


# (n, k, split_k, warps, row tiles a warp, ahead, unroll): the last has an odd count of groups a split.
CASES = [(32, 256, 256, 1, 1, 0, 1), (64, 512, 256, 2, 1, 1, 1), (96, 384, 128, 1, 2, 0, 1),
         (128, 768, 384, 2, 2, 1, 2)]


def check(device: str) -> None:
    for n, k, split_k, nw, mt, ahead, unroll in CASES:
        err = relative_error(n, k, split_k, nw, mt, ahead, unroll, device, seed=n + k)
        print(f"n={n} k={k} split_k={split_k} warps={nw} tiles a warp {mt} ahead {ahead} unroll {unroll}: "
              f"relative error {err:.2e}")
        assert err < 1e-5, err


def bench() -> None:
    from thin.ir import Encoding, Tensor, formats
    from thin.ir.formats.quantized import unpack_bits
    from thin.runtime.linear import make_linear

    sys.path.insert(0, os.path.dirname(__file__))
    from bench_kernels import time_graph

    shapes = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    for name, n, k in [shape for shape in shapes if only is None or shape[0] in only]:
        copies = max(1, min(24, 256 * 2**20 // (n * k // 2)))
        params = formats.get("int4").normalize({})
        ops, frags = [], []
        for _ in range(copies):
            w = 0.02 * torch.randn(n, k, device="cuda")
            raw = formats.encode("int4", w, params)
            record = Tensor("w", "ffn.down", 0, (n, k), Encoding("int4", params), "bf16")
            op = make_linear(record, raw.cpu(), None, torch.device("cuda"), torch.bfloat16)
            ops.append(op)
            parts = formats.get("int4").split(raw, (n, k), params)
            frags.append((repack(unpack_bits(parts["codes"], 4).cuda()), parts["scales"].contiguous().cuda()))
        x = torch.randn(k, device="cuda").bfloat16()
        xf = tuple(f.cuda() for f in x_fragments(x.cpu()))
        want = ops[0](x[None])[0].float()
        shipped = time_graph([lambda op=op, x=x: op.matvec(x) for op in ops] * max(1, 20 // copies))
        print(f"{name}: shipped ({ops[0].config('direct')}) {shipped * 1e6:.2f} us", flush=True)
        for split_k, nw, mt, ahead in [(c, w, m, a) for c in (k // 2, k // 4, k // 8) for w in (1, 2)
                                       for m in (1, 2) for a in (0, 1)]:
            if n % (16 * nw * mt) or split_k % 128:
                continue
            unroll = 2 if ahead else 1  # unrolled by two, the words loaded ahead need no moves (`sass`)
            got = matvec(*frags[0], xf, n, k, split_k, nw, True, mt, ahead, unroll).sum(0)
            err = ((got - want).norm() / want.norm()).item()
            t = time_graph([lambda f=f, a=(xf, n, k, split_k, nw, True, mt, ahead, unroll): matvec(*f, *a)
                            for f in frags]
                           * max(1, 20 // copies))
            print(f"  fragments split_k={split_k} warps={nw} tiles a warp {mt} ahead {ahead}: {t * 1e6:.2f} us, "
                  f"error against shipped {err:.1e}", flush=True)


def sass(n: int = 6144, k: int = 4096, split_k: int = 1024, nw: int = 1, mt: int = 1, ahead: int = 0,
         unroll: int = 1) -> None:
    """Compile the mma path for sm_90 on this machine (sass_budget.py's stand-in driver) and count its loop."""
    import collections

    from triton.runtime import driver

    sys.path.insert(0, os.path.dirname(__file__))
    from sass_budget import _Sm90, disassemble, hot_loop, opcode

    driver.set_active(_Sm90())
    words = torch.zeros(n // 16, k // 64, 32, 4, dtype=torch.int32)
    scales = torch.zeros(n, k // 128, dtype=torch.float16)
    xf = torch.zeros(k // 64, 4, 4, 2, dtype=torch.int32)
    z = torch.zeros(k // 128, dtype=torch.float32)
    out = torch.empty(k // split_k, n, dtype=torch.float32)
    kernel = _frag_matvec.warmup(words, scales, xf, z, out, n, k, split_k, nw, True, mt, ahead, unroll, num_warps=nw,
                                 grid=(n // (16 * nw * mt), k // split_k))
    loop = hot_loop(disassemble(kernel))
    counts = collections.Counter(opcode(t) for t in loop)
    # Each mma is one word a lane: 8 weights (the compiler may unroll the loop over groups).
    print(f"loop {len(loop)} instructions, {len(loop) / (8 * max(1, counts['HMMA'])):.3f} a weight and lane, shared "
          f"{kernel.metadata.shared} B: " + ", ".join(f"{o} {c}" for o, c in counts.most_common()))


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "check"
    if what == "check":
        check("cuda" if torch.cuda.is_available() else "cpu")
    elif what == "bench":
        bench()
    elif what == "sass":  # sass [split_k warps tiles_a_warp ahead unroll]
        sass(6144, 4096, *[int(a) for a in sys.argv[2:]])
