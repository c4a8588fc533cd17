"""The decode matvecs of llama-8b's shapes under Nsight Compute: the launch configuration the engine's tuner picks
for each (format, shape), profiled as one launch from DRAM, with occupancy, waves and stall reasons.

    python3 examples/benchmarks/profile_matvecs.py [--formats int4,fp8_e4m3] [--shapes qkv,o,gate_up,down] [--out DIR]

Three steps, each a process of its own: (1) build the weights (random, encoded on the GPU), compile every launch
candidate on host threads and let the tuner choose one per weight, over copies of it in turn, as the engine's warm-up
does (the choices land in the cache of launch configurations, THIN_CACHE_DIR or ~/.cache/thin); (2) the same script
under `ncu --profile-from-start off --cache-control all --clock-control none`, which launches each chosen
configuration on two copies between cudaProfilerStart and Stop, so only those launches are profiled, each with the
caches flushed; (3) read ncu's CSV and print one row per profiled matvec. o and down run as plain split-K partial
sums here (in the decode step their last program also finishes the residual norm). Needs `ncu` on PATH and a GPU
whose counters it can read.
"""

from __future__ import annotations

import argparse
import collections
import csv
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SECTIONS = ["SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats"]
STALLS = ["long_scoreboard", "barrier", "mio_throttle", "lg_throttle", "wait", "math_pipe_throttle", "not_selected",
          "short_scoreboard", "no_instruction", "drain", "membar", "branch_resolving", "imc_miss"]
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
COLUMNS = ["Duration", "DRAM Throughput", "Grid Size", "Waves Per SM", "Achieved Occupancy", "Theoretical Occupancy",
           "Registers Per Thread", "No Eligible"]


def chosen(formats: list[str], shapes: list[str], tune: bool):
    """[(format, shape, mode, ops, config)]: each weight with copies of it (past L2), its tuned configuration."""
    from bench_kernels import SHAPES, build

    from thin.runtime.kernels.tuning import choose, precompile

    built = []
    for fmt in formats:
        for name in shapes:
            n, k, mode = SHAPES[name]
            ops, nbytes = build(fmt, n, k, 1)
            ops += build(fmt, n, k, max(1, min(12, (256 << 20) // nbytes)) - 1)[0]
            built.append((fmt, name, mode, "direct" if mode == "plain" else mode, ops))
    if tune:
        precompile([(op, m) for *_, m, ops in built for op in ops])
    return [(fmt, name, mode, ops, choose(ops[0], m, peers=ops[1:])) for fmt, name, mode, m, ops in built]


def run_step(formats: list[str], shapes: list[str], tune: bool) -> None:
    """Step 1 (tune) or 2 (the profiled launches)."""
    import torch
    from bench_kernels import SHAPES, launch, out_buffer

    plan = chosen(formats, shapes, tune)
    for fmt, name, _, _, config in plan:
        print(f"{fmt} {name}: {config}", flush=True)
    if tune:
        return
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _fmt, name, mode, ops, config in plan:
        x = torch.randn(SHAPES[name][1], device="cuda").bfloat16()
        out = out_buffer(ops[0], config, mode)
        for op in ops[:2]:
            launch(op, x, config, mode, out)
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def table(csv_path: Path, names: list[str]) -> None:
    """Step 3: one row per profiled matvec kernel, named in launch order."""
    with open(csv_path) as fh:  # ncu's CSV, the profiled program's own output lines among it
        rows = [r for r in csv.reader(fh) if len(r) > 10]
    header, rows = rows[0], rows[1:]
    col = {h: i for i, h in enumerate(header)}
    kernels: dict = collections.OrderedDict()
    for r in rows:
        if "matvec" in r[col["Kernel Name"]]:
            value = f"{r[col['Metric Value']]} {r[col['Metric Unit']]}"
            kernels.setdefault(r[col["ID"]], {})[r[col["Metric Name"]]] = value
    print("| matvec | " + " | ".join(COLUMNS) + " | top stalls (cycles an issue) |")
    print("| --- |" + " ---: |" * len(COLUMNS) + " --- |")
    for i, metrics in enumerate(kernels.values()):
        stalls = sorted(((float(metrics.get(STALL_METRIC.format(s), "0").split()[0].replace(",", "") or 0), s)
                         for s in STALLS), reverse=True)[:3]
        name = names[i // 2] if i // 2 < len(names) else "?"
        print(f"| {name} | " + " | ".join(metrics.get(c, "") for c in COLUMNS) + " | "
              + ", ".join(f"{s} {v:.1f}" for v, s in stalls if v >= 0.05) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="int4,fp8_e4m3")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--out", default=".", help="folder for ncu's CSV")
    ap.add_argument("--step", choices=["tune", "launch"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    formats, shapes = args.formats.split(","), args.shapes.split(",")
    if args.step:
        run_step(formats, shapes, tune=args.step == "tune")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("profile_matvecs needs a CUDA GPU and ncu", file=sys.stderr)
        return 2
    me = [sys.executable, __file__, "--formats", args.formats, "--shapes", args.shapes]
    subprocess.run([*me, "--step", "tune"], check=True)
    out = Path(args.out) / "profile_matvecs.csv"
    metrics = ",".join(STALL_METRIC.format(s) for s in STALLS)
    ncu = ["ncu", "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "all", "--csv",
           "--page", "details", "--metrics", metrics] + [a for s in SECTIONS for a in ("--section", s)]
    with open(out, "w") as fh:
        subprocess.run([*ncu, *me, "--step", "launch"], check=True, stdout=fh)
    table(out, [f"{f} {s}" for f in formats for s in shapes])
    return 0


if __name__ == "__main__":
    sys.exit(main())
