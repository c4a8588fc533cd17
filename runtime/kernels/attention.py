"""Attention over the paged KV cache.

Decode (one query token, one launch a layer): split-KV ("flash-decoding"). Program (kv head h,
split s) takes the raw q/k/v of the token from the qkv projection, norms and rotates the query
heads that share kv head h (GQA: their keys and values are read once), walks its share of the
visible positions in tiles of BT tokens (each token's cache slot found through the block table)
and keeps an online softmax. The split that holds the new position (the last) also norms and
rotates the new key, writes it and the value into the cache and attends to them from registers:
no other program reads that slot, so there is no race. The splits then merge without a second
launch: each writes its partial (max, denominator, weighted values) and counts itself done on an
atomic counter per kv head (release); the last to arrive (acquire) merges them into the output and
sets the counter back to zero, so a captured graph can replay. A sequence short enough for one
split writes its output directly. The number of visible positions is read from the device (pos +
1, bounded by a sliding window), so a captured decode step attends to exactly the tokens there are.
Logit softcap (Gemma-2) and sinks (GPT-OSS: a per-head logit that joins the softmax's denominator
only) are constexpr options. The launch can also record how many positions head 0 attended, for the
benchmark's check of that number.

Prefill (many query tokens): the keys and values are gathered from the cache and multiplied with
torch's scaled_dot_product_attention (the executor's masks and GQA stacking); with a softcap or
sinks, an explicit softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import next_power_of_2
from .rope import rope_heads


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _decode_kernel(qkv_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_eps, k_eps,
                   sink_ptr, o_ptr, m_ptr, l_ptr, n_ptr, count_ptr, out_ptr, log_ptr, step_ptr, scale, softcap, window,
                   HQ, HKV, D, R, SPLITS, table_stride, G: tl.constexpr, GP: tl.constexpr, GQ: tl.constexpr,
                   SP: tl.constexpr, SB: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr, BLOCK_D: tl.constexpr,
                   NORM: tl.constexpr, ROPE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                   SINKS: tl.constexpr, LOG: tl.constexpr, IEEE: tl.constexpr):
    """Program (kv head h, split s, sequence r): sequence r's query heads of group h over split s of
    its visible positions (its own position and row of the block table, its own row of qkv)."""
    h = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.program_id(2)
    table_ptr += r * table_stride
    qkv_ptr += r * (HQ + 2 * HKV) * D
    new = tl.load(pos_ptr + r)  # this token's position: its key and value go there
    length = new + 1
    lo = 0
    if WINDOW:
        lo = tl.maximum(length - window, 0)
    chunk = tl.cdiv(tl.cdiv(length - lo, SPLITS), BT) * BT
    active = tl.cdiv(length - lo, chunk)  # splits with positions; the rest exit at once
    if s < active:
        begin = lo + s * chunk
        end = tl.minimum(begin + chunk, length)
        m, denom, acc = _split(qkv_ptr, k_ptr, v_ptr, table_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_eps, k_eps,
                               new, begin, end, h, scale, softcap, HQ, HKV, D, R, G, GP, BS, BT,
                               BLOCK_D, NORM, ROPE, SOFTCAP, IEEE)
        g = tl.arange(0, GP)
        d = tl.arange(0, BLOCK_D)
        head = h * G + g
        out_ptr += r * HQ * D
        if active == 1:  # a short sequence: one split holds every position, nothing to merge
            total = denom
            if SINKS:
                total += tl.exp(tl.load(sink_ptr + head, mask=g < G, other=0.0) - m)
            out = acc / total[:, None]
            tl.store(out_ptr + head[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=(g < G)[:, None] & (d < D)[None, :])
            if LOG:  # noqa: SIM102  (a constexpr condition, then a run-time one)
                if (h == 0) & (r == 0):
                    tl.store(log_ptr + tl.load(step_ptr), end - begin)
        else:
            o_ptr += r * SPLITS * HQ * D
            m_ptr += r * SPLITS * HQ
            l_ptr += r * SPLITS * HQ
            n_ptr += r * SPLITS
            part = s * HQ + head
            tl.store(o_ptr + part[:, None] * D + d[None, :], acc, mask=(g < G)[:, None] & (d < D)[None, :])
            tl.store(m_ptr + part, m, mask=g < G)
            tl.store(l_ptr + part, denom, mask=g < G)
            if h == 0:
                tl.store(n_ptr + s, end - begin)
            # Every thread's partials are written before one thread's release (the atomic); the split
            # that finishes last acquires them all and merges. It resets the counter for the next launch.
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + r * HKV + h, 1, sem="acq_rel")
            if done == active - 1:
                tl.store(count_ptr + r * HKV + h, 0)
                _merge(o_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, h, HQ, D, active, G, GQ, SB, BLOCK_D, SINKS)
                if LOG:  # noqa: SIM102
                    if (h == 0) & (r == 0):
                        j = tl.arange(0, SP)
                        n = tl.sum(tl.load(n_ptr + j, mask=j < active, other=0, cache_modifier=".cg"), axis=0)
                        tl.store(log_ptr + tl.load(step_ptr), n)


@triton.jit
def _split(qkv_ptr, k_ptr, v_ptr, table_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_eps, k_eps, new, begin, end, h,
           scale, softcap, HQ, HKV, D, R, G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr,
           BLOCK_D: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr, SOFTCAP: tl.constexpr,
           IEEE: tl.constexpr):
    """Online softmax (max [GP], denominator [GP], weighted values [GP, BLOCK_D]) of kv head h's query
    heads over positions begin .. end - 1. The query heads are normed and rotated here from the raw
    qkv row. The split that holds the new token (position `new`, the last) also makes its key and
    value, stores them in the cache and attends to them from registers: no program reads that slot."""
    g = tl.arange(0, GP)
    d = tl.arange(0, BLOCK_D)
    q = rope_heads(qkv_ptr, h * G + g, g < G, qn_ptr, q_eps, cos_ptr, sin_ptr, new, D, R, d, NORM, ROPE)
    q = q.to(qkv_ptr.dtype.element_ty)
    m = tl.full([GP], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, BLOCK_D], dtype=tl.float32)
    stop = tl.minimum(end, new)  # the cached positions of this split
    for t0 in range(begin, stop, BT):
        t = t0 + tl.arange(0, BT)
        valid = t < stop
        block = tl.load(table_ptr + t // BS, mask=valid, other=0)
        slot = ((block * HKV + h) * BS + t % BS).to(tl.int64) * D
        kv_mask = valid[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = _capped(scores * scale, softcap, SOFTCAP)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:  # noqa: SIM108  (constexpr branches: only one is compiled)
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if stop < end:
        one = tl.zeros([1], dtype=tl.int32)
        k = rope_heads(qkv_ptr, one + HQ + h, one == 0, kn_ptr, k_eps, cos_ptr, sin_ptr, new, D, R, d, NORM, ROPE)
        k = k.to(k_ptr.dtype.element_ty)
        v = tl.load(qkv_ptr + (HQ + HKV + h) * D + d[None, :], mask=(d < D)[None, :], other=0.0)
        v = v.to(v_ptr.dtype.element_ty)
        block = tl.load(table_ptr + new // BS)
        slot = ((block * HKV + h) * BS + new % BS).to(tl.int64) * D
        tl.store(k_ptr + slot + d[None, :], k, mask=(d < D)[None, :])
        tl.store(v_ptr + slot + d[None, :], v, mask=(d < D)[None, :])
        score = _capped(tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * scale, softcap, SOFTCAP)
        m_new = tl.maximum(m, score)
        alpha = tl.exp(m - m_new)
        p = tl.exp(score - m_new)
        denom = denom * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
        m = m_new
    return m, denom, acc


@triton.jit
def _capped(scores, softcap, SOFTCAP: tl.constexpr):
    """Gemma-2's tanh softcap on attention logits, where the model has one."""
    if SOFTCAP:
        scores = _tanh(scores / softcap) * softcap
    return scores


