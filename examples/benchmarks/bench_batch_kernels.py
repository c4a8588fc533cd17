"""The int4 linear kernels of a batched decode step at llama-8b's shapes, on one GPU.

    python examples/benchmarks/bench_batch_kernels.py [--rows 2,4,16,64] [--group 128]

For each projection shape (qkv, o, gate_up, down, lm_head) and number of rows (sequences in the
step) it times every candidate the batch engine chooses among (runtime/batch_engine.py): the few-rows
kernel in each scheme, band width and split offered at that row count (runtime/kernels/grouped_int_batch.py:
candidates(op, rows)) and the op's own prefill matmul, next to the matrix-vector product of one row. Times
are the batch engine's own measurement (median of 5 x 5 launches, microseconds; inf: the candidate did not
compile on this GPU); GB/s counts the packed weight bytes read once.
"""

from __future__ import annotations

import argparse
import sys

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (32000, 4096)}


def make_op(shape, group: int):
    from thin.ir import Encoding, Tensor, formats
    from thin.runtime.kernels import grouped_int

    params = formats.get("int4").normalize({"group_size": group})
    w = torch.randn(*shape, device="cuda")
    raw = formats.encode("int4", w, params)
    record = Tensor("layers.0.w", "ffn.down", 0, tuple(shape), Encoding("int4", params), "bf16")
    op = grouped_int.make(record, raw, None, torch.device("cuda"), torch.bfloat16)
    op.implementation = "triton"
    return op, raw.numel() * raw.element_size()


def bench_shape(name: str, shape, rows: list[int], group: int) -> None:
    from thin.runtime.batch_engine import _time, _time_or_inf
    from thin.runtime.kernels import grouped_int_batch

    op, nbytes = make_op(shape, group)
    one = torch.randn(1, shape[1], device="cuda").to(torch.bfloat16)
    t1 = _time(lambda: op(one))
    for m in rows:
        x = torch.randn(m, shape[1], device="cuda").to(torch.bfloat16)
        times = {"/".join(map(str, c)): _time_or_inf(lambda c=c, x=x: grouped_int_batch.rows_matmul(op, x, c))
                 for c in grouped_int_batch.candidates(op, m)}
        best = min(times, key=times.get)
        tm = _time(lambda x=x: op(x))
        detail = ", ".join(f"{k} {v:.1f}" for k, v in times.items())
        print(f"| {name} {shape[0]}x{shape[1]} | {m} | {t1:.1f} ({nbytes / t1 / 1e3:.0f}) | "
              f"{times[best]:.1f} {best} ({nbytes / times[best] / 1e3:.0f}) | {tm:.1f} | {detail} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="2,4,16,64")
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_batch_kernels: needs a CUDA GPU", file=sys.stderr)
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    print(f"int4 g{args.group} on {torch.cuda.get_device_name()}: us per call (GB/s of the packed weight)")
    print("| shape | rows | matvec, 1 row | best few-rows kernel (scheme/band/splits) | prefill matmul "
          "| all candidates |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, shape in SHAPES.items():
        bench_shape(name, shape, rows, args.group)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
