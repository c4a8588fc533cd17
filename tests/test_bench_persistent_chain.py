"""The prototype of examples/benchmarks/bench_persistent_chain.py at tiny shapes against torch: the chain of
launches, and the persistent kernel on one program (under the interpreter the programs of a launch run one
after another, so a barrier over several cannot complete there; one program has nothing to wait for)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from kernel_support import DEVICE

_SPEC = importlib.util.spec_from_file_location(
    "bench_persistent_chain", Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "bench_persistent_chain.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

# qkv rows past the hidden size, as llama's; row blocks of 4 over K in 32s; float32 activations (the interpreter
# truncates to bf16 where a GPU rounds to nearest, which compounds over the phases)
SHAPE = dict(H=64, NQ=96, F=128, dtype=torch.float32)


def _run(chain, run):
    chain.x.copy_(chain.x0)
    run()
    return chain.x.clone()


def test_launches_match_torch():
    chain = bench.Chain(2, **SHAPE, device=DEVICE)
    got = _run(chain, lambda: chain.launches(4, 32, 1))
    assert bench.rel_err(got, chain.reference()) < 1e-4


@pytest.mark.parametrize("barrier", [False, True])
def test_persistent_on_one_program_matches_the_launches(barrier):
    chain = bench.Chain(2, **SHAPE, device=DEVICE, seed=1)
    launched = _run(chain, lambda: chain.launches(4, 32, 1))
    got = _run(chain, lambda: chain.persistent(1, 4, 32, 1, barrier=barrier, max_spin=4))
    assert torch.equal(got, launched)  # the same program code over the same row blocks, in the same order
    assert int(chain.err) == 0
    # every barrier counts one arrival: 4 a layer
    assert int(chain.counter) == (8 if barrier else 0)


def test_weight_bytes_count_int8_weights_and_float32_scales():
    chain = bench.Chain(1, **SHAPE, device=DEVICE)
    H, NQ, F = SHAPE["H"], SHAPE["NQ"], SHAPE["F"]  # noqa: N806
    assert chain.weight_bytes() == (NQ * H + H * H + 2 * F * H + H * F) + 4 * (NQ + H + 2 * F + H)


def test_script_refuses_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("grid", [None, 3])
def test_pipelined_launches_match_the_plain_ones(grid):
    chain = bench.Chain(2, **SHAPE, device=DEVICE, seed=2)
    launched = _run(chain, lambda: chain.launches(4, 32, 1))
    got = _run(chain, lambda: chain.launches(4, 32, 1, stages=3, grid=grid))
    assert bench.rel_err(got, launched) < 1e-6  # the same sums; only the row blocks' order on the programs moves


def test_pipelined_persistent_on_one_program_matches_the_launches():
    chain = bench.Chain(2, **SHAPE, device=DEVICE, seed=3)
    launched = _run(chain, lambda: chain.launches(4, 32, 1, stages=2, grid=1))
    got = _run(chain, lambda: chain.persistent(1, 4, 32, 1, max_spin=4, stages=2))
    assert torch.equal(got, launched)
    assert int(chain.err) == 0 and int(chain.counter) == 8


def test_tma_tiles_match_the_pointer_loads():
    bench.use_scratch_allocator()
    chain = bench.Chain(2, **SHAPE, device=DEVICE, seed=4)
    launched = _run(chain, lambda: chain.launches(4, 32, 1, stages=2, grid=3))
    assert torch.equal(_run(chain, lambda: chain.launches(4, 32, 1, stages=2, grid=3, tma=True)), launched)
    assert torch.equal(_run(chain, lambda: chain.persistent(1, 4, 32, 1, max_spin=4, stages=2, tma=True)),
                       _run(chain, lambda: chain.launches(4, 32, 1, stages=2, grid=1)))
