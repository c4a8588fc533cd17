"""Compile streaming, key hashing and verify throughput on a large random checkpoint.

    python examples/benchmarks/bench_compile.py --size-gb 2.1 --workdir /tmp/thin-bench

Prints a table: peak RSS of `thinc compile` above the interpreter's baseline (from /usr/bin/time -v),
`thinc key` throughput with an empty hash cache and with a warm one, and `thinc verify` throughput.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed(cmd: list[str], env: dict) -> tuple[float, int, str]:
    """(wall seconds, max RSS in KiB, stdout) of a command run under /usr/bin/time -v."""
    t0 = time.perf_counter()
    out = subprocess.run(["/usr/bin/time", "-v", *cmd], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr).group(1))
    return wall, rss, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size-gb", type=float, default=2.1)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/thin-bench"))
    args = ap.parse_args()
    ckpt, out = args.workdir / "ckpt", args.workdir / "model.thin"
    if not (ckpt / "config.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_checkpoint.py"), str(ckpt), "--size-gb",
                        str(args.size_gb)], check=True)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    env = dict(os.environ, XDG_CACHE_HOME=str(args.workdir / "cache"))
    shutil.rmtree(args.workdir / "cache", ignore_errors=True)
    # Warm the OS page cache so "cold" below measures hashing, not the disk.
    subprocess.run(["cat", *map(str, ckpt.glob("*.safetensors"))], stdout=subprocess.DEVNULL, check=True)
    cold, _, _ = timed(["thinc", "key", str(ckpt)], env)
    warm, _, _ = timed(["thinc", "key", str(ckpt)], env)
    _, base_rss, _ = timed([sys.executable, "-c", "import torch, safetensors, numpy, thin.compiler, "
                            "thin.compiler.hf, thin.artifacts, thin.passes, typer"], env)
    compile_s, compile_rss, _ = timed(["thinc", "compile", str(ckpt), "-o", str(out), "-q"], env)
    verify_s, _, _ = timed(["thinc", "verify", str(out)], env)
    file_size = out.stat().st_size
    rows = [
        ("checkpoint", f"{size / 1e9:.2f} GB bf16, sharded"),
        ("thinc key, empty hash cache", f"{cold:.2f} s  ({size / 1e9 / cold:.2f} GB/s)"),
        ("thinc key, warm hash cache", f"{warm:.2f} s  ({size / 1e9 / warm:.1f} GB/s)"),
        ("thinc compile", f"{compile_s:.1f} s  ({size / 1e9 / compile_s:.2f} GB/s)"),
        ("compile peak RSS", f"{compile_rss / 1024:.0f} MiB"),
        ("interpreter baseline RSS", f"{base_rss / 1024:.0f} MiB"),
        ("compile RSS above baseline", f"{(compile_rss - base_rss) / 1024:.0f} MiB"),
        ("thinc verify", f"{verify_s:.2f} s  ({file_size / 1e9 / verify_s:.2f} GB/s)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
