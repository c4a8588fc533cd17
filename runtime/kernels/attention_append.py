"""Decode attention that also appends: the q/k norm, RoPE and KV append of rope.py's rope_append
done inside the split-KV kernel of attention.py, so a decode step's attention is two launches a
layer (this split kernel, then attention.py's merge) instead of three.

Every split program norms and rotates the query heads of its kv head from the raw qkv row (cheap,
and the same in every split). The split that holds the new position (the last one with positions)
also makes the new key and value, stores them in their cache slot through the block table and
attends to them from registers: no program of the launch reads that slot, so there is no race
with the store. Every other part (the number of visible positions read from the device, window,
softcap, GQA, the partial outputs, the merge with its sinks and its log of positions attended) is
attention.py's, so the two paths differ only in where q and the new key come from.

Whether this beats rope_append + split-KV + merge is timed on the device (`choose_appending`),
as the decode engine does at warm-up; the earlier one-launch variant that also merged through an
atomic counter was slower past ~64 positions on the H200 (BENCHMARKS, round 3).
"""

from __future__ import annotations

import itertools
import logging

import torch
import triton
import triton.language as tl

from . import dependent
from .attention import DecodeAttention, capped, kv_tile, online_softmax_from
from .common import next_power_of_2
from .dependent import release_next, wait_previous


