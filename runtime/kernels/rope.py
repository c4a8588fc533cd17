"""After the qkv projection: per-head q/k RMSNorm (Qwen3, Gemma-3), rotary embedding, and the
append of the new keys and values to the paged KV cache, in one launch.

RoPE of every kind the IR has (default, linear, llama3) comes in through the cos/sin tables of
runtime/rope.py (RotaryTables: the frequencies as transformers computes them, in the compute
dtype), indexed here by the position read from the device, so a captured decode step rotates by
the current position. Partial rotary (Phi-3) rotates the first `rotary_dim` features of a head.
Rounding follows the torch path: the norm's output, x * cos, rotate_half(x) * sin and their sum are
each rounded to the compute dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import dependent
from .common import next_power_of_2
from .dependent import release_next, wait_previous
from .tiles import split_sum


@triton.jit
def _features(x_ptr, bias_ptr, cols, mask, split_stride, dtype, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """qkv's features at `cols` (float32): loaded as they are, or (SPLITS > 0) the sum of SPLITS float32
    partial sums split_stride apart, in split order, plus the bias, rounded to `dtype` (the projection's
    summed output, as grouped_int_batch's `_sum_splits` rounds it)."""
    if SPLITS == 0:
        return tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return split_sum(x_ptr, cols, mask, split_stride, bias_ptr, cols, SPLITS, HAS_BIAS).to(dtype).to(tl.float32)


@triton.jit
def _head(x_ptr, w_ptr, eps, cos_ptr, sin_ptr, position, D, R, d, NORM: tl.constexpr, ROPE: tl.constexpr,
          bias_ptr=None, split_stride=0, dtype: tl.constexpr = None, SPLITS: tl.constexpr = 0,
          HAS_BIAS: tl.constexpr = False):
    """One head's D features (float32, rounded to the dtype of x_ptr at each torch step; SPLITS > 0: x_ptr
    holds float32 partial sums (`_features`) and `dtype` is the compute dtype)."""
    if SPLITS == 0:  # noqa: SIM108  (constexpr branches: only one is compiled)
        ty = x_ptr.dtype.element_ty
    else:
        ty = dtype
    mask = d < D
    x = _features(x_ptr, bias_ptr, d, mask, split_stride, ty, SPLITS, HAS_BIAS)
    if NORM:
        x = tl.where(mask, x, 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        x = (x * inv * tl.load(w_ptr + d, mask=mask, other=0.0)).to(ty).to(tl.float32)
    if ROPE:
        half = R // 2
        rot = d < R
        partner = tl.where(d < half, d + half, d - half)
        other = _features(x_ptr, bias_ptr, partner, rot, split_stride, ty, SPLITS, HAS_BIAS)
        if NORM:  # the partner feature is normed too (same row statistics)
            other = (other * inv * tl.load(w_ptr + partner, mask=rot, other=0.0)).to(ty).to(tl.float32)
        other = tl.where(d < half, -other, other)
        cos = tl.load(cos_ptr + position * R + d, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + position * R + d, mask=rot, other=0.0).to(tl.float32)
        rotated = ((x * cos).to(ty).to(tl.float32) + (other * sin).to(ty).to(tl.float32)).to(ty)
        x = tl.where(rot, rotated.to(tl.float32), x)
    return x


@triton.jit
def _rope_append_kernel(qkv_ptr, q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, pos_ptr, cos_ptr, sin_ptr,
                        qn_ptr, kn_ptr, q_eps, k_eps, HQ, HKV, D, R, table_stride,
                        BS: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                        ROWS: tl.constexpr, bias_ptr=None, split_stride=0, SPLITS: tl.constexpr = 0,
                        HAS_BIAS: tl.constexpr = False, PDL: tl.constexpr = 0):
    """Program (t, h): token t of this call; h < HQ a query head (-> q), else key/value head h - HQ
    (-> the cache slot of position pos + t, through the block table). ROWS: token t is the next
    token of sequence t of a batch, at position pos[t], through row t of the block table. SPLITS > 0:
    qkv is float32 partial sums [SPLITS, T, width] (split_stride = T * width), summed here with the
    bias (`_features`). PDL: launched as a programmatic dependent (dependent.py), waiting at its top."""
    wait_previous(PDL)
    release_next(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    if ROWS:
        position = tl.load(pos_ptr + t)
        table_ptr += t * table_stride
    else:
        position = tl.load(pos_ptr) + t
    row = qkv_ptr + t * (HQ + 2 * HKV) * D
    if h < HQ:
        x = _head(row + h * D, qn_ptr, q_eps, cos_ptr, sin_ptr, position, D, R, d, NORM, ROPE, bias_ptr + h * D,
                  split_stride, q_ptr.dtype.element_ty, SPLITS, HAS_BIAS)
        tl.store(q_ptr + (t * HQ + h) * D + d, x.to(q_ptr.dtype.element_ty), mask=d < D)
    else:
        kv = h - HQ
        # v is loaded before k's cache store (which the compiler cannot tell apart from qkv): its load then
        # goes out with the others instead of one latency after that store.
        if SPLITS > 0:
            v = _features(row + (HQ + HKV + kv) * D, bias_ptr + (HQ + HKV + kv) * D, d, d < D, split_stride,
                          q_ptr.dtype.element_ty, SPLITS, HAS_BIAS).to(v_cache_ptr.dtype.element_ty)
        else:
            v = tl.load(row + (HQ + HKV + kv) * D + d, mask=d < D, other=0.0)
        block = tl.load(table_ptr + position // BS)
        slot = ((block * HKV + kv) * BS + position % BS).to(tl.int64) * D
        k = _head(row + (HQ + kv) * D, kn_ptr, k_eps, cos_ptr, sin_ptr, position, D, R, d, NORM, ROPE,
                  bias_ptr + (HQ + kv) * D, split_stride, q_ptr.dtype.element_ty, SPLITS, HAS_BIAS)
        tl.store(k_cache_ptr + slot + d, k.to(k_cache_ptr.dtype.element_ty), mask=d < D)
        tl.store(v_cache_ptr + slot + d, v, mask=d < D)


def rope_append(qkv: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_table: torch.Tensor, pos: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                rope=None, q_norm=None, k_norm=None, splits: int = 0, bias: torch.Tensor | None = None) -> None:
    """qkv [T, (num_heads + 2 num_kv_heads) * head_dim] at positions pos[0] .. pos[0] + T - 1:
    q (normed, rotated) into q_out [T, num_heads, head_dim]; k (normed, rotated) and v into their
    cache slots. `k_cache`/`v_cache` are [blocks, num_kv_heads, block_size, head_dim]; `rope` is
    (cos, sin) tables [positions, rotary_dim] or None; q_norm/k_norm are (weight [head_dim], eps).

    A 2-D `block_table` [>= T, blocks] makes the T tokens the next tokens of T sequences: token t at
    position pos[t], stored through block_table[t] (a batched decode step). `splits` > 0: qkv is the
    projection's float32 split-K partial sums [splits, T, width], summed here with `bias` (q_out's
    dtype is the compute dtype)."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if splits and (qkv.dtype != torch.float32 or qkv.numel() % (splits * width) or not qkv.is_contiguous()):
        raise ValueError(f"rope_append's partial sums are float32 [{splits}, T, {width}], got {tuple(qkv.shape)} "
                         f"{qkv.dtype}")
    if not splits and bias is not None:
        raise ValueError("rope_append adds a bias to partial sums only")
    T = qkv.numel() // (max(1, splits) * width)
    rows = block_table.dim() == 2
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    cos, sin = rope if rope is not None else (qkv, qkv)
    rotary_dim = cos.shape[-1] if rope is not None else head_dim
    qn, q_eps = q_norm if q_norm is not None else (qkv, 0.0)
    kn, k_eps = k_norm if k_norm is not None else (qkv, 0.0)
    _rope_append_kernel[(T, num_heads + num_kv_heads)](
        qkv, q_out, k_cache, v_cache, block_table, pos, cos, sin, qn, kn, float(q_eps), float(k_eps), num_heads,
        num_kv_heads, head_dim, rotary_dim, block_table.stride(0) if rows else 0, BS=k_cache.shape[2],
        BLOCK_D=next_power_of_2(head_dim), NORM=q_norm is not None, ROPE=rope is not None, ROWS=rows,
        bias_ptr=bias if bias is not None else qkv, split_stride=T * width, SPLITS=splits, HAS_BIAS=bias is not None,
        num_warps=1 if head_dim <= 128 else 2, **dependent.kernel_args())
