"""Attention over the paged KV cache.

Decode (one query token): split-KV ("flash-decoding"). Program (kv head h, split s) takes all the
query heads that share kv head h (GQA: their keys and values are read once), walks its share of
the visible positions in tiles of BT tokens (each token's cache slot found through the block
table), and keeps an online softmax; a second kernel merges the splits. The number of visible
positions is read from the device (pos + 1, bounded by a sliding window), so a captured decode
step attends to exactly the tokens there are. Logit softcap (Gemma-2) and sinks (GPT-OSS: a
per-head logit that joins the softmax's denominator only) are constexpr options. The merge can
also record how many positions head 0 attended, for the benchmark's check of that number.
(attention_append.py: the same split kernel making q, and appending the new key and value, itself.)

Prefill (many query tokens): the keys and values are gathered from the cache and multiplied with
torch's scaled_dot_product_attention (the executor's masks and GQA stacking); with a softcap or
sinks, an explicit softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import dependent
from .common import next_power_of_2
from .dependent import release_next, wait_previous


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, n_ptr, scale, softcap, window,
                   HQ, HKV, D, SPLITS, table_stride, G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr,
                   BT: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                   IEEE: tl.constexpr, PDL: tl.constexpr = 0):
    """Program (kv head h, split s, sequence r): sequence r's query heads of group h over split s of
    its visible positions (its own position and row of the block table). PDL: dependent.py."""
    wait_previous(PDL)
    release_next(PDL)
    h = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.program_id(2)
    table_ptr += r * table_stride
    q_ptr += r * HQ * D
    o_ptr += r * SPLITS * HQ * D
    m_ptr += r * SPLITS * HQ
    l_ptr += r * SPLITS * HQ
    n_ptr += r * SPLITS
    length = tl.load(pos_ptr + r) + 1  # the current token's key was appended at position pos
    lo = 0
    if WINDOW:
        lo = tl.maximum(length - window, 0)
    chunk = tl.cdiv(tl.cdiv(length - lo, SPLITS), BT) * BT
    begin = lo + s * chunk
    end = tl.minimum(begin + chunk, length)
    g = tl.arange(0, GP)
    d = tl.arange(0, BLOCK_D)
    head = h * G + g
    q = tl.load(q_ptr + head[:, None] * D + d[None, :], mask=(g < G)[:, None] & (d < D)[None, :], other=0.0)
    m, denom, acc = online_softmax(q, k_ptr, v_ptr, table_ptr, begin, end, h, scale, softcap, HKV, D, GP, BS, BT,
                                   BLOCK_D, SOFTCAP, IEEE)
    out = (s * HQ + head)
    tl.store(o_ptr + out[:, None] * D + d[None, :], acc, mask=(g < G)[:, None] & (d < D)[None, :])
    tl.store(m_ptr + out, m, mask=g < G)
    tl.store(l_ptr + out, denom, mask=g < G)
    if h == 0:
        tl.store(n_ptr + s, tl.maximum(end - begin, 0))


@triton.jit
def online_softmax(q, k_ptr, v_ptr, table_ptr, begin, end, h, scale, softcap, HKV, D, GP: tl.constexpr,
                   BS: tl.constexpr, BT: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
                   IEEE: tl.constexpr):
    """The online softmax of query heads q [GP, BLOCK_D] (kv head h's) over cached positions begin ..
    end - 1, BT a step, each position's slot found through the block table: (max [GP], denominator
    [GP], probability-weighted values [GP, BLOCK_D]), float32."""
    k, v, valid = kv_tile(k_ptr, v_ptr, table_ptr, begin, end, h, HKV, D, BS, BT, BLOCK_D)
    return online_softmax_from(q, k, v, valid, k_ptr, v_ptr, table_ptr, begin, end, h, scale, softcap, HKV, D, GP,
                               BS, BT, BLOCK_D, SOFTCAP, IEEE)


@triton.jit
def kv_tile(k_ptr, v_ptr, table_ptr, t0, end, h, HKV, D, BS: tl.constexpr, BT: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """(keys, values [BT, BLOCK_D], valid [BT]) of cached positions t0 .. t0 + BT - 1 below `end`, kv head
    h (each position's slot found through the block table); zeros past `end`."""
    d = tl.arange(0, BLOCK_D)
    t = t0 + tl.arange(0, BT)
    valid = t < end
    block = tl.load(table_ptr + t // BS, mask=valid, other=0)
    slot = ((block * HKV + h) * BS + t % BS).to(tl.int64) * D
    kv_mask = valid[:, None] & (d < D)[None, :]
    k = tl.load(k_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return k, v, valid


@triton.jit
def softmax_tile(q, k, v, valid, m, denom, acc, scale, softcap, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """online_softmax's step over one tile of keys and values (kv_tile): (max, denominator, values)."""
    if IEEE:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = capped(scores * scale, softcap, SOFTCAP)
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    if IEEE:  # noqa: SIM108  (constexpr branches: only one is compiled)
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, denom, acc * alpha[:, None] + pv


@triton.jit
def online_softmax_from(q, k, v, valid, k_ptr, v_ptr, table_ptr, begin, end, h, scale, softcap, HKV, D,
                        GP: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr, BLOCK_D: tl.constexpr,
                        SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """online_softmax over positions begin .. end - 1 whose first tile (kv_tile at begin) the caller
    loaded already (attention_append.py's kernel loads it before it waits for the kernel before)."""
    m = tl.full([GP], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, BLOCK_D], dtype=tl.float32)
    if begin < end:  # a split with no positions keeps (-inf, 0, 0): an all-masked tile would make NaNs
        m, denom, acc = softmax_tile(q, k, v, valid, m, denom, acc, scale, softcap, SOFTCAP, IEEE)
    for t0 in range(begin + BT, end, BT):
        k, v, valid = kv_tile(k_ptr, v_ptr, table_ptr, t0, end, h, HKV, D, BS, BT, BLOCK_D)
        m, denom, acc = softmax_tile(q, k, v, valid, m, denom, acc, scale, softcap, SOFTCAP, IEEE)
    return m, denom, acc


@triton.jit
def capped(scores, softcap, SOFTCAP: tl.constexpr):
    """Gemma-2's tanh softcap on attention logits, where the model has one."""
    if SOFTCAP:
        scores = _tanh(scores / softcap) * softcap
    return scores


@triton.jit
def _merge_kernel(o_ptr, m_ptr, l_ptr, n_ptr, sink_ptr, out_ptr, log_ptr, step_ptr, HQ, D, SPLITS,
                  SP: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr, LOG: tl.constexpr,
                  PDL: tl.constexpr = 0):
    """Query head i of sequence r: softmax-weighted sum of the splits' partial outputs. PDL: dependent.py."""
    wait_previous(PDL)
    release_next(PDL)
    i = tl.program_id(0)
    r = tl.program_id(1)
    o_ptr += r * SPLITS * HQ * D
    m_ptr += r * SPLITS * HQ
    l_ptr += r * SPLITS * HQ
    n_ptr += r * SPLITS
    out_ptr += r * HQ * D
    s = tl.arange(0, SP)
    d = tl.arange(0, BLOCK_D)
    out = merged_head(o_ptr, m_ptr, l_ptr, sink_ptr, i, HQ, D, SPLITS, SP, BLOCK_D, SINKS)
    tl.store(out_ptr + i * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)
    if LOG:  # noqa: SIM102  (a constexpr condition, then a run-time one)
        if (i == 0) & (r == 0):
            n = tl.sum(tl.load(n_ptr + s, mask=s < SPLITS, other=0), axis=0)
            tl.store(log_ptr + tl.load(step_ptr), n)


@triton.jit
def merged_head(o_ptr, m_ptr, l_ptr, sink_ptr, i, HQ, D, SPLITS, SP: tl.constexpr, BLOCK_D: tl.constexpr,
                SINKS: tl.constexpr):
    """Query head i's softmax-weighted sum of the splits' partial outputs (one sequence's), float32 [BLOCK_D]."""
    s = tl.arange(0, SP)
    d = tl.arange(0, BLOCK_D)
    # The partial outputs first: their loads then go out with the maxima's and sums' (compiled for sm_90:
    # all before the reductions' barrier), not after the weights are known, one L2 latency later.
    o = tl.load(o_ptr + (s[:, None] * HQ + i) * D + d[None, :], mask=(s < SPLITS)[:, None] & (d < D)[None, :],
                other=0.0)
    ms = tl.load(m_ptr + s * HQ + i, mask=s < SPLITS, other=float("-inf"))
    ls = tl.load(l_ptr + s * HQ + i, mask=s < SPLITS, other=0.0)
    top = tl.max(ms, axis=0)
    w = tl.where(s < SPLITS, tl.exp(ms - top), 0.0)
    w = tl.where(ms == float("-inf"), 0.0, w)
    total = tl.sum(w * ls, axis=0)
    if SINKS:
        total += tl.exp(tl.load(sink_ptr + i) - top)
    return tl.sum(o * w[:, None], axis=0) / total


class DecodeAttention:
    """Scratch and launch parameters of the decode attention for one model shape, cache size and
    number of sequences (`rows`: a batched decode step attends for each sequence at once, each at
    its own position through its own row of a block table)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_len: int, device, sms: int = 132,
                 tile: int = 32, rows: int = 1):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.tile, self.rows = tile, rows
        # Enough splits to fill the device at the longest context; idle splits exit at once.
        self.splits = max(1, min(-(-max_len // tile), -(-2 * sms // (num_kv_heads * rows)), 64))
        self.o = torch.empty(rows, self.splits, num_heads, head_dim, dtype=torch.float32, device=device)
        self.m = torch.empty(rows, self.splits, num_heads, dtype=torch.float32, device=device)
        self.l = torch.empty(rows, self.splits, num_heads, dtype=torch.float32, device=device)
        self.n = torch.empty(rows, self.splits, dtype=torch.int32, device=device)

    def __call__(self, q, k_cache, v_cache, block_table, pos, out, *, scale: float, window: int | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None, log: torch.Tensor | None = None,
                 step: torch.Tensor | None = None, heads=None) -> None:
        """q [num_heads, head_dim] of the token at position pos[0] (its key already appended) ->
        out [num_heads * head_dim]; with `log`, log[step[0]] = positions attended (head 0); with `heads`
        (int8_heads.Int8Heads), out rounded to int8 a head there as well (`merge`).

        With rows > 1: q [rows, num_heads, head_dim], pos [>= rows], block_table [>= rows, blocks]
        (sequence r at pos[r] through block_table[r]) -> out [rows, num_heads * head_dim]."""
        if self.rows > 1 and (block_table.dim() != 2 or q.numel() != self.rows * self.num_heads * self.head_dim):
            raise ValueError(f"a decode attention over {self.rows} sequences takes q [{self.rows}, heads, dim] and a "
                             "block table of one row per sequence")
        table_stride = block_table.stride(0) if block_table.dim() == 2 else 0
        _decode_kernel[(self.num_kv_heads, self.splits, self.rows)](
            q, k_cache, v_cache, block_table, pos, self.o, self.m, self.l, self.n, float(scale),
            float(softcap or 1.0), int(window or 0), self.num_heads, self.num_kv_heads, self.head_dim, self.splits,
            table_stride, G=self.group, GP=max(16, next_power_of_2(self.group)), BS=k_cache.shape[2], BT=self.tile,
            BLOCK_D=next_power_of_2(self.head_dim), SOFTCAP=softcap is not None, WINDOW=window is not None,
            IEEE=self.ieee(q.dtype), num_warps=4, **dependent.kernel_args())
        self.merge(out, sinks, log, step, heads)

    def merge(self, out, sinks: torch.Tensor | None = None, log: torch.Tensor | None = None,
              step: torch.Tensor | None = None, heads=None) -> None:
        """The second launch: the splits' partial outputs (written by the split kernel) -> out. One warp a
        program where a head's partials fit 128 floats a lane (no cross-warp reductions: llama-8b int4 on the
        H200, 20 splits, +0.6% a decode step in fresh processes, BENCHMARKS Round 18), else four. With `heads`
        (one sequence, heads of 128), the merge also rounds each head to int8 for o (int8_heads.merge_codes)."""
        if heads is not None:
            from .int8_heads import merge_codes

            merge_codes(self, out, heads, sinks, log, step)
            return
        sp, block_d = next_power_of_2(self.splits), next_power_of_2(self.head_dim)
        _merge_kernel[(self.num_heads, self.rows)](
            self.o, self.m, self.l, self.n, sinks if sinks is not None else self.m, out,
            log if log is not None else self.n, step if step is not None else self.n, self.num_heads, self.head_dim,
            self.splits, SP=sp, BLOCK_D=block_d, SINKS=sinks is not None, LOG=log is not None,
            num_warps=1 if sp * block_d <= 32 * 128 else 4, **dependent.kernel_args())

    @staticmethod
    def ieee(dtype: torch.dtype) -> bool:
        """Whether the split kernel's products run in float32 (IEEE) rather than on tensor cores."""
        return dtype == torch.float32 or _interpreting()

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
