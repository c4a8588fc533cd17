"""Scratch: the appending decode attention (llama-8b heads) at tile x splits, one process, 8 layers' caches."""
import sys, os, torch
sys.path.insert(0, os.path.dirname(__file__))
import bench_attention as ba
from thin.runtime.kernels.attention import DecodeAttention
from thin.runtime.kernels.attention_append import append_attend
from thin.runtime.paged_kv import PagedKVCache
dev = torch.device("cuda")
heads, kvh, dim = 32, 8, 128
LAYERS = 8
max_len = 4096
gen = torch.Generator(device=dev).manual_seed(0)
cache = PagedKVCache(LAYERS, kvh, dim, max_len, torch.bfloat16, dev)
cache.reserve(max_len)
cache.keys.normal_(generator=gen); cache.values.normal_(generator=gen)
qkv = torch.randn((heads + 2 * kvh) * dim, generator=gen, device=dev).bfloat16()
rope, norms, options = ba.layer_args("llama-8b", max_len, dev, gen)
pos = torch.zeros(1, dtype=torch.int32, device=dev)
out = torch.empty(heads * dim, dtype=torch.bfloat16, device=dev)
ref = {}
def make(tile, splits):
    a = DecodeAttention(heads, kvh, dim, 640 if splits is None else max_len, dev, 132, tile=tile)
    if splits is not None:
        a.splits = splits
        a.o = torch.empty(1, splits, heads, dim, dtype=torch.float32, device=dev)
        a.m = torch.empty(1, splits, heads, dtype=torch.float32, device=dev)
        a.l = torch.empty(1, splits, heads, dtype=torch.float32, device=dev)
        a.n = torch.empty(1, splits, dtype=torch.int32, device=dev)
    return a
turn = [0]
def run(a):
    turn[0] += 1
    k, v = cache.layer(turn[0] % LAYERS)
    append_attend(a, qkv, k, v, cache.block_table, pos, out, scale=dim ** -0.5, rope=rope, repeat=True, **options)
rows = []
for length in (64, 576, 2048):
    pos.fill_(length - 1)
    for tile, splits in ((32, None), (16, 40), (16, 20), (32, 10), (32, 5), (64, 10), (64, 5), (64, 3), (128, 5), (128, 3)):
        if splits is not None and splits * tile > 2 * max(length, 640):
            pass
        a = make(tile, splits)
        turn[0] = 0
        run(a)
        o = out.float().clone()
        key = length
        if key not in ref:
            ref[key] = o
        err = float((o - ref[key]).norm() / ref[key].norm())
        us = ba.time_graph(lambda: run(a))
        rows.append((length, tile, a.splits, us, err))
        print(f"positions {length} tile {tile} splits {a.splits}: {us:.2f} us  (err vs first {err:.1e})", flush=True)
