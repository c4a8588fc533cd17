"""Experiment: a symmetric int4 (group 128) matvec whose packed words are the tensor cores' A fragments.

    python3 examples/benchmarks/exp_int4_fragments.py check            # CPU (TRITON_INTERPRET=1) or GPU
    python3 examples/benchmarks/exp_int4_fragments.py sass [SPLIT_K WARPS TILES AHEAD UNROLL]   # sm_90, no GPU
    python3 examples/benchmarks/exp_int4_fragments.py bench [qkv,o,gate_up,down]    # GPU: `_frag_matvec`
    python3 examples/benchmarks/exp_int4_fragments.py flat [qkv,o,gate_up,down]     # GPU: `_flat_matvec`

Why (BENCHMARKS Round 19): with the bf16-pair arithmetic cut to a few integer adds a word (wrong sums, timing
only) llama-8b's int4 step ran 688.5 tok/s against 629.2. `mma.sync.m16n8k16` takes the codes as they stand
(bf16 subnormals, pairs.py's trick) and sums in float32. The layout is re-packed (`repack`, at load in a
runtime that used it) so that one 32-bit word of a lane is its A fragment of a 16-row x 16-column slice:

    lane l = 4g + t, slice j of a 64-column step s: the word whose nibbles 0, 4, 2, 6 are row g's columns
    64s + 16t + 4j + 0, 1, 2, 3 and nibbles 1, 5, 3, 7 row g + 8's, so
    w & 0x000F000F, (w >> 8) & 0x000F000F  = a0, a2 (row g, units of 2^-133)
    w & 0x00F000F0, (w >> 8) & 0x00F000F0  = a1, a3 (row g + 8, units of 2^-129)

The column order inside a step is the mma's k order permuted the same way in A and B, so lane t's B fragments
of a step are x's columns 16t .. 16t + 15 as they lie in memory (two 16-byte loads, x as the kernel before
wrote it), scaled by 2^100 in the kernel (one bf16-pair FMA a pair: products stay normal floats). Every column
of B is x, so D's columns are equal and each lane holds its rows g and g + 8. The zero point is 8 more mma a
group with a constant A (every code -8 in each half's unit), a chain of their own shared by a warp's row tiles.
Per word: one shift, four logic ops and one mma; per group a lane also scales 16 x pairs and runs the zero
point's 8 mma (sm_90 loop, `sass`: 1.80 instructions a weight with one row tile, 1.26 with two).

Two kernels: `_frag_matvec` loads group by group (AHEAD: the next group's words during this one's mma), its
warps splitting a program's columns and their sums added at the end; `_flat_matvec` loads every word and scale
of a warp's run at once (joined into one register tensor, nothing moved) before it waits (PDL) for the kernel
before, as bench_read_floor.py's fastest reads do, then takes x and the sums group by group.

Status (BENCHMARKS Rounds 19 and 20, one H200): correct on the GPU (`check`: about 1e-7 relative against the
format's decode; 4.8e-3 to 5.1e-3 against the shipped bf16 pairs, their own rounding). Timed against the shipped
matvec (us; plain launches unless said): with partial sums over 8 splits of one warp (Round 20's first call, the
x-fragment form) o 4.83 against 5.40 and down 10.66 against 12.29, qkv 6.02 against 6.29, gate/up 17.48
against 17.60; in one split a row (as o and down must be, producing the deferred norm) down 11.14 against 12.44
(16 warps a program), o 5.28 against 5.22, qkv and gate/up slower; `_flat_matvec` as a dependent: o 4.21
against the shipped dependent's 4.32, qkv 6.06 against 6.46, down and gate/up slower. Not in the runtime.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from int4_lanes import chosen_shapes, load_run, pick, run_mode, shipped_weights, threads, warps_sum  # noqa: E402

from thin.runtime.kernels.pairs import HIGH_NIBBLES as ROW_H  # w & ROW_H: row g + 8's pair
from thin.runtime.kernels.pairs import LOW_NIBBLES as ROW_G  # w & ROW_G: row g's pair
from thin.runtime.kernels.pairs import X_UP_PAIR, _high, _low, pair_fma  # bf16 pairs


@triton.jit
def _x_up(pairs, ASM: tl.constexpr):
    """bf16 pairs of x times 2^100 (exact), so that the products with the codes (units of 2^-133 and 2^-129) stay
    normal floats."""
    return pair_fma(pairs, tl.full([1, 1], X_UP_PAIR, tl.int32), tl.zeros([1, 1], dtype=tl.int32), ASM)


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, d, ASM: tl.constexpr):
    """d + this lane's D fragment of A @ B for one 16x16 slice (A: this lane's fragment registers, bf16
    pairs; B: every column x, this lane's pairs b0 (its k = 2t, 2t + 1) and b1 (k = 2t + 8, 2t + 9)); d = (dg,
    dg2, dh, dh2): rows g and g + 8, columns 2t and 2t + 1, equal since B's columns are. ASM: one mma.sync, its
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
def _scaled_x(x_ptrs, ASM: tl.constexpr):
    """A lane's 4 bf16 pairs of x at x_ptrs [L, 4], scaled (`_x_up`)."""
    return _x_up(tl.load(x_ptrs), ASM)


