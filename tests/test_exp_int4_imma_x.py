"""The int8 tensor-core int4 experiments whose activations come another way (examples/benchmarks/
exp_int4_imma_max.py: bfloat16 x and its groups' max, rounded in the kernel; exp_int4_imma_cols.py: int8 codes with
a scale a chunk of 16, each chunk in its own column of the mma's B): on the packed planes as the format stores
them, each gives the format's decode times x as it rounds x, through the mma's interpreter twin on the CPU and the
mma on the GPU."""

import os
import sys

import pytest
import torch
from kernel_support import DEVICE

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "benchmarks"))

import exp_int4_imma as imma  # noqa: E402
import exp_int4_imma_cols as cols  # noqa: E402
import exp_int4_imma_max as by_max  # noqa: E402

CASES = pytest.mark.parametrize("case", [imma.CASES[0], imma.CASES[-2], imma.CASES[-1]],
                                ids=["one warp, one tile", "two tiles, groups past K", "groups past K"])


@CASES
def test_rounded_by_the_groups_max_matches_the_decode(case):
    err, err_x = by_max.relative_errors(*case, DEVICE, seed=case[0] + case[1])
    assert err < (3e-3 if DEVICE != "cpu" else 1e-5)  # on the GPU a value at a half may round either way
    assert err_x < 2e-2


@CASES
def test_chunks_in_columns_match_the_decode(case):
    err, err_x = cols.relative_errors(*case, DEVICE, seed=case[0] + case[1])
    assert err < 1e-5
    assert err_x < 1e-2  # x's own int8 rounding, a scale a chunk of 16


@pytest.mark.parametrize("case", [imma.CASES[0], imma.CASES[1]], ids=["one tile", "two tiles"])
def test_emitted_rows_are_the_next_matvecs_x(case):
    """EMIT (a producer's share of the work): the rows go out as quantize_x_cols lays them."""
    codes, scales = cols.emitted(*case, DEVICE, seed=case[1])
    assert codes and scales


def test_chunk_codes_lie_in_the_fragments_order_then_zeros():
    x = torch.randn(256, generator=torch.Generator().manual_seed(7))
    words, scales = cols.quantize_x_cols(x)
    want = x.reshape(16, 16).abs().amax(1) / 127
    assert torch.allclose(scales, want)
    q = torch.round(x.reshape(16, 16) / want[:, None]).clamp(-127, 127).to(torch.int64).reshape(-1)
    assert torch.equal(words[64:], torch.zeros(64, dtype=torch.int32))
    w = words.to(torch.int64) % 2**32
    # chunk c's words e0, e1, o0, o1 (its first 16 columns), e2, e3, o2, o3: octet j's even or odd columns
    for c, j, p, m in [(0, 0, 0, 0), (3, 2, 1, 3), (7, 3, 1, 1), (5, 1, 0, 2)]:
        byte = (int(w[8 * c + 4 * (j // 2) + 2 * p + j % 2]) >> (8 * m)) & 0xFF
        assert byte == int(q[32 * c + 8 * j + p + 2 * m]) % 256


def test_a_chunk_scale_is_not_shared():
    """One large value in a chunk of 16 leaves its neighbours' chunks their own scales (unlike a group of 128)."""
    x = torch.randn(128, generator=torch.Generator().manual_seed(8)).bfloat16()
    x[3] = 50.0
    near = cols.dequantized_x_cols(x)
    assert (near[16:] - x[16:].float()).abs().max() < x[16:].float().abs().max() / 127
    assert (imma.dequantized_x(x)[16:] - x[16:].float()).abs().max() > 0.1
