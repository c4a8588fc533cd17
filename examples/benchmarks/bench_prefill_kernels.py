"""The grouped-int, mxfp4 or q1 prefill matmul at llama-8b's shapes, on one GPU: every candidate the op times.

    python examples/benchmarks/bench_prefill_kernels.py [--tokens 16,128,512,2048] [--format int4]
        [--group 128] [--asymmetric 0] [--all]

For each projection shape (qkv, o, gate_up, down, lm_head) and prompt length T it times every
prefill tiling the op's matmul_candidates offers (runtime/kernels/grouped_int.py, mxfp4.py, q1.py: the plain
kernel, the pipelined "tiled" kernel and, for symmetric int4 under bf16, its "pairs" twin) with the
tuner's own measurement (tuning.median_ms_or_inf; inf: did not compile on this GPU), next to cuBLAS
on the same product in bf16 (torch.matmul against a dense bf16 weight of the same shape). Prints
microseconds, TFLOP/s (2 T N K) and the fastest tiling; --all also lists every candidate.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (32000, 4096)}


def make_op(fmt: str, shape, params):
    from thin.ir import Encoding, Tensor, formats
    from thin.runtime.kernels import grouped_int, mxfp4, q1

    w = torch.randn(*shape, device="cuda")
    raw = formats.encode(fmt, w, params)
    record = Tensor("layers.0.w", "ffn.down", 0, tuple(shape), Encoding(fmt, params), "bf16")
    family = {"mxfp4": mxfp4, "q1": q1}.get(fmt, grouped_int)
    return family.make(record, raw, None, torch.device("cuda"), torch.bfloat16)


def label(config) -> str:
    split = f" split {config.split}" if config.split > 1 else ""
    return (f"{config.kernel} {config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} "
            f"s{config.stages}{split}")


def bench_shape(name: str, shape, tokens: list[int], fmt: str, params, show_all: bool) -> None:
    from thin.runtime.kernels.tuning import compile_launches, median_ms_or_inf

    op = make_op(fmt, shape, params)
    n, k = shape
    dense = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    for t in tokens:
        x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
        candidates = op.matmul_candidates(t, k)
        launches = {c: partial(op._matmul, x, config=c) for c in candidates}
        compile_launches([(op.device, f) for f in launches.values()], report=False)
        times = {c: 1e3 * median_ms_or_inf(f) for c, f in launches.items()}
        cublas = 1e3 * median_ms_or_inf(partial(torch.matmul, x, dense.T))
        best = min(times, key=times.get)
        plain = times[candidates[0]]
        flop = 2 * t * n * k
        row = (f"| {name} {n}x{k} | {t} | {plain:.0f} | {times[best]:.0f} ({flop / times[best] / 1e6:.0f}) "
               f"| {label(best)} | {cublas:.0f} ({flop / cublas / 1e6:.0f}) | {plain / times[best]:.1f}x |")
        if show_all:
            row += " " + ", ".join(f"{label(c)} {v:.0f}" for c, v in times.items()) + " |"
        print(row, flush=True)
        del x
    del op, dense
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,128,512,2048")
    ap.add_argument("--format", default="int4", choices=["int3", "int4", "int5", "int6", "mxfp4", "q1"])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--asymmetric", type=int, default=0, choices=[0, 1])
    ap.add_argument("--all", action="store_true", help="list every candidate's time too")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_prefill_kernels: needs a CUDA GPU", file=sys.stderr)
        return 1
    from thin.ir import formats

    given = {"mxfp4": {}, "q1": {"group_size": args.group}}.get(
        args.format, {"group_size": args.group, "asymmetric": args.asymmetric})
    params = formats.get(args.format).normalize(given)
    tokens = [int(t) for t in args.tokens.split(",")]
    what = args.format if args.format == "mxfp4" else f"{args.format} g{args.group}{' asymmetric' * args.asymmetric}"
    print(f"{what} prefill matmul on "
          f"{torch.cuda.get_device_name()}: us per call (TFLOP/s)")
    print("| shape | T | plain kernel | best | best tiling | cuBLAS bf16 | speedup over plain |"
          + (" all candidates |" if args.all else ""))
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: |" + (" --- |" if args.all else ""))
    for name, shape in SHAPES.items():
        bench_shape(name, shape, tokens, args.format, params, args.all)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
