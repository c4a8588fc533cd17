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


def _new_token(length, heads, kv_heads, D, dtype, seed, rope=False, qk_norm=False):
    """Raw qkv of the token at position length - 1, the arguments the kernel takes for its RoPE and
    q/k norms, and (q, k, v) as the executor computes them ([heads, D], [kv_heads, D] twice)."""
    from thin.ir import RoPE
    from thin.runtime.executor import NormPlan
    from thin.runtime.rope import RotaryTables, apply_rotary

    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn((heads + 2 * kv_heads) * D, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D])
    q, k, v = q.reshape(1, heads, D), k.reshape(1, kv_heads, D), v.reshape(kv_heads, D)
    args = {}
    if qk_norm:
        norms = [NormPlan("rms", 1e-6, 1 + 0.3 * torch.randn(D, generator=gen), None) for _ in range(2)]
        q, k = norms[0](q), norms[1](k)
        args |= {"q_norm": (norms[0].weight.to(DEVICE), 1e-6), "k_norm": (norms[1].weight.to(DEVICE), 1e-6)}
    if rope:  # partial rotary: the first half of each head turns
        tables = RotaryTables(RoPE("default", 10000.0, D // 2), torch.device("cpu"), dtype)
        tables.get(0, 128)
        cos, sin = tables.get(length - 1, 1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        args["rope"] = (tables.cos.to(DEVICE), tables.sin.to(DEVICE))
    return qkv, args, (q[0], k[0], v)


def _attend(attention, qkv, cache, pos, **options):
    out = torch.full((qkv.shape[0] if qkv.dim() == 2 else 1, attention.num_heads * attention.head_dim), float("nan"),
                     dtype=qkv.dtype, device=DEVICE)
    k_cache, v_cache = cache.layer(0)
    table = getattr(cache, "rows_table", cache.block_table)
    attention(qkv.to(DEVICE), k_cache, v_cache, table, torch.tensor(pos, dtype=torch.int32, device=DEVICE),
              out if qkv.dim() == 2 else out[0], **options)
    return out


@pytest.mark.parametrize("length", [1, 7, 17, 45, 96])  # 17: the last split holds only the new token
@pytest.mark.parametrize("options", [{}, {"window": 10}, {"softcap": 2.0}, {"sinks": True}, {"rope": True},
                                     {"rope": True, "qk_norm": True}])
def test_decode_matches_softmax(length, options):
    from thin.runtime.kernels.attention import DecodeAttention, gather

    heads, kv_heads, D, scale = 8, 2, 32, 0.3
    cache, k, v = _filled_cache(length, kv_heads, D, torch.float32, seed=length)
    qkv, args, (q, k_new, v_new) = _new_token(length, heads, kv_heads, D, torch.float32, seed=9,
                                              rope=options.get("rope", False), qk_norm=options.get("qk_norm", False))
    k[:, -1], v[:, -1] = k_new, v_new
    sinks = torch.randn(heads) if options.get("sinks") else None
    # Four splits, merged two at a time (8 query heads on 2 kv heads: 4 rows of 32 features a split).
    attention = DecodeAttention(heads, kv_heads, D, cache.max_seq_len, DEVICE, sms=4, tile=16, merge_elements=256)
    assert (attention.splits, attention.merge_splits) == (4, 2)
    log = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    step = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the second launch finds the split counters as the first left them
        out = _attend(attention, qkv, cache, [length - 1], scale=scale, window=options.get("window"),
                      softcap=options.get("softcap"), sinks=None if sinks is None else sinks.to(DEVICE), log=log,
                      step=step, **args)
        want = reference(q, k, v, scale, options.get("window"), options.get("softcap"), sinks)
        assert rel_err(out[0], want) < 1e-5
        # The positions attended are recorded at log[step]: all of them, or the window.
        assert log[2].item() == min(length, options.get("window") or length)
        assert not attention.done.any()
    # The new key and value were appended at their slot.
    k_cache, v_cache = cache.layer(0)
    assert torch.equal(gather(k_cache, cache.block_table, length)[:, -1].cpu(), k_new)
    assert torch.equal(gather(v_cache, cache.block_table, length)[:, -1].cpu(), v_new)


def test_decode_bfloat16():
    from thin.runtime.kernels.attention import DecodeAttention

    cache, k, v = _filled_cache(37, 2, 64, torch.bfloat16, seed=1)
    qkv, args, (q, k_new, v_new) = _new_token(37, 8, 2, 64, torch.bfloat16, seed=2, rope=True, qk_norm=True)
    k[:, -1], v[:, -1] = k_new, v_new
    attention = DecodeAttention(8, 2, 64, cache.max_seq_len, DEVICE, sms=4, tile=16)
    out = _attend(attention, qkv, cache, [36], scale=0.125, **args)
    assert rel_err(out[0], reference(q, k, v, 0.125)) < 1.5e-2


def test_decode_rows_each_at_its_own_position():
    """A batched step: sequence r at pos[r] through row r of the block table; one short sequence
    (one split) beside a long one (merged splits)."""
    from thin.runtime.kernels.attention import DecodeAttention

    heads, kv_heads, D, lengths = 4, 2, 16, [5, 70]
    cache, k, v = _filled_cache(8 + lengths[1], kv_heads, D, torch.float32, seed=4)
    table = cache.block_table.cpu()  # sequence 1's blocks follow sequence 0's (5 positions: 2 blocks)
    cache.rows_table = torch.stack([table, torch.cat([table[2:], table[:2]])]).to(DEVICE)
    news = [_new_token(n, heads, kv_heads, D, torch.float32, seed=10 + r, rope=True) for r, n in enumerate(lengths)]
    qkv = torch.stack([qkv for qkv, _, _ in news])
    attention = DecodeAttention(heads, kv_heads, D, 96, DEVICE, sms=4, tile=16, rows=2)
    out = _attend(attention, qkv, cache, [n - 1 for n in lengths], scale=0.25, **news[0][1])
    for r, (start, n) in enumerate([(0, 5), (8, 70)]):
        q, k_new, v_new = news[r][2]
        keys, values = k[:, start:start + n].clone(), v[:, start:start + n].clone()
        keys[:, -1], values[:, -1] = k_new, v_new
        assert rel_err(out[r], reference(q, keys, values, 0.25)) < 1e-5
    assert not attention.done.any()


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
    qkv, args, (q, k_new, v_new) = _new_token(600, 32, 8, 128, torch.bfloat16, seed=6, rope=True, qk_norm=True)
    k[:, -1], v[:, -1] = k_new, v_new
    attention = DecodeAttention(32, 8, 128, cache.max_seq_len, DEVICE)
    first = _attend(attention, qkv, cache, [599], scale=128 ** -0.5, **args)
    assert rel_err(first[0], reference(q, k, v, 128 ** -0.5)) < 1e-2
    # The last split of each head merges what the others wrote: a launch that read a partial before it
    # landed, or found a counter not set back to zero, would differ from the first.
    for _ in range(50):
        assert torch.equal(_attend(attention, qkv, cache, [599], scale=128 ** -0.5, **args), first)
    assert not attention.done.any()