NEG_ZERO_G = tl.constexpr(-2146926584)  # 0x80088008: the bf16 pair (-2^-130, -2^-130), -8 codes in row g's unit
NEG_ZERO_H = tl.constexpr(-2139062144)  # 0x80808080: (-2^-126, -2^-126), -8 codes in row g + 8's unit


@triton.jit
def _zero(x_lo, x_hi, ASM: tl.constexpr):
    """-8 * the group's sum of x in each row half's unit, as a D fragment: 8 mma of a constant A (every code
    -8) with the group's B fragments, a chain of its own shared by every row tile of the warp."""
    zero = tl.zeros([x_lo[0].shape[0]], dtype=tl.float32)
    d = (zero, zero, zero, zero)
    ng = tl.full([x_lo[0].shape[0]], NEG_ZERO_G, tl.int32)
    nh = tl.full([x_lo[0].shape[0]], NEG_ZERO_H, tl.int32)
    for half in tl.static_range(2):
        xa, xb = x_lo if half == 0 else x_hi
        for j in tl.static_range(4):
            b0, b1 = _slice_x(xa, xb, j)
            d = _mma(ng, nh, ng, nh, b0, b1, d, ASM)
    return d


@triton.jit
def _slice_x(xa, xb, j: tl.constexpr):
    """Slice j's B fragment (b0, b1) of a lane's scaled x pairs of a step: xa pairs 0-3, xb pairs 4-7; slice j's
    b0 is pair 2j, its b1 pair 2j + 1."""
    src = xa if j < 2 else xb
    evens, odds = tl.split(tl.reshape(src, [src.shape[0], 2, 2]))  # pairs (0, 2), (1, 3) of src
    return tl.split(evens)[j % 2], tl.split(odds)[j % 2]


