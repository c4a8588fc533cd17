"""int3 / int4 / int5 / int6 (ir/formats/grouped_int.py): one matvec and one matmul for the
whole family, the code width a constexpr.

A b-bit code is a low plane of width WL (4, or 2 for int3) plus an optional high plane of width
WH (1 or 2); value = (u - 2^(b-1)) * scale (symmetric) or u * scale + offset (asymmetric), one
float16 scale (and offset) per group of G columns of a row. The matvec reads each plane's packed
half-words in 16-byte runs and turns codes into floats with the magic-number trick (tiles.py);
the zero point and the scale are applied once per half-word of codes, through the sum of x over
its columns: sum_k (u_k - mid) s x_k = s (sum_k u_k x_k - mid sum_k x_k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thin.ir.formats.grouped_int import PLANES

from . import interpreting
from .common import KernelLinear, MatvecConfig, interpreter_block, next_power_of_2, plane_candidates, sm_count
from .tiles import dot_tile, plane_codes, plane_dot, store_glu, store_rows


@triton.jit
def _rows_dot(low_ptr, high_ptr, scale_ptr, offset_ptr, x_ptr, rows, row_mask, K, low_stride, high_stride,
              split_index,
              WL: tl.constexpr, WH: tl.constexpr, MID: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr,
              GPI: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """sum_k W[rows, k] * x[k] over this program's share (1 / SPLIT) of the columns, float32 [BN]."""
    HL: tl.constexpr = G * WL // 16
    HH: tl.constexpr = G * WH // 16 if WH > 0 else 1
    groups = K // G
    per_split = groups // SPLIT
    begin = split_index * per_split
    gi = tl.arange(0, GPI)
    acc_low = tl.zeros([BN, GPI, HL], dtype=tl.float32)
    acc_high = tl.zeros([BN, GPI, HH], dtype=tl.float32)
    for g0 in range(begin, begin + per_split, GPI):
        # Group scales (and offsets): [BN, GPI], applied per half-word of codes.
        side = rows[:, None] * groups + (g0 + gi)[None, :]
        scale = tl.load(scale_ptr + side, mask=row_mask[:, None], other=0.0).to(tl.float32)[:, :, None]
        dot, xsum = plane_dot(low_ptr, rows, row_mask, low_stride, g0, x_ptr, WL, G, GPI, False, 1.0)
        if ASYM:
            offset = tl.load(offset_ptr + side, mask=row_mask[:, None], other=0.0).to(tl.float32)[:, :, None]
            acc_low += scale * dot + offset * xsum[None, :, :]
        else:
            acc_low += scale * (dot - MID * xsum[None, :, :])
        if WH > 0:
            # The high plane's codes weigh 2^WL: fold that into its x scaling.
            high, _ = plane_dot(high_ptr, rows, row_mask, high_stride, g0, x_ptr, WH, G, GPI, False, 1 << WL)
            acc_high += scale * high
    total = tl.sum(tl.sum(acc_low, axis=2), axis=1)
    if WH > 0:
        total += tl.sum(tl.sum(acc_high, axis=2), axis=1)
    return total


