"""A decode step's attention two ways on one GPU: rope_append + split-KV + merge (3 launches) against
the split kernel that norms, rotates and appends itself (kernels/attention_append.py) + merge (2).

    python examples/benchmarks/bench_attention.py [--lengths 1,64,640,2048,8000] [--shapes llama-8b,moe-a3b]
                                                  [--engine-choice]

For each shape and number of positions it first checks the fused path against the old one (output
within 2e-2, the same keys and values appended, the same count of positions attended), then times
both inside CUDA graphs: 20 launches a graph, each on the next of 8 layers' caches (so that long
contexts come from DRAM, not L2), the median of 7 replays, in microseconds a layer. bf16, RoPE
(theta 500000) on every shape. Shapes:
llama-8b (32/8 heads of 128), moe-a3b (32/4 of 128), qwen3-8b (32/8 of 128 with q/k norm),
gemma-2 (16/8 heads of 256, softcap 50, window 4096), gpt-oss (64/8 of 64, sinks, window 128).
--engine-choice also runs the engine's warm-up timing (attention_append.choose_appending) per shape
and prints what it would pick. Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys

import torch

SHAPES = {  # heads, kv heads, head dim, options
    "llama-8b": (32, 8, 128, {}),
    "moe-a3b": (32, 4, 128, {}),
    "qwen3-8b": (32, 8, 128, {"norm": True}),
    "gemma-2": (16, 8, 256, {"softcap": 50.0, "window": 4096}),
    "gpt-oss": (64, 8, 64, {"sinks": True, "window": 128}),
}
LAYERS = 8


def time_graph(launch, launches: int = 20, replays: int = 7) -> float:
    """Median microseconds of one `launch` call, `launches` of them captured in a CUDA graph."""
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / launches)
    return statistics.median(times)


def layer_args(shape: str, max_len: int, dev: torch.device, gen: torch.Generator):
    """(RoPE tables, q/k norms, attention options) of one layer of `shape`, random where weights."""
    heads, _, dim, opts = SHAPES[shape]
    t = torch.arange(max_len + 1, dtype=torch.float32, device=dev)[:, None]
    freq = 500000.0 ** (-torch.arange(0, dim, 2, device=dev).float() / dim)
    angles = torch.cat([t * freq, t * freq], dim=1)
    rope = (angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16))
    norms = {}
    if opts.get("norm"):
        norms = {"q_norm": (1 + 0.1 * torch.randn(dim, generator=gen, device=dev), 1e-6),
                 "k_norm": (1 + 0.1 * torch.randn(dim, generator=gen, device=dev), 1e-6)}
    options = {"window": opts.get("window"), "softcap": opts.get("softcap"),
               "sinks": torch.randn(heads, generator=gen, device=dev) if opts.get("sinks") else None}
    return rope, norms, options


def case(shape: str, length: int, max_len: int, dev: torch.device) -> dict:
    from thin.runtime.kernels.attention import DecodeAttention
    from thin.runtime.kernels.attention_append import VARIANTS, append_attend
    from thin.runtime.kernels.rope import rope_append
    from thin.runtime.paged_kv import PagedKVCache

    heads, kv_heads, dim, opts = SHAPES[shape]
    dtype = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(length)
    cache = PagedKVCache(LAYERS, kv_heads, dim, max_len, dtype, dev)
    cache.reserve(max_len)
    cache.keys.normal_(generator=gen)
    cache.values.normal_(generator=gen)
    qkv = torch.randn((heads + 2 * kv_heads) * dim, generator=gen, device=dev).to(dtype)
    rope, norms, options = layer_args(shape, max_len, dev, gen)
    pos = torch.tensor([length - 1], dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    attention = DecodeAttention(heads, kv_heads, dim, max_len, dev, sms)
    q = torch.empty(heads, dim, dtype=dtype, device=dev)
    outs = {name: torch.empty(heads * dim, dtype=dtype, device=dev) for name in ("old", False, True)}
    log, step = torch.zeros(4, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
    turn = [0]

    def layer():
        turn[0] += 1
        return cache.layer(turn[0] % LAYERS)

    def old():
        k_cache, v_cache = layer()
        rope_append(qkv, q, k_cache, v_cache, cache.block_table, pos, heads, kv_heads, dim, rope=rope, **norms)
        attention(q, k_cache, v_cache, cache.block_table, pos, outs["old"], scale=dim ** -0.5, log=log, step=step,
                  **options)

    def fused(repeat):
        k_cache, v_cache = layer()
        append_attend(attention, qkv, k_cache, v_cache, cache.block_table, pos, outs[repeat], scale=dim ** -0.5,
                      rope=rope, log=log, step=step, repeat=repeat, **norms, **options)

    turn[0] = -1
    old()
    attended = [int(log[0])]
    appended = [c[0].clone() for c in (cache.keys, cache.values)]
    row = {"shape": shape, "positions": length, "splits": attention.splits, "ok": True}
    for repeat in VARIANTS:
        turn[0] = -1
        fused(repeat)
        attended.append(int(log[0]))
        # The appended key is the old path's to the bit without a q/k norm (the same rounded steps); with one,
        # its sum of squares may add in another order: within a bf16 rounding.
        keys = float((cache.keys[0].float() - appended[0].float()).norm() / appended[0].float().norm())
        same = torch.equal(cache.values[0], appended[1]) and (keys == 0 or bool(opts.get("norm")) and keys < 1e-3)
        err = float((outs[repeat].float() - outs["old"].float()).norm() / outs["old"].float().norm())
        row["ok"] &= same and err < 2e-2 and attended[-1] == attended[0]
        row[f"err {repeat}"] = err
    row["attended"] = "/".join(map(str, attended))
    row["old_us"] = time_graph(old)
    for repeat in VARIANTS:
        row[repeat] = time_graph(lambda r=repeat: fused(r))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1,64,640,2048,8000")
    p.add_argument("--shapes", default="llama-8b,moe-a3b")
    p.add_argument("--engine-choice", action="store_true", help="also run the engine's warm-up timing per shape")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    lengths = [int(x) for x in args.lengths.split(",")]
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or min(lengths) < 1:
        print(f"unknown shape {unknown} (known: {', '.join(SHAPES)}) or a length below 1", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}; us per layer, CUDA graphs of 20 launches over {LAYERS} layers' caches")
    print("| shape | positions | splits | rope_append + split + merge | fused split + merge | change | "
          "fused, q heads repeated | change | rel err vs old | attended old/fused/repeated |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    bad = []
    for shape in shapes:
        for length in lengths:
            r = case(shape, length, max(max(lengths), 64), torch.device("cuda"))
            bad += [] if r["ok"] else [r]
            change = {v: f"{100 * (r[v] / r['old_us'] - 1):+.0f}%" for v in (False, True)}
            print(f"| {shape} | {length} | {r['splits']} | {r['old_us']:.1f} | {r[False]:.1f} | {change[False]} | "
                  f"{r[True]:.1f} | {change[True]} | {max(r['err False'], r['err True']):.1e} | {r['attended']} |"
                  + ("" if r["ok"] else " CHECK FAILED"), flush=True)
    if args.engine_choice:
        from thin.runtime.kernels.attention_append import choose_appending

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        for shape in shapes:
            heads, kv_heads, dim, opts = SHAPES[shape]
            dev = torch.device("cuda")
            rope, norms, options = layer_args(shape, 8192, dev, torch.Generator(device=dev).manual_seed(0))
            picked = choose_appending(heads, kv_heads, dim, torch.bfloat16, dev, scale=dim ** -0.5, rope=rope,
                                      **norms, **options)
            print(f"{shape}: the engine would take " + ("rope_append + split + merge" if picked is None
                                                        else f"the fused split kernel, repeat={picked}"))
    print("ALL OK" if not bad else f"FAILED: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
