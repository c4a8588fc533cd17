"""The int8 tensor-core int4 experiment (examples/benchmarks/exp_int4_imma.py): on the packed planes as the format
stores them, it gives the format's decode times x rounded to int8, through the mma's interpreter twin on the CPU
and the mma on the GPU; and its int8 activations lie where each lane's B fragment takes them."""

import os
import sys

import pytest
import torch
from kernel_support import DEVICE

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "benchmarks"))

import exp_int4_imma as imma  # noqa: E402


@pytest.mark.parametrize("way", imma.X_WAYS)
@pytest.mark.parametrize("case", [imma.CASES[0], imma.CASES[-2], imma.CASES[-1]],
                         ids=["one warp, one tile", "two tiles, groups past K", "groups past K"])
def test_int8_mma_matvec_matches_the_decode(case, way):
    err, err_x = imma.relative_errors(*case, DEVICE, seed=case[0] + case[1], way=way)
    # on the GPU a value at a half may round either way (x rounded in the kernel)
    assert err < (3e-3 if way == "kernel" and DEVICE != "cpu" else 1e-5)
    assert err_x < 2e-2  # x's own int8 rounding, groups of 128 or chunks of 32


def test_the_kernels_rounding_at_a_half_is_the_references():
    """Seed 432's x has values at exactly half a code from their group's scale (63.5): the kernel's rounding of x
    (QX) and quantize_x's agree there."""
    err, _ = imma.relative_errors(48, 384, 2, 1, DEVICE, seed=432, way="kernel")
    assert err < (3e-3 if DEVICE != "cpu" else 1e-5)


def test_int8_activations_lie_in_the_fragments_order():
    x = torch.randn(256, generator=torch.Generator().manual_seed(5))
    words, scales, sums = imma.quantize_x(x)
    q = torch.round(x.reshape(2, 128) / scales[:, None]).clamp(-127, 127).to(torch.int64).reshape(-1)
    assert torch.equal(sums.long(), q.reshape(2, 128).sum(1))
    w = words.to(torch.int64) % 2**32
    # chunk c's words e0, e1, o0, o1, e2, e3, o2, o3: octet j's even (p 0) or odd (p 1) columns, one a byte
    for c, j, p, m in [(0, 0, 0, 0), (3, 2, 1, 3), (7, 3, 1, 1), (5, 1, 0, 2), (6, 2, 0, 1)]:
        byte = (int(w[8 * c + 4 * (j // 2) + 2 * p + j % 2]) >> (8 * m)) & 0xFF
        assert byte == int(q[32 * c + 8 * j + p + 2 * m]) % 256


def test_chunk_activations_lie_where_each_lane_takes_them():
    """CHUNKS: group q's lane t reads words 32q + 8t .. + 7, chunk j's even columns 8t + 2m then its odd ones."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(6))
    words, scales, _ = imma.quantize_x_chunks(x)
    chunk_scale = x.reshape(8, 32).abs().amax(1) / 127
    q = torch.round(x.reshape(8, 32) / chunk_scale[:, None]).clamp(-127, 127).to(torch.int64)
    assert torch.allclose(scales.reshape(2, 8)[:, :4].reshape(-1), chunk_scale)
    assert torch.allclose(scales.reshape(2, 8)[:, 4:].reshape(-1), -8 * chunk_scale * q.sum(1))
    w = words.to(torch.int64) % 2**32
    for group, t, j, p, m in [(0, 0, 0, 0, 0), (1, 3, 2, 1, 3), (0, 2, 3, 1, 1), (1, 1, 1, 0, 2)]:
        byte = (int(w[32 * group + 8 * t + 2 * j + p]) >> (8 * m)) & 0xFF
        assert byte == int(q[4 * group + j, 8 * t + 2 * m + p]) % 256


def test_chunk_major_gives_each_lane_its_word_of_every_chunk():
    words = torch.arange(2 * 32, dtype=torch.int32).reshape(2, 32)  # 2 rows, 2 groups of 4 chunks of 4 words
    relaid = imma.chunk_major(words)
    for row, group, t, j in [(0, 0, 0, 0), (1, 1, 3, 2), (0, 1, 1, 3)]:
        assert relaid[row, 16 * group + 4 * t + j] == words[row, 16 * group + 4 * j + t]
