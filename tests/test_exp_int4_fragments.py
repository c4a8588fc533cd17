"""The tensor-core int4 experiment (examples/benchmarks/exp_int4_fragments.py): its re-packed fragment words give
the format's decode times x, through the kernels' interpreter twin on the CPU and their mma path on the GPU, for
the group-by-group kernel and the one that loads a warp's whole run at once."""

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


@pytest.mark.parametrize("case", [frag.FLAT_CASES[1], frag.FLAT_CASES[-1]], ids=["two tiles, splits", "odd run"])
def test_flat_matvec_matches_the_decode(case):
    assert frag.flat_relative_error(*case, DEVICE, seed=case[0] + case[1]) < 1e-5


def test_repacking_keeps_every_code_in_its_place():
    codes = torch.randint(0, 16, (32, 256), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    words = frag.repack(codes).to(torch.int64) % 2**32  # [tile, step, lane, slice]
    # lane 4g + t, slice j of step s: row g's columns 64s + 16t + 4j + (0, 1, 2, 3) at nibbles 0, 4, 2, 6, row g + 8's
    # one nibble up
    tile, step, g, t, j = 1, 2, 5, 3, 1
    word = int(words[tile, step, 4 * g + t, j])
    col = 64 * step + 16 * t + 4 * j
    for half in range(2):
        row = 16 * tile + g + 8 * half
        got = [(word >> (4 * (nibble + half))) & 15 for nibble in (0, 4, 2, 6)]
        assert got == codes[row, col:col + 4].tolist()
    nibbles = torch.stack([(words.flatten() >> (4 * i)) & 15 for i in range(8)]).flatten()
    assert torch.equal(torch.bincount(nibbles, minlength=16), torch.bincount(codes.flatten().long(), minlength=16))