@triton.jit
def _matvec_kernel(low_ptr, high_ptr, scale_ptr, offset_ptr, bias_ptr, x_ptr, out_ptr, n, K, low_stride, high_stride,
                   WL: tl.constexpr, WH: tl.constexpr, MID: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr,
                   GPI: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """Program (i, s): rows i*BN.. of the output, columns of split s. With ACT >= 0 the weight is
    [gate; up] and the program computes both halves' rows (gate row r pairs with up row n + r)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_mask = rows < n
    split_index = tl.program_id(1)
    acc = _rows_dot(low_ptr, high_ptr, scale_ptr, offset_ptr, x_ptr, rows, row_mask, K, low_stride, high_stride,
                    split_index, WL, WH, MID, ASYM, G, GPI, BN, SPLIT)
    if ACT >= 0:
        up = _rows_dot(low_ptr, high_ptr, scale_ptr, offset_ptr, x_ptr, rows + n, row_mask, K, low_stride,
                       high_stride, split_index, WL, WH, MID, ASYM, G, GPI, BN, SPLIT)
        store_glu(out_ptr, bias_ptr, rows, row_mask, acc, up, n, HAS_BIAS, ACT)
    else:
        store_rows(out_ptr, bias_ptr, rows, row_mask, acc, split_index, n, HAS_BIAS, PARTIAL)


@triton.jit
def _matmul_kernel(x_ptr, low_ptr, high_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, T, N, K,
                   WL: tl.constexpr, WH: tl.constexpr, MID: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                   IEEE: tl.constexpr):
    """Prefill: out[T, N] = x[T, K] @ W.T, a [BN, BK] tile of W dequantized per step, then tl.dot."""
    tok = tl.program_id(0) * BM + tl.arange(0, BM)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    tok_mask, row_mask = tok < T, rows < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None] * K + cols[None, :], mask=tok_mask[:, None], other=0.0)
        codes = plane_codes(low_ptr, rows, cols, row_mask, K * WL // 8, WL)
        if WH > 0:
            codes |= plane_codes(high_ptr, rows, cols, row_mask, K * WH // 8, WH) << WL
        side = rows[:, None] * (K // G) + (cols // G)[None, :]
        scale = tl.load(scale_ptr + side, mask=row_mask[:, None], other=0.0).to(tl.float32)
        if ASYM:
            offset = tl.load(offset_ptr + side, mask=row_mask[:, None], other=0.0).to(tl.float32)
            w = codes.to(tl.float32) * scale + offset
        else:
            w = (codes - MID).to(tl.float32) * scale
        acc += dot_tile(x, w.to(x.dtype), IEEE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + tok[:, None] * N + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tok_mask[:, None] & row_mask[None, :])


class GroupedIntLinear(KernelLinear):
    """A grouped-int weight served by the kernels above."""

    def __init__(self, record, raw, bias, dtype, device):
        super().__init__(record, raw, bias, dtype, device)
        bits = int(self.format.removeprefix("int"))
        planes = PLANES[bits]
        self.wl, self.wh = planes[0], (planes[1] if len(planes) == 2 else 0)
        self.mid, self.asym, self.group = 2 ** (bits - 1), self.p["asymmetric"], self.p["group_size"]
        names = self.fmt.plane_names()
        # Half-word views of the planes (the matvec's unit); byte views for the matmul.
        self.low = self.parts[names[0]]
        self.high = self.parts[names[1]] if self.wh else self.low
        self.scales = self.parts["scales"]
        self.offsets = self.parts["offsets"] if self.asym else self.scales
        self.low16, self.high16 = self.low.view(torch.int16), self.high.view(torch.int16)

    def candidates(self, mode: str) -> list[MatvecConfig]:
        n = self.out_features // 2 if mode == "glu" else self.out_features
        groups = self.in_features // self.group
        if interpreting():
            return [MatvecConfig(interpreter_block(n, 256), 1, 1, 4)]
        return plane_candidates(n, groups, self.group * self.wl // 16, mode, sm_count())

    def _matvec(self, x, out, config, act, partial):
        n = self.out_features // 2 if act >= 0 else self.out_features
        grid = (-(-n // config.block_n), config.split)
        bias = self.bias if self.bias is not None else x
        K = self.in_features
        _matvec_kernel[grid](self.low16, self.high16, self.scales, self.offsets, bias, x, out, n, K, K * self.wl // 16,
                             K * self.wh // 16, WL=self.wl, WH=self.wh, MID=self.mid, ASYM=self.asym, G=self.group,
                             GPI=config.chunk, BN=config.block_n, SPLIT=config.split, ACT=act,
                             HAS_BIAS=self.bias is not None, PARTIAL=partial, num_warps=config.num_warps)

    def _matmul(self, x):
        T, (N, K) = x.shape[0], self.shape
        out = torch.empty(T, N, dtype=self.dtype, device=x.device)
        bm, bn, bk = matmul_blocks(T, N, K)
        bias = self.bias if self.bias is not None else x
        _matmul_kernel[(-(-T // bm), -(-N // bn))](
            x, self.low, self.high, self.scales, self.offsets, bias, out, T, N, K, WL=self.wl, WH=self.wh,
            MID=self.mid, ASYM=self.asym, G=self.group, BM=bm, BN=bn, BK=bk, HAS_BIAS=self.bias is not None,
            IEEE=x.dtype == torch.float32 or interpreting(), num_warps=4)
        return out


def matmul_blocks(T: int, N: int, K: int) -> tuple[int, int, int]:
    """Tile sizes of the prefill matmuls: (tokens, rows, columns) per program and step."""
    bk = 64 if K % 64 == 0 else 32
    if interpreting():
        return max(16, next_power_of_2(T)), interpreter_block(N, 256), bk
    return (64 if T > 32 else 16 if T <= 16 else 32), 64, bk


def make(record, raw, bias, device, dtype):
    """The registry's factory: a GroupedIntLinear, or None for a shape the kernels can't tile."""
    k = record.shape[1]
    if k % 64 and k % 32:
        return None
    return GroupedIntLinear(record, raw.to(device), bias, dtype, device)


def reference(raw: torch.Tensor, shape, params, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the kernels compute, by the format's own decode: x @ decode(W).T in float32."""
    from thin.ir import formats

    return x.float() @ formats.get(fmt).decode(raw, tuple(shape), params, torch.float32).T
