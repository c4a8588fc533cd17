"""examples/benchmarks/sweep_attention_launch.py: its patch sets the attention's launch shape, and a process that
cannot bench (no GPU here) is reported as a failed row, not a crash."""

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "examples", "benchmarks", "sweep_attention_launch.py")


def test_patch_sets_warps_and_tile():
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(SCRIPT)!r}); import sweep_attention_launch as s; "
            "s.patch('6', '16'); import thin.runtime.kernels.attention_append as a; "
            "from thin.runtime.kernels.attention import DecodeAttention; import torch; "
            "d = DecodeAttention(8, 2, 64, 100, torch.device('cpu'), 4); print(a.split_warps(32, 128), d.tile, d.splits)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["6", "16", "4"]  # 100 positions in tiles of 16 would be 7 splits; 2 * 4 SMs / 2 kv heads = 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a run without a GPU prints")
def test_a_run_without_a_gpu_is_a_failed_row(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "missing.thin"), "--warps", "8", "--rounds", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 0 |")]
    assert len(rows) == 2 and all("failed:" in row for row in rows)
