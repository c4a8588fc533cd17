"""Decode speed of elastic FFN levels on the GPU: one artifact, every level, against keep 1.0.

    python examples/benchmarks/bench_ffn_levels.py --workdir /tmp/thinbench --out DIR \\
        [--shape llama-8b] [--format int4] [--levels 0.875,0.75,0.5] [--calib-tokens 2048] \\
        [--per-layer] [--baseline] [--prompt-len 512 --gen 128 --runs 5] [--compile-only] [--profile]

1. writes the random-weight checkpoint (examples/synth_checkpoint.py) unless it is there;
2. compiles it once with `--quant FORMAT --ffn-levels ...` on the GPU (calibration, the channel order,
   the levels' corrections and certificates run there; the format's reference encoder on the GPU, as
   bench_gpu.py does). Levels are the same share of every layer unless --per-layer (on random weights
   the per-layer sensitivities are noise); with --baseline also the plain `--quant FORMAT` artifact;
3. loads the artifact once and runs `thin-exec bench`'s measurement (runtime/bench.py: CUDA graph,
   greedy, checks) at each level in turn, switching levels in place (no weight copy, one captured
   graph per level); with --profile, one process per level (a graph captured after the profiler has run
   in a process replays slower);
4. prints one markdown table: per level the weight bytes a token reads, decode tok/s, the speed-up
   over keep 1.0 of the same artifact and the share of the bandwidth roofline; with --profile a second
   one: per level the whole captured step's replay and the device time of its gate/up and down
   sections (bench --profile, runtime/step_profile.py: summed over the layers, with the idle gaps
   before their launches) and the launch configuration the first layer's gate/up, down and o run with at that
   level (each level's prefix has its own, KernelLinear.config; down's and o's finishing configuration where
   their matvec also runs the residual norm, marked so), then every section and every kernel of the step
   side by side per level (launches a step, us, idle gap us before them), and a layer's launches in order
   (mean us and gap before each over the layers: which boundary the gaps sit at). JSON and logs go to --out
   (compile-*.log ends with the seconds each compile stage started at; bench-*.log holds the warm-up's
   choices, the "thin.runtime:" lines).
Steps whose outputs exist are skipped, so `--compile-only` and then the same command without it split
the work into two shorter runs on one machine. The certificate's numbers on random weights say nothing
about quality (tiny-coder's table does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def compile_one(src: str, dst: str, quant: str, levels: str | None, calib_tokens: int, per_layer: bool) -> None:
    """(in a child process) compile `src` into `dst` on the GPU, with the formats' encoder there too."""
    import torch

    from thin.compiler import compile_model
    from thin.ir.formats.quantized import QuantizedFormat

    encode = QuantizedFormat.encode

    def on_gpu(self, tensor, params=()):
        return encode(self, tensor.to("cuda"), params).cpu()

    QuantizedFormat.encode = on_gpu
    # The compile's certification runs the projections before fusion (q, k, v, gate, up apart): each takes
    # its default launch instead of timing every candidate configuration (minutes of kernel compiles
    # here; the same products up to summation order; the decode engine later tunes the fused shapes it runs).
    from thin.runtime.kernels import tuning

    tuning.small_weight = lambda op: True
    options = {"quant": quant, **({"group_size": 128} if quant == "int4" else {})}
    if levels:
        options.update(ffn_levels=levels, ffn_per_layer=per_layer, calib_tokens=calib_tokens, device="cuda")
    import shutil
    import tempfile

    from thin.passes.scratch import default_memory_limit

    # Intermediate statistics past the scratch's memory share spill to the temp folder: where and how much
    # room, so a failed spill can be told from a full disk at a glance.
    scratch = tempfile.gettempdir()
    print(f"scratch {scratch}: {shutil.disk_usage(scratch).free / 2**30:.1f} GiB free, up to "
          f"{default_memory_limit() / 2**30:.1f} GiB held in memory; output folder "
          f"{shutil.disk_usage(os.path.dirname(os.path.abspath(dst))).free / 2**30:.1f} GiB free",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    stages = {}

    def progress(stage, done, total):
        if stage not in stages:  # when each stage started, seconds into the compile
            stages[stage] = round(time.perf_counter() - started, 1)
            print(f"[{stages[stage]:7.1f} s] {stage}", file=sys.stderr, flush=True)

    compile_model(src, dst, progress=progress, **options)
    print(json.dumps({"compiled": dst, "seconds": time.perf_counter() - started, "stages": stages,
                      "gpu": torch.cuda.get_device_name()}))


def bench_levels(path: str, keeps: list[float], prompt_len: int, gen: int, runs: int, profile: bool) -> None:
    """(in a child process) load `path` once and measure decode at each level; one JSON line per level."""
    import logging

    from thin.runtime import bench, load

    # The warm-up's choices (each kind of weight's launch configuration, and whether o's and each level's down
    # matvec finish the residual norm: "residual norm in the matvec's last program" lines) go to the log.
    logging.basicConfig(stream=sys.stderr, format="thin.runtime: %(message)s")
    logging.getLogger("thin.runtime").setLevel(logging.INFO)
    model = load(path, device="cuda", context=prompt_len + gen)
    certificate = model.artifact.section("certificate") or {}
    levels = {lv["keep"]: lv for lv in (certificate.get("ffn_levels") or {}).get("levels", [])}
    for keep in keeps:
        if keep != 1.0 or levels:
            model.set_ffn_keep(keep)
        result = bench.run(model, prompt_len=prompt_len, new_tokens=gen, runs=runs, profile=profile).to_dict()
        level = levels.get(keep)
        result.update(ffn_keep=keep, channels=level["channels"] if level else None,
                      certificate_kld=level["measured"]["mean_kld"] if level else None, configs=ffn_configs(model))
        print(json.dumps(result), flush=True)


def ffn_configs(model) -> dict:
    """The launch configurations the first layer's gate/up, down and o matvecs run with at the current level:
    down's and o's finishing configuration where their matvec also runs the residual norm (then "finish":
    True), else their split-K partial sums' (an add_rmsnorm launch follows)."""
    from dataclasses import asdict

    engine, layer = model.engine, model.executor.layers[0]
    mlp = layer.ffn
    cols = None if mlp.width in (None, mlp.down.in_features) else mlp.width
    configs = {}
    for name, op, mode, rows, prefix in (("gate_up", mlp.up[0], "glu" if len(mlp.up) == 1 else "direct", mlp.width,
                                          None), ("down", mlp.down, "partial", None, cols),
                                         ("o", layer.attention.o, "partial", None, None)):
        if not hasattr(op, "config"):
            continue
        finishing = mode == "partial" and ((id(op), prefix) in engine._finishing_prefixes if prefix is not None
                                           else id(op) in engine._finishing)
        config = (op.finish_config if prefix is None else op.finish_prefixes[prefix]) if finishing else \
            op.config(mode, rows, prefix)
        configs[name] = {**asdict(config), "finish": finishing}
    return configs


def log_run(cmd: list[str], log: Path, env=None) -> subprocess.CompletedProcess:
    started = time.perf_counter()
    with open(log, "w") as fh:
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=fh, text=True, env=env)
        fh.write(f"\n--- stdout ---\n{result.stdout}\n--- exit {result.returncode} in "
                 f"{time.perf_counter() - started:.1f} s ---\n")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/thinbench"))
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--format", default="int4")
    ap.add_argument("--levels", default="0.875,0.75,0.5")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--per-layer", action="store_true", help="per-layer channel counts (default: uniform)")
    ap.add_argument("--baseline", action="store_true", help="also bench the same format compiled without levels")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--compile-only", action="store_true", help="stop after the checkpoint and the compiles")
    ap.add_argument("--profile", action="store_true",
                    help="also break down each level's captured decode step (bench --profile)")
    ap.add_argument("--compile-one", nargs=4, metavar=("SRC", "DST", "QUANT", "LEVELS"), help=argparse.SUPPRESS)
    ap.add_argument("--bench-levels", nargs=2, metavar=("PATH", "KEEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compile_one:
        src, dst, quant, levels = args.compile_one
        compile_one(src, dst, quant, None if levels == "-" else levels, args.calib_tokens, args.per_layer)
        return
    if args.bench_levels:
        path, keeps = args.bench_levels
        bench_levels(path, [float(k) for k in keeps.split(",")], args.prompt_len, args.gen, args.runs, args.profile)
        return

    started = time.perf_counter()
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.shape + (f"-{args.layers}l" if args.layers else "")
    src = args.workdir / name
    keeps = [1.0] + [float(Fraction(k)) for k in args.levels.split(",")]

    def stage(label: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {label}", file=sys.stderr, flush=True)

    if not (src / "config.json").exists():
        cmd = [sys.executable, str(REPO / "examples" / "synth_checkpoint.py"), "--shape", args.shape, "--out", str(src)]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    stage("checkpoint")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 8) // 2))}
    artifacts = {"levels": (args.workdir / f"{name}-{args.format}-levels.thin", args.levels)}
    if args.baseline:
        artifacts["plain"] = (args.workdir / f"{name}-{args.format}.thin", "-")
    flags = ["--calib-tokens", str(args.calib_tokens)] + (["--per-layer"] if args.per_layer else [])
    compiled = {}
    for label, (dst, levels) in artifacts.items():
        if not dst.exists():
            run = log_run([sys.executable, __file__, "--compile-one", str(src), str(dst), args.format, levels, *flags],
                          args.out / f"compile-{label}.log", env)
            if run.returncode != 0:
                raise SystemExit(f"compile {label} failed: see {args.out}/compile-{label}.log")
            compiled[label] = json.loads(run.stdout.strip().splitlines()[-1])
        stage(f"compile {label}")
    if args.compile_only:
        print(json.dumps({"compiled": compiled}))
        return
    results = {}
    for label, (dst, _) in artifacts.items():
        measure = keeps if label == "levels" else [1.0]
        # With --profile each level is measured in a process of its own: once torch.profiler has run in a
        # process, a CUDA graph captured there afterwards replays with ~0.4 us more before each of its
        # launches (measured on the H200: 80-110 us a llama-8b step), which would slow every level after
        # the first. Without it, one process switches levels in place.
        batches = [[keep] for keep in measure] if args.profile else [measure]
        results[label] = []
        for batch in batches:
            cmd = [sys.executable, __file__, "--bench-levels", str(dst), ",".join(map(str, batch)), "--prompt-len",
                   str(args.prompt_len), "--gen", str(args.gen), "--runs", str(args.runs)]
            cmd += ["--profile"] if args.profile else []
            log = args.out / (f"bench-{label}.log" if len(batches) == 1 else f"bench-{label}-{batch[0]:g}.log")
            run = log_run(cmd, log, env)
            results[label] += [json.loads(ln) for ln in run.stdout.splitlines() if ln.startswith("{")]
            if run.returncode != 0:
                print(f"bench {label} failed ({run.returncode}): see {log}", file=sys.stderr)
        stage(f"bench {label}")
    (args.out / "bench_ffn_levels.json").write_text(json.dumps({"shape": name, "format": args.format,
                                                                "compiled": compiled, "results": results}, indent=1))
    print_table(name, args, results)


def print_table(name: str, args, results: dict) -> None:
    rows = results.get("levels", [])
    full = next((r["decode_tokens_per_second"] for r in rows if r["ffn_keep"] == 1.0), None)
    bw = next((r["bandwidth_bytes_per_second"] for r in rows), 0)
    print(f"\n{name}, {args.format}, {args.prompt_len}-token prompt, {args.gen} new tokens, median of {args.runs}; "
          f"copy bandwidth {bw / 1e9:.0f} GB/s; levels {'per layer' if args.per_layer else 'uniform'}")
    print("| artifact | FFN keep | channels per layer | GB read/token | decode tok/s (min-max) | vs keep 1.0 | "
          "of roofline |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for label, runs in results.items():
        for r in runs:
            channels = r.get("channels")
            shown = "-" if not channels else (str(channels[0]) if len(set(channels)) == 1 else
                                              f"{min(channels)}-{max(channels)}")
            rate = r["decode_tokens_per_second"]
            print(f"| {label} | {r['ffn_keep']:g} | {shown} | {r['bytes_per_token'] / 1e9:.2f} | {rate:.1f} "
                  f"({r['decode_min']:.1f}-{r['decode_max']:.1f}) | {rate / full if full else float('nan'):.2f}x | "
                  f"{100 * r['roofline_fraction']:.1f}% |")
    if not args.profile:
        return
    print("\n| artifact | FFN keep | replay us (gaps) | gate/up + act us/step (gaps) | down us/step (gaps) | "
          "gate/up config | down config | o config |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- | --- |")
    nan = {"us": float("nan"), "gap_us": float("nan")}
    for label, runs in results.items():
        for r in runs:
            sections = {s["section"]: s for s in r.get("sections", [])}
            step = r.get("step_profile") or {"wall_us": float("nan"), "gap_us": float("nan")}
            gate_up, down = sections.get("gate/up + act", nan), sections.get("down", nan)
            configs = r.get("configs", {})
            print(f"| {label} | {r['ffn_keep']:g} | {step['wall_us']:.1f} ({step['gap_us']:.1f}) | "
                  f"{gate_up['us']:.1f} ({gate_up['gap_us']:.1f}) | {down['us']:.1f} ({down['gap_us']:.1f}) | "
                  f"{_config(configs.get('gate_up'))} | {_config(configs.get('down'))} | {_config(configs.get('o'))} |")
            if r.get("profile_error"):
                print(f"| {label} | {r['ffn_keep']:g} | no profile: {r['profile_error']} | | | | |")
    print_breakdown(results)


def print_breakdown(results: dict) -> None:
    """Every section and every kernel of the captured step side by side per level: launches a step, device
    us a step and the idle gap us before them (where a level's extra time or launches sit)."""
    runs = [(label, r) for label, rs in results.items() for r in rs if r.get("step_profile")]
    if not runs:
        return
    levels = [f"{label} {r['ffn_keep']:g}" for label, r in runs]
    head = " | ".join(f"{level}: calls, us, gap us" for level in levels)
    print(f"\n| step | {' | '.join(levels)} |")
    print(f"| --- | {' | '.join('---:' for _ in runs)} |")
    for name, key in (("launches", "launches"), ("replay us", "wall_us"), ("busy us", "busy_us"),
                      ("idle gaps us", "gap_us"), ("kernel durations us", "kernel_us")):
        values = [r["step_profile"][key] for _, r in runs]
        print(f"| {name} | {' | '.join(f'{v:.1f}' for v in values)} |")
    for what in ("sections", "kernels"):
        key = "section" if what == "sections" else "kernel"
        names = list(dict.fromkeys(row[key] for _, r in runs for row in r.get(what, [])))
        print(f"\n| {key} | {head} |")
        print(f"| --- | {' | '.join('---:' for _ in runs)} |")
        for name in names:
            cells = []
            for _, r in runs:
                row = next((x for x in r.get(what, []) if x[key] == name), None)
                cells.append("-" if row is None else f"{row['calls']:g}, {row['us']:.1f}, {row['gap_us']:.1f}")
            print(f"| {name[:60]} | {' | '.join(cells)} |")
    layers = [layer_timeline(r["step_profile"].get("timeline") or []) for _, r in runs]
    if any(layers):
        print(f"\n| a layer's launches (mean over the layers) | {' | '.join(f'{lv}: us, gap us' for lv in levels)} |")
        print(f"| --- | {' | '.join('---:' for _ in runs)} |")
        for j in range(max(map(len, layers))):
            first = next(x[j] for x in layers if j < len(x))
            cells = []
            for x in layers:
                t = x[j] if j < len(x) else None
                other = "" if t is None or t["section"] == first["section"] else f"{t['section']}: "
                cells.append("-" if t is None else f"{other}{t['us']:.2f}, {t['gap_us']:.2f}")
            print(f"| {j + 1}. {first['section']} ({first['kernel'][:40]}) | {' | '.join(cells)} |")


def layer_timeline(timeline: list[dict]) -> list[dict]:
    """A layer's launches in order (section, kernel), each one's us and idle gap us before it averaged over
    the step's layers of the common length (a layer starts at its qkv launch; the last layer, which the LM
    head follows, and any of another length left out)."""
    starts = [i for i, t in enumerate(timeline) if t["section"] == "qkv" and
              (i == 0 or timeline[i - 1]["section"] != "qkv")]
    layers = [timeline[a:b] for a, b in zip(starts, starts[1:])]
    if not layers:
        return []
    common = max({len(x) for x in layers}, key=[len(x) for x in layers].count)
    layers = [x for x in layers if len(x) == common]
    n = len(layers)
    return [{"section": layers[0][j]["section"], "kernel": layers[0][j]["kernel"],
             "us": sum(x[j]["us"] for x in layers) / n, "gap_us": sum(x[j]["gap_us"] for x in layers) / n}
            for j in range(common)]


def _config(c: dict | None) -> str:
    if not c:
        return "-"
    extra = "".join(f" {k}={c[k]}" for k in ("packed", "ahead", "stages") if c.get(k))
    finish = " (finishes the norm)" if c.get("finish") else ""
    return f"{c['block_n']} rows, {c['chunk']} cols/step, split {c['split']}, {c['num_warps']} warps{extra}{finish}"


if __name__ == "__main__":
    main()
