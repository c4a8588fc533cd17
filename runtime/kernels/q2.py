"""q2 (ir/formats/q2.py): 2-bit codes, an e4m3 step and offset per group under float32 row scales.

The matvec reads the code plane in 16-byte runs (tiles.py: eight codes a half-word, converted in
place) and applies each group's affine map once per half-word through the sum of x:
sum_k (u_k step + zero) x_k = step sum_k u_k x_k + zero sum_k x_k, with step = row_scale * scale
and zero = row_offset * offset decoded from their e4m3 bytes. Prefill dequantizes tiles for tl.dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import KernelLinear, MatvecConfig, groups_per_step, interpreter_block, plane_candidates, sm_count
from .grouped_int import matmul_blocks
from .tiles import dot_tile, plane_codes, plane_dot, store_glu, store_rows


@triton.jit
def _e4m3(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _rows_dot(c_ptr, s_ptr, o_ptr, rs_ptr, ro_ptr, x_ptr, rows, row_mask, K, stride, split_index, G: tl.constexpr,
              GPI: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """sum_k W[rows, k] x[k] over this program's share of the columns, float32 [BN]."""
    HPG: tl.constexpr = G // 8
    groups = K // G
    per_split = groups // SPLIT
    begin = split_index * per_split
    gi = tl.arange(0, GPI)
    row_scale = tl.load(rs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    row_offset = tl.load(ro_ptr + rows, mask=row_mask, other=0.0)[:, None]
    acc = tl.zeros([BN, GPI, HPG], dtype=tl.float32)
    for g0 in range(begin, begin + per_split, GPI):
        side = rows[:, None] * groups + (g0 + gi)[None, :]
        step = (row_scale * _e4m3(s_ptr, side, row_mask[:, None]))[:, :, None]
        zero = (row_offset * _e4m3(o_ptr, side, row_mask[:, None]))[:, :, None]
        dot, xsum = plane_dot(c_ptr, rows, row_mask, stride, g0, x_ptr, 2, G, GPI, False, 1.0)
        acc += step * dot + zero * xsum[None, :, :]
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _matvec_kernel(c_ptr, s_ptr, o_ptr, rs_ptr, ro_ptr, bias_ptr, x_ptr, out_ptr, n, K, stride, G: tl.constexpr,
                   GPI: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """Program (i, s): output rows i*BN.., columns of split s; ACT >= 0: [gate; up] rows r and n + r."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_mask = rows < n
    split_index = tl.program_id(1)
    acc = _rows_dot(c_ptr, s_ptr, o_ptr, rs_ptr, ro_ptr, x_ptr, rows, row_mask, K, stride, split_index, G, GPI, BN,
                    SPLIT)
    if ACT >= 0:
        up = _rows_dot(c_ptr, s_ptr, o_ptr, rs_ptr, ro_ptr, x_ptr, rows + n, row_mask, K, stride, split_index, G,
                       GPI, BN, SPLIT)
        store_glu(out_ptr, bias_ptr, rows, row_mask, acc, up, n, HAS_BIAS, ACT)
    else:
        store_rows(out_ptr, bias_ptr, rows, row_mask, acc, split_index, n, HAS_BIAS, PARTIAL)


@triton.jit
def _matmul_kernel(x_ptr, c_ptr, s_ptr, o_ptr, rs_ptr, ro_ptr, bias_ptr, out_ptr, T, N, K, G: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                   IEEE: tl.constexpr):
    """Prefill: out[T, N] = x[T, K] @ W.T with [BN, BK] tiles of W dequantized per step."""
    tok = tl.program_id(0) * BM + tl.arange(0, BM)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    tok_mask, row_mask = tok < T, rows < N
    row_scale = tl.load(rs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    row_offset = tl.load(ro_ptr + rows, mask=row_mask, other=0.0)[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None] * K + cols[None, :], mask=tok_mask[:, None], other=0.0)
        codes = plane_codes(c_ptr, rows, cols, row_mask, K // 4, 2)
        side = rows[:, None] * (K // G) + (cols // G)[None, :]
        step = row_scale * _e4m3(s_ptr, side, row_mask[:, None])
        zero = row_offset * _e4m3(o_ptr, side, row_mask[:, None])
        w = codes.to(tl.float32) * step + zero
        acc += dot_tile(x, w.to(x.dtype), IEEE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + tok[:, None] * N + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tok_mask[:, None] & row_mask[None, :])


class Q2Linear(KernelLinear):
    """A q2 weight."""

    def __init__(self, record, raw, bias, dtype, device):
        super().__init__(record, raw, bias, dtype, device)
        self.group = self.p["group_size"]
        self.codes = self.parts["codes"]
        self.codes16 = self.codes.view(torch.int16)
        self.scales = self.parts["scales"].view(torch.uint8)
        self.offsets = self.parts["offsets"].view(torch.uint8)
        self.row_scale, self.row_offset = self.parts["row_scale"], self.parts["row_offset"]

    def candidates(self, mode: str) -> list[MatvecConfig]:
        n = self.out_features // 2 if mode == "glu" else self.out_features
        groups = self.in_features // self.group
        if interpreting():
            return [MatvecConfig(interpreter_block(n, 256), groups_per_step(groups, 256 // self.group), 1, 4)]
        return plane_candidates(n, groups, self.group // 8, mode, sm_count())

    def _args(self):
        return self.codes16, self.scales, self.offsets, self.row_scale, self.row_offset

    def _matvec(self, x, out, config, act, partial):
        n = self.out_features // 2 if act >= 0 else self.out_features
        grid = (-(-n // config.block_n), config.split)
        _matvec_kernel[grid](*self._args(), self.bias if self.bias is not None else x, x, out, n, self.in_features,
                             self.in_features // 8, G=self.group, GPI=config.chunk, BN=config.block_n,
                             SPLIT=config.split, ACT=act, HAS_BIAS=self.bias is not None, PARTIAL=partial,
                             num_warps=config.num_warps)

    def _matmul(self, x):
        T, (N, K) = x.shape[0], self.shape
        out = torch.empty(T, N, dtype=self.dtype, device=x.device)
        bm, bn, bk = matmul_blocks(T, N, K)
        _matmul_kernel[(-(-T // bm), -(-N // bn))](
            x, self.codes, *self._args()[1:], self.bias if self.bias is not None else x, out, T, N, K, G=self.group,
            BM=bm, BN=bn, BK=bk, HAS_BIAS=self.bias is not None, IEEE=x.dtype == torch.float32 or interpreting(),
            num_warps=4)
        return out


def make(record, raw, bias, device, dtype):
    """The registry's factory for q2 weights."""
    if record.shape[1] % 32:
        return None
    return Q2Linear(record, raw.to(device), bias, dtype, device)
