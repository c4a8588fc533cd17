"""The split-KV decode attention merging its splits in the split kernel (`last`: the last split program
of each kv head to finish, attention.merge_last) against the merge launch, for both split kernels
(attention.py's after rope_append, attention_append.py's): the same output to the bit, the same cache
and log, and the arrival counters back at zero after every call, so a second call (a graph's replay)
counts from zero again."""

import pytest
import torch
from kernel_support import DEVICE, HAS_CUDA
from test_kernels_attention import _filled_cache
from test_kernels_attention_append import _token


def _run(path, heads, kv_heads, D, cache, pos, qkv, args, scale, sms=4, rows=1, repeat=False, last=False,
         calls=2, **options):
    """[(out, k_cache, v_cache, log)] of `calls` calls in a row of `path` ("plain": rope_append then
    DecodeAttention; "fused": append_attend) on one DecodeAttention, each call from a fresh copy of
    `cache`'s layer 0; then the DecodeAttention (its splits and counters)."""
    from thin.runtime.kernels.attention import DecodeAttention
    from thin.runtime.kernels.attention_append import append_attend
    from thin.runtime.kernels.rope import rope_append

    table = cache.rows_table if rows > 1 else cache.block_table
    pos = torch.tensor(pos, dtype=torch.int32, device=DEVICE)
    step = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    attention = DecodeAttention(heads, kv_heads, D, cache.max_seq_len, DEVICE, sms=sms, tile=16, rows=rows)
    results = []
    for _ in range(calls):
        k_cache, v_cache = (c.clone() for c in cache.layer(0))
        out = torch.full((rows, heads * D), float("nan"), dtype=qkv.dtype, device=DEVICE)
        log = torch.zeros(3, dtype=torch.int32, device=DEVICE)
        kwargs = dict(scale=scale, log=log, step=step, last=last, **options)
        if path == "fused":
            append_attend(attention, qkv, k_cache, v_cache, table, pos, out if rows > 1 else out[0], repeat=repeat,
                          **args, **kwargs)
        else:
            q = torch.full((rows, heads, D), float("nan"), dtype=qkv.dtype, device=DEVICE)
            rope_append(qkv.reshape(rows, -1), q, k_cache, v_cache, table, pos, heads, kv_heads, D, **args)
            attention(q if rows > 1 else q[0], k_cache, v_cache, table, pos, out if rows > 1 else out[0], **kwargs)
        assert not attention.counts.any()  # every (sequence, kv head)'s counter back at zero
        results.append((out, k_cache, v_cache, log))
    return results, attention


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


OPTIONS = [{}, {"window": 10}, {"softcap": 2.0}, {"sinks": True}, {"qk_norm": True, "repeat": True},
           {"window": 7, "softcap": 1.5, "sinks": True, "qk_norm": True}]
CASES = [(path, o) for path in ("plain", "fused") for o in OPTIONS if path == "fused" or not o.get("repeat")]


# 4-position blocks, 16-position tiles: 4 splits (sms=4) or 1 (sms=1); 1 and 5 positions fill one split of
# the four, 33 and 96 several; 8 query heads share 2 kv heads.
@pytest.mark.parametrize(("length", "sms"), [(1, 4), (5, 1), (33, 4), (96, 4), (96, 1)])
@pytest.mark.parametrize(("path", "options"), CASES,
                         ids=lambda c: c if isinstance(c, str) else ",".join(f"{k}={v}" for k, v in c.items()) or "-")
def test_last_program_merges_to_the_bit(path, length, sms, options):
    heads, kv_heads, D = 8, 2, 32
    cache, _, _ = _filled_cache(length, kv_heads, D, torch.bfloat16, seed=length)
    qkv, args, _ = _token(length - 1, heads, kv_heads, D, torch.bfloat16, seed=7, rope="llama3",
                          qk_norm=options.get("qk_norm", False))
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(3)).to(DEVICE) if options.get("sinks") else None
    kernel = dict(window=options.get("window"), softcap=options.get("softcap"), sinks=sinks,
                  repeat=options.get("repeat", False)) | ({} if path == "fused" else {"repeat": False})
    merged, attention = _run(path, heads, kv_heads, D, cache, [length - 1], qkv, args, 0.3, sms=sms, last=True,
                             **kernel)
    assert attention.splits == (4 if sms == 4 else 1)
    (want, *_), _ = _run(path, heads, kv_heads, D, cache, [length - 1], qkv, args, 0.3, sms=sms, calls=1, **kernel)
    assert not want[0].isnan().any()
    for got in merged:  # both calls: the second counted from zero again
        assert _same(got, want)
    assert merged[0][3][1].item() == min(length, options.get("window") or length)


