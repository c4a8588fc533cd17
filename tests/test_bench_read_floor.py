"""The read-only kernels of examples/benchmarks/bench_read_floor.py and bench_step_floor.py read what they are
given (their stored xor is the data's) and the step floor's writes zeros over the whole output, under the
interpreter (launched plainly: it has no grid-dependency instructions)."""

import importlib.util
from functools import reduce
from pathlib import Path

import pytest
import torch
from kernel_support import DEVICE


def _load(name):
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _xor(t):
    return reduce(lambda a, b: a ^ b, t.flatten().tolist(), 0)


def test_read_floor_stores_each_programs_xor():
    floor = _load("bench_read_floor")
    per, nw, programs = 2, 1, 3
    src = torch.randint(-2**31, 2**31 - 1, (programs * 32 * nw * per * 4,), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = torch.empty(programs, dtype=torch.int32, device=DEVICE)
    floor._read[(programs,)](src, out, per, nw, 0, num_warps=nw)
    chunk = 32 * nw * per * 4
    want = [(_xor(src[p * chunk:(p + 1) * chunk].cpu()) + 2**31) % 2**32 - 2**31 for p in range(programs)]
    assert out.cpu().tolist() == want


@pytest.mark.parametrize("chain, work, post", [(0, 0, 0), (5, 0, 0), (0, 3, 0), (0, 3, 2)],
                         ids=["no chain", "a chain of 5 after the wait", "3 multiply-adds a word after the wait",
                              "and 2 loads a lane after the wait"])
def test_step_floor_writes_zeros_over_the_whole_output(chain, work, post):
    floor = _load("bench_step_floor")
    gen = torch.Generator().manual_seed(1)
    words = torch.randint(-2**31, 2**31 - 1, (3000,), dtype=torch.int32, generator=gen).to(DEVICE)
    scales = torch.randint(-2**31, 2**31 - 1, (40,), dtype=torch.int32, generator=gen).to(DEVICE)
    out = torch.full((2500,), 7.0, dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(300, generator=gen).bfloat16().to(DEVICE)
    programs_words = -(-3000 // (32 * 1 * (2 + post) * 4))  # 2 (+ post) loads of 4 words a lane, one warp
    programs = programs_words + 1
    floor._read_zero[(programs,)](words, 3000, scales, 40, out, 2500, -(-2500 // programs), programs_words, x, 300,
                                  2, 1, 16, False, chain, work, False, post, num_warps=1)
    assert torch.count_nonzero(out).item() == 0


@pytest.mark.parametrize("way", ["groups", "IMMA_CHUNKS", "IMMA_MAX", "IMMA_COLS", "IMMA_EMIT"])
def test_imma_step_binds_each_ways_matvec_once(way, monkeypatch):
    """--imma: each op's launch is bound once (its x made and quantized the way's way) and then only launched."""
    import sys
    import types

    floor = _load("bench_step_floor")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
    import exp_int4_imma
    import exp_int4_imma_cols
    import exp_int4_imma_max

    calls = []
    for module in (exp_int4_imma, exp_int4_imma_cols, exp_int4_imma_max):
        monkeypatch.setattr(module, "matvec", lambda *a, module=module, **kw: calls.append((module.__name__, a, kw)))
    for flag in ("IMMA_CHUNKS", "IMMA_MAX", "IMMA_COLS", "IMMA_EMIT"):
        monkeypatch.setattr(floor, flag, flag == way or (way == "IMMA_EMIT" and flag == "IMMA_COLS"))
    n, k = 32, 256
    op = types.SimpleNamespace(out_features=n, in_features=k, low32=torch.zeros(n * k // 8, dtype=torch.int32),
                               scales=torch.ones(n * k // 128, dtype=torch.float16))
    config = types.SimpleNamespace(split=1)
    for _ in range(2):
        assert floor._imma_step_matvec(op, torch.zeros(k), None, config, -1, False) == 1
    module = {"groups": "exp_int4_imma", "IMMA_CHUNKS": "exp_int4_imma", "IMMA_MAX": "exp_int4_imma_max"}.get(
        way, "exp_int4_imma_cols")
    assert [c[0] for c in calls] == [module, module] and calls[0][1][0] is calls[1][1][0]  # bound once
    assert all(c[2]["pdl"] == 1 for c in calls) and calls[0][2].get("chunks", False) == (way == "IMMA_CHUNKS")
    assert (calls[0][2].get("emit") is not None) == (way == "IMMA_EMIT")
