"""int3 / int4 / int5 / int6 (ir/formats/grouped_int.py): one matvec and one matmul for the
whole family, the code width a constexpr.

A b-bit code is a low plane of width WL (4, or 2 for int3) plus an optional high plane of width
WH (1 or 2); value = (u - 2^(b-1)) * scale (symmetric) or u * scale + offset (asymmetric), one
float16 scale (and offset) per group of G columns of a row. The matvec runs the chunk scheme
(tiles.py): a lane owns 32 columns of each row of its tile (16 bytes of a 4-bit plane), turns
each code into a float in place with the zero point folded into the same add (one logic op, one
add, one fused multiply-add a code and plane), and applies the group scale once per chunk
(asymmetric: offset * sum of the chunk's x as well). Symmetric int4 under bfloat16 activations has a
second arithmetic the launch tuner may pick (MatvecConfig.packed): two weights an instruction as
bfloat16 pairs, the chunk's sums in bf16 (pairs.py, which also says what that costs in precision).
A split-K matvec may also finish the residual add + RMSNorm in its last program (`matvec_finish`, as
rowwise8's: norm.Finish), also over an elastic prefix of the columns.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from thin.ir.formats.grouped_int import PLANES

from . import common, dependent, interpreting
from .chunks import chunk_candidates, chunk_launch, chunk_prefix
from .common import (
    MAGIC_BITS,
    KernelLinear,
    MatvecConfig,
    prefix_rows,
    sm_count,
)
from .dependent import release_next, wait_previous
from .grouped_int_batch import _codes
from .norm import deferred_args, deferred_epilogue, deferred_reads, finish_partials, holds_row, prefetch_norms
from .pairs import PAIR_MAGIC, pair_sum, word_dot, x_pairs, zero_pair
from .prefill import MatmulConfig, TiledPrefill, matmul_blocks, tile_candidates, token_bucket
from .tiles import (
    chunk_side,
    dot_tile,
    matmul_tile,
    octet_dot,
    plane_codes,
    plane_load,
    plane_words,
    split_sum,
    split_words,
    store_tile,
    tile_rows,
    tile_starts,
    upper_halves,
    x_octet,
    x_sum8,
)


@triton.jit
def _rows_dot(low_ptr, high_ptr, scale_ptr, offset_ptr, x_ptr, n, K: tl.constexpr, split_chunks, magic,
              WL: tl.constexpr, WH: tl.constexpr, MID: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr,
              C: tl.constexpr, BN: tl.constexpr, GLU: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
              ASM: tl.constexpr, PACKED: tl.constexpr, ZERO_BITS: tl.constexpr, AHEAD: tl.constexpr,
              PDL: tl.constexpr):
    """sum_k W[rows, k] * x[k] over the tile's rows (tiles.tile_rows) and this program's chunks
    (split `program_id(1)`), float32 [rows].

    One step covers C chunks of 32 columns of every row (tiles.py, "chunk" scheme): each plane's
    words and the chunk's activations are loaded once per lane, the codes of an octet of columns
    become floats in place (zero point folded in) and go into a per-chunk dot product, which is
    scaled by the chunk's group scale once (a chunk never straddles a group: G >= 32). PACKED
    (symmetric 4-bit codes, bf16 x; magic = pairs.PAIR_MAGIC, ZERO_BITS = pairs.zero_pair(MID)):
    the chunk's products are summed as bf16 pairs, word o of a row holding octet o's codes.
    AHEAD >= 1: the group scales (and offsets) are loaded one step ahead. ptxas sinks a load next to
    its first use, and theirs is the end of a step: loaded in the step before, their memory latency
    overlaps a whole step's math instead of following it. AHEAD 2: the low plane's words too, two
    steps ahead (one step ahead, ptxas would issue them at the end of the step before, just ahead of
    their use). PDL (dependent.py): the wait for the kernel before comes after the loads made ahead of
    the loop (the launcher makes a dependent's AHEAD 2), before the first activations."""
    pid = tl.program_id(0)
    rows, row_mask = tile_rows(pid, n, BN, GLU)
    total: tl.constexpr = K // 32  # K a constexpr: the tile's row strides fold into the side loads (row_starts)
    starts = tile_starts(pid, n, total, BN, GLU, ASM)
    begin = tl.program_id(1) * split_chunks
    end = tl.minimum(begin + split_chunks, total)
    ci = tl.arange(0, C)
    groups: tl.constexpr = K // G
    acc = tl.zeros([rows.shape[0], C], dtype=tl.float32)
    if AHEAD >= 2:  # the low plane's words two steps ahead
        words_1 = plane_load(low_ptr, starts, row_mask, begin, end, C, WL, EVEN_N, EVEN_K, ASM, True)
        words_2 = plane_load(low_ptr, starts, row_mask, begin + C, end, C, WL, EVEN_N, EVEN_K, ASM, True)
    if AHEAD:
        scale_ahead, offset_ahead = _sides(scale_ptr, offset_ptr, pid, n, groups, begin, end, G, C, BN, GLU, EVEN_N,
                                           ASYM, ASM)
    wait_previous(PDL)
    release_next(PDL)
    for c0 in range(begin, end, C):
        chunk = c0 + ci
        cmask = chunk < end
        if AHEAD:  # this step's, then the next step's (past the end: masked off)
            scale, offset = scale_ahead, offset_ahead
            scale_ahead, offset_ahead = _sides(scale_ptr, offset_ptr, pid, n, groups, c0 + C, end, G, C, BN, GLU,
                                               EVEN_N, ASYM, ASM)
        if AHEAD >= 2:
            low = split_words(words_1, WL)
            words_1 = words_2
            words_2 = plane_load(low_ptr, starts, row_mask, c0 + 2 * C, end, C, WL, EVEN_N, EVEN_K, ASM, True)
        else:
            low = plane_words(low_ptr, starts, row_mask, c0, end, C, WL, EVEN_N, EVEN_K, ASM)
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
                high = plane_words(high_ptr, starts, row_mask, c0, end, C, WH, EVEN_N, EVEN_K, ASM)
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
        if not AHEAD:
            scale = chunk_side(scale_ptr, pid, n, groups, c0, end, G // 32, C, BN, GLU, EVEN_N, EVEN_K, ASM)
            if ASYM:
                offset = chunk_side(offset_ptr, pid, n, groups, c0, end, G // 32, C, BN, GLU, EVEN_N, EVEN_K, ASM)
        if ASYM:
            acc += scale.to(tl.float32) * dot + offset.to(tl.float32) * xsum[None, :]
        else:
            acc += scale.to(tl.float32) * dot
    return tl.sum(acc, axis=1)


@triton.jit
def _sides(scale_ptr, offset_ptr, pid, n, groups, c0, end, G: tl.constexpr, C: tl.constexpr, BN: tl.constexpr,
           GLU: tl.constexpr, EVEN_N: tl.constexpr, ASYM: tl.constexpr, ASM: tl.constexpr):
    """(scales, offsets) of the step at c0 (tiles.chunk_side, masked: the step may lie past `end`);
    the offsets are the scales again when symmetric (never used)."""
    scale = chunk_side(scale_ptr, pid, n, groups, c0, end, G // 32, C, BN, GLU, EVEN_N, False, ASM)
    offset = scale
    if ASYM:
        offset = chunk_side(offset_ptr, pid, n, groups, c0, end, G // 32, C, BN, GLU, EVEN_N, False, ASM)
    return scale, offset


@triton.jit
def _matvec_kernel(low_ptr, high_ptr, scale_ptr, offset_ptr, bias_ptr, level_ptr, x_ptr, out_ptr, n, K: tl.constexpr,
                   split_chunks, magic,
                   WL: tl.constexpr, WH: tl.constexpr, MID: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr,
                   C: tl.constexpr, BN: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                   ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, PACKED: tl.constexpr,
                   ZERO_BITS: tl.constexpr, AHEAD: tl.constexpr, LEVEL: tl.constexpr, counter_ptr=None,
                   res_ptr=None, finish_bias_ptr=None, post_ptr=None, norm_ptr=None, normed_ptr=None, post_eps=0.0,
                   eps=0.0, FINISH: tl.constexpr = False, FINISH_BIAS: tl.constexpr = False,
                   POST: tl.constexpr = False, NORM: tl.constexpr = False, H_BLOCK: tl.constexpr = 1,
                   N_PARTS: tl.constexpr = 0, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = 0,
                   slots_ptr=None, n_slots=0, H_rows=1, DEFER: tl.constexpr = False, SCALED: tl.constexpr = False,
                   SLOTS: tl.constexpr = 1):
    """Program (i, s): output rows i*BN.., chunks of split s. With ACT >= 0 the weight is [gate; up]
    and the tile holds both rows of each output (gate row r, up row n + r), one pass over x; LEVEL:
    the product times level_ptr[r] (an elastic FFN level's scale, instead of a launch of its own).
    FINISH (with PARTIAL): the launch's last program also adds the partial sums into the residual and
    norms it (norm.Finish), so no residual-norm launch follows; PREFETCH: program (0, 0) first asks L2
    for the norm weights that program reads (as rowwise8's matvec). DEFER (one split, plain rows): the
    rows go into the residual and the norm is left to the next projection (norm.Deferred); SCALED: x
    is such a deferred row, the sums are multiplied by its 1 / rms. PDL: launched as a programmatic
    dependent (dependent.py), waiting after its first weights' loads (`_rows_dot`)."""
    if PREFETCH:
        prefetch_norms(norm_ptr, post_ptr, n, NORM, POST)
    if PDL == 0:  # the deferred norm's reads of the kernel before, under the loop's loads (norm.deferred_reads)
        rstd, res, w = deferred_reads(slots_ptr, n_slots, H_rows, eps, res_ptr, norm_ptr, n, BN, SCALED, DEFER, SLOTS)
    total = _rows_dot(low_ptr, high_ptr, scale_ptr, offset_ptr, x_ptr, n, K, split_chunks, magic, WL, WH, MID, ASYM,
                      G, C, BN, ACT >= 0, EVEN_N, EVEN_K, ASM, PACKED, ZERO_BITS, AHEAD, PDL)
    if PDL != 0:
        rstd, res, w = deferred_reads(slots_ptr, n_slots, H_rows, eps, res_ptr, norm_ptr, n, BN, SCALED, DEFER, SLOTS)
    total = deferred_epilogue(total, rstd, res, w, n, BN, bias_ptr, HAS_BIAS, res_ptr, normed_ptr, slots_ptr, SCALED,
                              DEFER)
    if LEVEL:
        store_tile(out_ptr, bias_ptr, total, n, BN, ACT, HAS_BIAS, PARTIAL, level_ptr)
    elif not DEFER:  # a producer's rows are stored by deferred_epilogue
        store_tile(out_ptr, bias_ptr, total, n, BN, ACT, HAS_BIAS, PARTIAL)
    if FINISH:
        finish_partials(counter_ptr, res_ptr, out_ptr, finish_bias_ptr, post_ptr, norm_ptr, normed_ptr, n,
                        tl.num_programs(1), post_eps, eps, FINISH_BIAS, POST, NORM, H_BLOCK, N_PARTS)


@triton.jit
def _matmul_kernel(x_ptr, low_ptr, high_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, T, N, K, KS, n1, block,
                   WL: tl.constexpr, WH: tl.constexpr, MID: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                   IEEE: tl.constexpr):
    """Prefill: out[T, N] = x[T, K] @ W.T, a [BN, BK] tile of W dequantized per step, then tl.dot.
    An elastic prefix (prefill.matmul_prefix): output row r is weight row (r // n1) * block + r % n1,
    the first K columns of rows of KS."""
    tok = tl.program_id(0) * BM + tl.arange(0, BM)
    out_rows = tl.program_id(1) * BN + tl.arange(0, BN)
    tok_mask, row_mask = tok < T, out_rows < N
    rows = (out_rows // n1) * block + out_rows % n1
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None] * K + cols[None, :], mask=tok_mask[:, None], other=0.0)
        codes = plane_codes(low_ptr, rows, cols, row_mask, KS * WL // 8, WL)
        if WH > 0:
            codes |= plane_codes(high_ptr, rows, cols, row_mask, KS * WH // 8, WH) << WL
        side = rows[:, None] * (KS // G) + (cols // G)[None, :]
        scale = tl.load(scale_ptr + side, mask=row_mask[:, None], other=0.0).to(tl.float32)
        if ASYM:
            offset = tl.load(offset_ptr + side, mask=row_mask[:, None], other=0.0).to(tl.float32)
            w = codes.to(tl.float32) * scale + offset
        else:
            w = (codes - MID).to(tl.float32) * scale
        acc += dot_tile(x, w.to(x.dtype), IEEE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + tok[:, None] * N + out_rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tok_mask[:, None] & row_mask[None, :])


@triton.jit
def _unpack8(words, S: tl.constexpr, STEP: tl.constexpr, W: tl.constexpr):
    """The W-bit codes at bits S + STEP * i (i = 0..7) of each uint32 word, as a [..., 2, 2, 2] tensor
    whose last three dimensions flatten (row-major) to i: tl.join puts its new dimension last, so the
    outermost join picks i's lowest bit (codes 0, 2, 4, 6 against 1, 3, 5, 7) and the innermost its
    highest. Each join keeps the new dimension within a thread: no data moves between lanes."""
    m: tl.constexpr = (1 << W) - 1
    c0 = (words >> S) & m
    c1 = (words >> (S + STEP)) & m
    c2 = (words >> (S + 2 * STEP)) & m
    c3 = (words >> (S + 3 * STEP)) & m
    c4 = (words >> (S + 4 * STEP)) & m
    c5 = (words >> (S + 5 * STEP)) & m
    c6 = (words >> (S + 6 * STEP)) & m
    c7 = (words >> (S + 7 * STEP)) & m
    return tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))


@triton.jit
def _plane_tile(words_ptr, row_words, row_mask, k0, BN: tl.constexpr, BK: tl.constexpr, W: tl.constexpr):
    """Codes [BN, BK] (uint32, columns k0 .. k0 + BK in order) of a W-bit plane: each row's BK * W / 32
    packed words loaded whole (one contiguous load a row, no byte gathers), the 32 / W codes of a
    word spread by shifts (`_unpack8`: column 8 c + i is code i of word c for 4-bit planes, 16 c + i
    and 32 c + i for 2- and 1-bit ones)."""
    P: tl.constexpr = 32 // W  # codes a word
    words = tl.load(words_ptr + row_words[:, None] + (k0 // P + tl.arange(0, BK // P))[None, :],
                    mask=row_mask[:, None], other=0).to(tl.uint32, bitcast=True)  # logical shifts
    if P == 8:
        codes = _unpack8(words, 0, W, W)
    elif P == 16:
        codes = tl.join(_unpack8(words, 0, 2 * W, W), _unpack8(words, W, 2 * W, W))
    else:
        codes = tl.join(tl.join(_unpack8(words, 0, 4 * W, W), _unpack8(words, 2 * W, 4 * W, W)),
                        tl.join(_unpack8(words, W, 4 * W, W), _unpack8(words, 3 * W, 4 * W, W)))
    return tl.reshape(codes, [BN, BK])


@triton.jit
def _nibble(src, S: tl.constexpr, scale, bias, magic, dtype: tl.constexpr):
    """The weights of the 4-bit codes u at bits S..S+3 of each int32 in `src` (S <= 12), in `dtype`:
    the code masked in place and OR-ed into the mantissa of 2^23 by one logic op, 2^23 taken off
    (u * 2^S, exact), then u * 2^S * (scale * 2^-S) + bias by one fused multiply-add (exact products:
    the same float32 weight as (u - MID) * scale, or u * scale + offset)."""
    f = ((src & (0xF << S)) | magic).to(tl.float32, bitcast=True) - 8388608.0
    return (f * (scale * (1.0 / (1 << S))) + bias).to(dtype)


@triton.jit
def _int4_weights(words, scale, bias, magic, dtype: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Weights [BN, BK] (columns in order) of a one-plane 4-bit tile given as int32 words [BN, BK / 8]
    (code i of word c is column 8 c + i at bits 4 i), their rows' scale and bias [BN, 1] (symmetric:
    -MID * scale; asymmetric: the offset). Codes 0-3 are read in place and 4-7 from the word shifted
    by 16 (`_nibble`: S <= 12 keeps u * 2^S inside the float's mantissa), then joined as `_unpack8`.
    `magic` is 2^23's bits (common.MAGIC_BITS) as an argument: a register, where the masks are the
    logic op's immediates (one immediate an instruction; as constants, ptxas re-materialised them)."""
    high = words >> 16
    w0 = _nibble(words, 0, scale, bias, magic, dtype)
    w1 = _nibble(words, 4, scale, bias, magic, dtype)
    w2 = _nibble(words, 8, scale, bias, magic, dtype)
    w3 = _nibble(words, 12, scale, bias, magic, dtype)
    w4 = _nibble(high, 0, scale, bias, magic, dtype)
    w5 = _nibble(high, 4, scale, bias, magic, dtype)
    w6 = _nibble(high, 8, scale, bias, magic, dtype)
    w7 = _nibble(high, 12, scale, bias, magic, dtype)
    w = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
    return tl.reshape(w, [BN, BK])


@triton.jit
def _tiled_kernel(x_ptr, low_ptr, high_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, T, N, K, KS, n1, block, magic,
                  k_len,
                  WL: tl.constexpr, WH: tl.constexpr, MID: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, PAIRS: tl.constexpr = False, ASM: tl.constexpr = False,
                  MAGIC: tl.constexpr = 0x4B000000, PARTIAL: tl.constexpr = False):
    """Prefill, the pipelined tiling (MatmulConfig "tiled"): out[T, N] = x[T, K] @ W.T, as
    `_matmul_kernel` computes it (same rows, prefix and bias), with whole packed words loaded per step
    (`_plane_tile`), one group scale (and offset) per row and step (BK divides G), and the loop left
    to Triton's software pipeline (num_stages). Programs run GROUP_M token tiles per band of weight
    rows before the next band, so a band's codes are read from L2, not memory, by the token tiles
    after the first. Program (i, s) takes columns s * k_len .. (s + 1) * k_len (k_len = K without split-K);
    PARTIAL: its float32 sums go to out[s] (a [splits, T, N] buffer), the bias left to `_sum_splits`.

    PAIRS (MatmulConfig "pairs": symmetric int4, bfloat16 x, MID 8): the tile is the exact integers
    u - 8 in bfloat16, two codes an instruction pair (grouped_int_batch._codes: each int16 half of
    the words, bits 4j, OR-ed into 128.0's mantissa and 136 taken off by one bf16x2 fma; ASM, else
    its float32 twin), and the group scale multiplies the step's [BM, BN] sums instead of the
    weights (BK divides G). Not the reference's rounding (the weight rounded to bf16 before the
    product): the products are exact, the scale applied in float32."""
    tok, out_rows, tok_mask, row_mask, rows = matmul_tile(T, N, n1, block, BM, BN, GROUP_M)
    # Rows' first words (int32 views of the planes) and group sides.
    low_words = rows.to(tl.int64) * (KS * WL // 32)
    high_words = rows.to(tl.int64) * (KS * WH // 32)
    side_rows = rows.to(tl.int64) * (KS // G)
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * K + tl.arange(0, BK)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_first = tl.program_id(1) * k_len
    for k0 in range(k_first, k_first + k_len, BK):
        x = tl.load(x_rows + k0, mask=tok_mask[:, None], other=0.0)  # [BM, BK], 16 bytes a lane
        if PAIRS:
            # int16 halves of the words, codes 4 c + j at bits 4 j of half c; joined in column order.
            h = tl.load(low_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + 2 * low_words[:, None]
                        + (k0 // 4 + tl.arange(0, BK // 4))[None, :], mask=row_mask[:, None], other=0)
            u = tl.join(tl.join(_codes(h, 0, MID, ASM), _codes(h, 8, MID, ASM)),
                        tl.join(_codes(h, 4, MID, ASM), _codes(h, 12, MID, ASM)))
            scale = tl.load(scale_ptr + side_rows + k0 // G, mask=row_mask, other=0.0).to(tl.float32)
            acc += dot_tile(x, tl.reshape(u, [BN, BK]).to(x.dtype), IEEE) * scale[None, :]
        elif WL == 4 and WH == 0:  # int4: codes straight to weights, three instructions a weight
            words = tl.load(low_ptr + low_words[:, None] + (k0 // 8 + tl.arange(0, BK // 8))[None, :],
                            mask=row_mask[:, None], other=0)
            scale = tl.load(scale_ptr + side_rows + k0 // G, mask=row_mask, other=0.0).to(tl.float32)[:, None]
            if ASYM:  # noqa: SIM108  (constexpr branches: only one is compiled)
                bias = tl.load(offset_ptr + side_rows + k0 // G, mask=row_mask, other=0.0).to(tl.float32)[:, None]
            else:
                bias = -MID * scale
            acc += dot_tile(x, _int4_weights(words, scale, bias, magic, x.dtype, BN, BK), IEEE)
        else:
            codes = _plane_tile(low_ptr, low_words, row_mask, k0, BN, BK, WL)
            if WH > 0:
                codes |= _plane_tile(high_ptr, high_words, row_mask, k0, BN, BK, WH) << WL
            scale = tl.load(scale_ptr + side_rows + k0 // G, mask=row_mask, other=0.0).to(tl.float32)[:, None]
            # u as a float without a conversion instruction: OR-ed into the mantissa of 2^23, 2^23 taken off.
            u = (codes | MAGIC).to(tl.float32, bitcast=True) - 8388608.0
            if ASYM:
                offset = tl.load(offset_ptr + side_rows + k0 // G, mask=row_mask, other=0.0).to(tl.float32)[:, None]
                w = u * scale + offset
            else:  # u * s - MID * s: both exact in float32 (a 6-bit u times an 11-bit f16 scale), as (u - MID) * s
                w = u * scale - MID * scale
            acc += dot_tile(x, w.to(x.dtype), IEEE)
    dest = out_ptr + tok.to(tl.int64)[:, None] * N + out_rows[None, :]
    if PARTIAL:
        tl.store(dest + tl.program_id(1).to(tl.int64) * T * N, acc, mask=tok_mask[:, None] & row_mask[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=tok_mask[:, None] & row_mask[None, :])


@triton.jit
def _sum_splits(part_ptr, bias_ptr, out_ptr, total, N, n1, block, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK: tl.constexpr):
    """out[t, n] = the SPLITS float32 partial sums part[:, t, n] in split order, plus the bias of n's
    weight row (tiles.split_sum), in out's dtype; `total` = T * N elements, BLOCK a program."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    n = offs % N
    rows = (n // n1) * block + n % n1
    sums = split_sum(part_ptr, offs, mask, total, bias_ptr, rows, SPLITS, HAS_BIAS)
    tl.store(out_ptr + offs, sums.to(out_ptr.dtype.element_ty), mask=mask)


class GroupedIntLinear(TiledPrefill, KernelLinear):
    """A grouped-int weight served by the kernels above."""

    def __init__(self, record, raw, bias, dtype, device):
        super().__init__(record, raw, bias, dtype, device)
        bits = int(self.format.removeprefix("int"))
        planes = PLANES[bits]
        self.wl, self.wh = planes[0], (planes[1] if len(planes) == 2 else 0)
        self.mid, self.asym, self.group = 2 ** (bits - 1), self.p["asymmetric"], self.p["group_size"]
        names = self.fmt.plane_names()
        # Word views of the planes (the matvec's unit); byte views for the matmul.
        self.low = self.parts[names[0]]
        self.high = self.parts[names[1]] if self.wh else self.low
        self.scales = self.parts["scales"]
        self.offsets = self.parts["offsets"] if self.asym else self.scales
        self.low32, self.high32 = self.low.view(torch.int32), self.high.view(torch.int32)
        # The bf16-pair arithmetic (pairs.py): one 4-bit plane, a zero point, bfloat16 activations.
        self.pairs = (self.wl, self.wh, self.asym, dtype) == (4, 0, False, torch.bfloat16)

    glu_scale = True  # an elastic FFN level's scale in the gate/up epilogue (_matvec's `scale`)
    deferrable = True  # the residual norm left to the next projection (norm.Deferred)

    def candidates(self, mode, rows=None, cols=None):
        n, k = self.matvec_shape(mode, rows, cols)
        base = chunk_candidates(n, k, 32, mode, self.wl + self.wh)
        if not self.pairs:
            return base
        packed = [replace(c, packed=True) for c in base]
        # Loads ahead where a program takes more than one step; words two steps ahead hold three
        # steps' words in registers: tiles of up to 8 weight rows.
        rows = 2 if mode == "glu" else 1
        steps = [c for c in packed if _steps(k, c) > 1]
        return (base + packed + [replace(c, ahead=1) for c in steps]
                + [replace(c, ahead=2) for c in steps if c.block_n * rows <= 8])

    # The configuration of `matvec_finish` (norm.choose_finish), None until chosen; over a prefix of the
    # columns (an elastic FFN level's down) each prefix's own, by its columns.
    finish_config: MatvecConfig | None = None
    finish_prefixes: dict[int, MatvecConfig | None] | None = None

    def matvec_finish(self, x: torch.Tensor, partials: torch.Tensor, finish, cols: int | None = None) -> None:
        """matvec(x, partials=partials, cols=cols) with `finish_config` (or `finish_prefixes[cols]`), whose
        last program then adds the partial sums into the residual and norms it (`finish`, a norm.Finish):
        add_rmsnorm without a launch. `cols`: over the first cols columns (x is [cols]), the split cut to
        divide them as `_matvec`'s prefix does."""
        config = self.finish_config if cols is None else (self.finish_prefixes or {}).get(cols)
        if config is None or partials.shape[0] < config.split:
            raise ValueError("matvec_finish runs with a chosen finish_config and room for its partial sums")
        self._matvec(x.reshape(-1), partials[:config.split], config, -1, True, cols=cols, finish=finish)

    def finish_candidates(self, max_split: int, cols: int | None = None) -> list[MatvecConfig]:
        """Split-K configurations whose matvec can also finish the residual norm (`matvec_finish`, over
        the first `cols` columns when given): the partial-sum candidates of at most `max_split` splits
        whose last program holds the out_features-long row in registers (norm.holds_row)."""
        return [c for c in self.candidates("partial", None, cols)
                if holds_row(c.num_warps, self.out_features) and c.split <= max_split]

    def _matvec(self, x, out, config, act, partial, rows=None, cols=None, scale=None, finish=None, defer=None,
                rstd=None):
        n, programs, config = prefix_rows(self, config, act, rows)
        config, launch = chunk_prefix(config, self.in_features, cols)
        bias = self.bias if self.bias is not None else x
        if config.packed and not (self.pairs and x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0):
            raise ValueError(f"{self.format} {config}: bf16 pairs need symmetric int4, bfloat16 activations "
                             f"(got {x.dtype}) and x 4-byte aligned")
        if scale is not None and (act < 0 or scale.shape != out.shape or scale.dtype != out.dtype):
            raise ValueError(f"a gate/up scale must match the output ({tuple(out.shape)} {out.dtype}), got "
                             f"{tuple(scale.shape)} {scale.dtype} (act {act})")
        pdl = dependent.kernel_args()
        # A dependent loads its first two steps' words before it waits for the kernel before (_rows_dot).
        ahead = max(config.ahead, 2) if dependent.preloads(pdl) else config.ahead
        _matvec_kernel[(programs, config.split)](
            self.low32, self.high32, self.scales, self.offsets, bias, x if scale is None else scale, x, out, n,
            self.in_features, launch.split_chunks,
            PAIR_MAGIC if config.packed else MAGIC_BITS,
            WL=self.wl, WH=self.wh, MID=self.mid, ASYM=self.asym, G=self.group, C=launch.chunks,
            BN=config.block_n, EVEN_N=n % config.block_n == 0, EVEN_K=launch.even, ASM=launch.asm, ACT=act,
            HAS_BIAS=self.bias is not None, PARTIAL=partial, PACKED=config.packed,
            ZERO_BITS=zero_pair(self.mid) if config.packed else 0, AHEAD=ahead, LEVEL=scale is not None,
            num_warps=config.num_warps, **(finish.launch_args(config.split, n) if finish is not None else {}),
            **deferred_args(defer, rstd, config, programs, n, act, partial), **pdl)
        return config.split

    def matmul_candidates(self, T: int, K: int) -> list[MatmulConfig]:
        """Prefill tilings worth timing for T rows over K columns: the plain kernel first (the
        untuned default), then, under 16-bit activations, the pipelined one ("tiled") where BK divides
        the group and K, and for symmetric int4 under bfloat16 its bf16-pair twin ("pairs")."""
        bm, bn, bk = matmul_blocks(T, self.out_features, K)
        plain = MatmulConfig(bm, bn, bk, 4, 1, "plain")
        if self.dtype == torch.float32:  # the exact float32 dot is multiply-adds either way
            return [plain]
        if interpreting():
            return [plain, MatmulConfig(bm, bn, min(self.group, 64), 4, 1)]
        bucket = token_bucket(T)
        tiled = tile_candidates(T, K, (64, 128) if self.group % 64 == 0 else (32,), self.group)
        # The pairs' step sums sit beside the accumulator: tiles of up to 64 sums a thread (past that
        # ptxas spills at sm_90), 64 columns a step.
        pairs = [replace(c, kernel="pairs") for c in tiled if self.pairs and c.block_k == 64
                 and c.block_m * c.block_n <= 64 * 32 * c.num_warps]
        # Split-K where the tiles alone leave multiprocessors idle (few tokens, few rows): the K range
        # over 2 or 4 programs, their float32 sums added in split order by _sum_splits.
        sms = sm_count()

        def programs(c):
            return -(-bucket // c.block_m) * -(-self.out_features // c.block_n)

        splits = [replace(c, split=split) for c in tiled + pairs if c.stages == 3 and programs(c) < sms
                  for split in (2, 4) if programs(c) * split <= 4 * sms and (K // c.block_k) % split == 0]
        return [plain, *tiled, *pairs, *splits]

    def _launch_matmul(self, x, N, K, n1, block, config: MatmulConfig):
        T = x.shape[0]
        out = torch.empty(T, N, dtype=self.dtype, device=x.device)
        bias = self.bias if self.bias is not None else x
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        ieee = x.dtype == torch.float32 or interpreting()
        if config.kernel == "plain":
            _matmul_kernel[(-(-T // bm), -(-N // bn))](
                x, self.low, self.high, self.scales, self.offsets, bias, out, T, N, K, self.in_features, n1, block,
                WL=self.wl, WH=self.wh, MID=self.mid, ASYM=self.asym, G=self.group, BM=bm, BN=bn, BK=bk,
                HAS_BIAS=self.bias is not None, IEEE=ieee, num_warps=config.num_warps)
            return out
        if self.group % bk or K % bk or bk * self.wh % 32 or bk * self.wl % 32:
            raise ValueError(f"{self.format}: the tiled prefill takes {bk} columns a step, which must divide the "
                             f"group ({self.group}) and the {K} columns and hold whole words of each plane")
        pairs = config.kernel == "pairs"
        if pairs and not (self.pairs and x.dtype == torch.bfloat16):
            raise ValueError(f"{self.format} {config}: bf16 pairs need symmetric int4 and bfloat16 activations")
        split = config.split
        if (K // bk) % split:
            raise ValueError(f"{self.format} {config}: split-K {split} does not divide {K // bk} steps")
        dest = out if split == 1 else torch.empty(split, T, N, dtype=torch.float32, device=x.device)
        _tiled_kernel[(-(-T // bm) * -(-N // bn), split)](
            x, self.low32, self.high32, self.scales, self.offsets, bias, dest, T, N, K, self.in_features, n1, block,
            MAGIC_BITS, K // split,
            WL=self.wl, WH=self.wh, MID=self.mid, ASYM=self.asym, G=self.group, BM=bm, BN=bn, BK=bk, GROUP_M=8,
            HAS_BIAS=self.bias is not None, IEEE=ieee, PAIRS=pairs, ASM=pairs and common.INLINE_ASM and not ieee,
            PARTIAL=split > 1, num_warps=config.num_warps, num_stages=config.stages)
        if split > 1:
            _sum_splits[(-(-(T * N) // 1024),)](dest, bias, out, T * N, N, n1, block, SPLITS=split,
                                               HAS_BIAS=self.bias is not None, BLOCK=1024)
        return out

def _steps(K: int, config: MatvecConfig) -> int:
    """Loop steps of one program of `config` over K columns."""
    launch = chunk_launch(K // 32, config)
    return -(-launch.split_chunks // launch.chunks)


def make(record, raw, bias, device, dtype):
    """The registry's factory: a GroupedIntLinear, or None for a shape the kernels can't tile."""
    if record.shape[1] % 32:
        return None
    return GroupedIntLinear(record, raw.to(device), bias, dtype, device)


def reference(raw: torch.Tensor, shape, params, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the kernels compute, by the format's own decode: x @ decode(W).T in float32."""
    from thin.ir import formats

    return x.float() @ formats.get(fmt).decode(raw, tuple(shape), params, torch.float32).T
