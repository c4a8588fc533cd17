"""Each decode kernel at llama-8b's shapes on one GPU: time per call and GB/s against copy bandwidth.

    python examples/benchmarks/bench_kernels.py [--formats bf16,int4,...] [--sweep] [--tune] [--json OUT]

For every weight format and projection shape of a llama-8b decode step (qkv 6144x4096,
o 4096x4096 and down 4096x14336 as split-K partial sums, gate/up 28672x4096 with the fused
SiLU epilogue, LM head 32000x4096) it times the matvec with each candidate launch configuration
(`--sweep`: a wider grid than the engine tunes over) and keeps the best. Timing captures 20
launches in a CUDA graph over enough copies of the weight that they do not fit in L2, and takes
the median of 7 replays. cuBLAS (F.linear on bf16) is timed the same way for reference, and the
non-linear kernels of a step (norm, RoPE + append, attention at 640 positions, greedy pick) too.
Compilation of all candidates runs first, in parallel processes; timing then runs in one process.
With --tune the best of the engine's own candidates for each weight is stored in the cache of
launch configurations (runtime/kernels/tuning.py), so `thin-exec` on this device skips its timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import torch

SHAPES = {"qkv": (6144, 4096, "plain"), "o": (4096, 4096, "partial"), "gate_up": (28672, 4096, "glu"),
          "down": (4096, 14336, "partial"), "lm_head": (32000, 4096, "plain")}
FORMATS = ["bf16", "fp8_e4m3", "int8", "int4", "mxfp4", "q2", "q1", "int3", "int5", "int6"]
L2_BYTES = 256 * 2**20  # weights cycled per timing: several times the 50 MB L2


def build(fmt: str, n: int, k: int, copies: int = 1):
    """`copies` ops of one random weight [n, k] in `fmt` (encoded on the GPU), bf16 activations."""
    from thin.ir import Encoding, Tensor, formats
    from thin.runtime.linear import make_linear

    params = formats.get(fmt).normalize({})
    w = 0.02 * torch.randn(n, k, device="cuda")
    raw = formats.encode(fmt, w, params).cpu()
    record = Tensor("w", "ffn.down", 0, (n, k), Encoding(fmt, params), "bf16")
    return [make_linear(record, raw, None, torch.device("cuda"), torch.bfloat16) for _ in range(copies)], raw.numel()


def sweep_grid(op, mode: str):
    """A wide grid of configurations for `op`'s family (for --sweep): chunk is columns per step."""
    from thin.runtime.kernels.common import MatvecConfig
    from thin.runtime.kernels.tiles import split_candidates

    family = type(op).__name__
    n = op.out_features // 2 if mode == "glu" else op.out_features
    k = op.in_features
    if family == "DenseKernelLinear":
        grid = [(bn, bk, w) for bn in (2, 4, 8, 16, 32) for bk in (256, 512, 1024, 2048) for w in (4, 8)
                if 1024 <= bn * bk <= 16384]
    elif family == "Rowwise8Linear" and op.fp8:  # 8 columns a lane
        grid = [(bn, 256 * w, w) for bn in (2, 4, 8, 16) for w in (1, 2, 4, 8)]
    else:  # the chunk scheme: 32 chunks a warp
        columns = 16 if family == "Rowwise8Linear" else getattr(op, "columns", 32)
        grid = [(bn, 32 * columns * w, w) for bn in (2, 4, 8, 16, 32) for w in (1, 2, 4)]
    out = []
    for bn, chunk, warps in grid:
        block_n = max(1, bn // 2) if mode == "glu" else bn
        units = -(-k // chunk)
        splits = [1] if mode != "partial" else split_candidates(n, block_n, units, 132)
        for s in splits:
            config = MatvecConfig(block_n, chunk, s, warps)
            if config not in out:
                out.append(config)
    if getattr(op, "pairs", False):  # grouped int4: each tiling again with the bf16-pair arithmetic
        out += [replace(c, packed=True) for c in out]
    return out


def configs(op, mode: str, sweep: bool):
    return sweep_grid(op, mode) if sweep else op.candidates("direct" if mode == "plain" else mode)


def launch(op, x, config, mode, out):
    act = 0 if mode == "glu" else -1
    op._matvec(x, out, config, act, mode == "partial")


def out_buffer(op, config, mode):
    if mode == "glu":
        return torch.empty(op.out_features // 2, dtype=torch.bfloat16, device="cuda")
    if mode == "partial":
        return torch.empty(config.split, op.out_features, dtype=torch.float32, device="cuda")
    return torch.empty(op.out_features, dtype=torch.bfloat16, device="cuda")


def compile_all(job) -> str:
    """Worker: launch every configuration of one (format, shape) once, so Triton compiles and caches it."""
    fmt, name, sweep = job
    n, k, mode = SHAPES[name]
    try:
        (op,), _ = build(fmt, n, k)
        x = torch.randn(k, device="cuda").bfloat16()
        bad = 0
        for config in configs(op, mode, sweep):
            if mode != "plain" or config.split == 1:
                try:
                    launch(op, x, config, mode, out_buffer(op, config, mode))
                except Exception:  # noqa: BLE001  (a configuration that does not compile is skipped)
                    bad += 1
        torch.cuda.synchronize()
        return f"{fmt} {name}: compiled ({bad} failed)"
    except Exception as e:  # noqa: BLE001
        return f"{fmt} {name}: {type(e).__name__}: {e}"


def time_graph(fn_list, reps: int = 7) -> float:
    """Median seconds per call of the callables in `fn_list`, captured once in a CUDA graph."""
    for fn in fn_list:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fn_list:
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / len(fn_list))
    return statistics.median(times)


def bench_linear(fmt: str, name: str, sweep: bool, bandwidth: float, tune: bool = False) -> dict:
    n, k, mode = SHAPES[name]
    ops, nbytes = build(fmt, n, k)
    copies = max(1, min(24, L2_BYTES // nbytes))
    ops = [ops[0]] + build(fmt, n, k, copies - 1)[0] if copies > 1 else ops
    x = torch.randn(k, device="cuda").bfloat16()
    results = []
    for config in configs(ops[0], mode, sweep):
        if mode == "plain" and config.split > 1:
            continue
        outs = [out_buffer(op, config, mode) for op in ops]
        try:
            calls = [lambda op=op, o=o, c=config: launch(op, x, c, mode, o) for op, o in zip(ops, outs)]
            seconds = time_graph(calls * max(1, 20 // len(ops)))
        except Exception as e:  # noqa: BLE001
            results.append({"config": str(config), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        results.append({"config": config.__dict__, "us": seconds * 1e6, "GBps": nbytes / seconds / 1e9})
    good = [r for r in results if "us" in r]
    best = min(good, key=lambda r: r["us"]) if good else None
    chosen = ops[0].candidates("direct" if mode == "plain" else mode)
    tuned = [r for r in good if r["config"] in [c.__dict__ for c in chosen]]
    if tune and tuned:
        from thin.runtime.kernels.common import MatvecConfig
        from thin.runtime.kernels.tuning import TuneCache, _tuned_mode, cache_key

        mode_name = "direct" if mode == "plain" else mode
        fastest = min(tuned, key=lambda r: r["us"])
        for in_turn in (False, True):  # timed past L2: the engine's choice over a model's weights in turn too
            TuneCache.get().store(cache_key(ops[0], _tuned_mode(mode_name, None, None, in_turn), chosen),
                                   MatvecConfig(**fastest["config"]))
    row = {"format": fmt, "shape": name, "n": n, "k": k, "mode": mode, "bytes": nbytes, "best": best,
           "best_of_default_candidates": min(tuned, key=lambda r: r["us"]) if tuned else None, "all": results}
    if best:
        row["fraction_of_copy_bw"] = best["GBps"] * 1e9 / bandwidth
    return row


def bench_finish(fmt: str, name: str) -> dict | None:
    """o or down (split-K partial sums) then the residual norm: the op's tuned partial sums and an
    add_rmsnorm launch, against each configuration whose last program finishes the norm itself
    (matvec_finish), timed alike (20 of each in a graph, weights cycled past L2)."""
    from thin.runtime.kernels.norm import Finish, add_rmsnorm

    n, k, _ = SHAPES[name]
    ops, nbytes = build(fmt, n, k)
    if not hasattr(ops[0], "matvec_finish"):
        return None
    copies = max(1, min(24, L2_BYTES // nbytes))
    ops = [ops[0]] + build(fmt, n, k, copies - 1)[0] if copies > 1 else ops
    x = torch.randn(k, device="cuda").bfloat16()
    res, normed, w = torch.randn(n, device="cuda").bfloat16(), torch.empty(n, device="cuda").bfloat16(), torch.ones(
        n, device="cuda")
    parts = torch.empty(8, n, device="cuda")
    config = ops[0].config("partial")
    finish = Finish(torch.zeros(1, dtype=torch.int32, device="cuda"), res, normed, None, None, (w, 1e-5))

    def separate(op):
        view = op.matvec(x, partials=parts)
        add_rmsnorm(res, normed, partials=view, norm=(w, 1e-5))

    repeat = max(1, 20 // len(ops))
    row = {"format": fmt, "shape": name, "separate": (str(config), time_graph([lambda o=o: separate(o)
                                                                               for o in ops] * repeat) * 1e6)}
    row["finishing"] = []
    for c in ops[0].finish_candidates(parts.shape[0]):
        for op in ops:
            op.finish_config = c
        try:
            us = time_graph([lambda o=o: o.matvec_finish(x, parts, finish) for o in ops] * repeat) * 1e6
        except Exception as e:  # noqa: BLE001
            us = f"{type(e).__name__}"
        row["finishing"].append((str(c), us))
    return row


def bench_cublas(name: str, bandwidth: float) -> dict:
    n, k, _ = SHAPES[name]
    copies = max(1, min(24, L2_BYTES // (2 * n * k)))
    ws = [(0.02 * torch.randn(n, k, device="cuda")).bfloat16() for _ in range(copies)]
    x = torch.randn(1, k, device="cuda").bfloat16()
    outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
    calls = [lambda w=w, o=o: torch.matmul(x, w.T, out=o) for w, o in zip(ws, outs)]
    seconds = time_graph(calls * max(1, 20 // len(ws)))
    return {"format": "bf16 (cuBLAS)", "shape": name, "us": seconds * 1e6, "GBps": 2 * n * k / seconds / 1e9,
            "fraction_of_copy_bw": 2 * n * k / seconds / bandwidth}


def bench_others() -> list[dict]:
    """The non-linear kernels of one llama-8b decode step."""
    from thin.runtime.kernels.attention import DecodeAttention
    from thin.runtime.kernels.norm import add_rmsnorm
    from thin.runtime.kernels.rope import rope_append
    from thin.runtime.kernels.sampling import Sampler
    from thin.runtime.paged_kv import PagedKVCache
    from thin.runtime.sampling import GenerationOptions

    dt, dev = torch.bfloat16, "cuda"
    res, out, w = torch.randn(4096, device=dev).to(dt), torch.empty(4096, device=dev, dtype=dt), torch.ones(4096,
                                                                                                          device=dev)
    parts = torch.randn(4, 4096, device=dev)
    cache = PagedKVCache(1, 8, 128, 1024, dt, dev)
    cache.reserve(1024)
    k_cache, v_cache = cache.layer(0)
    k_cache.normal_()
    v_cache.normal_()
    pos = torch.tensor([639], dtype=torch.int32, device=dev)
    qkv, q = torch.randn(6144, device=dev).to(dt), torch.empty(32, 128, device=dev, dtype=dt)
    cos = torch.randn(2048, 128, device=dev).to(dt)
    attention = DecodeAttention(32, 8, 128, 1024, dev)
    attn_out = torch.empty(4096, device=dev, dtype=dt)
    logits = torch.randn(32000, device=dev).to(dt)
    state = [torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(64, dtype=torch.long, device=dev),
             torch.zeros(32000, dtype=torch.int8, device=dev), torch.zeros(1, dtype=torch.int32, device=dev),
             torch.zeros(1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.long, device=dev)]
    greedy = Sampler(GenerationOptions(), 32000, None)
    rows = []
    for name, fn in [
        ("residual + rmsnorm (4 partials)", lambda: add_rmsnorm(res, out, partials=parts, norm=(w, 1e-5))),
        ("residual + rmsnorm (2 partials)", lambda: add_rmsnorm(res, out, partials=parts[:2], norm=(w, 1e-5))),
        ("residual + rmsnorm (1 partial)", lambda: add_rmsnorm(res, out, partials=parts[:1], norm=(w, 1e-5))),
        ("rope + kv append", lambda: rope_append(qkv, q, k_cache, v_cache, cache.block_table, pos, 32, 8, 128,
                                                 rope=(cos, cos))),
        ("attention, 640 positions", lambda: attention(q, k_cache, v_cache, cache.block_table, pos, attn_out,
                                                       scale=0.088)),
        ("greedy pick, 32000", lambda: (state[4].zero_(), greedy(logits, *state, advance_pos=False))),
    ]:
        rows.append({"kernel": name, "us": time_graph([fn] * 20) * 1e6})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="time a wide grid of configurations, not the tuner's")
    ap.add_argument("--json", default=None, help="write every timing here")
    ap.add_argument("--tune", action="store_true", help="store the best candidate per weight in the config cache")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 4))
    args = ap.parse_args()
    from thin.runtime.bench import copy_bandwidth

    formats, shapes = args.formats.split(","), args.shapes.split(",")
    started = time.perf_counter()
    jobs = [(f, s, args.sweep) for f in formats for s in shapes]
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
        for line in pool.map(compile_all, jobs):
            print(line, file=sys.stderr)
    print(f"compiled in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = [bench_cublas(s, bandwidth) for s in shapes]
    for f in formats:
        for s in shapes:
            rows.append(bench_linear(f, s, args.sweep, bandwidth, args.tune))
    others = bench_others()
    finishing = [r for r in (bench_finish(f, s) for f in formats for s in shapes if s in ("o", "down")) if r]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"copy_bandwidth": bandwidth, "linear": rows, "others": others, "finishing": finishing}, fh,
                      indent=1)
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s ({torch.cuda.get_device_name()})")
    print("| format | shape | best config | us | GB/s | % of copy bw | tuner's best us |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "best" not in r:
            print(f"| {r['format']} | {r['shape']} | - | {r['us']:.1f} | {r['GBps']:.0f} | "
                  f"{100 * r['fraction_of_copy_bw']:.0f}% | |")
        elif r["best"]:
            b, d = r["best"], r["best_of_default_candidates"]
            c = b["config"]
            tiles = f"{c['block_n']}/{c['chunk']}/s{c['split']}/w{c['num_warps']}"
            if c["packed"]:  # and the float path's best, for comparison
                floats = [x["us"] for x in r["all"] if "us" in x and not x["config"]["packed"]]
                ahead = {1: ", scales 1 step ahead", 2: ", scales 1 and words 2 steps ahead"}.get(c.get("ahead"), "")
                tiles += f"/bf16 pairs{ahead} (float path {min(floats, default=float('nan')):.1f} us)"
            elif r["format"] == "fp8_e4m3":  # the best of each way of loading
                kinds = {"in-step": lambda x: not x["ahead"] and not x["stages"], "registers": lambda x: x["ahead"],
                         "pipelined": lambda x: x["stages"]}
                best_of = {k: min((x["us"] for x in r["all"] if "us" in x and f(x["config"])), default=float("nan"))
                           for k, f in kinds.items()}
                tiles += f"/{c['ahead']} steps ahead" if c["ahead"] else f"/{c['stages']} stages" if c["stages"] else ""
                tiles += " (" + ", ".join(f"{k} {us:.1f} us" for k, us in best_of.items()) + ")"
            print(f"| {r['format']} | {r['shape']} | {tiles} | "
                  f"{b['us']:.1f} | {b['GBps']:.0f} | {100 * r['fraction_of_copy_bw']:.0f}% | "
                  f"{d['us'] if d else float('nan'):.1f} |")
        else:
            print(f"| {r['format']} | {r['shape']} | failed | | | | |")
    for o in others:
        print(f"| {o['kernel']} | | | {o['us']:.1f} | | | |")
    if finishing:
        print("\n| format | shape | partial sums + add_rmsnorm launch | matvec finishing the norm: config, us |")
        print("| --- | --- | --- | --- |")
    for r in finishing:
        config, us = r["separate"]
        each = ", ".join(f"{c}: {u:.1f}" if isinstance(u, float) else f"{c}: {u}" for c, u in r["finishing"])
        print(f"| {r['format']} | {r['shape']} | {config}: {us:.1f} | {each} |")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
