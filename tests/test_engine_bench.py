"""thin-exec bench and --vram on a machine without a GPU: sizes parse, budgets add up, errors are one line."""

import subprocess
import sys

import pytest
from test_runtime_loader import write_tiny_artifact

from thin.runtime.memory import estimate


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    write_tiny_artifact(tmp / "tiny.thin", tmp)
    return tmp / "tiny.thin"


def test_estimate_counts_weights_kv_and_workspace(artifact):
    from thin.artifacts import open_artifact
    from thin.runtime.bench import bytes_per_token

    art = open_artifact(artifact)
    short, long = estimate(art, 16), estimate(art, 1024)
    assert short["weights"] == sum(art.tensor_entry(t.name)["size"] for t in art.model.tensors)
    layers = art.model.layers
    per_token = sum(2 * a.attention.num_kv_heads * a.attention.head_dim for a in layers) * 4  # float32 tiny model
    assert long["kv"] - short["kv"] == per_token * (1024 - 16)
    assert long["workspace"] > short["workspace"] > 0
    embedding = art.tensor_entry(art.model.embedding.weight)["size"]
    assert 0 < bytes_per_token(art) < short["weights"] + embedding


def _exec(*args):
    return subprocess.run([sys.executable, "-m", "thin.runtime.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=False)


def _one_line_error(result) -> str:
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("thin-exec: error:"), result.stderr
    return lines[0]


def test_vram_needs_a_gpu_and_a_size(artifact):
    assert "cuda" in _one_line_error(_exec(artifact, "--vram", "8G", "--prompt", "hi", "--device", "cpu"))
    assert "cannot read" in _one_line_error(_exec(artifact, "--vram", "eight", "--prompt", "hi"))


def test_bench_without_a_gpu_is_one_line(artifact):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert "cuda" in _one_line_error(_exec("bench", artifact, "--gen", "4", "--runs", "1")).lower()
    assert "--gen" in _one_line_error(_exec("bench", artifact, "--gen", "1"))
    help_text = _exec("bench", "--help").stdout
    for option in ("--prompt-len", "--gen", "--runs", "--json", "--vram", "--profile"):
        assert option in help_text


def test_vram_cap_is_set_on_the_device_number_and_bounds_the_bandwidth_copy(artifact, monkeypatch):
    """--vram with a bare "cuda" device: torch's fraction call wants a device number (a bare
    torch.device("cuda") raised ValueError on the H200), and the bench's bandwidth copy must fit in
    what the cap leaves (it asked for 2 GiB of the card's free memory and ran out under --vram 8G)."""
    import torch

    from thin.artifacts import open_artifact
    from thin.runtime import bench, memory

    calls, total, allocated = [], 80 * 2**30, {"bytes": 7 * 2**30}
    props = type("Props", (), {"total_memory": total})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (total - allocated["bytes"], total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: allocated["bytes"])
    monkeypatch.setattr(memory, "_CAPS", {})
    memory.check(open_artifact(artifact), 64, 8 * 2**30, torch.device("cuda"))
    assert calls == [(8 * 2**30 / total, 1)]
    assert memory.allocatable(torch.device("cuda")) == 2**30  # the cap's 8 GiB less 7 allocated
    assert memory.allocatable(torch.device("cuda:0")) == total - 7 * 2**30  # no cap on device 0
    allocated["bytes"] = 9 * 2**30  # past the cap: nothing left, not a negative size
    assert memory.allocatable("cuda:1") == 0

    sizes = []

    def empty(n, dtype, device):
        sizes.append(n * 4)
        raise RuntimeError("stop here")

    monkeypatch.setattr(torch, "empty", empty)
    allocated["bytes"] = 7 * 2**30
    with pytest.raises(RuntimeError, match="stop here"):
        bench.copy_bandwidth(torch.device("cuda"))
    assert sizes == [2**30 // 3 // 4 * 4]


def test_copy_bandwidth_is_the_best_of_fresh_buffer_pairs(monkeypatch):
    """Each round copies a fresh pair of buffers 20 times and takes the median; the result is the best round
    (a low reading would flatter the roofline fraction): rounds of 1.0, 0.8 and 1.25 ms a copy read 2 x
    bytes / 0.8 ms."""
    import torch

    from thin.runtime import bench, memory

    nbytes = 2**26
    monkeypatch.setattr(memory, "allocatable", lambda device: 3 * nbytes)
    per_round = iter([1.0] * 20 + [0.8] * 20 + [1.25] * 20)

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return next(per_round)

    real_empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: real_empty(*a, **k))
    assert bench.copy_bandwidth(torch.device("cpu")) == pytest.approx(2 * nbytes / 0.8e-3)
    assert next(per_round, None) is None  # three rounds of 20 copies