@triton.jit
def _group(w_lo, w_hi, x_lo, x_hi, ASM: tl.constexpr):
    """One row tile's D fragment over one group (128 columns: 2 steps of 4 slices, 8 mma). w_lo / w_hi [L, 4]: a
    lane's words of the group's two steps (one a slice); x_lo / x_hi: (xa, xb) of each step (`_slice_x`)."""
    zero = tl.zeros([w_lo.shape[0]], dtype=tl.float32)
    d = (zero, zero, zero, zero)
    for half in tl.static_range(2):
        words = w_lo if half == 0 else w_hi
        xa, xb = x_lo if half == 0 else x_hi
        w02, w13 = tl.split(tl.reshape(words, [words.shape[0], 2, 2]))  # slices (0, 2), (1, 3)
        for j in tl.static_range(4):
            w = tl.split(w02 if j % 2 == 0 else w13)[j // 2]
            b0, b1 = _slice_x(xa, xb, j)
            v = w >> 8
            d = _mma(w & ROW_G, w & ROW_H, v & ROW_G, v & ROW_H, b0, b1, d, ASM)
    return d


@triton.jit
def _scaled(acc_g, acc_h, d, z, s_ptrs, groups: tl.constexpr):
    """acc + the group's sums of rows g and g + 8 with the zero point (z, `_zero`) added and scaled."""
    acc_g += (d[0] + z[0]) * tl.load(s_ptrs).to(tl.float32)
    acc_h += (d[2] + z[2]) * tl.load(s_ptrs + 8 * groups).to(tl.float32)
    return acc_g, acc_h


@triton.jit
def _frag_matvec(w_ptr, s_ptr, x_ptr, out_ptr, N, K: tl.constexpr, SPLIT_K: tl.constexpr, NW: tl.constexpr,
                 ASM: tl.constexpr, MT: tl.constexpr = 1, AHEAD: tl.constexpr = 0, UNROLL: tl.constexpr = 1):
    """Program (i, s): MT row tiles (16 rows each) over columns s*SPLIT_K .. + SPLIT_K, which its NW warps split
    into equal runs (whole groups), their sums added across the warps at the end; out [splits, N] float32.
    w_ptr: int32 fragment words [N/16, K/64, 32, 4] (`repack`); s_ptr: float16 scales [N, K/128]; x_ptr: bf16
    x [K] as it is (int32 pairs). AHEAD: the next group's words and x are loaded before this group's mma."""
    e = threads(NW, ASM)
    warp = e // 32
    lane = e % 32
    g = lane // 4
    t = lane % 4
    tile = tl.program_id(0) * MT
    row_g = tile * 16 + g
    acc_g = tl.zeros([32 * NW], dtype=tl.float32)
    acc_h = tl.zeros([32 * NW], dtype=tl.float32)
    acc_g1 = tl.zeros([32 * NW], dtype=tl.float32)
    acc_h1 = tl.zeros([32 * NW], dtype=tl.float32)
    j4 = tl.arange(0, 4)
    steps: tl.constexpr = K // 64
    groups: tl.constexpr = K // 128
    RUN: tl.constexpr = SPLIT_K // NW  # a warp's columns
    count: tl.constexpr = RUN // 128
    first = (tl.program_id(1) * SPLIT_K + warp * RUN) // 64  # a warp's first step
    # A lane's 16 bytes of fragment words a step (the next row tile's K/64 * 128 words on), and its 32 bytes of
    # x: columns 16t .. 16t + 15 of the step, as 8 pairs.
    w_ptrs = w_ptr + ((tile * steps + first) * 32 + lane)[:, None] * 4 + j4[None, :]
    x_ptrs = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (first * 32 + 8 * t)[:, None] + j4[None, :]
    s_ptrs = s_ptr + row_g * groups + first // 2
    TILE: tl.constexpr = steps * 128
    if AHEAD:
        w_lo, w_hi = tl.load(w_ptrs), tl.load(w_ptrs + 128)
        if MT == 2:
            v_lo, v_hi = tl.load(w_ptrs + TILE), tl.load(w_ptrs + TILE + 128)
        x_lo = (_scaled_x(x_ptrs, ASM), _scaled_x(x_ptrs + 4, ASM))
        x_hi = (_scaled_x(x_ptrs + 32, ASM), _scaled_x(x_ptrs + 36, ASM))
    for grp in tl.range(count, loop_unroll_factor=UNROLL):
        if AHEAD:  # this group's, then the next group's (past the last: this group's again, no masks)
            cw_lo, cw_hi, cx_lo, cx_hi = w_lo, w_hi, x_lo, x_hi
            ahead = tl.where(grp + 1 < count, 1, 0)
            w_lo = tl.load(w_ptrs + ahead * 256)
            w_hi = tl.load(w_ptrs + ahead * 256 + 128)
            if MT == 2:
                cv_lo, cv_hi = v_lo, v_hi
                v_lo = tl.load(w_ptrs + TILE + ahead * 256)
                v_hi = tl.load(w_ptrs + TILE + ahead * 256 + 128)
            x_lo = (_scaled_x(x_ptrs + ahead * 64, ASM), _scaled_x(x_ptrs + ahead * 64 + 4, ASM))
            x_hi = (_scaled_x(x_ptrs + ahead * 64 + 32, ASM), _scaled_x(x_ptrs + ahead * 64 + 36, ASM))
        else:
            cw_lo, cw_hi = tl.load(w_ptrs), tl.load(w_ptrs + 128)
            if MT == 2:
                cv_lo, cv_hi = tl.load(w_ptrs + TILE), tl.load(w_ptrs + TILE + 128)
            cx_lo = (_scaled_x(x_ptrs, ASM), _scaled_x(x_ptrs + 4, ASM))
            cx_hi = (_scaled_x(x_ptrs + 32, ASM), _scaled_x(x_ptrs + 36, ASM))
        z = _zero(cx_lo, cx_hi, ASM)
        d = _group(cw_lo, cw_hi, cx_lo, cx_hi, ASM)
        acc_g, acc_h = _scaled(acc_g, acc_h, d, z, s_ptrs, groups)
        if MT == 2:  # the second row tile: its own mma chain, the same B fragments
            d1 = _group(cv_lo, cv_hi, cx_lo, cx_hi, ASM)
            acc_g1, acc_h1 = _scaled(acc_g1, acc_h1, d1, z, s_ptrs + 16 * groups, groups)
        w_ptrs += 256
        x_ptrs += 64
        s_ptrs += 1
    # The warps' runs added (lane by lane), then units: a code u is u * 2^-133 (row g) or u * 2^-129 (row g + 8),
    # x is x * 2^100.
    base = out_ptr + tl.program_id(1) * N
    lane = tl.arange(0, 32)
    row_g = tile * 16 + lane // 4
    store = (lane % 4 == 0) & (row_g < N)
    tl.store(base + row_g, warps_sum(acc_g, NW) * 8589934592.0, mask=store)  # 2^33
    tl.store(base + row_g + 8, warps_sum(acc_h, NW) * 536870912.0, mask=store)  # 2^29
    if MT == 2:
        tl.store(base + row_g + 16, warps_sum(acc_g1, NW) * 8589934592.0, mask=store)
        tl.store(base + row_g + 24, warps_sum(acc_h1, NW) * 536870912.0, mask=store)


@triton.jit
def _flat_x(x_ptr, step, t, ok, ASM: tl.constexpr):
    """(xa, xb) of a lane at `step` (`_slice_x`), scaled; zeros where not ok (past the warp's run)."""
    ptrs = x_ptr + (step * 32 + 8 * t)[:, None] + tl.arange(0, 4)[None, :]
    return (_x_up(tl.load(ptrs, mask=ok[:, None], other=0), ASM),
            _x_up(tl.load(ptrs + 4, mask=ok[:, None], other=0), ASM))


@triton.jit
def _tile_loads(w_ptr, s_ptr, tile, first, lane, g, steps: tl.constexpr, groups: tl.constexpr, RUN: tl.constexpr,
                S: tl.constexpr):
    """Row tile `tile`'s words of each warp's run of RUN steps and their group scales (rows g and g + 8), all
    loaded at once (`load_run`)."""
    lane_ptrs = w_ptr + ((tile * steps + first) * 32 + lane)[:, None] * 4 + tl.arange(0, 4)[None, :]
    s_ptrs = s_ptr + (tile * 16 + g) * groups + first // 2
    return (load_run(lane_ptrs, first, S, RUN, steps, 128), load_run(s_ptrs, first // 2, S // 2, RUN // 2, groups, 1),
            load_run(s_ptrs + 8 * groups, first // 2, S // 2, RUN // 2, groups, 1))


@triton.jit
def _rows(acc_g, acc_h, NW: tl.constexpr):
    """A tile's [16] row sums from its lanes' accumulators: lane 4g + t holds rows g and g + 8 (equal over t);
    the warps' runs added, one value a row, the units put back (codes 2^-133 and 2^-129, x 2^100)."""
    rows_g = tl.max(tl.reshape(warps_sum(acc_g, NW), [8, 4]), axis=1) * 8589934592.0  # 2^33
    rows_h = tl.max(tl.reshape(warps_sum(acc_h, NW), [8, 4]), axis=1) * 536870912.0  # 2^29
    return tl.reshape(tl.permute(tl.join(rows_g, rows_h), [1, 0]), [16])


@triton.jit
def _tile_sums(a, b, x32, first, t, steps: tl.constexpr, RUN: tl.constexpr, S: tl.constexpr, NW: tl.constexpr,
               TWO: tl.constexpr, ASM: tl.constexpr):
    """The [16] row sums of tile a (`_tile_loads`) and, with TWO, of tile b, over the warps' runs: x and the
    zero point's mma once a group for both."""
    G2: tl.constexpr = S // 2
    acc_g = tl.zeros([32 * NW], dtype=tl.float32)
    acc_h = tl.zeros([32 * NW], dtype=tl.float32)
    acc_g1 = tl.zeros([32 * NW], dtype=tl.float32)
    acc_h1 = tl.zeros([32 * NW], dtype=tl.float32)
    for grp in tl.static_range(G2):
        if grp < (RUN + 1) // 2:
            ok = (first + 2 * grp < steps) & (2 * grp < RUN)
            x_lo = _flat_x(x32, first + 2 * grp, t, ok, ASM)
            x_hi = _flat_x(x32, first + 2 * grp + 1, t, ok, ASM)
            z = _zero(x_lo, x_hi, ASM)
            d = _group(pick(a[0], 2 * grp, S), pick(a[0], 2 * grp + 1, S), x_lo, x_hi, ASM)
            acc_g += (d[0] + z[0]) * pick(a[1], grp, G2).to(tl.float32)
            acc_h += (d[2] + z[2]) * pick(a[2], grp, G2).to(tl.float32)
            if TWO:
                d1 = _group(pick(b[0], 2 * grp, S), pick(b[0], 2 * grp + 1, S), x_lo, x_hi, ASM)
                acc_g1 += (d1[0] + z[0]) * pick(b[1], grp, G2).to(tl.float32)
                acc_h1 += (d1[2] + z[2]) * pick(b[2], grp, G2).to(tl.float32)
    return _rows(acc_g, acc_h, NW), _rows(acc_g1, acc_h1, NW)


@triton.jit
def _flat_matvec(w_ptr, s_ptr, x_ptr, out_ptr, N, K: tl.constexpr, NW: tl.constexpr, RUN: tl.constexpr,
                 S: tl.constexpr, ASM: tl.constexpr, MT: tl.constexpr = 1, PDL: tl.constexpr = 0):
    """Program (i, j): MT row tiles over columns j * NW * RUN * 64 .., a run of RUN steps (64 columns) a warp. Every
    word of a warp's run is loaded at once, before anything else (S >= RUN steps of registers, a power of 2,
    masked past the run), then (PDL: after the wait for the kernel before) x and the sums group by group; out
    [K / (NW * RUN * 64), N] float32, the warps' sums added."""
    e = threads(NW, ASM)
    warp = e // 32
    lane = e % 32
    tile = tl.program_id(0) * MT
    steps: tl.constexpr = K // 64
    groups: tl.constexpr = K // 128
    first = (tl.program_id(1) * NW + warp) * RUN  # a warp's first step
    a = _tile_loads(w_ptr, s_ptr, tile, first, lane, lane // 4, steps, groups, RUN, S)
    b = a
    if MT == 2:
        b = _tile_loads(w_ptr, s_ptr, tile + 1, first, lane, lane // 4, steps, groups, RUN, S)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x32 = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    rows_a, rows_b = _tile_sums(a, b, x32, first, lane % 4, steps, RUN, S, NW, MT == 2, ASM)
    rows = tile * 16 + tl.arange(0, 16)
    base = out_ptr + tl.program_id(1) * N
    tl.store(base + rows, rows_a, mask=rows < N)
    if MT == 2:
        tl.store(base + rows + 16, rows_b, mask=rows + 16 < N)


def flat_matvec(words, scales, x, n, k, nw, run, asm, mt: int = 1, pdl: int = 0) -> torch.Tensor:
    """`_flat_matvec`'s sums [splits, n] (run: steps of 64 columns a warp, even; n a multiple of 16 * mt)."""
    if n % (16 * mt) or run % 2 or k % 128:
        raise ValueError(f"flat fragments tile n={n} by {16 * mt} rows, runs of whole groups (got {run} steps)")
    span = nw * run * 64
    out = torch.empty(-(-k // span), n, dtype=torch.float32, device=words.device)
    extra = {"launch_pdl": True} if pdl else {}
    _flat_matvec[(n // (16 * mt), out.shape[0])](words, scales, x, out, n, k, nw, run, triton.next_power_of_2(run),
                                                 asm, mt, pdl, num_warps=nw, **extra)
    return out


def repack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> int32 fragment words [N/16, K/64, 32, 4] (see the module docstring)."""
    n, k = codes.shape
    c = codes.to(torch.int64).reshape(n // 16, 2, 8, k // 64, 4, 4, 4)  # tile, half, g, step, t, slice, column
    word = torch.zeros(n // 16, 8, k // 64, 4, 4, dtype=torch.int64, device=codes.device)  # tile, g, step, t, slice
    for half in range(2):
        for col, nibble in enumerate((0, 4, 2, 6)):  # a0's pair, then a2's (row g); row g + 8's one nibble up
            word |= c[:, half, :, :, :, :, col] << (4 * (nibble + half))
    word = word.permute(0, 2, 1, 3, 4).reshape(n // 16, k // 64, 32, 4)  # tile, step, lane = 4g + t, slice
    return ((word + 2**31) % 2**32 - 2**31).to(torch.int32)


def matvec(words, scales, x, n, k, split_k, nw, asm, mt: int = 1, ahead: int = 0, unroll: int = 1) -> torch.Tensor:
    """The kernel's sums [k / split_k, n] (split_k a multiple of 128 * nw; n of 16 * mt)."""
    if n % (16 * mt) or split_k % (128 * nw) or k % split_k:
        raise ValueError(f"fragments tile n={n} by {16 * mt} rows and k={k} by splits of {128 * nw} columns")
    out = torch.empty(k // split_k, n, dtype=torch.float32, device=words.device)
    _frag_matvec[(n // (16 * mt), k // split_k)](words, scales, x, out, n, k, split_k, nw, asm, mt, ahead, unroll,
                                                 num_warps=nw)
    return out


def reference(codes, scales, x) -> torch.Tensor:
    w = (codes.float() - 8).reshape(codes.shape[0], -1, 128) * scales.float()[:, :, None]
    return w.reshape(codes.shape) @ x.float()


def _case(n, k, seed):
    """Random codes, scales (of both signs) and x of an [n, k] weight, and the format's decode times x."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (0.02 * torch.rand(n, k // 128, generator=gen) - 0.01).half()
    x = torch.randn(k, generator=gen).bfloat16()
    return codes, scales, x, reference(codes, scales, x)


def relative_error(n, k, split_k, nw, mt, ahead, unroll, device, seed: int = 0) -> float:
    """|kernel - reference| / |reference| of `_frag_matvec` on a random case (`_case`): the mma path on a GPU,
    the interpreter twin on the CPU."""
    codes, scales, x, want = _case(n, k, seed)
    asm = torch.device(device).type == "cuda"
    got = matvec(repack(codes).to(device), scales.to(device), x.to(device), n, k, split_k, nw, asm, mt, ahead, unroll)
    got = got.sum(0).cpu()
    return ((got - want).norm() / want.norm()).item()


# (n, k, split_k, warps, row tiles a program, ahead, unroll): the last has an odd count of groups a warp.
CASES = [(32, 256, 256, 1, 1, 0, 1), (64, 512, 256, 2, 1, 1, 1), (96, 512, 256, 2, 2, 0, 1),
         (128, 768, 768, 2, 2, 1, 2)]


# (n, k, warps, steps a warp, row tiles) of `_flat_matvec`: several splits, runs past K, odd groups a run.
FLAT_CASES = [(32, 1024, 2, 8, 1), (64, 1024, 2, 6, 2), (32, 1792, 4, 4, 1), (48, 896, 2, 14, 1)]


def flat_relative_error(n, k, nw, run, mt, device, seed: int = 0) -> float:
    """`relative_error` of `_flat_matvec` (launched plainly)."""
    codes, scales, x, want = _case(n, k, seed)
    asm = torch.device(device).type == "cuda"
    got = flat_matvec(repack(codes).to(device), scales.to(device), x.to(device), n, k, nw, run, asm, mt).sum(0).cpu()
    return ((got - want).norm() / want.norm()).item()


def check(device: str) -> None:
    for n, k, split_k, nw, mt, ahead, unroll in CASES:
        err = relative_error(n, k, split_k, nw, mt, ahead, unroll, device, seed=n + k)
        print(f"n={n} k={k} split_k={split_k} warps={nw} row tiles {mt} ahead {ahead} unroll {unroll}: "
              f"relative error {err:.2e}")
        assert err < 1e-5, err
    for n, k, nw, run, mt in FLAT_CASES:
        err = flat_relative_error(n, k, nw, run, mt, device, seed=n + k)
        print(f"flat n={n} k={k} warps={nw} steps a warp {run} row tiles {mt}: relative error {err:.2e}")
        assert err < 1e-5, err


def _weights(n, k):
    """(shipped ops, (fragment words, scales)) of `shipped_weights`, the same weights in both layouts."""
    from thin.ir import formats
    from thin.ir.formats.quantized import unpack_bits

    params = formats.get("int4").normalize({})
    ops, frags = [], []
    for op, raw in shipped_weights(n, k):
        ops.append(op)
        parts = formats.get("int4").split(raw, (n, k), params)
        frags.append((repack(unpack_bits(parts["codes"], 4).cuda()), parts["scales"].contiguous().cuda()))
    return ops, frags


def bench() -> None:
    """`_frag_matvec` against the shipped matvec (plain launches)."""
    from bench_kernels import time_graph

    for name, n, k in chosen_shapes():
        ops, frags = _weights(n, k)
        reps = max(1, 20 // len(ops))
        x = torch.randn(k, device="cuda").bfloat16()
        want = ops[0](x[None])[0].float()
        shipped = time_graph([partial(op.matvec, x) for op in ops] * reps)
        print(f"{name}: shipped ({ops[0].config('direct')}) {shipped * 1e6:.2f} us", flush=True)
        grid = [(k, w) for w in (4, 8, 16)] + [(k // 2, w) for w in (2, 4, 8)]
        for split_k, nw, mt, ahead in [(c, w, m, a) for c, w in grid for m in (1, 2) for a in (0, 1)]:
            if n % (16 * mt) or split_k % (128 * nw):
                continue
            unroll = 2 if ahead else 1  # unrolled by two, the words loaded ahead need no moves (`sass`)
            got = matvec(*frags[0], x, n, k, split_k, nw, True, mt, ahead, unroll).sum(0)
            err = ((got - want).norm() / want.norm()).item()
            t = time_graph([partial(matvec, *f, x, n, k, split_k, nw, True, mt, ahead, unroll) for f in frags] * reps)
            print(f"  fragments split_k={split_k} warps={nw} row tiles {mt} ahead {ahead}: {t * 1e6:.2f} us, "
                  f"error against shipped {err:.1e}", flush=True)


FLAT_GRID = {  # (warps, steps a warp, row tiles) a shape: one split where warps x steps x 64 >= K
    "qkv": [(8, 8, 1), (4, 16, 1), (16, 4, 1), (8, 8, 2), (4, 8, 1), (2, 16, 1)],
    "o": [(8, 8, 1), (4, 16, 1), (16, 4, 1), (8, 8, 2), (4, 8, 1), (2, 16, 1)],
    "gate_up": [(8, 8, 1), (4, 16, 1), (8, 8, 2), (4, 8, 2), (2, 16, 1), (4, 4, 2)],
    "down": [(16, 14, 1), (16, 16, 1), (8, 14, 1), (8, 16, 1), (4, 14, 1), (8, 8, 2)],
}


def bench_flat() -> None:
    """`_flat_matvec` against the shipped matvec, each launched plainly and as programmatic dependents."""
    from bench_kernels import time_graph

    from thin.runtime.kernels import dependent

    shapes = [("o", 4096, 4096), ("qkv", 6144, 4096), ("down", 4096, 14336), ("gate_up", 28672, 4096)]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    table = []
    for name, n, k in [shape for shape in shapes if only is None or shape[0] in only]:
        ops, frags = _weights(n, k)
        x = torch.randn(k, device="cuda").bfloat16()
        want = ops[0](x[None])[0].float()
        reps = max(1, 20 // len(ops))
        for pdl in (0, 1):
            with dependent.launching(bool(pdl)):
                shipped = time_graph([partial(op.matvec, x) for op in ops] * reps)
            print(f"{name} shipped pdl {pdl}: {shipped * 1e6:.2f} us", flush=True)
            table.append((name, "shipped", pdl, shipped, 0.0))
        for nw, run, mt in FLAT_GRID[name]:
            for pdl in (0, 1):
                got = flat_matvec(*frags[0], x, n, k, nw, run, True, mt, pdl).sum(0)
                err = ((got - want).norm() / want.norm()).item()
                t = time_graph([partial(flat_matvec, *f, x, n, k, nw, run, True, mt, pdl) for f in frags] * reps)
                splits = -(-k // (nw * run * 64))
                print(f"{name} flat warps {nw} steps {run} tiles {mt} splits {splits} pdl {pdl}: {t * 1e6:.2f} us, "
                      f"error against shipped {err:.1e}", flush=True)
                table.append((name, f"flat {nw}x{run}x{mt} ({splits} splits)", pdl, t, err))
    print("\n| matvec | kernel | launch | us | error against shipped |\n| --- | --- | --- | ---: | ---: |")
    for name, kernel, pdl, t, err in table:
        print(f"| {name} | {kernel} | {'dependent' if pdl else 'plain'} | {t * 1e6:.2f} | {err:.1e} |")


def sass(n: int = 6144, k: int = 4096, split_k: int = 4096, nw: int = 8, mt: int = 1, ahead: int = 0,
         unroll: int = 1) -> None:
    """Compile the mma path for sm_90 on this machine (sass_budget.py's stand-in driver) and count its loop."""
    import collections

    from sass_budget import _Sm90, disassemble, hot_loop, opcode
    from triton.runtime import driver

    driver.set_active(_Sm90())
    words = torch.zeros(n // 16, k // 64, 32, 4, dtype=torch.int32)
    scales = torch.zeros(n, k // 128, dtype=torch.float16)
    x = torch.zeros(k, dtype=torch.bfloat16)
    out = torch.empty(k // split_k, n, dtype=torch.float32)
    kernel = _frag_matvec.warmup(words, scales, x, out, n, k, split_k, nw, True, mt, ahead, unroll, num_warps=nw,
                                 grid=(n // (16 * mt), k // split_k))
    loop = hot_loop(disassemble(kernel))
    counts = collections.Counter(opcode(t) for t in loop)
    # A group has 8 mma a row tile, one word (8 weights) a lane each, and 8 for its zero point (the compiler may
    # unroll the loop over groups).
    words = max(1, counts["HMMA"] * mt // (mt + 1))
    print(f"loop {len(loop)} instructions, {len(loop) / (8 * words):.3f} a weight and lane, shared "
          f"{kernel.metadata.shared} B: " + ", ".join(f"{o} {c}" for o, c in counts.most_common()))


if __name__ == "__main__":
    run_mode({"check": lambda: check("cuda" if torch.cuda.is_available() else "cpu"), "bench": bench,
              "flat": bench_flat, "sass": lambda: sass(6144, 4096, *[int(a) for a in sys.argv[2:]])}, __doc__)
