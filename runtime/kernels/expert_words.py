"""Grouped-int (int3-int6) and mxfp4 experts read as whole 32-bit words: the expert kernels' second way of
reading an expert's rows (experts.py launches it where the launch tuner picks it; expert_rows.py's
rows_dot is the first, one byte per code group element).

The dense grouped-int matvec's "chunk" scheme (tiles.py): a lane owns one chunk of 32 columns of
every row of its tile and loads the chunk's words of each row in one 4 * WL-byte load, the warps
take further chunks, and nothing crosses lanes until the row sums. Codes become floats in place with
the zero point folded in (tiles.octet_dot), or, for symmetric int4 under bfloat16 activations, two
weights an instruction as bfloat16 pairs (pairs.py, which says what that costs in precision). The
group scale (and offset) multiplies a chunk's sum once. A tile is BN output rows, or with GLU the
gate row r and the up row n + r of each (one fused gate/up weight, one pass over x).

mxfp4 (a chunk is one block of 32 codes and its E8M0 scale): an E2M1 code s e1 e0 m becomes a
float32 by moving its bits into place, e1 e0 into the exponent's low bits and m into the mantissa's
top bit, s into the sign: 2^(e - 127) (1 + m / 2) for e >= 1, and for e = 0 the subnormal m * 2^-127,
so every code is exactly 2^-126 times its E2M1 value (2 shifts and 2 logic ops a code, no select).
x is taken times 2^100 (products stay normal floats: exact as the byte path's) and the chunk's
sum times 2^26 before its block scale. PACKED (bf16 x): the same bits moved into bf16 pairs (codes
k and k + 4 of a word, as pairs.py pairs int4 codes; bf16 has float32's exponent range, so 2^-126
times a value is again exact, subnormal for e = 0), x times 2^100 as bf16 pairs, two products an
instruction, summed in bf16 within a chunk (pairs.py says what that costs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .expert_rows import _e8m0, _part
from .pairs import CODE_UNIT, SUM_UP, e2m1_word_dot, pair_sum, word_dot, x_pairs
from .tiles import chunk_side, octet_dot, plane_words, tile_rows, tile_starts, upper_halves, x_octet, x_sum8


@triton.jit
def _e2m1_term(acc, w, x, P: tl.constexpr):
    """acc + 2^-126 * E2M1(code P of words w) * x (code P at bits 4P..4P+3; see the module's note)."""
    MS: tl.constexpr = 22 - 4 * P  # the magnitude's shift (right for codes 6 and 7; the mask drops the rest)
    if MS >= 0:  # noqa: SIM108  (constexpr branches: only one is compiled)
        magnitude = (w << MS) & 0x01C00000
    else:
        magnitude = (w >> -MS) & 0x01C00000
    sign = (w << (28 - 4 * P)) & SIGN_BIT
    return acc + (magnitude | sign).to(tl.float32, bitcast=True) * x


SIGN_BIT = tl.constexpr(-2147483648)  # 0x80000000 as an int32
X_UP = tl.constexpr(1.2676506002282294e30)  # 2^100: mxfp4's products x * 2^-126 * value stay normal


@triton.jit
def words_dot(base, offs, x_ptr, pid, n, K, magic, FMT: tl.constexpr, SUB: tl.constexpr, ASYM: tl.constexpr,
              G: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, GLU: tl.constexpr, EVEN_N: tl.constexpr,
              EVEN_K: tl.constexpr, ASM: tl.constexpr, PACKED: tl.constexpr, ZERO_BITS: tl.constexpr):
    """sum_k W[rows, k] x[k] over the rows of tile `pid` (tiles.tile_rows: BN rows, or with GLU
    2 * BN interleaved gate/up rows) of the expert whose offsets row is `offs`, float32: FMT 3, a
    grouped int of SUB bits (expert_rows.GINT), or 4, mxfp4 (expert_rows.MXFP4).

    Each step covers C chunks of 32 columns of every row: the low plane's WL words (and the high
    plane's WH) of each row and chunk in one load per lane, x loaded once per chunk and shared by
    the rows. PACKED (symmetric int4, bf16 x 4-byte aligned; ZERO_BITS = pairs.code_zero(8)), or mxfp4
    under bf16 x: products summed as bf16 pairs within a chunk; magic = 2^23's bits (the float path's)."""
    MX: tl.constexpr = FMT == 4
    WL: tl.constexpr = 2 if SUB == 3 else 4  # the low (or mxfp4's only) plane's bits
    WH: tl.constexpr = 0 if MX else SUB - WL
    MID: tl.constexpr = 1 << (WL + WH - 1)
    rows, row_mask = tile_rows(pid, n, BN, GLU)
    total = K // 32
    starts = tile_starts(pid, n, total, BN, GLU, ASM)
    low_ptr = _part(base, offs, 0, tl.int32)
    high_ptr = _part(base, offs, 3, tl.int32)
    scale_ptr = _part(base, offs, 1, tl.uint8 if MX else tl.float16)
    offset_ptr = _part(base, offs, 2, tl.float16)
    groups = K // G
    ci = tl.arange(0, C)
    acc = tl.zeros([rows.shape[0], C], dtype=tl.float32)
    for c0 in range(0, total, C):
        chunk = c0 + ci
        cmask = chunk < total
        low = plane_words(low_ptr, starts, row_mask, c0, total, C, WL, EVEN_N, EVEN_K, ASM)
        xsum = tl.zeros([C], dtype=tl.float32)
        if PACKED and MX:
            pairs = tl.zeros([rows.shape[0], C], dtype=tl.int32)  # bf16 pairs (0, 0)
            for o in tl.static_range(4):
                pairs = e2m1_word_dot(pairs, low[o], x_pairs(x_ptr, 32 * chunk + 8 * o, cmask, EVEN_K, ASM), ASM)
            dot = pair_sum(pairs)
        elif PACKED:
            pairs = tl.zeros([rows.shape[0], C], dtype=tl.int32)  # bf16 pairs (0, 0)
            for o in tl.static_range(4):
                pairs = word_dot(pairs, low[o], x_pairs(x_ptr, 32 * chunk + 8 * o, cmask, EVEN_K, ASM), ZERO_BITS,
                                 ASM)
            dot = pair_sum(pairs)
        elif MX:
            dot = tl.zeros([rows.shape[0], C], dtype=tl.float32)
            for o in tl.static_range(4):
                xs = x_octet(x_ptr, 32 * chunk + 8 * o, cmask, EVEN_K)
                for p in tl.static_range(8):
                    dot = _e2m1_term(dot, low[o], (xs[p] * X_UP)[None, :], p)
        else:
            low_up = upper_halves(low, WL, ASM)
            if WH > 0:
                high = plane_words(high_ptr, starts, row_mask, c0, total, C, WH, EVEN_N, EVEN_K, ASM)
                high_up = upper_halves(high, WH, ASM)
            dot = tl.zeros([rows.shape[0], C], dtype=tl.float32)
            for o in tl.static_range(4):
                xs = x_octet(x_ptr, 32 * chunk + 8 * o, cmask, EVEN_K)
                # Symmetric: u - MID through the low plane's add; the high plane's codes weigh 2^WL.
                dot = octet_dot(dot, low, low_up, xs, o, WL, 0 if ASYM else MID, 1.0, False, magic)
                if WH > 0:
                    dot = octet_dot(dot, high, high_up, xs, o, WH, 0, 1 << WL, False, magic)
                if ASYM:
                    xsum += x_sum8(xs)
        scale = chunk_side(scale_ptr, pid, n, groups, c0, total, G // 32, C, BN, GLU, EVEN_N, EVEN_K, ASM)
        if MX:  # 2^(byte - 127), the sum first brought back to the codes' values (2^26 apart: never inf)
            scale = _e8m0(scale.to(tl.int32))
            dot = dot * SUM_UP
        if ASYM:
            offset = chunk_side(offset_ptr, pid, n, groups, c0, total, G // 32, C, BN, GLU, EVEN_N, EVEN_K, ASM)
            acc += scale.to(tl.float32) * dot + offset.to(tl.float32) * xsum[None, :]
        else:
            acc += scale.to(tl.float32) * dot
    if PACKED and not MX:
        acc = acc * CODE_UNIT  # word_dot's unit (exact: a power of 2)
    return tl.sum(acc, axis=1)
