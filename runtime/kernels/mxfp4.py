"""mxfp4 (ir/formats/mxfp4.py): E2M1 codes, two a byte, one E8M0 scale per 32 columns.

A code's float bits are built in place: its 3 magnitude bits go to float32 bits 22-24 and its sign
to bit 31, which is the E2M1 value times 2^-126 (code 1, 0.5, lands on a float32 subnormal; the
multiply by 2^126 is exact and the GPU keeps subnormals in plain float32 arithmetic). A block's
dot product is then scaled once by its 2^(e - 127). The matvec reads 16-byte runs of half-words
(four codes each, eight half-words a block); prefill dequantizes [BN, BK] tiles for tl.dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thin.ir.formats.mxfp4 import BLOCK

from . import interpreting
from .common import KernelLinear, MatvecConfig, groups_per_step, interpreter_block, plane_candidates, sm_count
from .grouped_int import matmul_blocks
from .tiles import dot_tile, plane_codes, store_glu, store_rows

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
def _rows_dot(v_ptr, e_ptr, x_ptr, rows, row_mask, K, stride, split_index, GPI: tl.constexpr, BN: tl.constexpr,
              SPLIT: tl.constexpr):
    """sum_k W[rows, k] x[k] over this program's share of the columns, float32 [BN]. `stride` is a
    row's length in half-words (four codes each; eight half-words a block)."""
    HPB: tl.constexpr = 8
    blocks = K // 32
    per_split = blocks // SPLIT
    begin = split_index * per_split
    gi = tl.arange(0, GPI)
    hi = tl.arange(0, HPB)
    acc = tl.zeros([BN, GPI, HPB], dtype=tl.float32)
    for b0 in range(begin, begin + per_split, GPI):
        offs = rows[:, None, None] * stride + ((b0 + gi) * HPB)[None, :, None] + hi[None, None, :]
        half = tl.load(v_ptr + offs, mask=row_mask[:, None, None], other=0).to(tl.int32)
        first = (b0 + gi)[:, None] * 32 + hi[None, :] * 4
        dot = tl.zeros([BN, GPI, HPB], dtype=tl.float32)
        for j in tl.static_range(4):
            # Nibble j: magnitude bits to 22-24, sign to 31: the E2M1 value times 2^-126.
            bits = ((half << (22 - 4 * j)) & 0x01C00000) | ((half << (28 - 4 * j)) & -0x80000000)
            w = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # * 2^126, exact
            x = tl.load(x_ptr + first + j).to(tl.float32)
            dot += w * x[None, :, :]
        e = tl.load(e_ptr + rows[:, None] * blocks + (b0 + gi)[None, :], mask=row_mask[:, None], other=127)
        acc += _block_scale(e.to(tl.int32))[:, :, None] * dot
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _matvec_kernel(v_ptr, e_ptr, bias_ptr, x_ptr, out_ptr, n, K, stride, GPI: tl.constexpr, BN: tl.constexpr,
                   SPLIT: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """Program (i, s): output rows i*BN.., columns of split s; ACT >= 0: [gate; up] rows r and n + r."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_mask = rows < n
    split_index = tl.program_id(1)
    acc = _rows_dot(v_ptr, e_ptr, x_ptr, rows, row_mask, K, stride, split_index, GPI, BN, SPLIT)
    if ACT >= 0:
        up = _rows_dot(v_ptr, e_ptr, x_ptr, rows + n, row_mask, K, stride, split_index, GPI, BN, SPLIT)
        store_glu(out_ptr, bias_ptr, rows, row_mask, acc, up, n, HAS_BIAS, ACT)
    else:
        store_rows(out_ptr, bias_ptr, rows, row_mask, acc, split_index, n, HAS_BIAS, PARTIAL)


@triton.jit
def _matmul_kernel(x_ptr, v_ptr, e_ptr, bias_ptr, out_ptr, T, N, K, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """Prefill: out[T, N] = x[T, K] @ W.T with [BN, BK] tiles of W dequantized per step."""
    tok = tl.program_id(0) * BM + tl.arange(0, BM)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    tok_mask, row_mask = tok < T, rows < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None] * K + cols[None, :], mask=tok_mask[:, None], other=0.0)
        codes = plane_codes(v_ptr, rows, cols, row_mask, K // 2, 4)
        e = tl.load(e_ptr + rows[:, None] * (K // 32) + (cols // 32)[None, :], mask=row_mask[:, None], other=127)
        w = _code_values(codes) * _block_scale(e.to(tl.int32))
        acc += dot_tile(x, w.to(x.dtype), IEEE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + tok[:, None] * N + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tok_mask[:, None] & row_mask[None, :])


class MxFp4Linear(KernelLinear):
    """An mxfp4 weight."""

    def __init__(self, record, raw, bias, dtype, device):
        super().__init__(record, raw, bias, dtype, device)
        self.values = self.parts["values"]
        self.values16 = self.values.view(torch.int16)
        self.scales = self.parts["scales"]

    def candidates(self, mode: str) -> list[MatvecConfig]:
        n = self.out_features // 2 if mode == "glu" else self.out_features
        blocks = self.in_features // BLOCK
        if interpreting():
            return [MatvecConfig(interpreter_block(n, 256), groups_per_step(blocks, 8), 1, 4)]
        return plane_candidates(n, blocks, 8, mode, sm_count())

    def _matvec(self, x, out, config, act, partial):
        n = self.out_features // 2 if act >= 0 else self.out_features
        grid = (-(-n // config.block_n), config.split)
        _matvec_kernel[grid](self.values16, self.scales, self.bias if self.bias is not None else x, x, out, n,
                             self.in_features, self.in_features // 4, GPI=config.chunk, BN=config.block_n,
                             SPLIT=config.split, ACT=act, HAS_BIAS=self.bias is not None, PARTIAL=partial,
                             num_warps=config.num_warps)

    def _matmul(self, x):
        T, (N, K) = x.shape[0], self.shape
        out = torch.empty(T, N, dtype=self.dtype, device=x.device)
        bm, bn, bk = matmul_blocks(T, N, K)
        _matmul_kernel[(-(-T // bm), -(-N // bn))](
            x, self.values, self.scales, self.bias if self.bias is not None else x, out, T, N, K, BM=bm, BN=bn,
            BK=bk, HAS_BIAS=self.bias is not None, IEEE=x.dtype == torch.float32 or interpreting(), num_warps=4)
        return out


def make(record, raw, bias, device, dtype):
    """The registry's factory for mxfp4 weights."""
    return MxFp4Linear(record, raw.to(device), bias, dtype, device)
