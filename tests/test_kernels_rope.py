"""q/k norm + RoPE + paged KV append against the executor's NormPlan and apply_rotary, every RoPE kind."""

import pytest
import torch
from kernel_support import DEVICE, HAS_CUDA, rel_err

from thin.ir import RoPE

KINDS = {
    "default": RoPE("default", 10000.0, 32),
    "linear": RoPE("linear", 10000.0, 32, factor=4.0),
    "llama3": RoPE("llama3", 500000.0, 32, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "partial": RoPE("default", 10000.0, 16),  # Phi-3: only the first half of each head rotates
}


def _case(kind, dtype, qk_norm, T=3, start=5, heads=4, kv_heads=2, D=32, seed=0):
    from thin.runtime.executor import NormPlan
    from thin.runtime.kernels.rope import rope_append
    from thin.runtime.paged_kv import PagedKVCache
    from thin.runtime.rope import RotaryTables, apply_rotary

    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, generator=gen).to(dtype)
    tables = RotaryTables(KINDS[kind], torch.device("cpu"), dtype)
    tables.get(0, 64)
    norms = [NormPlan("rms", 1e-6, 1 + 0.3 * torch.randn(D, generator=gen), None) for _ in range(2)]
    # Reference: the executor's arithmetic on the CPU.
    q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    q, k, v = q.reshape(T, heads, D), k.reshape(T, kv_heads, D), v.reshape(T, kv_heads, D)
    if qk_norm:
        q, k = norms[0](q), norms[1](k)
    cos, sin = tables.get(start, T)
    q_ref, k_ref = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    # Kernel: a cache whose blocks are not in order.
    cache = PagedKVCache(1, kv_heads, D, 64, dtype, DEVICE, block_size=4)
    cache.reserve(start + T)
    pos = torch.tensor([start], dtype=torch.int32, device=DEVICE)
    q_out = torch.full((T, heads, D), float("nan"), dtype=dtype, device=DEVICE)
    k_cache, v_cache = cache.layer(0)
    norm_args = {"q_norm": (norms[0].weight.to(DEVICE), 1e-6), "k_norm": (norms[1].weight.to(DEVICE), 1e-6)} \
        if qk_norm else {}
    rope_append(qkv.to(DEVICE), q_out, k_cache, v_cache, cache.block_table, pos, heads, kv_heads, D,
                rope=(tables.cos.to(DEVICE), tables.sin.to(DEVICE)), **norm_args)
    from thin.runtime.kernels.attention import gather

    k_got = gather(k_cache, cache.block_table, start + T)[:, start:].transpose(0, 1)
    v_got = gather(v_cache, cache.block_table, start + T)[:, start:].transpose(0, 1)
    return (q_out, q_ref), (k_got, k_ref), (v_got, v)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("qk_norm", [False, True])
def test_matches_executor_float32(kind, qk_norm):
    for got, want in _case(kind, torch.float32, qk_norm):
        assert rel_err(got, want) < 1e-6


def test_matches_executor_bfloat16_rounding():
    (q, q_ref), (k, k_ref), (v, v_ref) = _case("llama3", torch.bfloat16, True)
    # Every torch rounding step is reproduced: an ulp apart here and there on the GPU. Triton's
    # interpreter truncates float32 to bf16 instead of rounding, which costs up to an ulp per step.
    tol = 2e-3 if HAS_CUDA else 1.5e-2
    assert rel_err(q, q_ref) < tol and rel_err(k, k_ref) < tol and torch.equal(v.cpu(), v_ref)


def test_physical_blocks_differ_from_logical():
    from thin.runtime.paged_kv import PagedKVCache

    cache = PagedKVCache(1, 1, 8, 64, torch.float32, "cpu", block_size=4)
    cache.reserve(9)
    table = cache.block_table[:3].tolist()
    assert table != [0, 1, 2] and len(set(table)) == 3
    cache.truncate(0)
    cache.length = 0
    cache.reserve(4)
    assert cache.block_table[0].item() in table  # freed blocks are handed out again


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize(("dtype", "bias", "qk_norm"), [(torch.bfloat16, True, True), (torch.float32, False, False)])
def test_split_partial_sums_of_a_batched_step(splits, dtype, bias, qk_norm):
    """A batched step's qkv as float32 split-K partial sums [splits, T, width] (plus the bias), summed by
    rope_append itself: the same q, keys and values as from the summed projection output
    (grouped_int_batch's `_sum_splits`), each token at its own position through its own block-table row."""
    from thin.runtime.kernels.grouped_int_batch import _summed
    from thin.runtime.kernels.rope import rope_append
    from thin.runtime.rope import RotaryTables

    T, heads, kv_heads, D = 3, 4, 2, 32
    width = (heads + 2 * kv_heads) * D
    gen = torch.Generator().manual_seed(splits)
    part = torch.randn(splits, T, width, generator=gen).to(DEVICE)
    b = torch.randn(width, generator=gen).to(dtype).to(DEVICE) if bias else None
    tables = RotaryTables(KINDS["llama3"], torch.device("cpu"), dtype)
    tables.get(0, 64)
    rope = (tables.cos.to(DEVICE), tables.sin.to(DEVICE))
    norms = {"q_norm": ((1 + 0.3 * torch.randn(D, generator=gen)).to(DEVICE), 1e-6),
             "k_norm": ((1 + 0.3 * torch.randn(D, generator=gen)).to(DEVICE), 1e-6)} if qk_norm else {}
    table = torch.tensor([[3, 1], [0, 2], [5, 4]], dtype=torch.int32, device=DEVICE)  # 2 blocks of 4 a row
    pos = torch.tensor([2, 5, 7], dtype=torch.int32, device=DEVICE)
    dense = _summed(part, b, dtype)
    outs = []
    for qkv, how in ((dense, {}), (part, {"splits": splits, "bias": b})):
        q = torch.full((T, heads, D), float("nan"), dtype=dtype, device=DEVICE)
        keys, values = (torch.zeros(6, kv_heads, 4, D, dtype=dtype, device=DEVICE) for _ in range(2))
        rope_append(qkv, q, keys, values, table, pos, heads, kv_heads, D, rope=rope, **norms, **how)
        outs.append((q, keys, values))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert torch.equal(got, want)
    assert outs[0][1].abs().sum() > 0 and not outs[0][0].isnan().any()
    with pytest.raises(ValueError, match="partial sums"):
        rope_append(part.to(torch.bfloat16), q, keys, values, table, pos, heads, kv_heads, D, rope=rope, splits=splits)
