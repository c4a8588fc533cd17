"""The pieces the int4 kernel experiments share (examples/benchmarks/int4_lanes.py): `split4` gives a lane's 4
words in order at any rank, and `run_mode` runs the named mode or exits with the usage."""

import os
import sys

import pytest
import torch
from kernel_support import DEVICE  # first: it chooses the interpreter before Triton is imported

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "benchmarks"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from int4_lanes import run_mode, split4  # noqa: E402


@triton.jit
def _digits(src, out):
    """out[:8] from [8, 4] words, out[8:] from [2, 4, 4]: each a * 1000 + b * 100 + c * 10 + d of split4's 4."""
    a, b, c, d = split4(tl.load(src + tl.arange(0, 8)[:, None] * 4 + tl.arange(0, 4)[None, :]))
    tl.store(out + tl.arange(0, 8), a * 1000 + b * 100 + c * 10 + d)
    t = tl.load(src + tl.arange(0, 2)[:, None, None] * 16 + tl.arange(0, 4)[None, :, None] * 4
                + tl.arange(0, 4)[None, None, :])
    a, b, c, d = split4(t)
    tl.store(out + 8 + tl.arange(0, 2)[:, None] * 4 + tl.arange(0, 4)[None, :], a * 1000 + b * 100 + c * 10 + d)


def test_split4_gives_the_words_in_order_at_any_rank():
    src = (torch.arange(32, dtype=torch.int32) % 4 + 1).to(DEVICE)  # words 1, 2, 3, 4 in every lane
    out = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    _digits[(1,)](src, out)
    assert out.cpu().tolist() == [1234] * 16


def test_run_mode_runs_the_named_mode_and_refuses_others(monkeypatch):
    ran = []
    monkeypatch.setattr(sys, "argv", ["x", "bench"])
    run_mode({"check": lambda: ran.append("check"), "bench": lambda: ran.append("bench")}, "usage")
    monkeypatch.setattr(sys, "argv", ["x"])
    run_mode({"check": lambda: ran.append("check")}, "usage")
    assert ran == ["bench", "check"]
    monkeypatch.setattr(sys, "argv", ["x", "nonsense"])
    with pytest.raises(SystemExit, match="usage"):
        run_mode({"check": lambda: None}, "usage")
