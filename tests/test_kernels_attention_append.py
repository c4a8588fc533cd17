"""Decode attention with the q/k norm, RoPE and KV append inside the split kernel (attention_append.py)
against the three-launch path it replaces (rope_append, then the split-KV attention and its merge) and
against the executor's arithmetic in torch (NormPlan, apply_rotary, a plain softmax)."""

import pytest
import torch
from kernel_support import DEVICE, rel_err
from test_kernels_attention import _filled_cache, reference

from thin.ir import RoPE

ROPES = {
    "default": RoPE("default", 10000.0, 32),
    "llama3": RoPE("llama3", 500000.0, 32, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "yarn": RoPE("yarn", 150000.0, 32, factor=32.0, original_max_position_embeddings=64, beta_fast=32.0,
                 beta_slow=1.0, truncate=False, attention_factor=1.3466),
    "partial": RoPE("default", 10000.0, 16),  # Phi-3: only the first half of each head rotates
}


def _token(position, heads, kv_heads, D, dtype, seed, rope="default", qk_norm=False):
    """Raw qkv [width] of the token at `position`, the arguments the kernels take for its RoPE and q/k
    norms, and (q [heads, D], k [kv_heads, D], v [kv_heads, D]) as the executor computes them."""
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
    if rope is not None:
        tables = RotaryTables(ROPES[rope], torch.device("cpu"), dtype)
        tables.get(0, 128)
        cos, sin = tables.get(position, 1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        args["rope"] = (tables.cos.to(DEVICE), tables.sin.to(DEVICE))
    return qkv.to(DEVICE), args, (q[0], k[0], v)


def _both(heads, kv_heads, D, cache, pos, qkv, args, scale, rows=1, repeat=False, **options):
    """(out, k_cache, v_cache, log) of the old path and of append_attend (its `repeat`), each from a copy
    of `cache`'s layer 0, with pos [rows] and `cache.rows_table` for several rows."""
    from thin.runtime.kernels.attention import DecodeAttention
    from thin.runtime.kernels.attention_append import append_attend
    from thin.runtime.kernels.rope import rope_append

    table = cache.rows_table if rows > 1 else cache.block_table
    pos = torch.tensor(pos, dtype=torch.int32, device=DEVICE)
    step = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    results = []
    for fused in (False, True):
        k_cache, v_cache = (c.clone() for c in cache.layer(0))
        attention = DecodeAttention(heads, kv_heads, D, cache.max_seq_len, DEVICE, sms=4, tile=16, rows=rows)
        out = torch.full((rows, heads * D), float("nan"), dtype=qkv.dtype, device=DEVICE)
        log = torch.zeros(4, dtype=torch.int32, device=DEVICE)
        if fused:
            append_attend(attention, qkv, k_cache, v_cache, table, pos, out if rows > 1 else out[0], scale=scale,
                          log=log, step=step, repeat=repeat, **args, **options)
        else:
            q = torch.full((rows, heads, D), float("nan"), dtype=qkv.dtype, device=DEVICE)
            rope_append(qkv.reshape(rows, -1), q, k_cache, v_cache, table, pos, heads, kv_heads, D, **args)
            attention(q if rows > 1 else q[0], k_cache, v_cache, table, pos, out if rows > 1 else out[0],
                      scale=scale, log=log, step=step, **options)
        results.append((out, k_cache, v_cache, log))
    return results


OPTIONS = [{}, {"rope": "llama3"}, {"rope": "yarn"}, {"rope": "partial"}, {"rope": None}, {"qk_norm": True},
           {"window": 10}, {"softcap": 2.0}, {"sinks": True}, {"repeat": True}, {"qk_norm": True, "repeat": True}]


# 4-position blocks, 16-position tiles, 4 splits: 5 puts the new token first in its block, 33 alone in
# its split (the splits before it hold 32 positions), 96 fills the cache; 8 query heads share 2 kv heads.
@pytest.mark.parametrize("length", [1, 5, 33, 96])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_matches_the_three_launch_path_and_torch(length, options):
    heads, kv_heads, D, scale = 8, 2, 32, 0.3
    cache, k, v = _filled_cache(length, kv_heads, D, torch.float32, seed=length)
    qkv, args, (q, k_new, v_new) = _token(length - 1, heads, kv_heads, D, torch.float32, seed=9,
                                          rope=options.get("rope", "default"), qk_norm=options.get("qk_norm", False))
    k[:, -1], v[:, -1] = k_new, v_new
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(3)) if options.get("sinks") else None
    kernel_options = {"window": options.get("window"), "softcap": options.get("softcap"),
                      "sinks": None if sinks is None else sinks.to(DEVICE)}
    (old, k_old, v_old, log_old), (out, k_cache, v_cache, log) = _both(
        heads, kv_heads, D, cache, [length - 1], qkv, args, scale, repeat=options.get("repeat", False),
        **kernel_options)
    want = reference(q, k, v, scale, options.get("window"), options.get("softcap"), sinks)
    assert rel_err(out[0], want) < 1e-5 and rel_err(out[0], old[0]) < 1e-5
    # The new key and value landed in their slot and nothing else changed.
    from thin.runtime.kernels.attention import gather

    table = cache.block_table
    assert rel_err(gather(k_cache, table, length)[:, -1], k_new) < 1e-6
    assert torch.equal(gather(v_cache, table, length)[:, -1].cpu(), v_new)
    slot = table[(length - 1) // 4].item(), (length - 1) % 4
    for got, was in ((k_cache, k_old), (v_cache, v_old)):
        got, was = got.clone(), was.clone()
        got[slot[0], :, slot[1]] = was[slot[0], :, slot[1]] = 0
        assert torch.equal(got, was)
    # The positions attended at log[step]: all of them, or the window; as the old path logs them.
    assert log[2].item() == log_old[2].item() == min(length, options.get("window") or length)


@pytest.mark.parametrize(("qk_norm", "repeat"), [(False, False), (True, False), (True, True)])
def test_bfloat16_same_cache_as_the_three_launch_path(qk_norm, repeat):
    """In the compute dtype the appended key and value are the old path's to the bit (without a q/k norm:
    the same rounded steps; with one, the norm's sum may add in another order), and the outputs agree."""
    heads, kv_heads, D, length = 8, 2, 64, 37
    cache, k, v = _filled_cache(length, kv_heads, D, torch.bfloat16, seed=1)
    qkv, args, (q, k_new, v_new) = _token(length - 1, heads, kv_heads, D, torch.bfloat16, seed=2, rope="llama3",
                                          qk_norm=qk_norm)
    (old, k_old, v_old, _), (out, k_cache, v_cache, _) = _both(heads, kv_heads, D, cache, [length - 1], qkv, args,
                                                               0.125, repeat=repeat)
    assert torch.equal(v_cache, v_old)
    if qk_norm:
        assert rel_err(k_cache, k_old) < 1e-3
    else:
        assert torch.equal(k_cache, k_old)
    k[:, -1], v[:, -1] = k_new, v_new
    assert rel_err(out[0], old[0]) < 1e-2 and rel_err(out[0], reference(q, k, v, 0.125)) < 1.5e-2


@pytest.mark.parametrize("length", [1, 5, 33, 96])
@pytest.mark.parametrize("window", [None, 20])
def test_dependent_code_gives_the_same_bits(length, window):
    """Launched as a programmatic dependent (kernels/dependent.py; under the interpreter its code without the
    grid-dependency instructions) the split kernel loads its first tile of cached keys and values before
    it waits: the same outputs, cache and log to the bit as the plain launch, with splits of no position
    (length 1, 5), of one tile and of two (96: 32 positions a split, 16-position tiles)."""
    from thin.runtime.kernels import dependent
    from thin.runtime.kernels.attention import DecodeAttention
    from thin.runtime.kernels.attention_append import append_attend

    heads, kv_heads, D = 8, 2, 32
    cache, _, _ = _filled_cache(length, kv_heads, D, torch.float32, seed=length)
    qkv, args, _ = _token(length - 1, heads, kv_heads, D, torch.float32, seed=9, rope="llama3", qk_norm=True)
    pos = torch.tensor([length - 1], dtype=torch.int32, device=DEVICE)
    step = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    results = []
    for on in (False, True):
        k_cache, v_cache = (c.clone() for c in cache.layer(0))
        attention = DecodeAttention(heads, kv_heads, D, cache.max_seq_len, DEVICE, sms=4, tile=16)
        out = torch.full((heads * D,), float("nan"), device=DEVICE)
        log = torch.zeros(4, dtype=torch.int32, device=DEVICE)
        with dependent.launching(on):
            append_attend(attention, qkv, k_cache, v_cache, cache.block_table, pos, out, scale=0.3, window=window,
                          log=log, step=step, **args)
        results.append((out, k_cache, v_cache, log))
    for plain, dependent_run in zip(*results, strict=True):
        assert torch.equal(plain, dependent_run)


def test_rows_each_at_its_own_position():
    """A batched step: sequence r at pos[r] through row r of the block table, from row r of qkv; a short
    sequence (one split) beside a long one."""
    heads, kv_heads, D, lengths = 4, 2, 32, [5, 70]
    cache, k, v = _filled_cache(8 + lengths[1], kv_heads, D, torch.float32, seed=4)
    table = cache.block_table.cpu()  # sequence 1's blocks follow sequence 0's (its 5 positions: 2 blocks)
    cache.rows_table = torch.stack([table, torch.cat([table[2:], table[:2]])]).to(DEVICE)
    qkv = torch.stack([_token(n - 1, heads, kv_heads, D, torch.float32, seed=10 + r)[0]
                       for r, n in enumerate(lengths)])
    _, args, _ = _token(0, heads, kv_heads, D, torch.float32, seed=12, qk_norm=True)
    (old, k_old, v_old, _), (out, k_cache, v_cache, _) = _both(heads, kv_heads, D, cache, [n - 1 for n in lengths],
                                                               qkv, args, 0.25, rows=2, repeat=True)
    assert rel_err(out, old) < 1e-5 and rel_err(k_cache, k_old) < 1e-6 and torch.equal(v_cache, v_old)


@pytest.mark.gpu
def test_choose_appending_times_every_path():
    """The warm-up's timing runs the old path and each fused variant on scratch caches and logs their
    times at each length."""
    import logging

    from thin.runtime.kernels.attention_append import choose_appending

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("thin.runtime")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        _, args, _ = _token(0, 32, 8, 128, torch.bfloat16, seed=0, qk_norm=True)
        best = choose_appending(32, 8, 128, torch.bfloat16, DEVICE, scale=128 ** -0.5, lengths=(16, 300), **args)
    finally:
        logger.removeHandler(handler)
    message = records[-1].getMessage()
    longest = min(300, args["rope"][0].shape[0]) if args.get("rope") is not None else 300  # clamped to the table
    assert f"[16, {longest}] positions" in message and "repeat=True" in message and "repeat=False" in message
    assert best in (None, False, True) and message.endswith("rope_append + split + merge" if best is None
                                                            else f"fused, repeat={best}")


@pytest.mark.gpu
def test_real_shapes_on_gpu():
    heads, kv_heads, D = 32, 8, 128
    for length in (1, 600, 1000):
        cache, k, v = _filled_cache(length, kv_heads, D, torch.bfloat16, seed=5, block_size=16, capacity=1024)
        qkv, args, (q, k_new, v_new) = _token(length - 1, heads, kv_heads, D, torch.bfloat16, seed=6, qk_norm=True)
        (old, k_old, v_old, _), (out, k_cache, v_cache, _) = _both(heads, kv_heads, D, cache, [length - 1], qkv, args,
                                                                   D ** -0.5, repeat=length == 600)
        k[:, -1], v[:, -1] = k_new, v_new
        assert rel_err(out[0], old[0]) < 1e-2 and rel_err(out[0], reference(q, k, v, D ** -0.5)) < 1e-2
        assert torch.equal(v_cache, v_old) and rel_err(k_cache, k_old) < 1e-3


def test_split_programs_take_a_warp_a_512_key_elements():
    """The appending split kernel's warps (split_warps): 8 for llama-8b's tiles of 32 keys of 128 features (the
    measured best on the H200), 4 for 64-feature heads, never more than 8 for 256."""
    from thin.runtime.kernels.attention_append import split_warps

    assert split_warps(32, 128) == 8
    assert split_warps(32, 64) == 4
    assert split_warps(32, 80) == 8  # padded to 128 features
    assert split_warps(32, 256) == 8
    assert split_warps(16, 128) == 4
    assert split_warps(32, 128, rows=16) == 4  # the server's batches: as measured
