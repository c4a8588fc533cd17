"""The kernels of examples/benchmarks/bench_boundary.py at tiny sizes against torch's sums, and the
grid barrier's epoch arithmetic. Under the interpreter the programs of a launch run one after
another, so a barrier over several programs cannot complete there: the persistent kernel runs
with BARRIER off, except on one program (nothing to wait for) and in the test of the timeout flag."""

import contextlib
import importlib.util
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kernel_support import DEVICE

_SPEC = importlib.util.spec_from_file_location(
    "bench_boundary", Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "bench_boundary.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

BLOCK = 16


def _pool(elems, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (elems,), dtype=torch.int32, generator=g).to(DEVICE)


def _zeros(n):
    return torch.zeros(n, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("pdl", [False, True])
def test_stream_sums_each_tile_and_adds_the_previous_launchs_value(pdl):
    src = _pool(2 * 5 * BLOCK)
    a, b = _zeros(5), _zeros(5)
    bench.stream(src[:5 * BLOCK], a, BLOCK, pdl=pdl)
    bench.stream(src[5 * BLOCK:], b, BLOCK, prev=a, pdl=pdl)
    want_a = src[:5 * BLOCK].view(5, BLOCK).sum(1)
    assert torch.equal(a.long().cpu(), want_a.cpu())
    # B adds A's value from program (p + 2) % 5, another program.
    want_b = src[5 * BLOCK:].view(5, BLOCK).sum(1) + want_a[torch.tensor([2, 3, 4, 0, 1], device=DEVICE)]
    assert torch.equal(b.long().cpu(), want_b.cpu())


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("grid", [1, 3, 9])
def test_persistent_without_barrier_sums_every_grid_th_tile(grid, prefetch):
    tiles = 7  # more tiles than programs (3), fewer (9): a program may get none (and prefetches nothing)
    src = _pool(2 * tiles * BLOCK, seed=grid)
    a, b, err = _zeros(grid), _zeros(grid), _zeros(1)
    bench.persistent(src, a, b, _zeros(1), err, grid, BLOCK, barrier=False, prefetch=prefetch)
    half = tiles * BLOCK
    for p in range(grid):
        want_a = sum(int(src[t * BLOCK:(t + 1) * BLOCK].sum()) for t in range(p, tiles, grid))
        want_b = sum(int(src[half + t * BLOCK:half + (t + 1) * BLOCK].sum()) for t in range(p, tiles, grid))
        assert int(a[p]) == want_a and int(b[p]) == want_b
    assert torch.equal(a.long().cpu(), bench.program_sums(src[:half], BLOCK, grid).cpu())
    assert int(err) == 0


@pytest.mark.parametrize(("poll_load", "prefetch"), [(False, False), (True, False), (False, True)])
def test_barrier_of_one_program_passes_and_counts_an_epoch_a_launch(poll_load, prefetch):
    src = _pool(2 * 3 * BLOCK)
    a, b, counter, err = _zeros(1), _zeros(1), _zeros(1), _zeros(1)
    for launch in range(1, 4):
        bench.persistent(src, a, b, counter, err, 1, BLOCK, barrier=True, poll_load=poll_load, max_spin=4,
                         prefetch=prefetch)
        assert int(counter) == launch and int(err) == 0
    want_a = int(src[:3 * BLOCK].sum())
    assert int(a) == want_a and int(b) == int(src[3 * BLOCK:].sum()) + want_a


@pytest.mark.skipif(DEVICE.type == "cuda", reason="programs run one after another only in the interpreter")
@pytest.mark.parametrize("poll_load", [False, True])
def test_barrier_that_cannot_complete_sets_the_error_flag_instead_of_hanging(poll_load):
    # Program 0 arrives first and waits for programs the interpreter has not started yet.
    src = _pool(2 * 3 * BLOCK)
    a, b, counter, err = _zeros(3), _zeros(3), _zeros(1), _zeros(1)
    bench.persistent(src, a, b, counter, err, 3, BLOCK, barrier=True, poll_load=poll_load, max_spin=3)
    assert int(err) == 1
    assert int(counter) == 3  # every program still arrived once: the next launch's epoch is intact


def test_epoch_target_ends_each_launch_at_the_next_multiple_of_the_grid():
    rng = random.Random(0)
    for grid in (1, 2, 7, 132, 528):
        counter = 0
        for _ in range(5):
            tickets = list(range(counter, counter + grid))
            rng.shuffle(tickets)  # arrival order does not matter
            targets = {bench.epoch_target(t, grid) for t in tickets}
            counter += grid
            assert targets == {counter}
            # Before the last arrival, no program of the launch sees its target.
            assert all(t + 1 < counter for t in tickets if t != counter - 1)


def test_blocks_per_sm_is_bounded_by_registers_warps_and_shared_memory():
    assert bench.blocks_per_sm(32, 4, 0) == 16  # 64 warps
    assert bench.blocks_per_sm(128, 4, 0) == 4  # 64K registers
    assert bench.blocks_per_sm(32, 1, 0) == 32  # 32 blocks
    assert bench.blocks_per_sm(32, 4, 100 * 1024) == 2  # 228 KB shared
    assert bench.blocks_per_sm(255, 8, 0) == 1


def test_fit_line_recovers_intercept_and_slope():
    a, b = bench.fit_line([1.0, 2.0, 4.0], [5.5, 7.5, 11.5])
    assert a == pytest.approx(3.5) and b == pytest.approx(2.0)


class _Graph:
    def replay(self):
        pass


class _Event:
    def __init__(self, enable_timing=False):
        self.at = 0.0

    def record(self):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a dry run of the script's bookkeeping on the CPU")
@pytest.mark.parametrize("sms", [1, 2])
def test_script_runs_end_to_end_with_the_gpu_faked(monkeypatch, capsys, sms):
    # 1 "MB" = 4 KB; CUDA graphs and events replaced by no-ops and the clock: the numbers mean
    # nothing, but every check against torch runs. On 2 "SMs" program 0 waits for a program the
    # interpreter has not started: the barrier columns must say so instead of hanging.
    monkeypatch.setattr(bench, "MB", 4096)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(name="fake", multi_processor_count=sms))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    bench.main(["--sizes-mb", "1,2", "--boundary-mb", "1", "--ks", "1,2", "--pool-mb", "4", "--block-kb", "1",
                "--persistent-block-kb", "1", "--warps", "1", "--replays", "1", "--min-units", "1",
                "--max-spin", "2"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 | ")]
    table = [r for r in rows if len(r) == 16]
    assert [r[5] for r in table] == ["1", "2"] and [r[6] for r in table] == [str(sms), str(2 * sms)]
    # k=2 has no known occupancy under the interpreter: not run.
    assert table[1][7] == table[1][8] == table[1][10] == table[1][12] == "k>1"
    assert all(_is_number(r[i]) for r in table for i in (14, 15))  # the dependent launches' pair
    if sms == 1:
        assert all(_is_number(table[0][i]) for i in range(7, 14))
    else:
        assert _is_number(table[0][7]) and table[0][8] == table[0][10] == table[0][12] == "barrier timed out"


def _is_number(text):
    try:
        float(text.strip(" |"))
    except ValueError:
        return False
    return True
