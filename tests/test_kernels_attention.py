"""Split-KV decode attention over a paged cache, and the prefill path, against a plain softmax."""

import pytest
import torch
from kernel_support import DEVICE, rel_err


def reference(q, k, v, scale, window=None, softcap=None, sinks=None):
    """One query per head q [H, D] over keys/values [Hkv, L, D] (the last position is the query's)."""
    heads, kv_heads, length = q.shape[0], k.shape[0], k.shape[1]
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, 0).float(), v.repeat_interleave(group, 0).float()
    scores = torch.einsum("hd,hld->hl", q.float(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if window is not None:
        scores[:, : max(0, length - window)] = float("-inf")
    if sinks is not None:
        probs = torch.softmax(torch.cat([scores, sinks.float()[:, None]], dim=1), dim=1)[:, :-1]
    else:
        probs = torch.softmax(scores, dim=1)
    return torch.einsum("hl,hld->hd", probs, v).reshape(-1)


def _filled_cache(length, kv_heads, D, dtype, seed, block_size=4, capacity=96):
    from thin.runtime.paged_kv import PagedKVCache

    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, kv_heads, D, capacity, dtype, DEVICE, block_size=block_size)
    cache.reserve(length)
    k = torch.randn(kv_heads, length, D, generator=gen).to(dtype)
    v = torch.randn(kv_heads, length, D, generator=gen).to(dtype)
    k_cache, v_cache = cache.layer(0)
    table = cache.block_table.cpu().long()
    for t in range(length):  # through the block table, as the append kernel writes
        k_cache[table[t // block_size], :, t % block_size] = k[:, t].to(DEVICE)
        v_cache[table[t // block_size], :, t % block_size] = v[:, t].to(DEVICE)
    return cache, k, v


@pytest.mark.parametrize("length", [1, 7, 45, 96])
@pytest.mark.parametrize("options", [{}, {"window": 10}, {"softcap": 2.0}, {"sinks": True}])
def test_decode_matches_softmax(length, options):
    from thin.runtime.kernels.attention import DecodeAttention

    heads, kv_heads, D, scale = 8, 2, 32, 0.3
    cache, k, v = _filled_cache(length, kv_heads, D, torch.float32, seed=length)
    q = torch.randn(heads, D, generator=torch.Generator().manual_seed(9))
    sinks = torch.randn(heads) if options.get("sinks") else None
    attention = DecodeAttention(heads, kv_heads, D, cache.max_seq_len, DEVICE, sms=4, tile=16)
    out = torch.full((heads * D,), float("nan"), device=DEVICE)
    log = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    step = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    pos = torch.tensor([length - 1], dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = cache.layer(0)
    attention(q.to(DEVICE), k_cache, v_cache, cache.block_table, pos, out, scale=scale, window=options.get("window"),
              softcap=options.get("softcap"), sinks=None if sinks is None else sinks.to(DEVICE), log=log, step=step)
    want = reference(q, k, v, scale, options.get("window"), options.get("softcap"), sinks)
    assert rel_err(out, want) < 1e-5
    # The positions attended are recorded at log[step]: all of them, or the window.
    assert log[2].item() == min(length, options.get("window") or length)


def test_decode_bfloat16():
    from thin.runtime.kernels.attention import DecodeAttention

    cache, k, v = _filled_cache(37, 2, 64, torch.bfloat16, seed=1)
    q = torch.randn(8, 64).to(torch.bfloat16)
    attention = DecodeAttention(8, 2, 64, cache.max_seq_len, DEVICE, sms=4, tile=16)
    out = torch.empty(8 * 64, dtype=torch.bfloat16, device=DEVICE)
    k_cache, v_cache = cache.layer(0)
    attention(q.to(DEVICE), k_cache, v_cache, cache.block_table, torch.tensor([36], dtype=torch.int32, device=DEVICE),
              out, scale=0.125)
    assert rel_err(out, reference(q, k, v, 0.125)) < 1.5e-2


@pytest.mark.parametrize("options", [{}, {"window": 5}, {"softcap": 3.0}, {"sinks": True}])
def test_prefill_matches_softmax_per_query(options):
    from thin.runtime.kernels.attention import prefill

    heads, kv_heads, D, start, T = 4, 2, 16, 6, 5
    cache, k, v = _filled_cache(start + T, kv_heads, D, torch.float32, seed=3)
    q = torch.randn(T, heads, D, generator=torch.Generator().manual_seed(4))
    sinks = torch.randn(heads) if options.get("sinks") else None
    k_cache, v_cache = cache.layer(0)
    got = prefill(q.to(DEVICE), k_cache, v_cache, cache.block_table, start, scale=0.5, window=options.get("window"),
                  softcap=options.get("softcap"), sinks=None if sinks is None else sinks.to(DEVICE))
    for t in range(T):
        n = start + t + 1
        want = reference(q[t], k[:, :n], v[:, :n], 0.5, options.get("window"), options.get("softcap"), sinks)
        assert rel_err(got[t], want) < 1e-5


@pytest.mark.gpu
def test_real_shape_on_gpu():
    from thin.runtime.kernels.attention import DecodeAttention

    cache, k, v = _filled_cache(600, 8, 128, torch.bfloat16, seed=5, block_size=16, capacity=1024)
    q = torch.randn(32, 128).to(torch.bfloat16)
    attention = DecodeAttention(32, 8, 128, cache.max_seq_len, DEVICE)
    out = torch.empty(32 * 128, dtype=torch.bfloat16, device=DEVICE)
    k_cache, v_cache = cache.layer(0)
    attention(q.to(DEVICE), k_cache, v_cache, cache.block_table, torch.tensor([599], dtype=torch.int32, device=DEVICE),
              out, scale=128 ** -0.5)
    assert rel_err(out, reference(q, k, v, 128 ** -0.5)) < 1e-2
