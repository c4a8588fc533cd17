"""The tensor-core int4 experiment (examples/benchmarks/exp_int4_fragments.py): its re-packed fragment words and
x fragments give the format's decode times x, through the kernel's interpreter twin on the CPU and its mma path
on the GPU."""

import os
import sys

import pytest
import torch
from kernel_support import DEVICE

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "benchmarks"))

import exp_int4_fragments as frag  # noqa: E402


@pytest.mark.parametrize("case", [frag.CASES[0], frag.CASES[-1]], ids=["one tile a warp", "two tiles, ahead"])
def test_fragment_matvec_matches_the_decode(case):
    assert frag.relative_error(*case, DEVICE, seed=case[0] * case[1]) < 1e-5


def test_repacking_keeps_every_code():
    codes = torch.randint(0, 16, (32, 256), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    words = frag.repack(codes).view(-1).to(torch.int64) % 2**32
    nibbles = torch.stack([(words >> (4 * i)) & 15 for i in range(8)]).flatten()
    assert torch.equal(torch.bincount(nibbles, minlength=16), torch.bincount(codes.flatten().long(), minlength=16))
