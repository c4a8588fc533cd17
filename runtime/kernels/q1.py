"""q1 (ir/formats/q1.py): sign bits, an e4m3 magnitude per group under a float32 row scale.

value = (2b - 1) * step, so a group's dot product is step * (2 * sum_k b_k x_k - sum_k x_k): the
matvec runs the chunk scheme (tiles.py): a lane owns 32 columns of its rows (one word of sign
bits each), turns each bit into a float in place (a logic op and an add) and multiplies-adds
it; the group's step is applied once per chunk. Prefill dequantizes tiles for tl.dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .chunks import chunk_candidates, chunk_prefix
from .common import MAGIC_BITS, KernelLinear, MatvecConfig, prefix_rows
from .prefill import MatmulConfig, TiledPrefill, plain_tile, store_plain
from .q2 import _e4m3, group_e4m3
from .tiles import (
    dot_tile,
    matmul_tile,
    octet_dot,
    plane_codes,
    plane_words,
    store_tile,
    tile_rows,
    tile_starts,
    upper_halves,
    x_octet,
    x_sum8,
)


@triton.jit
def _rows_dot(b_ptr, s_ptr, rs_ptr, x_ptr, n, K: tl.constexpr, split_chunks, magic, G: tl.constexpr, C: tl.constexpr,
              BN: tl.constexpr, GLU: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """sum_k W[rows, k] x[k] over the tile's rows and this program's chunks of 32 columns (one word
    of sign bits a row and lane), float32 [rows]: step * (2 sum(x where b) - sum(x)) per chunk."""
    pid = tl.program_id(0)
    rows, row_mask = tile_rows(pid, n, BN, GLU)
    total = K // 32
    starts = tile_starts(pid, n, total, BN, GLU, ASM)
    begin = tl.program_id(1) * split_chunks
    end = tl.minimum(begin + split_chunks, total)
    ci = tl.arange(0, C)
    row_scale = tl.load(rs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    acc = tl.zeros([rows.shape[0], C], dtype=tl.float32)
    for c0 in range(begin, end, C):
        chunk = c0 + ci
        cmask = chunk < end
        words = plane_words(b_ptr, starts, row_mask, c0, end, C, 1, EVEN_N, EVEN_K, ASM)
        uppers = upper_halves(words, 1, ASM)
        dot = tl.zeros([rows.shape[0], C], dtype=tl.float32)
        xsum = tl.zeros([C], dtype=tl.float32)
        for o in tl.static_range(4):
            xs = x_octet(x_ptr, 32 * chunk + 8 * o, cmask, EVEN_K)
            dot = octet_dot(dot, words, uppers, xs, o, 1, 0, 2.0, False, magic)
            xsum += x_sum8(xs)
        step = row_scale * group_e4m3(s_ptr, pid, n, K // G, c0, end, G // 32, C, BN, GLU, EVEN_N, EVEN_K, ASM)
        acc += step * (dot - xsum[None, :])
    return tl.sum(acc, axis=1)


@triton.jit
def _matvec_kernel(b_ptr, s_ptr, rs_ptr, bias_ptr, x_ptr, out_ptr, n, K: tl.constexpr, split_chunks, magic,
                   G: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                   ASM: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """Program (i, s): output rows i*BN.., chunks of split s; ACT >= 0: gate and up rows in one tile."""
    total = _rows_dot(b_ptr, s_ptr, rs_ptr, x_ptr, n, K, split_chunks, magic, G, C, BN, ACT >= 0, EVEN_N, EVEN_K, ASM)
    store_tile(out_ptr, bias_ptr, total, n, BN, ACT, HAS_BIAS, PARTIAL)


@triton.jit
def _matmul_kernel(x_ptr, b_ptr, s_ptr, rs_ptr, bias_ptr, out_ptr, T, N, K, KS, n1, block, G: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """Prefill: out[T, N] = x[T, K] @ W.T with [BN, BK] tiles of W dequantized per step. An elastic
    prefix (prefill.matmul_prefix): output row r is weight row (r // n1) * block + r % n1, the first
    K columns of rows of KS."""
    tok, out_rows, tok_mask, row_mask, rows = plain_tile(T, N, n1, block, BM, BN)
    row_scale = tl.load(rs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None] * K + cols[None, :], mask=tok_mask[:, None], other=0.0)
        bits = plane_codes(b_ptr, rows, cols, row_mask, KS // 8, 1)
        step = row_scale * _e4m3(s_ptr, rows[:, None] * (KS // G) + (cols // G)[None, :], row_mask[:, None])
        w = tl.where(bits != 0, step, -step)
        acc += dot_tile(x, w.to(x.dtype), IEEE)
    store_plain(out_ptr, bias_ptr, acc, tok, out_rows, tok_mask, row_mask, rows, N, HAS_BIAS)


@triton.jit
def _signs8(words, S: tl.constexpr, step, dtype: tl.constexpr):
    """The weights (+step or -step, in dtype) of the sign bits S + 4 i (i = 0..7) of each int32 word,
    as [..., 2, 2, 2] flattening to i (grouped_int._unpack8's join order)."""
    w0 = tl.where(((words >> S) & 1) != 0, step, -step).to(dtype)
    w1 = tl.where(((words >> (S + 4)) & 1) != 0, step, -step).to(dtype)
    w2 = tl.where(((words >> (S + 8)) & 1) != 0, step, -step).to(dtype)
    w3 = tl.where(((words >> (S + 12)) & 1) != 0, step, -step).to(dtype)
    w4 = tl.where(((words >> (S + 16)) & 1) != 0, step, -step).to(dtype)
    w5 = tl.where(((words >> (S + 20)) & 1) != 0, step, -step).to(dtype)
    w6 = tl.where(((words >> (S + 24)) & 1) != 0, step, -step).to(dtype)
    w7 = tl.where(((words >> (S + 28)) & 1) != 0, step, -step).to(dtype)
    return tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))