@triton.jit
def _heads(x_ptr, rows, valid, w_ptr, eps, cos_ptr, sin_ptr, position, D, R, d, NORM: tl.constexpr,
                 ROPE: tl.constexpr):
    """Heads `rows` [N] (where `valid`; zeros elsewhere) of the qkv row at x_ptr, normed (NORM) and
    rotated (ROPE) at `position` as rope.py's `_head` does one head: [N, BLOCK_D] float32, rounded
    to x_ptr's dtype at each of the torch path's steps."""
    ty = x_ptr.dtype.element_ty
    base = x_ptr + rows[:, None] * D
    x = tl.load(base + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    if NORM:
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.load(w_ptr + d, mask=d < D, other=0.0)
        x = (x * inv[:, None] * w[None, :]).to(ty).to(tl.float32)
    if ROPE:
        half = R // 2
        rot = d < R
        partner = tl.where(d < half, d + half, d - half)
        other = tl.load(base + partner[None, :], mask=valid[:, None] & rot[None, :], other=0.0).to(tl.float32)
        if NORM:  # the partner feature is normed too (same row statistics)
            w_partner = tl.load(w_ptr + partner, mask=rot, other=0.0)
            other = (other * inv[:, None] * w_partner[None, :]).to(ty).to(tl.float32)
        other = tl.where((d < half)[None, :], -other, other)
        cos = tl.load(cos_ptr + position * R + d, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + position * R + d, mask=rot, other=0.0).to(tl.float32)
        rotated = ((x * cos[None, :]).to(ty).to(tl.float32) + (other * sin[None, :]).to(ty).to(tl.float32)).to(ty)
        x = tl.where(rot[None, :], rotated.to(tl.float32), x)
    return x


@triton.jit
def _append_decode_kernel(qkv_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_eps, k_eps,
                          o_ptr, m_ptr, l_ptr, n_ptr, scale, softcap, window, HQ, HKV, D, R, SPLITS, table_stride,
                          G: tl.constexpr, GQ: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr,
                          BLOCK_D: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr, SOFTCAP: tl.constexpr,
                          WINDOW: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = 0):
    """Program (kv head h, split s, sequence r): attention.py's `_decode_kernel` over split s of
    sequence r's visible positions, its query heads made here from sequence r's raw qkv row; the
    split holding the new position (pos[r]) also stores the new key and value and attends to them.
    PDL: launched as a programmatic dependent (dependent.py): the position (written two kernels or more
    before), the new slot's block and the first tile of cached keys and values are loaded before the wait
    for the kernel before (the qkv matvec), so the cache's memory latency overlaps that kernel."""
    h = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.program_id(2)
    table_ptr += r * table_stride
    qkv_ptr += r * (HQ + 2 * HKV) * D
    o_ptr += r * SPLITS * HQ * D
    m_ptr += r * SPLITS * HQ
    l_ptr += r * SPLITS * HQ
    n_ptr += r * SPLITS
    new = tl.load(pos_ptr + r)  # this token's position: its key and value go there
    length = new + 1
    lo = 0
    if WINDOW:
        lo = tl.maximum(length - window, 0)
    chunk = tl.cdiv(tl.cdiv(length - lo, SPLITS), BT) * BT
    begin = lo + s * chunk
    end = tl.minimum(begin + chunk, length)
    holds = (begin <= new) & (new < end)
    # What no kernel of the step before this one writes, loaded before the wait for it (a no-op unless
    # launched as a programmatic dependent): the new slot's block and the first tile of cached keys and values.
    block = tl.load(table_ptr + new // BS)
    k_first, v_first, valid_first = kv_tile(k_ptr, v_ptr, table_ptr, begin, tl.minimum(end, new), h, HKV, D, BS, BT,
                                            BLOCK_D)
    wait_previous(PDL)
    release_next(PDL)
    g = tl.arange(0, GP)
    d = tl.arange(0, BLOCK_D)
    head = h * G + g
    ty = qkv_ptr.dtype.element_ty
    # The group's query heads, made GQ rows at a time, repeated to the GP rows the dot takes (the rows past
    # G are never stored): GQ = GP makes all GP rows.
    j = tl.arange(0, GQ)
    q = _heads(qkv_ptr, h * G + j, j < G, qn_ptr, q_eps, cos_ptr, sin_ptr, new, D, R, d, NORM, ROPE).to(ty)
    if GQ < GP:
        q = tl.reshape(tl.broadcast_to(q[None, :, :], (GP // GQ, GQ, BLOCK_D)), (GP, BLOCK_D))
    # The new key and value: made in every split (one head's features, loaded beside q's), stored by the
    # split that holds the new position only. Their slot is not read by any program of this launch.
    one = tl.zeros([1], dtype=tl.int32)
    k_new = _heads(qkv_ptr, one + HQ + h, one == 0, kn_ptr, k_eps, cos_ptr, sin_ptr, new, D, R, d, NORM,
                   ROPE).to(k_ptr.dtype.element_ty)  # [1, BLOCK_D]
    v_new = tl.load(qkv_ptr + (HQ + HKV + h) * D + d[None, :], mask=(d < D)[None, :], other=0.0)
    v_new = v_new.to(v_ptr.dtype.element_ty)
    slot = ((block * HKV + h) * BS + new % BS).to(tl.int64) * D
    place = tl.where(d < D, new, -1)[None, :]  # each feature's position; -1 past the head's features
    stored = (place >= begin) & (place < end)  # all (d < D) in the split that holds the new position, else none
    tl.store(k_ptr + slot + d[None, :], k_new, mask=stored)
    tl.store(v_ptr + slot + d[None, :], v_new, mask=stored)
    m, denom, acc = online_softmax_from(q, k_first, v_first, valid_first, k_ptr, v_ptr, table_ptr, begin,
                                        tl.minimum(end, new), h, scale, softcap, HKV, D, GP, BS, BT, BLOCK_D, SOFTCAP,
                                        IEEE)
    if holds:  # the new position, last (as it comes last in the old path's last tile)
        score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * scale
        score = capped(score, softcap, SOFTCAP)
        m_new = tl.maximum(m, score)
        alpha = tl.exp(m - m_new)
        p = tl.exp(score - m_new)
        denom = denom * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)
        m = m_new
    out = s * HQ + head
    tl.store(o_ptr + out[:, None] * D + d[None, :], acc, mask=(g < G)[:, None] & (d < D)[None, :])
    tl.store(m_ptr + out, m, mask=g < G)
    tl.store(l_ptr + out, denom, mask=g < G)
    if h == 0:
        tl.store(n_ptr + s, tl.maximum(end - begin, 0))


def append_attend(attention: DecodeAttention, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, *, scale: float, rope=None,
                  q_norm=None, k_norm=None, window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None, log: torch.Tensor | None = None,
                  step: torch.Tensor | None = None, repeat: bool = False, heads=None) -> None:
    """rope_append then `attention` (DecodeAttention.__call__) in two launches: qkv [(num_heads + 2
    num_kv_heads) * head_dim], the raw projections of the token at position pos[0]; its key (normed by
    k_norm, rotated) and value go into their cache slots, and its query's (normed by q_norm, rotated)
    attention over positions 0 .. pos[0] into out [num_heads * head_dim]; with `log`, log[step[0]] =
    positions attended (head 0). `rope`: (cos, sin) tables [positions, rotary_dim] or None; q_norm /
    k_norm: per-head RMSNorms (weight [head_dim], eps) or None. `repeat`: each program makes its group's
    query heads once and repeats them to the 16 rows its products take, rather than making all 16 rows
    (fewer instructions before the loop, another layout for q: `VARIANTS`, timed). `heads`: the merge also
    rounds out to int8 a head there (DecodeAttention.merge).

    With attention.rows > 1: qkv [rows, ...], pos [>= rows], block_table [>= rows, blocks] (sequence r
    at pos[r] through block_table[r]) -> out [rows, num_heads * head_dim]."""
    width = (attention.num_heads + 2 * attention.num_kv_heads) * attention.head_dim
    if qkv.numel() != attention.rows * width or not qkv.is_contiguous() or (
            attention.rows > 1 and block_table.dim() != 2):
        raise ValueError(f"a decode attention over {attention.rows} sequence(s) takes a contiguous qkv "
                         f"[{attention.rows}, {width}] and, for more than one, a block table of one row per sequence")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    cos, sin = rope if rope is not None else (qkv, qkv)
    qn, q_eps = q_norm if q_norm is not None else (qkv, 0.0)
    kn, k_eps = k_norm if k_norm is not None else (qkv, 0.0)
    gp = max(16, next_power_of_2(attention.group))
    _append_decode_kernel[(attention.num_kv_heads, attention.splits, attention.rows)](
        qkv, k_cache, v_cache, block_table, pos, cos, sin, qn, kn, float(q_eps), float(k_eps), attention.o,
        attention.m, attention.l, attention.n, float(scale), float(softcap or 1.0), int(window or 0),
        attention.num_heads, attention.num_kv_heads, attention.head_dim,
        cos.shape[-1] if rope is not None else attention.head_dim, attention.splits,
        block_table.stride(0) if block_table.dim() == 2 else 0, G=attention.group,
        GQ=next_power_of_2(attention.group) if repeat else gp, GP=gp, BS=k_cache.shape[2], BT=attention.tile,
        BLOCK_D=next_power_of_2(attention.head_dim), NORM=q_norm is not None, ROPE=rope is not None,
        SOFTCAP=softcap is not None, WINDOW=window is not None, IEEE=attention.ieee(qkv.dtype),
        num_warps=split_warps(attention.tile, attention.head_dim, attention.rows), **dependent.kernel_args())
    attention.merge(out, sinks, log, step, heads)


def split_warps(tile: int, head_dim: int, rows: int = 1) -> int:
    """Warps of an appending split program: for one sequence, one a 512 elements of its tile of keys (4 to 8). A
    program loads its keys and values before its wait for qkv; more warps spread those loads and the work after the
    wait thinner. llama-8b int4 on the H200 (tiles of 32 by 128): 8 warps 637.0-638.3 tok/s, 4 warps 629.4-630.2,
    2 warps 620.1, 16 warps 616.8 (BENCHMARKS Round 23); the warm-up's timing alone (`choose_appending`) does not
    see it. Several sequences (`rows`, the server's batches: fewer splits, each looping over many tiles) keep the
    4 warps they were measured with."""
    return max(4, min(8, tile * next_power_of_2(head_dim) // 512)) if rows == 1 else 4


VARIANTS = (False, True)  # append_attend's `repeat`


def choose_appending(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, *,
                     scale: float, rope=None, q_norm=None, k_norm=None, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None,
                     lengths: tuple[int, ...] = (64, 1024, 4096), layers: int = 4) -> bool | None:
    """For one kind of attention layer (its RoPE tables, q/k norms, window, softcap, sinks): the variant of
    `append_attend` (its `repeat`) that runs fastest over `lengths` positions on this device, among those
    faster than rope_append then the split-KV attention and its merge at every one of them; None if none
    is. Timed as the decode step's CUDA graph runs them: back to back on the stream (tuning.median_ms),
    each launch on the next of `layers` scratch caches in turn, so that at the longer lengths the keys
    and values come from DRAM. Logs the times on the "thin.runtime" log."""
    from ..paged_kv import PagedKVCache
    from .rope import rope_append
    from .tuning import median_ms

    if rope is not None:  # positions the tables hold
        lengths = tuple(min(n, rope[0].shape[0]) for n in lengths)
    lengths = sorted(set(lengths))
    cache = PagedKVCache(layers, num_kv_heads, head_dim, lengths[-1], dtype, device)
    cache.reserve(lengths[-1])
    cache.keys.normal_()
    cache.values.normal_()
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    attention = DecodeAttention(num_heads, num_kv_heads, head_dim, cache.max_seq_len, device, sms)
    qkv = torch.randn((num_heads + 2 * num_kv_heads) * head_dim, device=device).to(dtype)
    q = torch.empty(num_heads, head_dim, dtype=dtype, device=device)
    out = torch.empty(num_heads * head_dim, dtype=dtype, device=device)
    pos = torch.zeros(1, dtype=torch.int32, device=device)
    turn = itertools.count()
    options = dict(window=window, softcap=softcap, sinks=sinks)

    def old():
        k_cache, v_cache = cache.layer(next(turn) % layers)
        rope_append(qkv, q, k_cache, v_cache, cache.block_table, pos, num_heads, num_kv_heads, head_dim, rope=rope,
                    q_norm=q_norm, k_norm=k_norm)
        attention(q, k_cache, v_cache, cache.block_table, pos, out, scale=scale, **options)

    def fused(repeat):
        k_cache, v_cache = cache.layer(next(turn) % layers)
        append_attend(attention, qkv, k_cache, v_cache, cache.block_table, pos, out, scale=scale, rope=rope,
                      q_norm=q_norm, k_norm=k_norm, repeat=repeat, **options)

    # Repeating changes nothing where the group already fills the 16 rows.
    variants = VARIANTS if next_power_of_2(attention.group) < 16 else VARIANTS[:1]
    times = {name: [] for name in ("old", *variants)}
    for length in lengths:
        pos.fill_(length - 1)
        times["old"].append(median_ms(old, inner=2 * layers))
        for repeat in variants:
            times[repeat].append(median_ms(lambda r=repeat: fused(r), inner=2 * layers))
    faster = [r for r in variants if all(t < o for t, o in zip(times[r], times["old"], strict=True))]
    best = min(faster, key=lambda r: sum(times[r])) if faster else None
    shown = "; ".join(f"{'rope_append + split + merge' if name == 'old' else f'fused, repeat={name}'} "
                      + ", ".join(f"{1e3 * t:.1f}" for t in ts) for name, ts in times.items())
    logging.getLogger("thin.runtime").info(
        f"decode attention {num_heads}/{num_kv_heads} heads of {head_dim}, us at {lengths} positions: {shown} -> "
        + ("rope_append + split + merge" if best is None else f"fused, repeat={best}"))
    return best
