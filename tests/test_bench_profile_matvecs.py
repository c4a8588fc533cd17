"""examples/benchmarks/profile_matvecs.py: its reading of ncu's CSV (what it prints is the table in BENCHMARKS.md),
and its refusal without a GPU. The profiling itself needs ncu and a GPU."""

import importlib.util
from pathlib import Path

import torch

_PATH = Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "profile_matvecs.py"
_SPEC = importlib.util.spec_from_file_location("profile_matvecs", _PATH)
profile = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(profile)

HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
          "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value"]


def _row(kernel_id, kernel, metric, unit, value):
    return [str(kernel_id), "1", "python3", "h", kernel, "1", "7", "(64, 1, 1)", "(1024, 1, 1)", "0", "9.0", "S", metric,
            unit, value]


def test_table_keeps_the_matvecs_in_launch_order_with_their_top_stalls(tmp_path, capsys):
    stall = profile.STALL_METRIC
    rows = [HEADER, ["a line the profiled program printed"],
            _row(0, "void at::vectorized_elementwise_kernel", "Duration", "ns", "2,000")]
    for kernel_id, (duration, long_sb, wait) in enumerate([("6,208", "4.91", "1.09"), ("6,176", "5.02", "1.10"),
                                                           ("19,264", "4.50", "0.20")], start=1):
        rows += [_row(kernel_id, "_matvec_kernel", "Duration", "ns", duration),
                 _row(kernel_id, "_matvec_kernel", "Waves Per SM", "", "0.39"),
                 _row(kernel_id, "_matvec_kernel", stall.format("long_scoreboard"), "inst", long_sb),
                 _row(kernel_id, "_matvec_kernel", stall.format("wait"), "inst", wait)]
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(",".join(f'"{c}"' for c in r) if len(r) > 1 else r[0] for r in rows) + "\n")
    profile.table(path, ["int4 o", "int4 gate_up"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| int4")]
    assert [line.split(" | ")[0] for line in lines] == ["| int4 o", "| int4 o", "| int4 gate_up"]
    assert "6,208 ns" in lines[0] and "19,264 ns" in lines[2] and "0.39" in lines[0]
    assert lines[0].endswith("| long_scoreboard 4.9, wait 1.1 |")


def test_script_refuses_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profile.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