@triton.jit
def _tiled_kernel(x_ptr, b_ptr, s_ptr, rs_ptr, bias_ptr, out_ptr, T, N, K, KS, n1, block, G: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """Prefill, the pipelined tiling (MatmulConfig "tiled"), as grouped_int._tiled_kernel: the same
    out[T, N] as `_matmul_kernel` from a step's whole words of sign bits (BK / 32 a row: word c holds
    columns 32 c .. 32 c + 31, within one group, whose step is loaded once), each bit made +step or
    -step and the 32 joined in column order (bit j of word c is column 32 c + j)."""
    tok, out_rows, tok_mask, row_mask, rows = matmul_tile(T, N, n1, block, BM, BN, GROUP_M)
    # [rows, groups, words]: a step's NG groups of WG words each. One group a step: its steps loaded
    # as a vector [rows] (as the int kernels' scales); several: as [rows, groups, 1]. (Loaded as
    # [rows, words], a step a word, Triton 3.6 gave the weights a layout whose transposed tile it
    # could not place in shared memory for sm_90's wgmma.)
    NG: tl.constexpr = BK // G if BK > G else 1
    WG: tl.constexpr = BK // 32 // NG
    g = tl.arange(0, NG)[None, :, None]
    row_words = rows.to(tl.int64)[:, None, None] * (KS // 32) + WG * g + tl.arange(0, WG)[None, None, :]
    row_steps = rows.to(tl.int64) * (KS // G)
    row_scale = tl.load(rs_ptr + rows, mask=row_mask, other=0.0)[:, None, None]
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * K + tl.arange(0, BK)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_rows + k0, mask=tok_mask[:, None], other=0.0)
        words = tl.load(b_ptr + row_words + k0 // 32, mask=row_mask[:, None, None], other=0)
        if NG == 1:
            step = row_scale * _e4m3(s_ptr, row_steps + k0 // G, row_mask)[:, None, None]
        else:
            step = row_scale * _e4m3(s_ptr, row_steps[:, None, None] + k0 // G + g, row_mask[:, None, None])
        # Bit j = 4 i + r of a word: the outer joins pick r's two bits, lowest outermost.
        w = tl.join(tl.join(_signs8(words, 0, step, x.dtype), _signs8(words, 2, step, x.dtype)),
                    tl.join(_signs8(words, 1, step, x.dtype), _signs8(words, 3, step, x.dtype)))
        acc += dot_tile(x, tl.reshape(w, [BN, BK]), IEEE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * N + out_rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tok_mask[:, None] & row_mask[None, :])


class Q1Linear(TiledPrefill, KernelLinear):
    """A q1 weight."""

    def __init__(self, record, raw, bias, dtype, device):
        super().__init__(record, raw, bias, dtype, device)
        self.group = self.p["group_size"]
        self.signs = self.parts["signs"]
        self.signs32 = self.signs.view(torch.int32)
        self.scales = self.parts["scales"].view(torch.uint8)
        self.row_scale = self.parts["row_scale"]

    def candidates(self, mode: str, rows: int | None = None, cols: int | None = None) -> list[MatvecConfig]:
        n, k = self.matvec_shape(mode, rows, cols)
        return chunk_candidates(n, k, 32, mode, 1)

    def _matvec(self, x, out, config, act, partial, rows=None, cols=None):
        n, programs, config = prefix_rows(self, config, act, rows)
        config, launch = chunk_prefix(config, self.in_features, cols)
        _matvec_kernel[(programs, config.split)](
            self.signs32, self.scales, self.row_scale, self.bias if self.bias is not None else x, x, out, n,
            self.in_features, launch.split_chunks, MAGIC_BITS, G=self.group, C=launch.chunks, BN=config.block_n,
            EVEN_N=n % config.block_n == 0, EVEN_K=launch.even, ASM=launch.asm, ACT=act,
            HAS_BIAS=self.bias is not None, PARTIAL=partial, num_warps=config.num_warps)
        return config.split

    def _launch_matmul(self, x, N, K, n1, block, config: MatmulConfig):
        T = x.shape[0]
        out = torch.empty(T, N, dtype=self.dtype, device=x.device)
        bias = self.bias if self.bias is not None else x
        ieee = x.dtype == torch.float32 or interpreting()
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        if config.kernel == "plain":
            _matmul_kernel[(-(-T // bm), -(-N // bn))](
                x, self.signs, self.scales, self.row_scale, bias, out, T, N, K, self.in_features, n1, block,
                G=self.group, BM=bm, BN=bn, BK=bk, HAS_BIAS=self.bias is not None, IEEE=ieee,
                num_warps=config.num_warps)
            return out
        if K % bk or bk % 32 or config.split != 1:
            raise ValueError(f"q1 {config}: the tiled prefill takes whole words of the {K} columns a step, "
                             "without split-K")
        _tiled_kernel[(-(-T // bm) * -(-N // bn),)](
            x, self.signs32, self.scales, self.row_scale, bias, out, T, N, K, self.in_features, n1, block,
            G=self.group, BM=bm, BN=bn, BK=bk, GROUP_M=8, HAS_BIAS=self.bias is not None, IEEE=ieee,
            num_warps=config.num_warps, num_stages=config.stages)
        return out


def make(record, raw, bias, device, dtype):
    """The registry's factory for q1 weights."""
    if record.shape[1] % 32:
        return None
    return Q1Linear(record, raw.to(device), bias, dtype, device)
