"""Decode with and without programmatic dependent launch (PDL), in one process on one artifact.

    python examples/benchmarks/bench_pdl.py MODEL.thin [--rounds 3] [--runs 3] [--gen 128] [--prompt-len 512]

Loads the artifact once on the GPU, then runs the same decode engine each way (DecodeEngine._dependent:
plainly, the step's matvecs, norms, RoPE and attention all launched as programmatic dependents,
runtime/kernels/dependent.py, and with --sections only the launches of the named step sections; a captured
step per way),
checks that both give the same greedy tokens (graphed), counts the programmatic edges in a captured step of
each (cuGraphGetEdges: whether CUDA-graph capture kept the launches' PDL attribute; 0 with PDL means it did
not and the option can do nothing), then measures both with runtime/bench.run, `thin-exec bench`'s own
measurement, taking turns for --rounds rounds (bench_attention_step.py's harness). Prints one row per round
and the median over rounds with the change against plain launches.

Compare ways within one run only: every way here reads 1-4% below a fresh process running one way (the
engine's default is chosen from fresh processes, BENCHMARKS.md Round 11).
"""

from __future__ import annotations

import ctypes
import sys


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
    from bench_attention_step import arguments, compare, load_engine  # this folder: the A/B harness

    def sections(ap):
        ap.add_argument("--sections", nargs="*", help="more ways: comma-separated step sections (the engine's "
                        "profiler names, e.g. 'qkv,o') whose launches alone are programmatic dependents")

    args = arguments(__doc__, sections)
    model, engine, started = load_engine(args)
    import torch

    chosen = engine._dependent
    print(f"the engine's default: {sorted(chosen) if isinstance(chosen, frozenset) else chosen}", file=sys.stderr)
    ways = {"plain": False, "pdl": True}  # the same launches, only their attribute differs
    for subset in args.sections or ():  # only the launches of these step sections as dependents
        ways[subset] = frozenset(subset.split(","))

    def use(on):
        engine._dependent = on

    prompt = torch.randint(0, model.ir.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    for v, on in ways.items():
        use(on)
        print(f"captured step, {v}: {programmatic_edges(engine, prompt)}", file=sys.stderr)
    compare(args, model, engine, ways, use, "launches", started, strict=True)
    use(chosen)


if __name__ == "__main__":
    main()
