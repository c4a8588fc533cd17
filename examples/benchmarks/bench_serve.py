"""The serving table: aggregate decode tokens/s of `thin-exec serve`'s batched decode at 1, 4, 16
and 64 concurrent streams, with time to first token, next to one stream alone (`thin-exec`).

    python examples/benchmarks/bench_serve.py --workdir /tmp/tb --out DIR \\
        [--shape llama-8b] [--formats int4,bf16] [--streams 1,4,16,64] [--prompt-len 128] [--gen 128]

1. writes the random-weight checkpoint (examples/synth_checkpoint.py) unless it is there;
2. compiles it per format (bench_gpu.py's compile: int4 in groups of 128, the encoder on the GPU);
3. per format, in a fresh process: one stream through the decode engine's generate (what
   `thin-exec` runs), then for each stream count N, N requests submitted at once to the server's
   scheduler over the CUDA engine's batch backend (runtime/serve/engine_backend.py: the server
   without its HTTP layer; text is detokenized per token as the server does), greedy, no stop
   token, each of a different random prompt. Each N runs twice; the second (graphs captured) counts;
4. prints one markdown table last. Logs and JSON go to --out.

Aggregate decode tok/s = N x (gen - 1) / (time the last request finished - time the last one got
its first token): requests are admitted (prefilled one after another) in one turn, then decode
together. TTFT is from submission to the first token (median and worst of the N).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))


def run_format(artifact: str, streams: list[int], prompt_len: int, gen: int) -> None:
    """(in a child process) the measurements of one artifact; one JSON line on stdout."""
    import torch

    from thin.runtime import load
    from thin.runtime.sampling import GenerationOptions
    from thin.runtime.serve.engine_backend import EngineBackend
    from thin.runtime.serve.scheduler import Done, Failed, Job, Scheduler

    model = load(artifact, device="cuda")
    if model.engine is None:
        raise SystemExit("the decode engine does not take this model")
    vocab = model.ir.vocab_size

    def prompt(i: int) -> list[int]:
        g = torch.Generator().manual_seed(1000 + i)
        return torch.randint(3, vocab, (prompt_len,), generator=g).tolist()

    options = GenerationOptions(max_new_tokens=gen, stop_token_ids=())
    alone = []
    for _ in range(3):
        list(model.generate(prompt(0), max_new_tokens=gen, stop_token_ids=()))
        s = model.last_stats
        alone.append((s.new_tokens - 1) / s.decode_seconds)
    single = {"decode_tokens_per_second": statistics.median(alone), "decode_min": min(alone),
              "decode_max": max(alone), "ttft_seconds": model.last_stats.prefill_seconds}

    largest = max(streams)
    backend = EngineBackend(model.engine, largest, kv_tokens=largest * (prompt_len + gen))
    first: dict[int, float] = {}
    add = backend.add

    def timed_add(spec):  # the moment each sequence's first token exists
        token = add(spec)
        first[spec.id] = time.perf_counter()
        return token

    backend.add = timed_add
    scheduler = Scheduler(backend, largest, 0)
    scheduler.start()

    def once(n: int) -> dict:
        done: dict[int, float] = {}
        failed: list[str] = []
        finished = threading.Event()
        jobs = []

        def sink_for(job_id):
            def sink(event):
                if isinstance(event, Done):
                    done[job_id()] = time.perf_counter()
                elif isinstance(event, Failed):
                    failed.append(event.message)
                if len(done) + len(failed) == n:
                    finished.set()
            return sink

        first.clear()
        for i in range(n):
            holder: list = []
            job = Job(prompt(i), options, model.tokenizer, sink_for(lambda h=holder: h[0].id))
            holder.append(job)
            jobs.append(job)
        with scheduler._cv:  # all at once: the scheduler admits (prefills) them in one turn
            submitted = time.perf_counter()
            for job in jobs:
                scheduler.submit(job)
        finished.wait()
        if failed:
            raise SystemExit(f"{len(failed)} requests failed: {failed[0]}")
        tokens = [job.completion_tokens for job in jobs]
        last_first, last_done = max(first.values()), max(done.values())
        ttft = sorted(first[job.id] - submitted for job in jobs)
        return {"streams": n, "decode_tokens_per_second": sum(t - 1 for t in tokens) / (last_done - last_first),
                "end_to_end_tokens_per_second": sum(tokens) / (last_done - submitted),
                "ttft_median_seconds": statistics.median(ttft), "ttft_max_seconds": ttft[-1],
                "tokens": sum(tokens)}

    rows = []
    for n in streams:
        once(n)  # compile, capture this bucket's graph
        rows.append(once(n))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    scheduler.close()
    choices = {"x".join(map(str, k)): v for k, v in backend.batch.choices.items()}
    print(json.dumps({"artifact": artifact, "gpu": torch.cuda.get_device_name(), "alone": single, "batched": rows,
                      "peak_vram_bytes": torch.cuda.max_memory_allocated(), "int4_kernel_times": choices}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/thinbench"))
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--formats", default="int4,bf16")
    ap.add_argument("--streams", default="1,4,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--run-format", metavar="ARTIFACT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    if min(streams) < 1 or args.gen < 2 or args.prompt_len < 1:
        raise SystemExit("bench_serve: streams >= 1, --gen >= 2 and --prompt-len >= 1")
    if args.run_format:
        run_format(args.run_format, streams, args.prompt_len, args.gen)
        return

    from bench_gpu import log_run

    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.shape + (f"-{args.layers}l" if args.layers else "")
    src = args.workdir / name
    if not (src / "config.json").exists():
        cmd = [sys.executable, str(REPO / "examples" / "synth_checkpoint.py"), "--shape", args.shape, "--out", str(src)]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    formats = args.formats.split(",")
    procs = {}
    for fmt in formats:
        dst = args.workdir / f"{name}-{fmt}.thin"
        if not dst.exists():
            log = open(args.out / f"compile-{fmt}.log", "w")  # noqa: SIM115  (the child keeps it)
            procs[fmt] = subprocess.Popen([sys.executable, str(HERE / "bench_gpu.py"), "--compile-one", str(src),
                                           str(dst), fmt], stdout=log, stderr=log)
    for fmt, proc in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"compile {fmt} failed: see {args.out}/compile-{fmt}.log")
    results = {}
    for fmt in formats:
        dst = args.workdir / f"{name}-{fmt}.thin"
        run = log_run([sys.executable, __file__, "--run-format", str(dst), "--streams", args.streams,
                       "--prompt-len", str(args.prompt_len), "--gen", str(args.gen)], args.out / f"serve-{fmt}.log")
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
        results[fmt] = json.loads(lines[-1]) if run.returncode == 0 and lines else {"error": run.returncode}
        (args.out / "bench_serve.json").write_text(json.dumps(results, indent=1))
    print_table(name, results, args)


def print_table(name: str, results: dict, args) -> None:
    gpu = next((r["gpu"] for r in results.values() if "gpu" in r), "?")
    for fmt, r in results.items():
        if r.get("int4_kernel_times"):
            print(f"\n{fmt}: int4 linears of a batched step, us (rows x columns x group x asymmetric x batch; "
                  "scheme/B/S: the batch kernel's tile, code-position or transposed scheme in bands of B rows, "
                  "its columns split S ways; matmul: the op's own)")
            print("| weight | times |\n| --- | --- |")
            for key, t in r["int4_kernel_times"].items():
                print(f"| {key} | {', '.join(f'{k} {v:.1f}' for k, v in t.items())} |")
    print(f"\n{name} on {gpu}: {args.prompt_len}-token prompts, {args.gen} new tokens each, greedy")
    print("| format | streams | aggregate decode tok/s | per stream | vs 1 stream served | vs `thin-exec` alone | "
          "end-to-end tok/s | TTFT median / worst |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for fmt, r in results.items():
        if "error" in r:
            print(f"| {fmt} | failed ({r['error']}) | | | | | | |")
            continue
        a = r["alone"]
        alone = a["decode_tokens_per_second"]
        print(f"| {fmt} | `thin-exec` alone | {alone:.1f} ({a['decode_min']:.1f}-{a['decode_max']:.1f}) | "
              f"{alone:.1f} | | 1.00x | | {1000 * a['ttft_seconds']:.0f} ms |")
        one = next((b["decode_tokens_per_second"] for b in r["batched"] if b["streams"] == 1), None)
        for b in r["batched"]:
            rate, n = b["decode_tokens_per_second"], b["streams"]
            print(f"| {fmt} | {n} | {rate:.1f} | {rate / n:.1f} | {rate / one if one else float('nan'):.2f}x | "
                  f"{rate / alone:.2f}x | {b['end_to_end_tokens_per_second']:.1f} | "
                  f"{1000 * b['ttft_median_seconds']:.0f} / {1000 * b['ttft_max_seconds']:.0f} ms |")


if __name__ == "__main__":
    main()
