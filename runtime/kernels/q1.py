"""q1 (ir/formats/q1.py): sign bits, an e4m3 magnitude per group under a float32 row scale.

value = (2b - 1) * step, so a group's dot product is step * (2 * sum_k b_k x_k - sum_k x_k): the
matvec reads the sign plane in 16-byte runs (tiles.py: sixteen bits a half-word, converted in
place) and needs one multiply-add per weight plus one per half-word. Prefill dequantizes tiles
for tl.dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import KernelLinear, MatvecConfig, groups_per_step, interpreter_block, plane_candidates, sm_count
from .grouped_int import matmul_blocks
from .q2 import _e4m3
from .tiles import dot_tile, plane_codes, plane_dot, store_glu, store_rows


@triton.jit
def _rows_dot(b_ptr, s_ptr, rs_ptr, x_ptr, rows, row_mask, K, stride, split_index, G: tl.constexpr, GPI: tl.constexpr,
              BN: tl.constexpr, SPLIT: tl.constexpr):
    """sum_k W[rows, k] x[k] over this program's share of the columns, float32 [BN]."""
    HPG: tl.constexpr = G // 16
    groups = K // G
    per_split = groups // SPLIT
    begin = split_index * per_split
    gi = tl.arange(0, GPI)
    row_scale = tl.load(rs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    acc = tl.zeros([BN, GPI, HPG], dtype=tl.float32)
    for g0 in range(begin, begin + per_split, GPI):
        step = (row_scale * _e4m3(s_ptr, rows[:, None] * groups + (g0 + gi)[None, :], row_mask[:, None]))
        dot, xsum = plane_dot(b_ptr, rows, row_mask, stride, g0, x_ptr, 1, G, GPI, False, 2.0)
        acc += step[:, :, None] * (dot - xsum[None, :, :])
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _matvec_kernel(b_ptr, s_ptr, rs_ptr, bias_ptr, x_ptr, out_ptr, n, K, stride, G: tl.constexpr, GPI: tl.constexpr,
                   BN: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PARTIAL: tl.constexpr):
    """Program (i, s): output rows i*BN.., columns of split s; ACT >= 0: [gate; up] rows r and n + r."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_mask = rows < n
    split_index = tl.program_id(1)
    acc = _rows_dot(b_ptr, s_ptr, rs_ptr, x_ptr, rows, row_mask, K, stride, split_index, G, GPI, BN, SPLIT)
    if ACT >= 0:
        up = _rows_dot(b_ptr, s_ptr, rs_ptr, x_ptr, rows + n, row_mask, K, stride, split_index, G, GPI, BN, SPLIT)
        store_glu(out_ptr, bias_ptr, rows, row_mask, acc, up, n, HAS_BIAS, ACT)
    else:
        store_rows(out_ptr, bias_ptr, rows, row_mask, acc, split_index, n, HAS_BIAS, PARTIAL)


@triton.jit
def _matmul_kernel(x_ptr, b_ptr, s_ptr, rs_ptr, bias_ptr, out_ptr, T, N, K, G: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """Prefill: out[T, N] = x[T, K] @ W.T with [BN, BK] tiles of W dequantized per step."""
    tok = tl.program_id(0) * BM + tl.arange(0, BM)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    tok_mask, row_mask = tok < T, rows < N
    row_scale = tl.load(rs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None] * K + cols[None, :], mask=tok_mask[:, None], other=0.0)
        bits = plane_codes(b_ptr, rows, cols, row_mask, K // 8, 1)
        step = row_scale * _e4m3(s_ptr, rows[:, None] * (K // G) + (cols // G)[None, :], row_mask[:, None])
        w = tl.where(bits != 0, step, -step)
        acc += dot_tile(x, w.to(x.dtype), IEEE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + tok[:, None] * N + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tok_mask[:, None] & row_mask[None, :])


class Q1Linear(KernelLinear):
    """A q1 weight."""

    def __init__(self, record, raw, bias, dtype, device):
        super().__init__(record, raw, bias, dtype, device)
        self.group = self.p["group_size"]
        self.signs = self.parts["signs"]
        self.signs16 = self.signs.view(torch.int16)
        self.scales = self.parts["scales"].view(torch.uint8)
        self.row_scale = self.parts["row_scale"]

    def candidates(self, mode: str) -> list[MatvecConfig]:
        n = self.out_features // 2 if mode == "glu" else self.out_features
        groups = self.in_features // self.group
        if interpreting():
            return [MatvecConfig(interpreter_block(n, 256), groups_per_step(groups, 256 // self.group), 1, 4)]
        return plane_candidates(n, groups, self.group // 16, mode, sm_count())

    def _matvec(self, x, out, config, act, partial):
        n = self.out_features // 2 if act >= 0 else self.out_features
        grid = (-(-n // config.block_n), config.split)
        _matvec_kernel[grid](self.signs16, self.scales, self.row_scale, self.bias if self.bias is not None else x, x,
                             out, n, self.in_features, self.in_features // 16, G=self.group, GPI=config.chunk,
                             BN=config.block_n, SPLIT=config.split, ACT=act, HAS_BIAS=self.bias is not None,
                             PARTIAL=partial, num_warps=config.num_warps)

    def _matmul(self, x):
        T, (N, K) = x.shape[0], self.shape
        out = torch.empty(T, N, dtype=self.dtype, device=x.device)
        bm, bn, bk = matmul_blocks(T, N, K)
        _matmul_kernel[(-(-T // bm), -(-N // bn))](
            x, self.signs, self.scales, self.row_scale, self.bias if self.bias is not None else x, out, T, N, K,
            G=self.group, BM=bm, BN=bn, BK=bk, HAS_BIAS=self.bias is not None,
            IEEE=x.dtype == torch.float32 or interpreting(), num_warps=4)
        return out


def make(record, raw, bias, device, dtype):
    """The registry's factory for q1 weights."""
    if record.shape[1] % 32:
        return None
    return Q1Linear(record, raw.to(device), bias, dtype, device)
