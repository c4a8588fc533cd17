"""mxfp4 (ir/formats/mxfp4.py): E2M1 codes, two a byte, one E8M0 scale per 32 columns.

A code's float bits are built in place: its 3 magnitude bits go to float32 bits 22-24 and its sign
to bit 31, which is the E2M1 value times 2^-126 (code 1, 0.5, lands on a float32 subnormal; the
multiply by 2^126 is exact and the GPU keeps subnormals in plain float32 arithmetic). The matvec
runs the chunk scheme (tiles.py): a lane owns one block (32 columns, four words) of its rows, and
the block's dot product is scaled once by its 2^(e - 127). Under bf16 activations the launch tuner also
has the bf16 pairs (pairs.py: two products an instruction, a block summed in bf16, as the mxfp4 experts
do). The residual norm may be left to the next projection (deferred_norm.Deferred), as the grouped-int and
8-bit matvecs do. Prefill dequantizes [BN, BK] tiles for tl.dot.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from thin.ir.formats.mxfp4 import BLOCK

from . import interpreting
from .chunks import chunk_candidates, chunk_prefix
from .common import KernelLinear, MatvecConfig, prefix_rows
from .deferred_norm import deferred_args, deferred_epilogue, deferred_reads
from .pairs import SUM_UP, e2m1_word_dot, pair_sum, x_pairs
from .prefill import MatmulConfig, TiledPrefill, plain_tile, store_plain
from .tiles import (
    chunk_side,
    dot_tile,
    matmul_tile,
    plane_codes,
    plane_words,
    store_tile,
    tile_rows,
    tile_starts,
    x_octet,
)

TWO_126 = 2.0**126


@triton.jit
def _block_scale(e):
    """2^(e - 127) for E8M0 bytes e (int32): the exponent field itself, and the subnormal 2^-127 for 0."""
    return tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _code_values(codes):
    """E2M1 codes (int32, 0..15) -> their float32 values."""
    bits = ((codes & 7) << 22) | ((codes & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # * 2^126, exact


@triton.jit
def _term(acc, word, x, B: tl.constexpr):
    """acc + value * x for the E2M1 code at bit B of `word`: magnitude bits to 22-24, sign to 31."""
    if B <= 22:  # noqa: SIM108  (constexpr branches: only one is compiled)
        mag = (word << (22 - B)) & 0x01C00000
    else:
        mag = (word >> (B - 22)) & 0x01C00000
    bits = mag | ((word << (28 - B)) & -0x80000000)
    return acc + (bits.to(tl.float32, bitcast=True) * 8.507059173023462e37) * x[None, :]


@triton.jit
def _octet(acc, word, xs):
    for p in tl.static_range(8):
        acc = _term(acc, word, xs[p], 4 * p)
    return acc


@triton.jit
def _rows_dot(v_ptr, e_ptr, x_ptr, n, K: tl.constexpr, split_chunks, C: tl.constexpr, BN: tl.constexpr,
              GLU: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, PACKED: tl.constexpr):
    """sum_k W[rows, k] x[k] over the tile's rows and this program's blocks, float32 [rows]. PACKED (bf16 x):
    a block's products summed as bf16 pairs, two an instruction (pairs.e2m1_word_dot)."""
    pid = tl.program_id(0)
    rows, row_mask = tile_rows(pid, n, BN, GLU)
    total = K // 32
    starts = tile_starts(pid, n, total, BN, GLU, ASM)
    begin = tl.program_id(1) * split_chunks
    end = tl.minimum(begin + split_chunks, total)
    ci = tl.arange(0, C)
    acc = tl.zeros([rows.shape[0], C], dtype=tl.float32)
    for c0 in range(begin, end, C):
        chunk = c0 + ci
        cmask = chunk < end
        words = plane_words(v_ptr, starts, row_mask, c0, end, C, 4, EVEN_N, EVEN_K, ASM)
        if PACKED:
            pairs = tl.zeros([rows.shape[0], C], dtype=tl.int32)  # bf16 pairs (0, 0)
            for o in tl.static_range(4):
                pairs = e2m1_word_dot(pairs, words[o], x_pairs(x_ptr, 32 * chunk + 8 * o, cmask, EVEN_K, ASM), ASM)
            dot = pair_sum(pairs) * SUM_UP
        else:
            dot = tl.zeros([rows.shape[0], C], dtype=tl.float32)
            for o in tl.static_range(4):
                dot = _octet(dot, words[o], x_octet(x_ptr, 32 * chunk + 8 * o, cmask, EVEN_K))
        e = chunk_side(e_ptr, pid, n, total, c0, end, 1, C, BN, GLU, EVEN_N, EVEN_K, ASM)
        acc += _block_scale(e.to(tl.int32)) * dot
    return tl.sum(acc, axis=1)


