"""Grouped-int experts (int3-int6) read as whole 32-bit words: the expert kernels' second way of
reading an expert's rows (experts.py launches it where the launch tuner picks it; expert_rows.py's
rows_dot is the first, one byte per code group element).

The dense grouped-int matvec's "chunk" scheme (tiles.py): a lane owns one chunk of 32 columns of
every row of its tile and loads the chunk's words of each row in one 4 * WL-byte load, the warps
take further chunks, and nothing crosses lanes until the row sums. Codes become floats in place with
the zero point folded in (tiles.octet_dot), or, for symmetric int4 under bfloat16 activations, two
weights an instruction as bfloat16 pairs (pairs.py, which says what that costs in precision). The
group scale (and offset) multiplies a chunk's sum once. A tile is BN output rows, or with GLU the
gate row r and the up row n + r of each (one fused gate/up weight, one pass over x).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .expert_rows import _part
from .pairs import pair_sum, word_dot, x_pairs
from .tiles import chunk_side, octet_dot, plane_words, tile_rows, tile_starts, upper_halves, x_octet, x_sum8


@triton.jit
def words_dot(base, offs, x_ptr, pid, n, K, magic, WL: tl.constexpr, WH: tl.constexpr, ASYM: tl.constexpr,
              G: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, GLU: tl.constexpr, EVEN_N: tl.constexpr,
              EVEN_K: tl.constexpr, ASM: tl.constexpr, PACKED: tl.constexpr, ZERO_BITS: tl.constexpr):
    """sum_k W[rows, k] x[k] over the rows of tile `pid` (tiles.tile_rows: BN rows, or with GLU
    2 * BN interleaved gate/up rows) of the grouped-int expert whose offsets row is `offs`, float32.

    Each step covers C chunks of 32 columns of every row: the low plane's WL words (and the high
    plane's WH) of each row and chunk in one load per lane, x loaded once per chunk and shared by
    the rows. PACKED (symmetric int4, bf16 x 4-byte aligned; magic = pairs.PAIR_MAGIC, ZERO_BITS =
    pairs.zero_pair(8)): products summed as bf16 pairs within a chunk; else magic = 2^23's bits."""
    MID: tl.constexpr = 1 << (WL + WH - 1)
    rows, row_mask = tile_rows(pid, n, BN, GLU)
    total = K // 32
    starts = tile_starts(pid, n, total, BN, GLU, ASM)
    low_ptr = _part(base, offs, 0, tl.int32)
    high_ptr = _part(base, offs, 3, tl.int32)
    scale_ptr = _part(base, offs, 1, tl.float16)
    offset_ptr = _part(base, offs, 2, tl.float16)
    groups = K // G
    ci = tl.arange(0, C)
    acc = tl.zeros([rows.shape[0], C], dtype=tl.float32)
    for c0 in range(0, total, C):
        chunk = c0 + ci
        cmask = chunk < total
        low = plane_words(low_ptr, starts, row_mask, c0, total, C, WL, EVEN_N, EVEN_K, ASM)
        xsum = tl.zeros([C], dtype=tl.float32)
        if PACKED:
            pairs = tl.zeros([rows.shape[0], C], dtype=tl.int32)  # bf16 pairs (0, 0)
            for o in tl.static_range(4):
                pairs = word_dot(pairs, low[o], x_pairs(x_ptr, 32 * chunk + 8 * o, cmask, EVEN_K, ASM), magic,
                                 ZERO_BITS, ASM)
            dot = pair_sum(pairs)
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
        if ASYM:
            offset = chunk_side(offset_ptr, pid, n, groups, c0, total, G // 32, C, BN, GLU, EVEN_N, EVEN_K, ASM)
            acc += scale.to(tl.float32) * dot + offset.to(tl.float32) * xsum[None, :]
        else:
            acc += scale.to(tl.float32) * dot
    return tl.sum(acc, axis=1)
