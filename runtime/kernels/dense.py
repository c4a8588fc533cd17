"""bf16 / f16 / f32 weights (ir/formats/dense.py): the decode matvec.

Batch-1 decode reads every weight once, so the matvec is a streaming kernel: each program takes
`BN` rows and walks their columns `BK` at a time with 16-byte loads (optionally loading the next
tile before using this one, so two tiles are in flight), accumulating in float32 registers; where
rows are few (o_proj, down_proj) split-K programs cover the columns and leave float32 partial
sums for the consumer (the fused residual norm) to add. Prefill multiplies through cuBLAS
(`F.linear`): for a dense weight that is the fastest matrix-matrix product there is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..linear import load_weight
from . import dependent, interpreting
from .common import KernelLinear, MatvecConfig, interpreter_block, next_power_of_2, prefix_rows, prefix_split
from .dependent import release_next, wait_previous
from .tiles import split_candidates, store_glu, store_rows


@triton.jit
def _rows_dot(w_ptr, x_ptr, rows, row_mask, K, KS, split_index, BN: tl.constexpr, BK: tl.constexpr,
              SPLIT: tl.constexpr, PREFETCH: tl.constexpr, EVEN_K: tl.constexpr):
    """sum_k W[rows, k] * x[k] over this program's share of the first K columns (rows of KS), float32 [BN]."""
    per_split = K // SPLIT
    begin = split_index * per_split
    end = begin + per_split
    ks = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * KS + ks[None, :]
    if PREFETCH:
        # Software double buffering: the next tile's loads are issued before this tile's math.
        w_next = tl.load(ptrs + begin, mask=row_mask[:, None] & (begin + ks < end)[None, :], other=0.0)
        for k0 in range(begin, end, BK):
            w = w_next
            w_next = tl.load(ptrs + k0 + BK, mask=row_mask[:, None] & (k0 + BK + ks < end)[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + ks, mask=k0 + ks < end, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    else:
        for k0 in range(begin, end, BK):
            if EVEN_K:
                w = tl.load(ptrs + k0, mask=row_mask[:, None], other=0.0)
                x = tl.load(x_ptr + k0 + ks)
            else:
                w = tl.load(ptrs + k0, mask=row_mask[:, None] & (k0 + ks < end)[None, :], other=0.0)
                x = tl.load(x_ptr + k0 + ks, mask=k0 + ks < end, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _matvec_kernel(w_ptr, bias_ptr, x_ptr, out_ptr, n, K, KS, BN: tl.constexpr, BK: tl.constexpr,
                   SPLIT: tl.constexpr, PREFETCH: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, PDL: tl.constexpr = 0):
    """Program (i, s): output rows i*BN.., columns of split s (the first K of rows of KS: an elastic
    prefix reads leading columns in place); ACT >= 0: [gate; up] rows r and n + r. PDL: launched as a
    programmatic dependent (dependent.py), waiting at its top."""
    wait_previous(PDL)
    release_next(PDL)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_mask = rows < n
    split_index = tl.program_id(1)
    acc = _rows_dot(w_ptr, x_ptr, rows, row_mask, K, KS, split_index, BN, BK, SPLIT, PREFETCH, EVEN_K)
    if ACT >= 0:
        up = _rows_dot(w_ptr, x_ptr, rows + n, row_mask, K, KS, split_index, BN, BK, SPLIT, PREFETCH, EVEN_K)
        store_glu(out_ptr, bias_ptr, rows, row_mask, acc, up, n, HAS_BIAS, ACT)
    else:
        store_rows(out_ptr, bias_ptr, rows, row_mask, acc, split_index, n, HAS_BIAS, PARTIAL)


class DenseKernelLinear(KernelLinear):
    """A dense weight (decoded once to the compute dtype, as the torch path holds it)."""

    def __init__(self, record, raw, bias, device, dtype):
        super().__init__(record, raw, bias, dtype, device)
        self.weight = load_weight(record, raw, device, dtype).contiguous()
        self.raw = None  # the decoded weight is the only copy kept

    def candidates(self, mode: str, rows: int | None = None, cols: int | None = None) -> list[MatvecConfig]:
        n, K = self.matvec_shape(mode, rows, cols)
        if interpreting():
            return [MatvecConfig(interpreter_block(n, 256), min(next_power_of_2(K), 512), 1, 4)]
        out = []
        for block_n, block_k, warps in ((8, 512, 4), (16, 256, 4), (4, 1024, 4), (16, 512, 8)):
            if K % block_k:
                continue
            splits = [1] if mode != "partial" else split_candidates(n, block_n, K // block_k, _sms())
            out += [MatvecConfig(block_n, block_k, s, warps) for s in splits[-2:]]
        return out or [MatvecConfig(16, 128, 1, 4)]

    def _matvec(self, x, out, config, act, partial, rows=None, cols=None):
        n, programs, config = prefix_rows(self, config, act, rows)
        K = self.in_features if cols is None else cols
        if cols is not None:  # an elastic prefix of the columns: a split that divides it, whole steps if it can
            config = prefix_split(config, K, config.chunk)
        even = K % (config.split * config.chunk) == 0
        prefetch = not interpreting() and even
        _matvec_kernel[(programs, config.split)](
            self.weight, self.bias if self.bias is not None else x, x, out, n, K, self.in_features, BN=config.block_n,
            BK=config.chunk, SPLIT=config.split, PREFETCH=prefetch, EVEN_K=even, ACT=act,
            HAS_BIAS=self.bias is not None, PARTIAL=partial, num_warps=config.num_warps, **dependent.kernel_args())
        return config.split

    def _matmul(self, x, rows=None, cols=None, halves=1):
        # cuBLAS reads a prefix as a view with the full row stride: no copy.
        from ..linear import row_blocks

        weight = self.weight if cols is None else self.weight[:, :cols]
        outs = [F.linear(x, weight[r], None if self.bias is None else self.bias[r])
                for r in row_blocks(self.out_features, rows, halves)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def dense_weight(self):
        return self.weight


def _sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def make(record, raw, bias, device, dtype):
    """The registry's factory: every dense 2-D weight."""
    if record.shape[1] % 16:
        return None
    return DenseKernelLinear(record, raw, bias, torch.device(device), dtype)


def reference(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What the matvec computes: x @ W.T in float32."""
    return x.float() @ weight.float().T