@triton.jit
def _matvec_kernel(v_ptr, e_ptr, bias_ptr, x_ptr, out_ptr, n, K: tl.constexpr, split_chunks, C: tl.constexpr,
                   BN: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, ACT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, PACKED: tl.constexpr, res_ptr=None, norm_ptr=None,
                   normed_ptr=None, slots_ptr=None, n_slots=0, H_rows=1, eps=0.0, DEFER: tl.constexpr = False,
                   SCALED: tl.constexpr = False, SLOTS: tl.constexpr = 1):
    """Program (i, s): output rows i*BN.., blocks of split s; ACT >= 0: gate and up rows in one tile. DEFER (one
    split, plain rows): the rows go into the residual and the norm is left to the next projection
    (deferred_norm.Deferred); SCALED: x is such a deferred row, the sums are multiplied by its 1 / rms."""
    # The deferred norm's reads of the kernel before, under the loop's loads.
    rstd, res, w = deferred_reads(slots_ptr, n_slots, H_rows, eps, res_ptr, norm_ptr, n, BN, SCALED, DEFER, SLOTS)
    total = _rows_dot(v_ptr, e_ptr, x_ptr, n, K, split_chunks, C, BN, ACT >= 0, EVEN_N, EVEN_K, ASM, PACKED)
    total = deferred_epilogue(total, rstd, res, w, n, BN, bias_ptr, HAS_BIAS, res_ptr, normed_ptr, slots_ptr, SCALED,
                              DEFER)
    if not DEFER:  # a producer's rows are stored by deferred_epilogue
        store_tile(out_ptr, bias_ptr, total, n, BN, ACT, HAS_BIAS, PARTIAL)


