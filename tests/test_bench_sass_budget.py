"""examples/benchmarks/sass_budget.py on the CPU machine: the int4 matvec compiled for sm_90 by Triton's own ptxas,
its hot loop counted. The bf16 pairs spend one shift a packed word (pairs.py) and two pair FMAs a pair of weights,
and fewer instructions a weight than the float path; a change to the arithmetic that brings the shifts back, or
moves work into the loop, fails here before it costs device time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "sass_budget.py"
PROBE = f"""
import importlib.util, json
spec = importlib.util.spec_from_file_location("sass_budget", {str(SCRIPT)!r})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
out = {{}}
for name, config in [("pairs", "block_n=4, chunk=2048, num_warps=2, packed=1"),
                     ("float", "block_n=4, chunk=2048, num_warps=2")]:
    r = m.budget("int4", "qkv", config)
    out[name] = {{"per_weight": r["per_weight"], "opcodes": dict(r["opcodes"])}}
print(json.dumps(out))
"""


def test_int4_pairs_loop_budget():
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip("this Triton carries no nvdisasm")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    pairs, plain = result["pairs"], result["float"]
    words = 4 * 4  # a lane's step: one 32-column chunk (4 words) of each of the tile's 4 rows
    ops = pairs["opcodes"]
    assert ops.get("HFMA2", 0) <= 8 * words + 2  # two pair FMAs a pair of weights, four pairs a word
    assert ops.get("SHF", 0) <= 2 * words  # one shift a word (three before Round 16) and a few others
    assert pairs["per_weight"] < 0.7 * plain["per_weight"]
