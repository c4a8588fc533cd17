"""Peak resident memory of `load()` plus one forward of a quantized artifact on the CPU.

    python examples/benchmarks/bench_load_rss.py --size-gb 1.0 --quant int4

Builds a random Llama-shaped bf16 checkpoint (make_checkpoint.py), compiles it with --quant, then in a
fresh process measures the peak RSS above the baseline (python + torch + thin imported) of
`load(path)` followed by a 64-token prefill and one decode step. The bound the runtime is held to:
1.5 x the artifact's size + the largest single weight in float32 (the torch path dequantizes one
block of one weight at a time; a dense bf16 embedding stays a view of the mapped file).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, sys, torch
import thin.runtime
from thin.runtime import load

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
torch.set_num_threads(2)
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
base = status("VmRSS:")
model = load(sys.argv[1])
after_load = status("VmHWM:")
ids = torch.arange(64) % model.ir.vocab_size
cache = model.executor.new_cache(128)
model.executor.forward(ids, cache)
model.executor.forward(ids[:1], cache)
import math
largest = max(math.prod(t.shape) for t in model.ir.tensors) * 4
print(json.dumps({"baseline": base, "load_peak": after_load - base, "forward_peak": status("VmHWM:") - base,
                  "largest_f32": largest}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--keep", type=Path, help="build in this folder and keep it")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        ckpt, out = root / "ckpt", root / f"model-{args.quant}.thin"
        if not (ckpt / "config.json").exists():
            subprocess.run([sys.executable, str(here / "make_checkpoint.py"), str(ckpt), "--size-gb",
                            str(args.size_gb)], check=True)
        subprocess.run([sys.executable, "-m", "thin.compiler.cli", "compile", str(ckpt), "-o", str(out),
                        "--quant", args.quant, "-q"], check=True)
        child = subprocess.run([sys.executable, "-c", _CHILD, str(out)], check=True, capture_output=True,
                               text=True)
        r = json.loads(child.stdout.strip().splitlines()[-1])
        size = out.stat().st_size
        bound = 1.5 * size + r["largest_f32"]
        mib = 2 ** 20
        print(f"artifact {size / mib:.0f} MiB ({args.quant}); "
              f"largest weight in float32 {r['largest_f32'] / mib:.0f} MiB")
        print(f"peak RSS above baseline: load {r['load_peak'] / mib:.0f} MiB, load + forward "
              f"{r['forward_peak'] / mib:.0f} MiB; bound 1.5 x artifact + largest f32 = {bound / mib:.0f} MiB "
              f"({'within' if r['forward_peak'] <= bound else 'OVER'})")


if __name__ == "__main__":
    main()
