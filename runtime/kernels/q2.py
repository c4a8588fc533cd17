"""q2 (ir/formats/q2.py): 2-bit codes, an e4m3 step and offset per group under float32 row scales.

The matvec runs the chunk scheme (tiles.py): each lane owns a chunk of min(32, group) columns of
its rows (one or two words of codes), converts the codes in place and applies the group's affine
map once per chunk through the sum of x: sum_k (u_k step + zero) x_k = step sum_k u_k x_k + zero
sum_k x_k, with step = row_scale * scale and zero = row_offset * offset decoded from their e4m3
bytes. Prefill dequantizes tiles for tl.dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .chunks import chunk_candidates, chunk_prefix
from .common import MAGIC_BITS, KernelLinear, MatvecConfig, prefix_rows
from .prefill import matmul_blocks, matmul_prefix, plain_tile, store_plain
from .tiles import (
    chunk_side,
    dot_tile,
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
def _e4m3(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def group_e4m3(ptr, pid, n, groups, c0, end, PER: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, GLU: tl.constexpr,
               EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """The e4m3 bytes of the tile's groups, one per row and chunk (tiles.chunk_side), as float32."""
    v = chunk_side(ptr, pid, n, groups, c0, end, PER, C, BN, GLU, EVEN_N, EVEN_K, ASM)
    return v.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _rows_dot(c_ptr, s_ptr, o_ptr, rs_ptr, ro_ptr, x_ptr, n, K: tl.constexpr, split_chunks, magic, G: tl.constexpr,
              CC: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, GLU: tl.constexpr, EVEN_N: tl.constexpr,
              EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """sum_k W[rows, k] x[k] over the tile's rows and this program's chunks of CC columns."""
    NW: tl.constexpr = CC // 16  # words of 2-bit codes a chunk
    pid = tl.program_id(0)
    rows, row_mask = tile_rows(pid, n, BN, GLU)
    total = K // CC
    starts = tile_starts(pid, n, total, BN, GLU, ASM)
    begin = tl.program_id(1) * split_chunks
    end = tl.minimum(begin + split_chunks, total)
    ci = tl.arange(0, C)
    row_scale = tl.load(rs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    row_offset = tl.load(ro_ptr + rows, mask=row_mask, other=0.0)[:, None]
    acc = tl.zeros([rows.shape[0], C], dtype=tl.float32)
    for c0 in range(begin, end, C):
        chunk = c0 + ci
        cmask = chunk < end
        words = plane_words(c_ptr, starts, row_mask, c0, end, C, NW, EVEN_N, EVEN_K, ASM)
        uppers = upper_halves(words, NW, ASM)
        dot = tl.zeros([rows.shape[0], C], dtype=tl.float32)
        xsum = tl.zeros([C], dtype=tl.float32)
        for o in tl.static_range(CC // 8):
            xs = x_octet(x_ptr, CC * chunk + 8 * o, cmask, EVEN_K)
            dot = octet_dot(dot, words, uppers, xs, o, 2, 0, 1.0, False, magic)
            xsum += x_sum8(xs)
        step = row_scale * group_e4m3(s_ptr, pid, n, K // G, c0, end, G // CC, C, BN, GLU, EVEN_N, EVEN_K, ASM)
        zero = row_offset * group_e4m3(o_ptr, pid, n, K // G, c0, end, G // CC, C, BN, GLU, EVEN_N, EVEN_K, ASM)
        acc += step * dot + zero * xsum[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _matvec_kernel(c_ptr, s_ptr, o_ptr, rs_ptr, ro_ptr, bias_ptr, x_ptr, out_ptr, n, K: tl.constexpr, split_chunks,
                   magic, G: tl.constexpr, CC: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, EVEN_N: tl.constexpr,
                   EVEN_K: tl.constexpr, ASM: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PARTIAL: tl.constexpr):
    """Program (i, s): output rows i*BN.., chunks of split s; ACT >= 0: gate and up rows in one tile."""
    total = _rows_dot(c_ptr, s_ptr, o_ptr, rs_ptr, ro_ptr, x_ptr, n, K, split_chunks, magic, G, CC, C, BN, ACT >= 0,
                      EVEN_N, EVEN_K, ASM)
    store_tile(out_ptr, bias_ptr, total, n, BN, ACT, HAS_BIAS, PARTIAL)


@triton.jit
def _matmul_kernel(x_ptr, c_ptr, s_ptr, o_ptr, rs_ptr, ro_ptr, bias_ptr, out_ptr, T, N, K, KS, n1, block,
                   G: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                   IEEE: tl.constexpr):
    """Prefill: out[T, N] = x[T, K] @ W.T with [BN, BK] tiles of W dequantized per step. An elastic
    prefix (prefill.matmul_prefix): output row r is weight row (r // n1) * block + r % n1, the first
    K columns of rows of KS."""
    tok, out_rows, tok_mask, row_mask, rows = plain_tile(T, N, n1, block, BM, BN)
    row_scale = tl.load(rs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    row_offset = tl.load(ro_ptr + rows, mask=row_mask, other=0.0)[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None] * K + cols[None, :], mask=tok_mask[:, None], other=0.0)
        codes = plane_codes(c_ptr, rows, cols, row_mask, KS // 4, 2)
        side = rows[:, None] * (KS // G) + (cols // G)[None, :]
        step = row_scale * _e4m3(s_ptr, side, row_mask[:, None])
        zero = row_offset * _e4m3(o_ptr, side, row_mask[:, None])
        w = codes.to(tl.float32) * step + zero
        acc += dot_tile(x, w.to(x.dtype), IEEE)
    store_plain(out_ptr, bias_ptr, acc, tok, out_rows, tok_mask, row_mask, rows, N, HAS_BIAS)


class Q2Linear(KernelLinear):
    """A q2 weight."""

    def __init__(self, record, raw, bias, dtype, device):
        super().__init__(record, raw, bias, dtype, device)
        self.group = self.p["group_size"]
        self.columns = min(32, self.group)  # a chunk never straddles a group
        self.codes = self.parts["codes"]
        self.codes32 = self.codes.view(torch.int32)
        self.scales = self.parts["scales"].view(torch.uint8)
        self.offsets = self.parts["offsets"].view(torch.uint8)
        self.row_scale, self.row_offset = self.parts["row_scale"], self.parts["row_offset"]

    def candidates(self, mode: str, rows: int | None = None, cols: int | None = None) -> list[MatvecConfig]:
        n, k = self.matvec_shape(mode, rows, cols)
        return chunk_candidates(n, k, self.columns, mode, self.columns // 16)

    def _args(self):
        return self.scales, self.offsets, self.row_scale, self.row_offset

    def _matvec(self, x, out, config, act, partial, rows=None, cols=None):
        n, programs, config = prefix_rows(self, config, act, rows)
        config, launch = chunk_prefix(config, self.in_features, cols, self.columns)
        _matvec_kernel[(programs, config.split)](
            self.codes32, *self._args(), self.bias if self.bias is not None else x, x, out, n, self.in_features,
            launch.split_chunks, MAGIC_BITS, G=self.group, CC=self.columns, C=launch.chunks, BN=config.block_n,
            EVEN_N=n % config.block_n == 0, EVEN_K=launch.even, ASM=launch.asm, ACT=act,
            HAS_BIAS=self.bias is not None, PARTIAL=partial, num_warps=config.num_warps)
        return config.split

    def _matmul(self, x, rows=None, cols=None, halves=1):
        T = x.shape[0]
        N, K, n1, block = matmul_prefix(self, rows, cols, halves)
        out = torch.empty(T, N, dtype=self.dtype, device=x.device)
        bm, bn, bk = matmul_blocks(T, N, K)
        _matmul_kernel[(-(-T // bm), -(-N // bn))](
            x, self.codes, *self._args(), self.bias if self.bias is not None else x, out, T, N, K, self.in_features,
            n1, block, G=self.group,
            BM=bm, BN=bn, BK=bk, HAS_BIAS=self.bias is not None, IEEE=x.dtype == torch.float32 or interpreting(),
            num_warps=4)
        return out


def make(record, raw, bias, device, dtype):
    """The registry's factory for q2 weights."""
    if record.shape[1] % 32:
        return None
    return Q2Linear(record, raw.to(device), bias, dtype, device)
