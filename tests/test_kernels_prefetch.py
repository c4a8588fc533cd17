"""L2 prefetch of weights (kernels/prefetch.py): the ranges it computes and the segments it issues.

A prefetch has no result to compare; what can be wrong is which bytes it asks for. The ranges must
cover every byte of the weight's tensors and no line that holds none of them, and the kernel's lanes
must tile the ranges exactly (under the interpreter the kernel records its lanes' segments instead of
issuing them; on a GPU it records them while issuing).
"""

import pytest
import torch
from kernel_support import DEVICE, HAS_CUDA
from linear_kernel_cases import make_op


def _covered(record: torch.Tensor) -> list[tuple[int, int]]:
    """The [start, end) ranges the lanes of a launch covered, exactly adjacent segments joined (an
    overlap or a gap leaves two)."""
    spans = sorted((a, a + n) for a, n in record.reshape(-1, 2).tolist() if n > 0)
    out: list[tuple[int, int]] = []
    for begin, end in spans:
        if out and begin == out[-1][1]:
            out[-1] = (out[-1][0], end)
        else:
            out.append((begin, end))
    return out


def _tensors():
    """Views at odd offsets into one buffer (some a few bytes apart, one far), and a separate tensor."""
    buffer = torch.zeros(400_000, dtype=torch.uint8, device=DEVICE)
    return [buffer[3:1003], buffer[1010:1050],
            buffer[5000:205_000].view(torch.int16), buffer[300_001:300_002],
            torch.zeros(77, dtype=torch.bfloat16, device=DEVICE)]


def _spans(tensors):
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


def test_ranges_cover_the_tensors_in_whole_lines_and_nothing_else():
    from thin.runtime.kernels.prefetch import LINE, byte_ranges

    tensors = _tensors()
    ranges = byte_ranges(tensors)
    assert all(b % LINE == 0 and e % LINE == 0 and b < e for b, e in ranges)
    assert all(e1 < b2 for (_, e1), (b2, _) in zip(ranges, ranges[1:])), "sorted and disjoint, not touching"
    for begin, end in _spans(tensors):  # every byte of every tensor
        assert any(b <= begin and end <= e for b, e in ranges)
    for b, e in ranges:  # every line holds a byte of some tensor
        for line in range(b, e, LINE):
            assert any(begin < line + LINE and line < end for begin, end in _spans(tensors)), hex(line)
    def home(t):
        return next(i for i, (b, e) in enumerate(ranges) if b <= t.data_ptr() < e)

    # the first two tensors are 7 bytes apart: one range; the third and fourth lie far apart
    assert home(tensors[0]) == home(tensors[1]) != home(tensors[2]) != home(tensors[3])


def test_table_rows_tile_the_ranges():
    from thin.runtime.kernels.prefetch import table_rows

    ranges = [(0, 128), (1024, 1024 + 5 * 256 + 128)]
    rows = table_rows(ranges, program_bytes=256)
    assert rows == [(0, 128), (1024, 256), (1280, 256), (1536, 256), (1792, 256), (2048, 256), (2304, 128)]


def test_launch_lanes_tile_the_ranges_exactly():
    """Rows of 64 KB and a partial last row (lanes left idle), and small ranges of one or a few lines."""
    from thin.runtime.kernels.prefetch import LANES, Prefetch

    tensors = _tensors()
    fetch = Prefetch(tensors, DEVICE, record=True)
    assert len(fetch.table) > len(fetch.ranges) > 1
    fetch.record.fill_(-1)
    fetch()
    assert _covered(fetch.record) == fetch.ranges
    sizes = fetch.record[..., 1]
    assert bool((sizes % 128 == 0).all()) and bool((fetch.record[..., 0] % 128 == 0).all())
    assert fetch.record.shape == (len(fetch.table), LANES, 2) and bool((sizes == 0).any())
    assert fetch.nbytes == sum(e - b for b, e in fetch.ranges)


@pytest.mark.parametrize("fmt, params", [("int4", {"group_size": 32}), ("fp8_e4m3", {}), ("bf16", {})])
def test_weight_tensors_are_the_stored_parts_and_bias(fmt, params):
    """A packed weight: its parts (codes, scales, ...), which together are its blob; a dense one: the
    weight the kernel reads; both with the bias."""
    from thin.runtime.kernels.prefetch import byte_ranges, weight_tensors

    op, _, bias = make_op(fmt, (64, 96), params, bias=True)
    tensors = weight_tensors([op])
    assert any(t.data_ptr() == bias.data_ptr() for t in tensors)
    stored = [bias] + (list(op.parts.values()) if op.parts else [op.weight])
    assert byte_ranges(tensors) == byte_ranges(stored)
    if op.parts:
        assert byte_ranges(tensors) == byte_ranges([op.raw, bias])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="issues prefetches on a GPU")
def test_issued_prefetch_records_the_same_segments_and_leaves_the_bytes():
    from thin.runtime.kernels.prefetch import NONE, Prefetch

    tensors = _tensors()
    for t in tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 255, (t.numel() * t.element_size(),), dtype=torch.uint8))
    before = [t.clone() for t in tensors]
    fetch = Prefetch(tensors, DEVICE, record=True)
    assert fetch.issue != NONE
    fetch()
    torch.cuda.synchronize()
    assert _covered(fetch.record) == fetch.ranges
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