@triton.jit
def _matmul_kernel(x_ptr, v_ptr, e_ptr, bias_ptr, out_ptr, T, N, K, KS, n1, block, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """Prefill: out[T, N] = x[T, K] @ W.T with [BN, BK] tiles of W dequantized per step. An elastic
    prefix (prefill.matmul_prefix): output row r is weight row (r // n1) * block + r % n1, the first
    K columns of rows of KS."""
    tok, out_rows, tok_mask, row_mask, rows = plain_tile(T, N, n1, block, BM, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None] * K + cols[None, :], mask=tok_mask[:, None], other=0.0)
        codes = plane_codes(v_ptr, rows, cols, row_mask, KS // 2, 4)
        e = tl.load(e_ptr + rows[:, None] * (KS // 32) + (cols // 32)[None, :], mask=row_mask[:, None], other=127)
        w = _code_values(codes) * _block_scale(e.to(tl.int32))
        acc += dot_tile(x, w.to(x.dtype), IEEE)
    store_plain(out_ptr, bias_ptr, acc, tok, out_rows, tok_mask, row_mask, rows, N, HAS_BIAS)


@triton.jit
def _word_values(words, scale, S: tl.constexpr, dtype: tl.constexpr):
    """The weights of the codes at bits S..S+3 of int32 `words` times their block's 2^(e - 127), in dtype."""
    return (_code_values((words >> S) & 0xF) * scale).to(dtype)


@triton.jit
def _tiled_kernel(x_ptr, w_ptr, e_ptr, bias_ptr, out_ptr, T, N, K, KS, n1, block, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
                  IEEE: tl.constexpr):
    """Prefill, the pipelined tiling (MatmulConfig "tiled"), as grouped_int._tiled_kernel: the same
    out[T, N] as `_matmul_kernel` from a step's whole words (BK / 8 a row, code i of word c is column
    8 c + i) and their block scales (one byte a block of 4 words), each code turned
    into its weight by `_word_values` and the eight joined in column order (grouped_int._unpack8's
    order: the outermost join picks i's lowest bit)."""
    tok, out_rows, tok_mask, row_mask, rows = matmul_tile(T, N, n1, block, BM, BN, GROUP_M)
    # [rows, blocks, words]: a step's BK / 32 blocks of 4 words each, every block's scale byte loaded
    # once as [rows, blocks, 1] (as [rows, words] a byte a word, Triton 3.6 gave the weights a layout
    # whose transposed tile it could not place in shared memory for sm_90's wgmma).
    b = tl.arange(0, BK // 32)[None, :, None]
    row_words = rows.to(tl.int64)[:, None, None] * (KS // 8) + 4 * b + tl.arange(0, 4)[None, None, :]
    row_scales = rows.to(tl.int64)[:, None, None] * (KS // 32) + b
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * K + tl.arange(0, BK)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_rows + k0, mask=tok_mask[:, None], other=0.0)
        words = tl.load(w_ptr + row_words + k0 // 8, mask=row_mask[:, None, None], other=0)
        e = tl.load(e_ptr + row_scales + k0 // 32, mask=row_mask[:, None, None], other=127)
        scale = _block_scale(e.to(tl.int32))
        w = tl.join(tl.join(tl.join(_word_values(words, scale, 0, x.dtype), _word_values(words, scale, 16, x.dtype)),
                            tl.join(_word_values(words, scale, 8, x.dtype), _word_values(words, scale, 24, x.dtype))),
                    tl.join(tl.join(_word_values(words, scale, 4, x.dtype), _word_values(words, scale, 20, x.dtype)),
                            tl.join(_word_values(words, scale, 12, x.dtype), _word_values(words, scale, 28, x.dtype))))
        acc += dot_tile(x, tl.reshape(w, [BN, BK]), IEEE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * N + out_rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tok_mask[:, None] & row_mask[None, :])


class MxFp4Linear(TiledPrefill, KernelLinear):
    """An mxfp4 weight."""

    def __init__(self, record, raw, bias, dtype, device):
        super().__init__(record, raw, bias, dtype, device)
        self.values = self.parts["values"]
        self.words = self.values.view(torch.int32)
        self.scales = self.parts["scales"]

    deferrable = True  # the residual norm left to the next projection (deferred_norm.Deferred)

    def candidates(self, mode: str, rows: int | None = None, cols: int | None = None) -> list[MatvecConfig]:
        n, k = self.matvec_shape(mode, rows, cols)
        base = chunk_candidates(n, k, BLOCK, mode, 4)
        # Under bf16 activations also the bf16 pairs (pairs.py; the plain float32 arithmetic stays first, the
        # untimed default).
        return base + [replace(c, packed=True) for c in base] if self.dtype == torch.bfloat16 else base

    def _matvec(self, x, out, config, act, partial, rows=None, cols=None, defer=None, rstd=None):
        n, programs, config = prefix_rows(self, config, act, rows)
        config, launch = chunk_prefix(config, self.in_features, cols, BLOCK)
        if config.packed and not (x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0):
            raise ValueError(f"mxfp4 {config}: bf16 pairs need bfloat16 activations (got {x.dtype}), 4-byte aligned")
        _matvec_kernel[(programs, config.split)](
            self.words, self.scales, self.bias if self.bias is not None else x, x, out, n, self.in_features,
            launch.split_chunks, C=launch.chunks, BN=config.block_n, EVEN_N=n % config.block_n == 0,
            EVEN_K=launch.even, ASM=launch.asm, ACT=act, HAS_BIAS=self.bias is not None, PARTIAL=partial,
            PACKED=bool(config.packed), num_warps=config.num_warps,
            **deferred_args(defer, rstd, config, programs, n, act, partial))
        return config.split

    def _launch_matmul(self, x, N, K, n1, block, config: MatmulConfig):
        T = x.shape[0]
        out = torch.empty(T, N, dtype=self.dtype, device=x.device)
        bias = self.bias if self.bias is not None else x
        ieee = x.dtype == torch.float32 or interpreting()
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        if config.kernel == "plain":
            _matmul_kernel[(-(-T // bm), -(-N // bn))](
                x, self.values, self.scales, bias, out, T, N, K, self.in_features, n1, block, BM=bm, BN=bn, BK=bk,
                HAS_BIAS=self.bias is not None, IEEE=ieee, num_warps=config.num_warps)
            return out
        if K % bk or bk % 32 or config.split != 1:
            raise ValueError(f"mxfp4 {config}: the tiled prefill takes whole blocks of the {K} columns a step, "
                             "without split-K")
        _tiled_kernel[(-(-T // bm) * -(-N // bn),)](
            x, self.words, self.scales, bias, out, T, N, K, self.in_features, n1, block, BM=bm, BN=bn, BK=bk,
            GROUP_M=8, HAS_BIAS=self.bias is not None, IEEE=ieee, num_warps=config.num_warps,
            num_stages=config.stages)
        return out


def make(record, raw, bias, device, dtype):
    """The registry's factory for mxfp4 weights."""
    return MxFp4Linear(record, raw.to(device), bias, dtype, device)
