"""int8 and fp8_e4m3 (ir/formats/int8.py, fp8.py): one byte a weight, one float32 scale a row.

Both matvecs stream a row's bytes in 16-byte loads and apply the row's scale once, after the dot
product. int8 goes through the bit-plane path (tiles.py, an 8-bit plane: two codes a half-word,
read as u = v + 128 and corrected by 128 * sum(x)); fp8 converts with the hardware's e4m3
conversion. Prefill dequantizes [BN, BK] tiles to the compute dtype and multiplies with tl.dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import KernelLinear, MatvecConfig, interpreter_block, next_power_of_2, plane_candidates
from .grouped_int import matmul_blocks
from .tiles import dot_tile, plane_dot, split_candidates, store_glu, store_rows

GROUP = 128  # int8: columns per xsum correction (any divisor of K works; there is no group scale)


@triton.jit
def _rows_dot(v_ptr, scale_ptr, x_ptr, rows, row_mask, K, stride, split_index, FP8: tl.constexpr, G: tl.constexpr,
              BN: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr):
    """scale[rows] * sum_k W[rows, k] x[k] over this program's share of the columns, float32 [BN]."""
    per_split = K // SPLIT
    begin = split_index * per_split
    if FP8:
        ks = tl.arange(0, CHUNK)
        acc = tl.zeros([BN, CHUNK], dtype=tl.float32)
        ptrs = v_ptr + rows[:, None].to(tl.int64) * stride + ks[None, :]
        for k0 in range(begin, begin + per_split, CHUNK):
            w = tl.load(ptrs + k0, mask=row_mask[:, None], other=0)
            x = tl.load(x_ptr + k0 + ks).to(tl.float32)
            acc += w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * x[None, :]
        total = tl.sum(acc, axis=1)
    else:
        GPI: tl.constexpr = CHUNK // G
        HPG: tl.constexpr = G // 2
        acc = tl.zeros([BN, GPI, HPG], dtype=tl.float32)
        for g0 in range(begin // G, (begin + per_split) // G, GPI):
            dot, xsum = plane_dot(v_ptr, rows, row_mask, stride, g0, x_ptr, 8, G, GPI, True, 1.0)
            acc += dot - 128.0 * xsum[None, :, :]
        total = tl.sum(tl.sum(acc, axis=2), axis=1)
    return total * tl.load(scale_ptr + rows, mask=row_mask, other=0.0)


@triton.jit
def _matvec_kernel(v_ptr, scale_ptr, bias_ptr, x_ptr, out_ptr, n, K, stride, FP8: tl.constexpr, G: tl.constexpr,
                   BN: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """Program (i, s): output rows i*BN.., columns of split s; ACT >= 0: [gate; up] rows r and n + r."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_mask = rows < n
    split_index = tl.program_id(1)
    acc = _rows_dot(v_ptr, scale_ptr, x_ptr, rows, row_mask, K, stride, split_index, FP8, G, BN, CHUNK, SPLIT)
    if ACT >= 0:
        up = _rows_dot(v_ptr, scale_ptr, x_ptr, rows + n, row_mask, K, stride, split_index, FP8, G, BN, CHUNK, SPLIT)
        store_glu(out_ptr, bias_ptr, rows, row_mask, acc, up, n, HAS_BIAS, ACT)
    else:
        store_rows(out_ptr, bias_ptr, rows, row_mask, acc, split_index, n, HAS_BIAS, PARTIAL)


@triton.jit
def _matmul_kernel(x_ptr, v_ptr, scale_ptr, bias_ptr, out_ptr, T, N, K, FP8: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """Prefill: out[T, N] = x[T, K] @ W.T with [BN, BK] tiles of W dequantized per step."""
    tok = tl.program_id(0) * BM + tl.arange(0, BM)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    tok_mask, row_mask = tok < T, rows < N
    scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None] * K + cols[None, :], mask=tok_mask[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=row_mask[:, None], other=0)
        if FP8:  # noqa: SIM108  (constexpr branches: only one is compiled)
            w = v.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            w = v.to(tl.int8, bitcast=True).to(tl.float32)
        acc += dot_tile(x, (w * scale[:, None]).to(x.dtype), IEEE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + tok[:, None] * N + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tok_mask[:, None] & row_mask[None, :])


class Rowwise8Linear(KernelLinear):
    """An int8 or fp8_e4m3 weight."""

    def __init__(self, record, raw, bias, dtype, device):
        super().__init__(record, raw, bias, dtype, device)
        self.fp8 = self.format == "fp8_e4m3"
        self.values = self.parts["values"].view(torch.uint8)
        self.values16 = self.values.view(torch.int16)
        self.scales = self.parts["scales"]
        K = self.in_features
        self.group = next(g for g in (GROUP, 64, 32, 16) if K % g == 0)

    def candidates(self, mode: str) -> list[MatvecConfig]:
        n = self.out_features // 2 if mode == "glu" else self.out_features
        K = self.in_features
        if interpreting():
            if self.fp8:
                chunk = min(next_power_of_2(K), 256)
                while K % chunk:
                    chunk //= 2
            else:
                gpi = 1
                while 2 * gpi * self.group <= 256 and (K // self.group) % (2 * gpi) == 0:
                    gpi *= 2
                chunk = gpi * self.group
            return [MatvecConfig(interpreter_block(n, 256), chunk, 1, 4)]
        if not self.fp8:  # the bit-plane tiles, chunk in columns
            plane = plane_candidates(n, K // self.group, self.group // 2, mode, _sms())
            return [MatvecConfig(c.block_n, c.chunk * self.group, c.split, c.num_warps) for c in plane]
        out = []
        for block_n, chunk in ((4, 2048), (8, 1024), (16, 512), (8, 2048), (32, 256)):
            if K % chunk:
                continue
            splits = [1] if mode != "partial" else split_candidates(n, block_n, K // chunk, _sms())
            out += [MatvecConfig(block_n, chunk, s, 4) for s in splits[-2:]]
        return out or [MatvecConfig(16, self.group, 1, 4)]

    def _matvec(self, x, out, config, act, partial):
        n = self.out_features // 2 if act >= 0 else self.out_features
        grid = (-(-n // config.block_n), config.split)
        values = self.values if self.fp8 else self.values16
        K = self.in_features
        _matvec_kernel[grid](values, self.scales, self.bias if self.bias is not None else x, x, out, n, K,
                             K if self.fp8 else K // 2, FP8=self.fp8, G=self.group, BN=config.block_n,
                             CHUNK=config.chunk, SPLIT=config.split, ACT=act, HAS_BIAS=self.bias is not None,
                             PARTIAL=partial, num_warps=config.num_warps)

    def _matmul(self, x):
        T, (N, K) = x.shape[0], self.shape
        out = torch.empty(T, N, dtype=self.dtype, device=x.device)
        bm, bn, bk = matmul_blocks(T, N, K)
        _matmul_kernel[(-(-T // bm), -(-N // bn))](
            x, self.values, self.scales, self.bias if self.bias is not None else x, out, T, N, K, FP8=self.fp8,
            BM=bm, BN=bn, BK=bk, HAS_BIAS=self.bias is not None, IEEE=x.dtype == torch.float32 or interpreting(),
            num_warps=4)
        return out


def _sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def make(record, raw, bias, device, dtype):
    """The registry's factory for int8 and fp8_e4m3 weights."""
    if record.shape[1] % 32:
        return None
    return Rowwise8Linear(record, raw.to(device), bias, dtype, device)


def reference(raw: torch.Tensor, shape, params, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the kernels compute, by the format's own decode: x @ decode(W).T in float32."""
    from thin.ir import formats

    return x.float() @ formats.get(fmt).decode(raw, tuple(shape), params, torch.float32).T
