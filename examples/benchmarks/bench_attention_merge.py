"""Decode attention with the merge launch against the merge done by each kv head's last split program
(attention.merge_last), 32 layers in a CUDA graph, on random caches: no model artifact needed.

    python examples/benchmarks/bench_attention_merge.py [--lengths 64,512,1024,4096] [--layers 32]
        [--replays 15] [--paths fused,plain] [--shape llama-8b] [--device cuda]

For each number of positions: `--layers` layers' separate paged caches (random bf16 keys and values,
16-position blocks; 32 layers of llama-8b at 4096 positions: 0.5 GB, so the keys and values come from
DRAM, not L2), one random qkv row and output per layer, and one DecodeAttention (its split count for
this device, as the engine sizes it for the longest length). Each path's layers are captured in one
CUDA graph twice, with the merge launch and with `last`: `fused` is attention_append.append_attend
(RoPE and the KV append in the split kernel: two launches a layer, or one), `plain` is rope_append then
the split kernel (three, or two). Prints microseconds a layer (the median of --replays replays over the
layer count) and whether every layer's output, the appended keys and values and the count of positions
attended are the same to the bit with and without the merge launch. Exits non-zero when one is not.

Shapes: llama-8b (32 / 8 heads of 128, RoPE theta 500000), tiny (8 / 2 heads of 32). --device cpu runs
the same under Triton's interpreter, eagerly (no graphs; the times are the interpreter's, not a GPU's),
to check the script and the equality on small shapes: e.g. --device cpu --shape tiny --lengths 5,40
--layers 2 --replays 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SHAPES = {"llama-8b": (32, 8, 128), "tiny": (8, 2, 32)}
PATHS = ("fused", "plain")


def arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="64,512,1024,4096", help="positions in the cache, comma-separated")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--replays", type=int, default=15)
    p.add_argument("--paths", default=",".join(PATHS), help="fused (append_attend), plain (rope_append + split)")
    p.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths takes comma-separated integers, got {args.lengths!r}")
    args.paths = args.paths.split(",")
    if min(args.lengths) < 1 or args.layers < 1 or args.replays < 1:
        p.error("--lengths, --layers and --replays must be at least 1")
    if any(path not in PATHS for path in args.paths):
        p.error(f"--paths takes {', '.join(PATHS)}, got {','.join(args.paths)}")
    return args


class Layers:
    """`layers` layers of random caches at `length` positions, their qkv rows and outputs, and one
    DecodeAttention (whose counters every launch shares, as the engine's layers do)."""

    def __init__(self, shape: str, layers: int, length: int, max_len: int, dev):
        import torch

        from thin.runtime.kernels.attention import DecodeAttention
        from thin.runtime.paged_kv import PagedKVCache

        heads, kv_heads, dim = SHAPES[shape]
        self.heads, self.kv_heads, self.dim, self.layers = heads, kv_heads, dim, layers
        gen = torch.Generator(device=dev).manual_seed(length)
        self.cache = PagedKVCache(layers, kv_heads, dim, max_len, torch.bfloat16, dev, block_size=16)
        self.cache.reserve(max_len)
        self.cache.keys.normal_(generator=gen)
        self.cache.values.normal_(generator=gen)
        self.qkv = torch.randn(layers, (heads + 2 * kv_heads) * dim, generator=gen, device=dev).to(torch.bfloat16)
        self.q = torch.empty(heads, dim, dtype=torch.bfloat16, device=dev)
        self.out = torch.empty(layers, heads * dim, dtype=torch.bfloat16, device=dev)
        t = torch.arange(max_len + 1, dtype=torch.float32, device=dev)[:, None]
        freq = 500000.0 ** (-torch.arange(0, dim, 2, device=dev).float() / dim)
        angles = torch.cat([t * freq, t * freq], dim=1)
        self.rope = (angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16))
        self.pos = torch.tensor([length - 1], dtype=torch.int32, device=dev)
        self.log = torch.zeros(2, dtype=torch.int32, device=dev)
        self.step = torch.zeros(1, dtype=torch.int32, device=dev)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        self.attention = DecodeAttention(heads, kv_heads, dim, max_len, dev, sms)

    def run(self, path: str, last: bool) -> None:
        """Every layer's attention by `path`, merged by the merge launch or (`last`) the last programs."""
        from thin.runtime.kernels.attention_append import append_attend
        from thin.runtime.kernels.rope import rope_append

        for i in range(self.layers):
            k_cache, v_cache = self.cache.layer(i)
            options = dict(scale=self.dim ** -0.5, last=last, log=self.log if i == 0 else None, step=self.step)
            if path == "fused":
                append_attend(self.attention, self.qkv[i], k_cache, v_cache, self.cache.block_table, self.pos,
                              self.out[i], rope=self.rope, **options)
            else:
                rope_append(self.qkv[i], self.q, k_cache, v_cache, self.cache.block_table, self.pos, self.heads,
                            self.kv_heads, self.dim, rope=self.rope)
                self.attention(self.q, k_cache, v_cache, self.cache.block_table, self.pos, self.out[i], **options)

    def state(self) -> list:
        """What a run leaves: the outputs, the appended keys and values, the log, the counters."""
        new = int(self.pos[0])
        slots = self.cache.block_table[new // 16]
        return [self.out.clone(), self.cache.keys[:, slots, :, new % 16].clone(),
                self.cache.values[:, slots, :, new % 16].clone(), self.log.clone(), self.attention.counts.clone()]


def timed(layers: Layers, path: str, last: bool, replays: int, graphs: bool) -> tuple[float, list]:
    """(median microseconds a layer, the state after the last replay) of `path` captured in one graph
    (graphs) or run eagerly."""
    import torch

    run = lambda: layers.run(path, last)  # noqa: E731
    run()  # compiles
    layers.out.fill_(float("nan"))
    if graphs:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        layers.out.fill_(float("nan"))
        for _ in range(replays):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e3 / layers.layers)
    else:
        times = []
        for _ in range(replays):
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) * 1e6 / layers.layers)
    return statistics.median(times), layers.state()


def main(argv=None) -> int:
    args = arguments(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_attention_merge: no CUDA GPU here (--device cpu runs it under the interpreter)",
              file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    graphs = dev.type == "cuda"
    heads, kv_heads, dim = SHAPES[args.shape]
    max_len = max(args.lengths)
    where = torch.cuda.get_device_name() if graphs else "CPU, Triton's interpreter, eager (not GPU times)"
    print(f"{where}; {args.shape} attention ({heads}/{kv_heads} heads of {dim}, bf16), {args.layers} layers "
          f"{'in one CUDA graph' if graphs else 'run eagerly'}; us per layer, median of {args.replays}")
    print("| path | positions | splits | merge launch | last program merges | change | same bits |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    bad = []
    for length in args.lengths:
        layers = Layers(args.shape, args.layers, length, max_len, dev)
        for path in args.paths:
            separate, want = timed(layers, path, False, args.replays, graphs)
            merged, got = timed(layers, path, True, args.replays, graphs)
            same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and not want[0].isnan().any()
            same &= int(got[3][0]) == length and not got[4].any()
            bad += [] if same else [(path, length)]
            print(f"| {path} | {length} | {layers.attention.splits} | {separate:.2f} | {merged:.2f} | "
                  f"{100 * (merged / separate - 1):+.1f}% | {'yes' if same else 'NO'} |", flush=True)
        del layers
        if graphs:
            torch.cuda.empty_cache()
    print("ALL SAME" if not bad else f"NOT THE SAME BITS: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
