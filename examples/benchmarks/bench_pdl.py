"""Decode with and without programmatic dependent launch (PDL), in one process on one artifact.

    python examples/benchmarks/bench_pdl.py MODEL.thin [--rounds 3] [--runs 3] [--gen 128] [--prompt-len 512]

Loads the artifact once on the GPU, then runs the same decode engine each way (DecodeEngine._dependent:
plainly, the step's matvecs, norms, RoPE and attention all launched as programmatic dependents,
runtime/kernels/dependent.py, and with --sections only the launches of the named step sections; a captured
step per way),
checks that both give the same greedy tokens (graphed), counts the programmatic edges in a captured step of
each (cuGraphGetEdges: whether CUDA-graph capture kept the launches' PDL attribute; 0 with PDL means it did
not and the option can do nothing), then measures both with runtime/bench.run, `thin-exec bench`'s own
measurement, taking turns for --rounds rounds. Prints one row per round and the median over rounds with
the change against plain launches.

Compare ways within one run only: every way here reads 1-4% below a fresh process running one way (the
engine's default is chosen from fresh processes, BENCHMARKS.md Round 11).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time


def programmatic_edges(engine, prompt) -> str:
    """'P of E edges programmatic' in one decode step captured from `engine` (or why it could not tell)."""
    import torch

    from thin.runtime.sampling import GenerationOptions

    try:
        cache = engine.new_cache(len(prompt) + 8)
        sampler = engine.sampler(GenerationOptions(max_new_tokens=4, stop_token_ids=()))
        engine.start(cache, prompt, GenerationOptions(max_new_tokens=4, stop_token_ids=()))
        engine.prefill(cache, torch.tensor(prompt), sampler)
        engine.decode_one_token(cache, sampler)  # compiled and chosen before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):  # a pool of its own: this graph is never replayed
            engine.decode_one_token(cache, sampler)
        handle = ctypes.c_void_p(graph.raw_cuda_graph())
        cuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        cuda.cuDriverGetVersion(ctypes.byref(version))
        # The edges with their data: cuGraphGetEdges_v2 from CUDA 12.3; CUDA 13's cuGraphGetEdges takes the same.
        get = getattr(cuda, "cuGraphGetEdges_v2", None) or (cuda.cuGraphGetEdges if version.value >= 13000 else None)
        if get is None:
            return f"the driver ({version.value}) lists no edge data (CUDA 12.3 or later has it)"
        count = ctypes.c_size_t(0)
        status = get(handle, None, None, None, ctypes.byref(count))
        if status != 0:
            return f"cuGraphGetEdges failed ({status})"
        n = count.value
        nodes_from, nodes_to = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
        data = (ctypes.c_uint8 * (8 * n))()  # CUgraphEdgeData: from_port, to_port, type, 5 reserved
        status = get(handle, nodes_from, nodes_to, data, ctypes.byref(count))
        if status != 0:
            return f"cuGraphGetEdges failed ({status})"
        programmatic = sum(1 for i in range(n) if data[8 * i + 2] != 0)  # type 1: CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        return f"{programmatic} of {n} edges programmatic"
    except Exception as e:  # a diagnostic only: the timing below does not depend on it
        return f"could not inspect the captured graph: {type(e).__name__}: {e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a compiled .thin artifact")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3, help="timed runs a measurement (its median)")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--sections", nargs="*", help="more ways: comma-separated step sections (the engine's "
                    "profiler names, e.g. 'qkv,o') whose launches alone are programmatic dependents")
    args = ap.parse_args()

    import torch

    from thin.runtime import bench, load
    from thin.runtime.engine import generate as engine_generate
    from thin.runtime.sampling import GenerationOptions

    if not torch.cuda.is_available():
        sys.exit("bench_pdl measures the CUDA decode engine: no CUDA device here")
    started = time.perf_counter()
    model = load(args.model, device="cuda", context=args.prompt_len + args.gen)
    if model.engine is None:
        sys.exit("the decode engine does not take this model")
    print(f"loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    engine = model.engine
    chosen = engine._dependent
    print(f"the engine's default: {sorted(chosen) if isinstance(chosen, frozenset) else chosen}", file=sys.stderr)
    ways = {"plain": False, "pdl": True}  # the same launches, only their attribute differs
    for subset in args.sections or ():  # only the launches of these step sections as dependents
        ways[subset] = frozenset(subset.split(","))

    prompt = torch.randint(0, model.ir.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    options = GenerationOptions(max_new_tokens=32, stop_token_ids=())
    tokens = {}
    for v, on in ways.items():
        engine._dependent = on
        tokens[v] = list(engine_generate(engine, prompt, options))
    if any(t != tokens["plain"] for t in tokens.values()):
        sys.exit("greedy tokens with programmatic dependent launch differ from those without")
    print("check: greedy tokens (32, graphed) with pdl == without", file=sys.stderr)
    for v, on in ways.items():
        engine._dependent = on
        print(f"captured step, {v}: {programmatic_edges(engine, prompt)}", file=sys.stderr)

    rows = []
    for r in range(args.rounds):
        for v, on in ways.items():
            engine._dependent = on
            result = bench.run(model, prompt_len=args.prompt_len, new_tokens=args.gen, runs=args.runs)
            rows.append((r, v, result))
            print(f"[{time.perf_counter() - started:6.1f} s] round {r} {v}: {result.decode_tokens_per_second:.1f} "
                  f"tok/s", file=sys.stderr, flush=True)
    engine._dependent = chosen

    first = rows[0][2]
    print(f"\n{first.model} ({', '.join(f'{k} x{n}' for k, n in sorted(first.formats.items()))}) on {first.device}, "
          f"{first.bytes_per_token / 1e9:.3f} GB read per token, {args.prompt_len}-token prompt, {args.gen} new "
          f"tokens, median of {args.runs} per measurement")
    print("| round | launches | decode tok/s (min-max) | step ms | copy GB/s | of roofline |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for r, v, res in rows:
        print(f"| {r} | {v} | {res.decode_tokens_per_second:.1f} ({res.decode_min:.1f}-{res.decode_max:.1f}) | "
              f"{1e3 / res.decode_tokens_per_second:.3f} | {res.bandwidth_bytes_per_second / 1e9:.0f} | "
              f"{100 * res.roofline_fraction:.1f}% |")
    bandwidth = statistics.median(res.bandwidth_bytes_per_second for _, _, res in rows)
    roofline = bandwidth / first.bytes_per_token
    medians = {v: statistics.median(res.decode_tokens_per_second for _, w, res in rows if w == v) for v in ways}
    print(f"\nmedian over {args.rounds} rounds (roofline {roofline:.0f} tok/s at the median copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s)")
    print("| launches | decode tok/s | step ms | of roofline | vs plain |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for v in ways:
        print(f"| {v} | {medians[v]:.1f} | {1e3 / medians[v]:.3f} | {100 * medians[v] / roofline:.1f}% | "
              f"{100 * (medians[v] / medians['plain'] - 1):+.1f}% |")


if __name__ == "__main__":
    main()
