"""The tensor-core int4 experiment (examples/benchmarks/exp_int4_fragments.py): its re-packed fragment words and
x fragments give the format's decode times x, through the kernel's interpreter twin on the CPU and its mma path
on the GPU."""

import os
import sys

import pytest
import torch
from kernel_support import DEVICE, HAS_CUDA

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "benchmarks"))

import exp_int4_fragments as frag  # noqa: E402


@pytest.mark.parametrize("n,k,split_k,warps,tiles,ahead,unroll", [(32, 256, 128, 1, 1, 0, 1),
                                                                    (128, 768, 384, 2, 2, 1, 2)])
def test_fragment_matvec_matches_the_decode(n, k, split_k, warps, tiles, ahead, unroll):
    gen = torch.Generator().manual_seed(n * k)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (0.02 * torch.rand(n, k // 128, generator=gen) - 0.01).half()
    x = torch.randn(k, generator=gen).bfloat16()
    xf = tuple(f.to(DEVICE) for f in frag.x_fragments(x))
    got = frag.matvec(frag.repack(codes).to(DEVICE), scales.to(DEVICE), xf, n, k, split_k, warps, HAS_CUDA, tiles,
                      ahead, unroll)
    want = frag.reference(codes, scales, x)
    assert ((got.sum(0).cpu() - want).norm() / want.norm()).item() < 1e-5
    # Re-packing is a permutation: every code appears once.
    words = frag.repack(codes).view(-1).to(torch.int64) % 2**32
    nibbles = torch.stack([(words >> (4 * i)) & 15 for i in range(8)]).flatten()
    assert torch.equal(torch.bincount(nibbles, minlength=16), torch.bincount(codes.flatten().long(), minlength=16))