@pytest.mark.parametrize("path", ["plain", "fused"])
def test_rows_each_merged_to_the_bit(path):
    """A batched step: each sequence's kv heads count on their own counter; a short sequence (one split
    with positions) beside a long one."""
    heads, kv_heads, D, lengths = 4, 2, 32, [5, 70]
    cache, _, _ = _filled_cache(8 + lengths[1], kv_heads, D, torch.float32, seed=4)
    table = cache.block_table.cpu()
    cache.rows_table = torch.stack([table, torch.cat([table[2:], table[:2]])]).to(DEVICE)
    qkv = torch.stack([_token(n - 1, heads, kv_heads, D, torch.float32, seed=10 + r)[0]
                       for r, n in enumerate(lengths)])
    _, args, _ = _token(0, heads, kv_heads, D, torch.float32, seed=12, qk_norm=True)
    positions = [n - 1 for n in lengths]
    merged, _ = _run(path, heads, kv_heads, D, cache, positions, qkv, args, 0.25, rows=2, last=True)
    (want, *_), _ = _run(path, heads, kv_heads, D, cache, positions, qkv, args, 0.25, rows=2, calls=1)
    assert all(_same(got, want) for got in merged)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_real_shapes_merge_to_the_bit_on_gpu():
    """llama-8b's attention (32 / 8 heads of 128, bf16, the device's split count) on the GPU: the last
    program's merge is the merge launch's to the bit, three calls in a row (the CUDA-graph replays:
    examples/benchmarks/bench_attention_merge.py)."""
    heads, kv_heads, D = 32, 8, 128
    for length in (1, 64, 600, 4000):
        cache, _, _ = _filled_cache(length, kv_heads, D, torch.bfloat16, seed=5, block_size=16, capacity=4096)
        qkv, args, _ = _token(length - 1, heads, kv_heads, D, torch.bfloat16, seed=6, qk_norm=True)
        sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
        for path in ("plain", "fused"):
            (want, *_), _ = _run(path, heads, kv_heads, D, cache, [length - 1], qkv, args, D ** -0.5, sms=sms,
                                 calls=1)
            merged, _ = _run(path, heads, kv_heads, D, cache, [length - 1], qkv, args, D ** -0.5, sms=sms,
                             last=True, calls=3)
            assert all(_same(got, want) for got in merged), (path, length)


@pytest.mark.parametrize("path", ["plain", "fused"])
def test_heads_of_256_merge_128_features_at_a_time(path):
    """A head of 256 features (Gemma-2's) is merged as two 128-feature tiles, by the merge launch and the
    last program alike: both the softmax over every position, and the same bits."""
    from test_kernels_attention import reference

    heads, kv_heads, D, length = 4, 2, 256, 40
    cache, k, v = _filled_cache(length, kv_heads, D, torch.float32, seed=8)
    qkv, args, (q, k_new, v_new) = _token(length - 1, heads, kv_heads, D, torch.float32, seed=9, rope=None)
    k[:, -1], v[:, -1] = k_new, v_new
    (want, *_), _ = _run(path, heads, kv_heads, D, cache, [length - 1], qkv, args, 0.1, calls=1, softcap=3.0)
    merged, _ = _run(path, heads, kv_heads, D, cache, [length - 1], qkv, args, 0.1, last=True, softcap=3.0)
    assert all(_same(got, want) for got in merged)
    assert torch.allclose(want[0][0].cpu(), reference(q, k, v, 0.1, softcap=3.0), rtol=1e-5, atol=1e-5)