@triton.jit
def _merge(o_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, h, HQ, D, splits, G: tl.constexpr, GQ: tl.constexpr,
           SB: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    """Kv head h's query heads: the softmax-weighted sum of the first `splits` splits' partial outputs,
    SB splits at a time (each block rescaled as the max grows). The partials were written by other
    programs of this launch: read past L1."""
    g = tl.arange(0, GQ)
    d = tl.arange(0, BLOCK_D)
    head = h * G + tl.minimum(g, G - 1)  # padding rows repeat the last head; they are not stored
    top = tl.full([GQ], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GQ], dtype=tl.float32)
    acc = tl.zeros([GQ, BLOCK_D], dtype=tl.float32)
    for j0 in range(0, splits, SB):
        j = j0 + tl.arange(0, SB)
        part = j[:, None] * HQ + head[None, :]  # [SB, GQ]
        live = (j < splits)[:, None]
        ms = tl.load(m_ptr + part, mask=live, other=float("-inf"), cache_modifier=".cg")
        ls = tl.load(l_ptr + part, mask=live, other=0.0, cache_modifier=".cg")
        o = tl.load(o_ptr + part[:, :, None] * D + d[None, None, :], mask=live[:, :, None] & (d < D)[None, None, :],
                    other=0.0, cache_modifier=".cg")
        top_new = tl.maximum(top, tl.max(ms, axis=0))  # finite: split j0 has positions
        alpha = tl.exp(top - top_new)
        w = tl.exp(ms - top_new[None, :])
        total = total * alpha + tl.sum(w * ls, axis=0)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], axis=0)
        top = top_new
    if SINKS:
        total += tl.exp(tl.load(sink_ptr + head) - top)
    out = acc / total[:, None]
    tl.store(out_ptr + head[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(g < G)[:, None] & (d < D)[None, :])


class DecodeAttention:
    """Scratch and launch parameters of the decode attention for one model shape, cache size and
    number of sequences (`rows`: a batched decode step attends for each sequence at once, each at
    its own position through its own row of a block table)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_len: int, device, sms: int = 132,
                 tile: int = 32, rows: int = 1, merge_elements: int = 8192):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.tile, self.rows = tile, rows
        # Enough splits to fill the device at the longest context; idle splits exit at once.
        self.splits = max(1, min(-(-max_len // tile), -(-2 * sms // (num_kv_heads * rows)), 64))
        # The merging program reads the splits' partial outputs merge_elements floats at a time (a
        # bound on its registers: 64 a thread by default).
        self.merge_splits = min(next_power_of_2(self.splits),
                                max(2, merge_elements // (next_power_of_2(self.group) * next_power_of_2(head_dim))))
        self.o = torch.empty(rows, self.splits, num_heads, head_dim, dtype=torch.float32, device=device)
        self.m = torch.empty(rows, self.splits, num_heads, dtype=torch.float32, device=device)
        self.l = torch.empty(rows, self.splits, num_heads, dtype=torch.float32, device=device)
        self.n = torch.empty(rows, self.splits, dtype=torch.int32, device=device)
        # Splits of each (sequence, kv head) done so far in a launch; the last one sets it back to 0.
        self.done = torch.zeros(rows, num_kv_heads, dtype=torch.int32, device=device)

    def __call__(self, qkv, k_cache, v_cache, block_table, pos, out, *, scale: float, rope=None, q_norm=None,
                 k_norm=None, window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None, log: torch.Tensor | None = None,
                 step: torch.Tensor | None = None) -> None:
        """qkv [(num_heads + 2 num_kv_heads) * head_dim], the raw projections of the token at position
        pos[0]: its key and value go into their cache slots, and its query's attention over positions
        0 .. pos[0] into out [num_heads * head_dim]; with `log`, log[step[0]] = positions attended
        (head 0). `rope` is (cos, sin) tables [positions, rotary_dim] or None; q_norm/k_norm are
        per-head RMSNorms (weight [head_dim], eps) or None; the cache is [blocks, num_kv_heads,
        block_size, head_dim].

        With rows > 1: qkv [rows, ...], pos [>= rows], block_table [>= rows, blocks] (sequence r at
        pos[r] through block_table[r]) -> out [rows, num_heads * head_dim]."""
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if qkv.numel() != self.rows * width or (self.rows > 1 and block_table.dim() != 2):
            raise ValueError(f"a decode attention over {self.rows} sequence(s) takes qkv [{self.rows}, {width}] and, "
                             "for more than one, a block table of one row per sequence")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        cos, sin = rope if rope is not None else (qkv, qkv)
        qn, q_eps = q_norm if q_norm is not None else (qkv, 0.0)
        kn, k_eps = k_norm if k_norm is not None else (qkv, 0.0)
        block_d = next_power_of_2(self.head_dim)
        _decode_kernel[(self.num_kv_heads, self.splits, self.rows)](
            qkv, k_cache, v_cache, block_table, pos, cos, sin, qn, kn, float(q_eps), float(k_eps),
            sinks if sinks is not None else self.m, self.o, self.m, self.l, self.n, self.done, out,
            log if log is not None else self.n, step if step is not None else self.n, float(scale),
            float(softcap or 1.0), int(window or 0), self.num_heads, self.num_kv_heads, self.head_dim,
            cos.shape[-1] if rope is not None else self.head_dim, self.splits,
            block_table.stride(0) if block_table.dim() == 2 else 0, G=self.group,
            GP=max(16, next_power_of_2(self.group)), GQ=next_power_of_2(self.group), SP=next_power_of_2(self.splits),
            SB=self.merge_splits,
            BS=k_cache.shape[2], BT=self.tile, BLOCK_D=block_d, NORM=q_norm is not None, ROPE=rope is not None,
            SOFTCAP=softcap is not None, WINDOW=window is not None, SINKS=sinks is not None, LOG=log is not None,
            IEEE=qkv.dtype == torch.float32 or _interpreting(), num_warps=4)


def _interpreting() -> bool:
    from . import interpreting

    return interpreting()


def gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of a paged cache [blocks, heads, block_size, dim], in order:
    [heads, length, dim]."""
    blocks, heads, size, dim = cache.shape
    used = block_table[: -(-length // size)].long()
    return cache[used].permute(1, 0, 2, 3).reshape(heads, -1, dim)[:, :length]


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, start: int,
            *, scale: float, window: int | None = None, softcap: float | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] at positions start.. over the cache's first
    start + T positions (already appended) -> [T, num_heads * head_dim]."""
    T, num_heads, head_dim = q.shape
    k = gather(k_cache, block_table, start + T)
    v = gather(v_cache, block_table, start + T)
    num_kv = k.shape[0]
    group = num_heads // num_kv
    # Query heads sharing a kv head are stacked along the query axis: GQA without repeating k/v.
    qs = q.transpose(0, 1).reshape(num_kv, group * T, head_dim)
    query_pos = torch.arange(start, start + T, device=q.device)[:, None]
    key_pos = torch.arange(start + T, device=q.device)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    mask = visible.repeat(group, 1) if group > 1 else visible
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(qs, k.transpose(1, 2)).float() * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one extra logit per head that takes probability mass and gives nothing
            sink = sinks.float().reshape(num_kv, group, 1, 1).expand(num_kv, group, T, 1).reshape(num_kv, group * T, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs.to(v.dtype), v)
    return out.reshape(num_heads, T, head_dim).transpose(0, 1).reshape(T, num_heads * head_dim)
