"""The prefill matmul of the grouped-int family (grouped_int.py): x [T, K] @ W.T for many rows of
activations, reading the packed planes in place. Two kernels, timed against each other per shape by
the prefill tuner (prefill.py TiledPrefill): the plain one dequantizes a [BN, BK] tile per step and
calls `tl.dot`; the pipelined one ("tiled") loads whole packed words per step, one group scale a row
and step, under Triton's software pipeline, with split-K where the tiles alone leave multiprocessors
idle, and for symmetric int4 under bfloat16 a bf16-pair twin ("pairs").
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from . import common, interpreting
from .common import MAGIC_BITS, sm_count
from .grouped_int_batch import _codes
from .prefill import MatmulConfig, TiledPrefill, matmul_blocks, plain_tile, store_plain, tile_candidates, token_bucket
from .tiles import dot_tile, matmul_tile, plane_codes, split_sum


@triton.jit
def _matmul_kernel(x_ptr, low_ptr, high_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, T, N, K, KS, n1, block,
                   WL: tl.constexpr, WH: tl.constexpr, MID: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                   IEEE: tl.constexpr):
    """Prefill: out[T, N] = x[T, K] @ W.T, a [BN, BK] tile of W dequantized per step, then tl.dot.
    An elastic prefix (prefill.matmul_prefix): output row r is weight row (r // n1) * block + r % n1,
    the first K columns of rows of KS."""
    tok, out_rows, tok_mask, row_mask, rows = plain_tile(T, N, n1, block, BM, BN)
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
    store_plain(out_ptr, bias_ptr, acc, tok, out_rows, tok_mask, row_mask, rows, N, HAS_BIAS)


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


class GroupedIntPrefill(TiledPrefill):
    """The prefill side of GroupedIntLinear: its matmul candidates and their launches (the weight's
    planes, scales, offsets, widths and zero point are GroupedIntLinear's attributes)."""

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
