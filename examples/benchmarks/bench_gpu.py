"""The GPU decode table: one checkpoint, every format, thin against transformers, in one run.

    python examples/benchmarks/bench_gpu.py --workdir /tmp/thinbench --out DIR \\
        [--shape llama-8b] [--layers N] [--formats bf16,fp8_e4m3,int8,int4,mxfp4] \\
        [--transformers static,compile] [--prompt-len 512 --gen 128 --runs 5] [--profile bf16,int4] \\
        [--group-size 128]

1. writes the random-weight checkpoint (examples/synth_checkpoint.py) unless it is there;
2. compiles it once per format, in parallel processes: bf16 is the exact compile (`thinc compile`; of a
   checkpoint with pre-quantized experts, such as gpt-oss-20b's MXFP4, the table says "as stored"),
   the others `--quant FORMAT` (int3-int6 with groups of --group-size, 128 by default) through
   thin.compiler.compile_model with
   the formats' reference encoder running on the GPU: the same bytes as on the CPU (the formats'
   own CPU/CUDA test checks that), in seconds instead of minutes;
3. runs `thin-exec bench --json` on each artifact, one process at a time; for the formats in --profile
   with `--profile`: the captured decode step's replays by section and by kernel (device time and the
   idle gap before each launch, runtime/step_profile.py), printed as tables before the main one;
4. runs transformers on the same checkpoint (bf16, static cache; `compile` adds torch.compile);
5. prints one markdown table last. Logs and JSON go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
GROUPED = ("int3", "int4", "int5", "int6")  # formats that take --group-size


def log_run(cmd: list[str], log: Path, env=None, timeout=None) -> subprocess.CompletedProcess:
    started = time.perf_counter()
    with open(log, "w") as fh:
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=fh, text=True, env=env, timeout=timeout)
        fh.write(f"\n--- stdout ---\n{result.stdout}\n--- exit {result.returncode} in "
                 f"{time.perf_counter() - started:.1f} s ---\n")
    return result


def compile_one(src: str, dst: str, quant: str | None, group: int = 128) -> None:
    """(in a child process) compile `src` into `dst`, quantizing with the encoder on the GPU."""
    import torch

    from thin.compiler import compile_model
    from thin.ir.formats.quantized import QuantizedFormat

    encode = QuantizedFormat.encode

    def on_gpu(self, tensor, params=()):
        return encode(self, tensor.to("cuda"), params).cpu()

    if quant and torch.cuda.is_available():
        QuantizedFormat.encode = on_gpu
    started = time.perf_counter()
    options = {"quant": quant, **({"group_size": group} if quant in GROUPED else {})} if quant else {}
    compile_model(src, dst, **options)
    print(json.dumps({"compiled": dst, "seconds": time.perf_counter() - started,
                      "gpu": torch.cuda.get_device_name() if quant else None}))


def transformers_run(src: str, mode: str, prompt_len: int, gen: int, runs: int) -> None:
    """(in a child process) transformers generate on `src`: bf16, static cache, greedy; JSON out."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).to("cuda").eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len),
                           generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(prompt)
    kwargs = dict(attention_mask=mask, do_sample=False, cache_implementation="static", eos_token_id=None,
                  pad_token_id=0, disable_compile=mode != "compile")

    def timed(n):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - begin, out[0, prompt_len:].tolist()

    warm = time.perf_counter()
    timed(gen)
    warm = time.perf_counter() - warm
    prefill = statistics.median(timed(1)[0] for _ in range(3))
    totals, tokens = [], None
    for _ in range(runs):
        seconds, tokens = timed(gen)
        totals.append(seconds)
    rates = sorted((gen - 1) / (t - prefill) for t in totals)
    print(json.dumps({"system": f"transformers {transformers.__version__}, static cache"
                                + (" + torch.compile" if mode == "compile" else ""),
                      "decode_tokens_per_second": statistics.median(rates), "decode_min": rates[0],
                      "decode_max": rates[-1], "prefill_tokens_per_second": prompt_len / prefill,
                      "warmup_seconds": warm, "peak_vram_bytes": torch.cuda.max_memory_allocated(),
                      "first_tokens": tokens[:8]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/thinbench"))
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--formats", default="bf16,fp8_e4m3,int8,int4,mxfp4")
    ap.add_argument("--transformers", default="static", help="comma list of static, compile; or none")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--profile", default="bf16,int4",
                    help="formats whose captured decode step is broken down by kernel and section (bench --profile)")
    ap.add_argument("--parallel", type=int, default=3, help="compiles at once")
    ap.add_argument("--deadline", type=float, default=540, help="seconds; optional stages are skipped after it")
    ap.add_argument("--cleanup", action="store_true", help="delete each artifact once benchmarked")
    ap.add_argument("--group-size", type=int, default=128,
                    help="columns per scale of int3-int6 (gpt-oss-20b's 2880 takes 64 or 32)")
    ap.add_argument("--compile-one", nargs=3, metavar=("SRC", "DST", "QUANT"), help=argparse.SUPPRESS)
    ap.add_argument("--transformers-run", nargs=2, metavar=("SRC", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compile_one:
        src, dst, quant = args.compile_one
        compile_one(src, dst, None if quant == "bf16" else quant, args.group_size)
        return
    if args.transformers_run:
        transformers_run(*args.transformers_run, args.prompt_len, args.gen, args.runs)
        return

    started = time.perf_counter()
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.shape + (f"-{args.layers}l" if args.layers else "")
    src = args.workdir / name
    stages: dict[str, float] = {}

    def stage(label: str, since: float) -> None:
        stages[label] = round(time.perf_counter() - since, 1)
        print(f"[{time.perf_counter() - started:6.1f} s] {label}: {stages[label]} s", file=sys.stderr, flush=True)

    t = time.perf_counter()
    if not (src / "config.json").exists():
        cmd = [sys.executable, str(REPO / "examples" / "synth_checkpoint.py"), "--shape", args.shape, "--out", str(src)]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    stage("checkpoint", t)

    formats = args.formats.split(",")
    t = time.perf_counter()
    threads = max(1, (os.cpu_count() or 8) // max(1, args.parallel))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    pending = list(formats)
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    compile_seconds: dict[str, float] = {}
    while pending or running:
        while pending and len(running) < args.parallel:
            fmt = pending.pop(0)
            dst = args.workdir / f"{name}-{fmt}.thin"
            if dst.exists():
                compile_seconds[fmt] = 0.0
                continue
            cmd = [sys.executable, __file__, "--compile-one", str(src), str(dst), fmt, "--group-size",
                   str(args.group_size)]
            with open(args.out / f"compile-{fmt}.log", "w") as log:  # the child keeps its own handle
                running[fmt] = (subprocess.Popen(cmd, stdout=log, stderr=log, env=env), time.perf_counter())
        for fmt, (proc, since) in list(running.items()):
            if proc.poll() is not None:
                if proc.returncode != 0:
                    raise SystemExit(f"compile {fmt} failed: see {args.out}/compile-{fmt}.log")
                compile_seconds[fmt] = round(time.perf_counter() - since, 1)
                del running[fmt]
        time.sleep(0.5)
    stage(f"compile {compile_seconds}", t)

    results = {}
    for fmt in formats:
        t = time.perf_counter()
        dst = args.workdir / f"{name}-{fmt}.thin"
        cmd = [sys.executable, "-m", "thin.runtime.cli", "bench", str(dst), "--json", "--prompt-len",
               str(args.prompt_len), "--gen", str(args.gen), "--runs", str(args.runs)]
        if fmt in args.profile.split(","):
            cmd.append("--profile")
        run = log_run(cmd, args.out / f"bench-{fmt}.log")
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
        results[fmt] = json.loads(lines[-1]) if run.returncode == 0 and lines else {"error": run.returncode}
        if args.cleanup:
            dst.unlink(missing_ok=True)
        stage(f"bench {fmt}", t)

    baselines: dict = {}

    def report() -> None:  # after every stage: a run cut short still leaves its table
        (args.out / "bench_gpu.json").write_text(json.dumps(
            {"shape": name, "stages": stages, "thin": results, "transformers": baselines}, indent=1))
        print_table(name, results, baselines, args)
        sys.stdout.flush()

    report()
    for mode in [m for m in args.transformers.split(",") if m and m != "none"]:
        if mode == "compile" and time.perf_counter() - started > args.deadline:
            print(f"skipping transformers {mode}: past the deadline", file=sys.stderr)
            continue
        t = time.perf_counter()
        run = log_run([sys.executable, __file__, "--transformers-run", str(src), mode, "--prompt-len",
                       str(args.prompt_len), "--gen", str(args.gen), "--runs", str(min(args.runs, 3))],
                      args.out / f"transformers-{mode}.log")
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
        baselines[mode] = json.loads(lines[-1]) if run.returncode == 0 and lines else {"error": run.returncode}
        stage(f"transformers {mode}", t)
        report()


def print_table(name, results, baselines, args) -> None:
    base = baselines.get("static", {}).get("decode_tokens_per_second")
    compiled = baselines.get("compile", {}).get("decode_tokens_per_second")
    for fmt, r in results.items():
        print_profile(fmt, r)
    bw = next((r["bandwidth_bytes_per_second"] for r in results.values() if "bandwidth_bytes_per_second" in r), 0)
    print(f"\n{name}, {args.prompt_len}-token prompt, {args.gen} new tokens, median of {args.runs}; "
          f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print("| system | format | GB read/token (routed experts) | decode tok/s (min-max) | roofline tok/s "
          "| of roofline | vs transformers static | vs static+compile | prefill tok/s | peak VRAM |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for fmt, r in results.items():
        if "error" in r:
            print(f"| thin | {fmt} | failed ({r['error']}) | | | | | | | |")
            continue
        rate = r["decode_tokens_per_second"]
        experts = f" ({r['expert_bytes_per_token'] / 1e9:.2f})" if r.get("expert_bytes_per_token") else ""
        stored = sorted(r.get("formats", {}))
        label = f"as stored ({', '.join(stored)})" if fmt == "bf16" and set(stored) - {"bf16", "f16", "f32"} else fmt
        print(f"| thin | {label} | {r['bytes_per_token'] / 1e9:.2f}{experts} | {rate:.1f} ({r['decode_min']:.1f}-"
              f"{r['decode_max']:.1f}) | {r['roofline_tokens_per_second']:.0f} | {100 * r['roofline_fraction']:.1f}% | "
              f"{_times(rate, base)} | {_times(rate, compiled)} | {r['prefill_tokens_per_second']:.0f} | "
              f"{r['peak_vram_bytes'] / 2**30:.1f} GiB |")
    bf16 = results.get("bf16", {})
    for mode, b in baselines.items():
        if "error" in b:
            print(f"| transformers ({mode}) | bf16 | failed ({b['error']}) | | | | | | | |")
            continue
        rate = b["decode_tokens_per_second"]
        roof = bf16.get("roofline_tokens_per_second")
        print(f"| {b['system']} | bf16 | {bf16.get('bytes_per_token', 0) / 1e9:.2f} | {rate:.1f} "
              f"({b['decode_min']:.1f}-{b['decode_max']:.1f}) | {f'{roof:.0f}' if roof else '-'} | "
              f"{f'{100 * rate / roof:.1f}%' if roof else '-'} | {_times(rate, base)} | {_times(rate, compiled)} | "
              f"{b['prefill_tokens_per_second']:.0f} | {b['peak_vram_bytes'] / 2**30:.1f} GiB |")


def _times(rate: float, base: float | None) -> str:
    """rate as a multiple of base, or "-" where that baseline was not run (or failed)."""
    return f"{rate / base:.2f}x" if base else "-"


def print_profile(fmt: str, r: dict) -> None:
    """bench --profile's breakdown of the captured decode step (runtime/step_profile.py) as markdown."""
    if r.get("profile_error"):
        print(f"\n{fmt}: no profile: {r['profile_error']}")
    p = r.get("step_profile")
    if not p:
        return
    print(f"\n{fmt}: the CUDA graph's decode step, {p['replays']} replays under torch.profiler: "
          f"{p['wall_us']:.1f} us first start to last end = {p['busy_us']:.1f} us busy + {p['gap_us']:.1f} us idle "
          f"gaps, {p['between_us'] or 0:.1f} us between replays; measured step {p['step_us'] or 0:.1f} us"
          + ("" if p["attribution"] == "position" else f" (sections by {p['attribution']})"))
    print("| section | calls | us/step | gap us/step | share |\n| --- | ---: | ---: | ---: | ---: |")
    for k in r["sections"]:
        print(f"| {k['section']} | {k['calls']:g} | {k['us']:.1f} | {k['gap_us']:.1f} | {100 * k['share']:.1f}% |")
    print("| kernel | sections | calls | us/step | us/call | gap us/step | share |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for k in r["kernels"]:
        print(f"| {k['kernel']} | {', '.join(k['sections'])} | {k['calls']:g} | {k['us']:.1f} | {k['mean_us']:.2f} | "
              f"{k['gap_us']:.1f} | {100 * k['share']:.1f}% |")


if __name__ == "__main__":
    main()
