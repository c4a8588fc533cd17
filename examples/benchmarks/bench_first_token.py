"""Time from nothing to the first generated token for a compiled model.

    python examples/benchmarks/bench_first_token.py examples/models/tiny-coder --runs 5

Compiles the model once, then reports the median of --runs fresh processes each doing
`load()` + one token (measured inside the process, after imports) and the whole
`thin-exec --max-new-tokens 1` command line (interpreter start and imports included).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = """
import sys, time
import thin.runtime
t0 = time.perf_counter()
model = thin.runtime.load(sys.argv[1])
t1 = time.perf_counter()
next(iter(model.generate("def fibonacci(n):", max_new_tokens=1, temperature=0.0)))
t2 = time.perf_counter()
print(t1 - t0, t2 - t0)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    from thin.compiler import compile_model

    with tempfile.TemporaryDirectory() as tmp:
        path = compile_model(args.model_dir, Path(tmp) / "m.thin")
        loads, firsts, commands = [], [], []
        for _ in range(args.runs):
            out = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True,
                                 check=True).stdout.split()
            loads.append(float(out[0]))
            firsts.append(float(out[1]))
            t0 = time.perf_counter()
            subprocess.run(["thin-exec", str(path), "--raw", "--prompt", "def fibonacci(n):",
                            "--max-new-tokens", "1"], capture_output=True, check=True)
            commands.append(time.perf_counter() - t0)
        size = path.stat().st_size
    print(f"artifact: {args.model_dir} ({size / 2**20:.1f} MiB), median of {args.runs} fresh processes")
    print(f"{'load()':<40} {statistics.median(loads) * 1000:8.1f} ms")
    print(f"{'load() + first token':<40} {statistics.median(firsts) * 1000:8.1f} ms")
    print(f"{'thin-exec --max-new-tokens 1 (whole command)':<40} {statistics.median(commands) * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
