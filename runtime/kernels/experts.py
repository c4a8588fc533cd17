"""Mixture-of-experts decode: the router's top-k and the chosen experts' gate/up + activation and
weighted down projection, each expert read from its own packed bytes where they lie.

Per MoE layer and token, three launches, none of which needs the host:

    _router_kernel   logits[E] = x @ router.T (+ bias), float32 (programs over experts)
    _gate_up_kernel  program (slot, row block): the top-k of the logits (every program recomputes
                     it: E <= 256 numbers in registers, cheaper than a launch; row block 0 also
                     stores it in `chosen` / `weights`), e = the slot's expert,
                     h[slot] = act(gate_e x + b) * (up_e x + b), GPT-OSS's clamped SwiGLU included
                     (alpha, limit, the offset added to up)
    _down_kernel     program (slot, row block): e and w from `chosen` / `weights`,
                     partials[slot] = w * (down_e h[slot] + b), float32; the fused residual norm
                     adds the k rows (norm.add_rmsnorm)

So expert indices never leave the device and a captured decode step holds the whole layer. The
weights stay as the executor loaded them, one blob (or dense tensor) per expert: each group of
experts sharing a format gets a table of byte offsets (int64 [experts, 6]: up to five parts and
the bias) from one base address, and a program turns the slot's expert into addresses by one
load from that table. Experts of different formats in one layer (routing-aware bits) are served
by one launch per format, each program checking that its slot's expert is one of the group's
(`member` is -1 otherwise, and it writes nothing).

Formats: bf16 / f16 / f32, int8, fp8_e4m3, int3-int6 (one or two code planes), mxfp4, q2, q1 (each
tile decoded in registers; the format's reference `decode` is what it must match). What the
kernels do not run (shared experts, other router scorings, experts kept in host memory) raises
NotImplementedError at construction, which the engine turns into a clear refusal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from thin.ir import formats

from . import interpreting
from .common import ACTIVATION_CODES, median_ms_or_inf, next_power_of_2
from .tiles import activate

# Format codes of the kernels' FMT constexpr; SUB is a dense format's dtype code or a grouped int's bits.
DENSE, INT8, FP8, GINT, MXFP4, Q2, Q1 = range(7)
_CODES = {"bf16": DENSE, "f16": DENSE, "f32": DENSE, "int8": INT8, "fp8_e4m3": FP8, "int3": GINT, "int4": GINT,
          "int5": GINT, "int6": GINT, "mxfp4": MXFP4, "q2": Q2, "q1": Q1}
# The parts each format's kernel reads, in the table's column order (column 5 is the bias; a grouped
# int's low code plane is "codes" for int4, "codes_low" otherwise, its high plane column 3).
_PARTS = {DENSE: ("weight",), INT8: ("values", "scales"), FP8: ("values", "scales"),
          GINT: ("codes", "scales", "offsets", "codes_high"), MXFP4: ("values", "scales"),
          Q2: ("codes", "scales", "offsets", "row_scale", "row_offset"), Q1: ("signs", "scales", "row_scale")}
_DENSE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
SUPPORTED = tuple(_CODES)
_CHOSEN: dict = {}  # launch tiles chosen by timing, by shape and format (MoEKernels.config)


# ---- reading one expert's rows ------------------------------------------------------------------------

@triton.jit
def _part(base, offs, j: tl.constexpr, dtype: tl.constexpr):
    """The address of part j of the expert whose offsets row is `offs` (16-byte aligned), typed."""
    off = tl.multiple_of(tl.load(offs + j), 16)
    return (base + off).to(tl.pointer_type(dtype))


@triton.jit
def _e4m3(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _byte_step(acc, w, x_ptr, k0, ks, cmask, FMT: tl.constexpr):
    x = tl.load(x_ptr + k0 + ks, mask=cmask, other=0.0).to(tl.float32)
    if FMT == 1:  # int8: v + 128 is 0..255, converted by _small_int
        wf = _small_int(w.to(tl.int32) + 128, 128.0)
    elif FMT == 2:  # fp8_e4m3 bytes
        wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        wf = w.to(tl.float32)
    return acc + wf * x[None, :]


@triton.jit
def _bytewise_dot(w_ptr, x_ptr, rows, row_mask, K, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  PREFETCH: tl.constexpr):
    """sum_k W[rows, k] x[k] for one element a column (dense, int8, fp8): float32 [BN]. PREFETCH:
    the next tile's loads are issued before this tile's math (two tiles in flight)."""
    ks = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    if PREFETCH:
        w_next = tl.load(ptrs, mask=row_mask[:, None] & (ks < K)[None, :], other=0)
        for k0 in range(0, K, BK):
            w = w_next
            w_next = tl.load(ptrs + k0 + BK, mask=row_mask[:, None] & (k0 + BK + ks < K)[None, :], other=0)
            acc = _byte_step(acc, w, x_ptr, k0, ks, k0 + ks < K, FMT)
    else:
        for k0 in range(0, K, BK):
            cmask = k0 + ks < K
            w = tl.load(ptrs + k0, mask=row_mask[:, None] & cmask[None, :], other=0)
            acc = _byte_step(acc, w, x_ptr, k0, ks, cmask, FMT)
    return tl.sum(acc, axis=1)


@triton.jit
def _x_split(x_ptr, start, gi, gmask, GB: tl.constexpr, G: tl.constexpr, PER: tl.constexpr):
    """x at the columns of NG groups of G from `start`, as PER tensors [NG, GB]: element j holds the
    columns PER * i + j (the codes packed at bits j * 8 / PER of byte i of a group's GB bytes)."""
    offs = start + gi[:, None] * G + tl.arange(0, G)[None, :]
    x = tl.load(x_ptr + offs, mask=gmask[:, None], other=0.0).to(tl.float32)
    x = tl.reshape(x, [gi.shape[0], GB, PER])
    if PER == 2:
        x0, x1 = tl.split(x)
        out = (x0, x1)
    elif PER == 4:
        a, b = tl.split(tl.reshape(x, [gi.shape[0], GB, 2, 2]))  # a: j even, b: j odd; split again by j // 2
        x0, x2 = tl.split(a)
        x1, x3 = tl.split(b)
        out = (x0, x1, x2, x3)
    else:
        a, b = tl.split(tl.reshape(x, [gi.shape[0], GB, 2, 2, 2]))  # j % 2
        aa, ab = tl.split(a)  # (j // 2) % 2 of the even j
        ba, bb = tl.split(b)
        x0, x4 = tl.split(aa)
        x2, x6 = tl.split(ab)
        x1, x5 = tl.split(ba)
        x3, x7 = tl.split(bb)
        out = (x0, x1, x2, x3, x4, x5, x6, x7)
    return out


@triton.jit
def _small_int(u, zero: tl.constexpr):
    """float(u - zero) for integers 0 <= u < 2^23 (int32), without the int-to-float unit (a fraction of
    the float rate): u OR-ed into the mantissa of 2^23 is exactly 2^23 + u."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + zero)


@triton.jit
def _e2m1(code):
    """The E2M1 value of 4-bit codes (int32): magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6, sign bit 3, built
    as float32 bits: a normal code (exponent e >= 1) has exponent e - 1 and the mantissa bit on top;
    code 1 is 0.5 (0x3F000000), code 0 zero."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(byte):
    """2^(byte - 127) for E8M0 scale bytes (int32, 0..254): the float32 with that biased exponent."""
    return tl.where(byte == 0, 5.877471754111438e-39, (byte << 23).to(tl.float32, bitcast=True))


@triton.jit
def _grouped_dot(base, offs, x_ptr, rows, row_mask, K, FMT: tl.constexpr, SUB: tl.constexpr, G: tl.constexpr,
                 NG: tl.constexpr, BN: tl.constexpr, ASYM: tl.constexpr, PREFETCH: tl.constexpr):
    """sum_k W[rows, k] x[k] for the formats with a scale per group of G columns (int3-int6, mxfp4,
    q2, q1): NG groups a step, each group's packed bytes [BN, NG, GB] (a grouped int's low plane)
    decoded in registers against x split the same way (_x_split). float32 [BN]. PREFETCH: the next
    step's codes are loaded before this step's math."""
    PER: tl.constexpr = (4 if SUB == 3 else 2) if FMT == 3 else (2 if FMT == 4 else (4 if FMT == 5 else 8))
    GB: tl.constexpr = G // PER
    groups = K // G
    row_bytes = K // PER
    gi = tl.arange(0, NG)
    bi = tl.arange(0, GB)
    r64 = rows.to(tl.int64)
    codes_ptr = _part(base, offs, 0, tl.uint8)
    byte_offs = r64[:, None, None] * row_bytes + gi[None, :, None] * GB + bi[None, None, :]
    side_offs = r64[:, None] * groups + gi[None, :]
    acc = tl.zeros([BN, NG, GB], dtype=tl.float32)
    row_scale = tl.zeros([BN, 1], dtype=tl.float32)  # q2 and q1 only
    row_offset = row_scale  # q2 only
    if FMT == 5:
        row_scale = tl.load(_part(base, offs, 3, tl.float32) + rows, mask=row_mask, other=0.0)[:, None]
        row_offset = tl.load(_part(base, offs, 4, tl.float32) + rows, mask=row_mask, other=0.0)[:, None]
    if FMT == 6:
        row_scale = tl.load(_part(base, offs, 2, tl.float32) + rows, mask=row_mask, other=0.0)[:, None]
    if PREFETCH:
        first = row_mask[:, None] & (gi < groups)[None, :]
        b_next = tl.load(codes_ptr + byte_offs, mask=first[:, :, None], other=0)
        for g0 in range(0, groups, NG):
            b = b_next
            following = row_mask[:, None] & (g0 + NG + gi < groups)[None, :]
            b_next = tl.load(codes_ptr + byte_offs + (g0 + NG) * GB, mask=following[:, :, None], other=0)
            acc = _group_step(acc, b.to(tl.int32), base, offs, x_ptr, g0, gi, r64, row_mask, side_offs, groups,
                              row_scale, row_offset, K, FMT, SUB, G, GB, PER, ASYM)
    else:
        for g0 in range(0, groups, NG):
            mask2 = row_mask[:, None] & (g0 + gi < groups)[None, :]
            b = tl.load(codes_ptr + byte_offs + g0 * GB, mask=mask2[:, :, None], other=0).to(tl.int32)
            acc = _group_step(acc, b, base, offs, x_ptr, g0, gi, r64, row_mask, side_offs, groups, row_scale,
                              row_offset, K, FMT, SUB, G, GB, PER, ASYM)
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _group_step(acc, b, base, offs, x_ptr, g0, gi, r64, row_mask, side_offs, groups, row_scale, row_offset, K,
                FMT: tl.constexpr, SUB: tl.constexpr, G: tl.constexpr, GB: tl.constexpr, PER: tl.constexpr,
                ASYM: tl.constexpr):
    """acc [BN, NG, GB] + the products of one step's codes `b` (int32 bytes) with x, scaled per group."""
    gmask = g0 + gi < groups
    mask2 = row_mask[:, None] & gmask[None, :]
    xs = _x_split(x_ptr, g0 * G, gi, gmask, GB, G, PER)
    if FMT == 3 and SUB == 4 and not ASYM:  # int4: (u - 8) * scale, the 8 taken off in _small_int
        scale = tl.load(_part(base, offs, 1, tl.float16) + side_offs + g0, mask=mask2, other=0.0).to(tl.float32)
        lo, hi = _small_int(b & 15, 8.0), _small_int(b >> 4, 8.0)
        acc += scale[:, :, None] * (lo * xs[0][None] + hi * xs[1][None])
    elif FMT == 3:  # int3-int6: u = low | high << WL; (u - 2^(bits-1)) * scale, or u * scale + offset
        scale = tl.load(_part(base, offs, 1, tl.float16) + side_offs + g0, mask=mask2, other=0.0).to(tl.float32)
        if PER == 2:  # a 4-bit low plane
            dot = _small_int(b & 15, 0.0) * xs[0][None] + _small_int(b >> 4, 0.0) * xs[1][None]
            xsum = xs[0] + xs[1]
        else:  # int3's 2-bit low plane
            dot = _small_int(b & 3, 0.0) * xs[0][None] + _small_int((b >> 2) & 3, 0.0) * xs[1][None] \
                + _small_int((b >> 4) & 3, 0.0) * xs[2][None] + _small_int(b >> 6, 0.0) * xs[3][None]
            xsum = xs[0] + xs[1] + xs[2] + xs[3]
        if ASYM:
            offset = tl.load(_part(base, offs, 2, tl.float16) + side_offs + g0, mask=mask2,
                             other=0.0).to(tl.float32)
            acc += scale[:, :, None] * dot + offset[:, :, None] * xsum[None]
        else:
            acc += scale[:, :, None] * (dot - (1 << (SUB - 1)) * xsum[None])
        WL: tl.constexpr = 8 // PER
        WH: tl.constexpr = SUB - WL
        if WH > 0:
            # The high plane's codes weigh 2^WL. Its dot has its own split of x ([.., G / (8 / WH)]), so
            # its per-group sum is spread evenly over the low plane's GB lanes (GB is a power of 2: exact).
            PH: tl.constexpr = 8 // WH
            GH: tl.constexpr = G // PH
            hb = tl.load(_part(base, offs, 3, tl.uint8) + r64[:, None, None] * (K // PH)
                         + (g0 + gi)[None, :, None] * GH + tl.arange(0, GH)[None, None, :],
                         mask=mask2[:, :, None], other=0).to(tl.int32)
            xh = _x_split(x_ptr, g0 * G, gi, gmask, GH, G, PH)
            high = tl.zeros(hb.shape, dtype=tl.float32)
            for j in tl.static_range(PH):
                high += _small_int((hb >> (j * WH)) & ((1 << WH) - 1), 0.0) * xh[j][None]
            acc += (scale * tl.sum(high, axis=2) * ((1 << WL) / GB))[:, :, None]
    elif FMT == 4:  # mxfp4: E2M1 * 2^(scale byte - 127)
        e8 = tl.load(_part(base, offs, 1, tl.uint8) + side_offs + g0, mask=mask2, other=127).to(tl.int32)
        scale = _e8m0(e8)
        acc += scale[:, :, None] * (_e2m1(b & 15) * xs[0][None] + _e2m1(b >> 4) * xs[1][None])
    elif FMT == 5:  # q2: u * (row_scale * scale) + row_offset * offset
        step = row_scale * _e4m3(_part(base, offs, 1, tl.uint8), side_offs + g0, mask2)
        zero = row_offset * _e4m3(_part(base, offs, 2, tl.uint8), side_offs + g0, mask2)
        dot = _small_int(b & 3, 0.0) * xs[0][None] + _small_int((b >> 2) & 3, 0.0) * xs[1][None] \
            + _small_int((b >> 4) & 3, 0.0) * xs[2][None] + _small_int(b >> 6, 0.0) * xs[3][None]
        acc += step[:, :, None] * dot + zero[:, :, None] * (xs[0] + xs[1] + xs[2] + xs[3])[None]
    else:  # q1: (2 b - 1) * row_scale * scale
        step = row_scale * _e4m3(_part(base, offs, 1, tl.uint8), side_offs + g0, mask2)
        signed = tl.zeros(b.shape, dtype=tl.float32)
        for j in tl.static_range(8):  # + x where the bit is set, - x where not: a select, no conversion
            xj = xs[j][None]
            signed += tl.where(((b >> j) & 1) != 0, xj, -xj)
        acc += step[:, :, None] * signed
    return acc


@triton.jit
def _rows_dot(base, offs, x_ptr, rows, row_mask, K, FMT: tl.constexpr, SUB: tl.constexpr, G: tl.constexpr,
              NG: tl.constexpr, BN: tl.constexpr, ASYM: tl.constexpr, PREFETCH: tl.constexpr):
    """sum_k W[rows, k] x[k] of the expert whose offsets row is `offs`, any format: float32 [BN]."""
    if FMT == 0:
        if SUB == 0:
            w_ptr = _part(base, offs, 0, tl.bfloat16)
        elif SUB == 1:
            w_ptr = _part(base, offs, 0, tl.float16)
        else:
            w_ptr = _part(base, offs, 0, tl.float32)
        total = _bytewise_dot(w_ptr, x_ptr, rows, row_mask, K, FMT, BN, G, PREFETCH)
    elif FMT == 1:
        total = _bytewise_dot(_part(base, offs, 0, tl.int8), x_ptr, rows, row_mask, K, FMT, BN, G, PREFETCH)
        total *= tl.load(_part(base, offs, 1, tl.float32) + rows, mask=row_mask, other=0.0)
    elif FMT == 2:
        total = _bytewise_dot(_part(base, offs, 0, tl.uint8), x_ptr, rows, row_mask, K, FMT, BN, G, PREFETCH)
        total *= tl.load(_part(base, offs, 1, tl.float32) + rows, mask=row_mask, other=0.0)
    else:
        total = _grouped_dot(base, offs, x_ptr, rows, row_mask, K, FMT, SUB, G, NG, BN, ASYM, PREFETCH)
    return total


@triton.jit
def _bias(base, offs, rows, row_mask, HAS_BIAS: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The expert's bias at `rows` (float32), or 0."""
    if HAS_BIAS:
        b = tl.load((base + tl.load(offs + 5)).to(tl.pointer_type(OUT_DTYPE)) + rows, mask=row_mask,
                    other=0.0).to(tl.float32)
    else:
        b = tl.zeros(rows.shape, dtype=tl.float32)
    return b


# ---- routing --------------------------------------------------------------------------------------------

@triton.jit
def _router_kernel(x_ptr, w_ptr, b_ptr, out_ptr, E, H, BE: tl.constexpr, BH: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program i: logits of experts i*BE.. = router rows . x (float32 weights, x widened), + bias."""
    rows = tl.program_id(0) * BE + tl.arange(0, BE)
    row_mask = rows < E
    hs = tl.arange(0, BH)
    acc = tl.zeros([BE, BH], dtype=tl.float32)
    for h0 in range(0, H, BH):
        cmask = h0 + hs < H
        w = tl.load(w_ptr + rows[:, None] * H + h0 + hs[None, :], mask=row_mask[:, None] & cmask[None, :], other=0.0)
        x = tl.load(x_ptr + h0 + hs, mask=cmask, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    logits = tl.sum(acc, axis=1)
    if HAS_BIAS:
        logits += tl.load(b_ptr + rows, mask=row_mask, other=0.0)
    tl.store(out_ptr + rows, logits, mask=row_mask)


@triton.jit
def _route(logits_ptr, slot, E, EP: tl.constexpr, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr):
    """(expert, weight) of `slot` (0 .. TOP_K-1, best first): softmax over the E logits, the TOP_K
    largest probabilities (ties to the lower index), renormalised to sum 1 when NORMALIZE."""
    ei = tl.arange(0, EP)
    logits = tl.load(logits_ptr + ei, mask=ei < E, other=float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    work = tl.where(ei < E, p, -1.0)
    expert = slot * 0
    weight = 0.0
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(work, axis=0)
        index = tl.min(tl.where(work == best, ei, EP), axis=0)
        total += best
        expert = tl.where(slot == j, index, expert)
        weight = tl.where(slot == j, best, weight)
        work = tl.where(ei == index, -1.0, work)
    if NORMALIZE:
        weight = weight / total
    return expert, weight


# ---- the expert kernels ---------------------------------------------------------------------------------

@triton.jit
def _gate_up_kernel(base, gate_table, up_table, member_ptr, logits_ptr, chosen_ptr, weights_ptr, x_ptr, h_ptr, E, K, n,
                    up_row0,
                    alpha, limit, up_offset,
                    FMT: tl.constexpr, SUB: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, BN: tl.constexpr,
                    ASYM: tl.constexpr, HAS_BIAS: tl.constexpr, EP: tl.constexpr, TOP_K: tl.constexpr,
                    NORMALIZE: tl.constexpr, ACT: tl.constexpr, CLAMP: tl.constexpr, GAIN: tl.constexpr,
                    PREFETCH: tl.constexpr, FUSED: tl.constexpr):
    """Program (slot, i): h[slot, i*BN..] = act(gate) * (up + up_offset) of the slot's expert, as the
    torch path rounds it (projection outputs, then the product, in h's dtype). FUSED: gate and up
    are row halves of one weight, read in one pass over x (gate row r and up row n + r interleaved in
    a tile of 2 * BN rows)."""
    slot = tl.program_id(0)
    expert, weight = _route(logits_ptr, slot, E, EP, TOP_K, NORMALIZE)
    if tl.program_id(1) == 0:  # for the down kernel (every format's launch stores the same)
        tl.store(chosen_ptr + slot, expert)
        tl.store(weights_ptr + slot, weight)
    member = tl.load(member_ptr + expert)
    if member >= 0:
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        row_mask = rows < n
        dtype: tl.constexpr = h_ptr.dtype.element_ty
        g_offs = gate_table + member * 6
        u_offs = up_table + member * 6
        if FUSED:
            both = tl.reshape(tl.join(rows, rows + up_row0), [2 * BN])
            both_mask = tl.reshape(tl.join(rows, rows), [2 * BN]) < n
            total = _rows_dot(base, g_offs, x_ptr, both, both_mask, K, FMT, SUB, G, NG, 2 * BN, ASYM, PREFETCH)
            gate, up = tl.split(tl.reshape(total, [BN, 2]))
        else:
            gate = _rows_dot(base, g_offs, x_ptr, rows, row_mask, K, FMT, SUB, G, NG, BN, ASYM, PREFETCH)
            up = _rows_dot(base, u_offs, x_ptr, rows + up_row0, row_mask, K, FMT, SUB, G, NG, BN, ASYM, PREFETCH)
        gate = (gate + _bias(base, g_offs, rows, row_mask, HAS_BIAS, dtype)).to(dtype).to(tl.float32)
        up = (up + _bias(base, u_offs, rows + up_row0, row_mask, HAS_BIAS, dtype)).to(dtype).to(tl.float32)
        if CLAMP:  # GPT-OSS: gate clamped from above, up on both sides
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        if GAIN:  # noqa: SIM108  (constexpr branches: only one is compiled). silu with a gain
            act = gate * (1.0 / (1.0 + tl.exp(tl.minimum(-alpha * gate, 80.0))))
        else:
            act = activate(gate, ACT)
        act = act.to(dtype).to(tl.float32)
        up = (up + up_offset).to(dtype).to(tl.float32)
        tl.store(h_ptr + slot * n + rows, (act * up).to(dtype), mask=row_mask)


@triton.jit
def _down_kernel(base, table, member_ptr, chosen_ptr, weights_ptr, h_ptr, out_ptr, K, n,
                 FMT: tl.constexpr, SUB: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, BN: tl.constexpr,
                 ASYM: tl.constexpr, HAS_BIAS: tl.constexpr, PREFETCH: tl.constexpr):
    """Program (slot, i): out[slot, i*BN..] = w_slot * (down h[slot] + bias), float32, each factor
    rounded to h's dtype as the torch path rounds it."""
    slot = tl.program_id(0)
    expert = tl.load(chosen_ptr + slot)
    weight = tl.load(weights_ptr + slot)
    member = tl.load(member_ptr + expert)
    if member >= 0:
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        row_mask = rows < n
        dtype: tl.constexpr = h_ptr.dtype.element_ty
        offs = table + member * 6
        y = _rows_dot(base, offs, h_ptr + slot * K, rows, row_mask, K, FMT, SUB, G, NG, BN, ASYM, PREFETCH)
        y = (y + _bias(base, offs, rows, row_mask, HAS_BIAS, dtype)).to(dtype).to(tl.float32)
        w = weight.to(dtype).to(tl.float32)
        tl.store(out_ptr + slot * n + rows, (y * w).to(dtype).to(tl.float32), mask=row_mask)


# ---- launchers --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertConfig:
    """Tiles of one expert kernel: `block_n` rows a program, `groups` format groups a loop step
    (columns per step for one-byte and dense formats), `num_warps`."""

    block_n: int
    groups: int
    num_warps: int = 4
    prefetch: bool = False  # load the next step's weights before this step's math


def weight_parts(op) -> tuple[str, dict, tuple]:
    """(format, {part: tensor}, params) of a LinearOp's weight as the executor holds it: the dense
    tensor of a dense op, the packed parts (views, no copy) of a quantized one."""
    weight = getattr(op, "weight", None)
    if isinstance(weight, torch.Tensor):
        return op.format, {"weight": weight}, ()
    raw, shape, params = getattr(op, "raw", None), getattr(op, "shape", None), getattr(op, "params", ())
    if raw is None or shape is None:
        raise NotImplementedError(f"{op!r} exposes neither a dense weight nor its packed bytes")
    fmt = formats.get(op.format)
    return op.format, fmt.split(raw, tuple(shape), params), tuple(fmt.normalize(params))


class _Group:
    """The experts of one layer that share a format: their offset tables and launch constants."""

    def __init__(self, key, members: list[int], num_experts: int, gate_ops, up_ops, down_ops, fused: bool,
                 device, dtype):
        fmt_name, dense_dtype, params, has_bias = key
        self.fmt = _CODES[fmt_name]
        self.params = dict(params)
        self.dt = int(fmt_name[3:]) if self.fmt == GINT else _DENSE_DTYPES.get(dense_dtype, 0)
        self.asym = bool(self.params.get("asymmetric", 0))
        self.group = {GINT: self.params.get("group_size", 0), MXFP4: 32, Q2: self.params.get("group_size", 0),
                      Q1: self.params.get("group_size", 0)}.get(self.fmt, 0)
        self.has_bias = has_bias
        self.fused = fused
        member = torch.full((num_experts,), -1, dtype=torch.int32)
        member[torch.tensor(members, dtype=torch.long)] = torch.arange(len(members), dtype=torch.int32)
        self.member = member.to(device)
        self.ops = (gate_ops, up_ops, down_ops)
        self.tensors = []  # every tensor whose address a table holds (kept alive here too)
        self.addresses = {}
        for role, ops in (("gate", gate_ops), ("up", up_ops), ("down", down_ops)):
            rows = []
            for op in ops:
                _, parts, _ = weight_parts(op)
                names = list(_PARTS[self.fmt])
                if self.fmt == GINT and "codes_low" in parts:
                    names[0] = "codes_low"
                row = [parts.get(name) for name in names]  # absent parts (offsets, a high plane): 0
                self.tensors += [t for t in row if t is not None]
                if op.bias is not None:
                    self.tensors.append(op.bias)
                rows.append([t.data_ptr() if t is not None else 0 for t in row] + [0] * (5 - len(row))
                            + [op.bias.data_ptr() if op.bias is not None else 0])
            self.addresses[role] = rows

    def tables(self, base: int, device) -> None:
        for role, rows in self.addresses.items():
            table = torch.tensor([[a - base if a else 0 for a in row] for row in rows], dtype=torch.int64)
            if (table < 0).any():
                raise NotImplementedError("an expert part below the base address")
            if (table[:, :5] % 16).any():
                raise NotImplementedError("an expert part is not 16-byte aligned")
            setattr(self, f"{role}_table", table.to(device))


class MoEKernels:
    """The decode path of one MoE layer (executor's MoEPlan) on the kernels above (`tune`: time the
    launch tiles on a GPU, else take the first candidate).

    `__call__(x, partials)` reads x [hidden], writes partials[:top_k] (float32 [top_k, hidden]) and
    returns that view: the caller adds its rows into the residual."""

    def __init__(self, plan, device: torch.device, dtype: torch.dtype, *, tune: bool = True):
        if plan.scoring != "softmax":
            raise NotImplementedError(f"router scoring {plan.scoring!r}")
        if plan.shared_expert is not None:
            raise NotImplementedError("shared experts (Qwen2-MoE)")
        experts = plan.experts
        if any(e is None for e in experts) or getattr(plan, "cache", None) is not None:
            raise NotImplementedError("experts kept in host memory (the expert cache)")
        first = experts[0]
        if any(not e.gated for e in experts) or any(e.activation not in ACTIVATION_CODES for e in experts):
            raise NotImplementedError("experts that are not gated MLPs of a known activation")
        clamps = {(e.activation, e.alpha, e.limit, e.up_offset, len(e.up)) for e in experts}
        if len(clamps) != 1:
            raise NotImplementedError("experts of one layer with different activations or clamps")
        self.device, self.dtype, self.tune = torch.device(device), dtype, tune
        self.num_experts, self.top_k, self.normalize = len(experts), plan.top_k, plan.normalize_top_k
        if self.num_experts > 256:
            raise NotImplementedError(f"{self.num_experts} experts (at most 256)")
        self.hidden = first.down.out_features
        self.inter = first.down.in_features
        if any(e.down.out_features != self.hidden or e.down.in_features != self.inter for e in experts):
            raise NotImplementedError("experts of different shapes in one layer")
        self.act, self.alpha, self.limit, self.up_offset = first.activation, first.alpha, first.limit, first.up_offset
        self.fused = len(first.up) == 1
        self.router_weight = plan.router_weight.contiguous()
        self.router_bias = plan.router_bias
        groups: dict = {}
        for e, mlp in enumerate(experts):
            ops = mlp.up + [mlp.down]
            keys = set()
            for op in ops:
                fmt, parts, params = weight_parts(op)
                if fmt not in _CODES:
                    raise NotImplementedError(f"{fmt} experts (the expert kernels read {', '.join(SUPPORTED)})")
                if op.bias is not None and op.bias.dtype != dtype:
                    raise NotImplementedError("expert biases in another dtype than the activations")
                dense = parts["weight"].dtype if "weight" in parts else None
                keys.add((fmt, dense, params, op.bias is not None))
            if len(keys) != 1:
                raise NotImplementedError("an expert whose projections differ in format")
            groups.setdefault(keys.pop(), []).append(e)
        self.groups = []
        for key, members in groups.items():
            gate = [experts[e].up[0] for e in members]
            up = gate if self.fused else [experts[e].up[1] for e in members]
            down = [experts[e].down for e in members]
            self.groups.append(_Group(key, members, self.num_experts, gate, up, down, self.fused, self.device, dtype))
        for g in self.groups:
            if g.group and (self.hidden % g.group or self.inter % g.group):
                raise NotImplementedError(f"expert shapes that groups of {g.group} columns do not divide")
        # The lowest address of all is the base: every table entry is a non-negative byte offset.
        anchor = min((t for g in self.groups for t in g.tensors), key=lambda t: t.data_ptr())
        if not anchor.is_contiguous():
            raise NotImplementedError("expert weights that are not contiguous")
        self.base = anchor.reshape(-1).view(torch.uint8)
        for g in self.groups:
            g.tables(anchor.data_ptr(), self.device)
        self.logits = torch.zeros(self.num_experts, dtype=torch.float32, device=self.device)
        self.h = torch.zeros(self.top_k, self.inter, dtype=dtype, device=self.device)
        # The routing of the last token: experts best first and their weights (gate/up writes, down reads).
        self.chosen = torch.zeros(self.top_k, dtype=torch.int32, device=self.device)
        self.weights = torch.zeros(self.top_k, dtype=torch.float32, device=self.device)
        self._configs: dict = {}

    # ---- configurations ----

    def candidates(self, group: _Group, kind: str) -> list[ExpertConfig]:
        """Tiles worth timing for `group`'s gate/up ("gate_up") or down ("down") kernel; first is the default."""
        K = self.hidden if kind == "gate_up" else self.inter
        n = self.inter if kind == "gate_up" else self.hidden
        if interpreting():  # the whole row in one step, and with the prefetch's masked extra step
            cols = next_power_of_2(K)
            ng = cols // group.group if group.group else cols
            return [ExpertConfig(min(next_power_of_2(n), 64), ng), ExpertConfig(16, max(1, ng // 2), 4, True)]
        if group.group:  # groups a step: 256 or 512 columns, at most the row's
            steps = [min(max(1, c // group.group), next_power_of_2(K // group.group)) for c in (256, 512)]
            tiles = [(bn, step, w) for step in steps for bn, w in ((16, 4), (8, 4), (32, 8))]
        else:
            tiles = [(bn, min(bk, next_power_of_2(K)), w) for bk in (256, 512) for bn, w in ((8, 4), (16, 4), (4, 2))]
        out = []
        for prefetch in (False, True):
            for bn, step, w in tiles[:4] if prefetch else tiles:
                config = ExpertConfig(bn, step, w, prefetch)
                if config not in out:
                    out.append(config)
        return out

    def config(self, index: int, kind: str) -> ExpertConfig:
        """The tiles of group `index`'s `kind` kernel: the first candidate off a GPU, else the fastest,
        timed once per shape and format in this process (every layer of a model shares it)."""
        key = (index, kind)
        if key not in self._configs:
            g = self.groups[index]
            shape = (kind, g.fmt, g.dt, g.group, g.asym, g.has_bias, self.hidden, self.inter, self.num_experts,
                     self.top_k, len(self.groups), str(self.dtype), str(self.device))
            candidates = self.candidates(g, kind)
            if len(candidates) == 1 or self.device.type != "cuda" or not self.tune:
                self._configs[key] = candidates[0]
            else:
                if shape not in _CHOSEN:
                    times = {c: self._time(index, kind, c) for c in candidates}
                    best = min(times, key=times.get)
                    if times[best] == float("inf"):
                        raise RuntimeError(f"no launch tiling of the {kind} expert kernel compiles here")
                    _CHOSEN[shape] = best
                self._configs[key] = _CHOSEN[shape]
        return self._configs[key]

    def _time(self, index: int, kind: str, config: ExpertConfig) -> float:
        """Median milliseconds of one launch with `config`; infinite when it does not compile here (a
        tiling past the registers or shared memory this GPU has)."""
        x = torch.randn(self.hidden, device=self.device).to(self.dtype)
        out = torch.empty(self.top_k, self.hidden, dtype=torch.float32, device=self.device)
        ready = []

        def launch():
            if not ready:  # the first (compiling) call also routes x, which the down kernel reads
                self.route(x)
                self._gate_up(index, x, self.candidates(self.groups[index], "gate_up")[0])
                ready.append(True)
            if kind == "gate_up":
                self._gate_up(index, x, config)
            else:
                self._down(index, out, config)

        return median_ms_or_inf(launch, repeats=5, inner=10, device=self.device)

    def warm_up(self) -> None:
        """Choose every kernel's tiles now (timed on a GPU), not inside the first decode step."""
        for index in range(len(self.groups)):
            self.config(index, "gate_up")
            self.config(index, "down")

    # ---- launches ----

    def route(self, x: torch.Tensor) -> None:
        """self.logits = router logits of x [hidden] (float32)."""
        E, H = self.num_experts, self.hidden
        block_e = max(1, min(16, E // 64)) if not interpreting() else next_power_of_2(E)
        block_h = min(next_power_of_2(H), 1024 if interpreting() else 512)
        _router_kernel[(-(-E // block_e),)](x, self.router_weight, self.router_bias if self.router_bias is not None
                                            else self.logits, self.logits, E, H, BE=block_e, BH=block_h,
                                            HAS_BIAS=self.router_bias is not None, num_warps=4)

    def _common(self, g: _Group) -> dict:
        return dict(FMT=g.fmt, SUB=g.dt, ASYM=g.asym, HAS_BIAS=g.has_bias)

    def _gate_up(self, index: int, x: torch.Tensor, config: ExpertConfig) -> None:
        g = self.groups[index]
        n = self.inter
        grid = (self.top_k, -(-n // config.block_n))
        _gate_up_kernel[grid](
            self.base, g.gate_table, g.up_table, g.member, self.logits, self.chosen, self.weights, x, self.h,
            self.num_experts, self.hidden, n, n if self.fused else 0, float(self.alpha),
            float(self.limit if self.limit is not None else 0.0), float(self.up_offset),
            G=g.group or config.groups, NG=config.groups if g.group else 1, BN=config.block_n,
            ACT=ACTIVATION_CODES[self.act], CLAMP=self.limit is not None, GAIN=self.alpha != 1.0,
            EP=max(2, next_power_of_2(self.num_experts)), TOP_K=self.top_k, NORMALIZE=self.normalize,
            FUSED=self.fused, PREFETCH=config.prefetch, num_warps=config.num_warps, **self._common(g))

    def _down(self, index: int, out: torch.Tensor, config: ExpertConfig) -> None:
        g = self.groups[index]
        n = self.hidden
        grid = (self.top_k, -(-n // config.block_n))
        _down_kernel[grid](
            self.base, g.down_table, g.member, self.chosen, self.weights, self.h, out, self.inter, n,
            G=g.group or config.groups, NG=config.groups if g.group else 1, BN=config.block_n,
            PREFETCH=config.prefetch, num_warps=config.num_warps, **self._common(g))

    def __call__(self, x: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
        """partials[:top_k] = the k chosen experts' weighted outputs for x [hidden]; returns that view."""
        out = partials[:self.top_k]
        self.route(x)
        for index in range(len(self.groups)):
            self._gate_up(index, x, self.config(index, "gate_up"))
        for index in range(len(self.groups)):
            self._down(index, out, self.config(index, "down"))
        return out


def reference(x: torch.Tensor, plan) -> torch.Tensor:
    """What MoEKernels computes, through the executor's torch path: the MoE output [hidden] for x [hidden]."""
    from ..ffn import run_moe

    return run_moe(x[None], plan)[0]
