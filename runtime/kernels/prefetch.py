"""L2 prefetch of a weight's bytes ahead of the matvec that reads them.

A decode step's small matvecs (qkv, o) are too short for DRAM to reach full speed, and between them
run latency-bound kernels (RoPE + KV append, attention, residual + norm) during which DRAM is idle.
A prefetch launched before those kernels asks the memory system for the next small weight's bytes
and returns at once; the matvec then finds them in L2 (50 MB on an H200) or in flight.

    weight_tensors(ops)   the device tensors the matvecs of `ops` read (packed parts or weight, bias)
    byte_ranges(tensors)  their storage as disjoint [start, end) address ranges, in whole 128-byte lines
    Prefetch(tensors)     one launch that prefetches those ranges: a table of (address, bytes) rows
                          on the device, LANES requests per program

The kernel issues, per lane, one bulk prefetch (`cp.async.bulk.prefetch.L2.global`, sm_90 on: the
TMA unit fetches up to the whole segment) or, before sm_90, one `prefetch.global.L2` per 128-byte
line. A prefetch has no result to check: under Triton's interpreter the kernel issues nothing and
records the (address, bytes) segments its lanes would prefetch instead, which the tests compare with
the weights' storage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import triton
import triton.language as tl

from . import interpreting

LINE = 128  # bytes: ranges are whole cache lines (a bulk prefetch needs 16-byte alignment, a line more)
LANES = 32  # requests in flight per program (one warp)
PROGRAM_BYTES = 64 * 1024  # a table row: an 8 MB weight spreads over about one program per SM of an H200
NONE, BULK, LINES = 0, 1, 2  # what the kernel issues


@triton.jit
def _prefetch_kernel(table_ptr, record_ptr, LANES: tl.constexpr, ISSUE: tl.constexpr, RECORD: tl.constexpr):
    """Program p prefetches table row p: (address, bytes), both multiples of 128, split over LANES
    lanes in whole lines. RECORD: store each lane's (address, bytes) in record [programs, LANES, 2]."""
    row = tl.program_id(0)
    start = tl.load(table_ptr + 2 * row)
    length = tl.load(table_ptr + 2 * row + 1)
    lane_bytes = (length + LANES * 128 - 1) // (LANES * 128) * 128
    offset = tl.arange(0, LANES).to(tl.int64) * lane_bytes
    size = tl.minimum(tl.maximum(length - offset, 0), lane_bytes)
    address = start + offset
    if ISSUE == 1:  # one bulk request a lane; the TMA unit walks the segment, nothing waits for it
        tl.inline_asm_elementwise(
            """{
            .reg .pred p;
            setp.ne.s32 p, $2, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0;
            }""", "=r,l,r", [address, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    if ISSUE == 2:  # one request a line
        for line in range(0, lane_bytes, 128):
            tl.inline_asm_elementwise(
                """{
                .reg .pred p;
                setp.ne.s32 p, $2, 0;
                @p prefetch.global.L2 [$1];
                mov.u32 $0, 0;
                }""", "=r,l,r", [address + line, (line < size).to(tl.int32)], dtype=tl.int32, is_pure=False,
                pack=1)
    if RECORD:
        lanes = row * LANES + tl.arange(0, LANES)
        tl.store(record_ptr + 2 * lanes, address)
        tl.store(record_ptr + 2 * lanes + 1, size)


def weight_tensors(ops: Iterable) -> list[torch.Tensor]:
    """The tensors the matvecs of `ops` (LinearOps) read: a kernel op's packed parts (codes, scales,
    offsets, ...) or its dense weight, the torch ops' stored bytes or weight; and each one's bias."""
    out = []
    for op in ops:
        parts = getattr(op, "parts", None)
        if parts:
            out += list(parts.values())
        elif getattr(op, "weight", None) is not None:
            out.append(op.weight)
        else:
            out.append(op.raw)
        if op.bias is not None:
            out.append(op.bias)
    return out


def byte_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The storage of `tensors` (each contiguous) as sorted, disjoint [start, end) address ranges,
    each widened to whole 128-byte lines; tensors whose lines touch or overlap share a range."""
    spans = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"prefetch takes contiguous tensors, got strides {t.stride()} for shape {tuple(t.shape)}")
        if t.numel():
            begin = t.data_ptr()
            spans.append((begin // LINE * LINE, -(-(begin + t.numel() * t.element_size()) // LINE) * LINE))
    out: list[tuple[int, int]] = []
    for begin, end in sorted(spans):
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def table_rows(ranges: Sequence[tuple[int, int]], program_bytes: int = PROGRAM_BYTES) -> list[tuple[int, int]]:
    """(address, bytes) of each program: the ranges cut into pieces of at most `program_bytes`."""
    return [(address, min(program_bytes, end - address))
            for begin, end in ranges for address in range(begin, end, program_bytes)]


def issue_kind(device: torch.device) -> int:
    """What the kernel issues on `device`: bulk prefetches from sm_90 on, line prefetches before, and
    nothing under the interpreter."""
    if interpreting() or device.type != "cuda":
        return NONE
    return BULK if torch.cuda.get_device_capability(device) >= (9, 0) else LINES


class Prefetch:
    """One launch that prefetches the storage of `tensors` (on `device`) into L2; its table of rows
    has a fixed address, so a captured graph can hold the launch. `record` (issuing nothing, or
    when asked): [programs, LANES, 2] int64, the (address, bytes) each lane covered in the last call."""

    def __init__(self, tensors: Iterable[torch.Tensor], device: torch.device, *, record: bool | None = None):
        self.device = torch.device(device)
        self.ranges = byte_ranges(tensors)
        rows = table_rows(self.ranges)
        self.table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 2).to(self.device)
        self.issue = issue_kind(self.device)
        keep = self.issue == NONE if record is None else record
        self.record = torch.zeros(len(rows), LANES, 2, dtype=torch.int64, device=self.device) if keep else None

    @property
    def nbytes(self) -> int:
        return sum(end - begin for begin, end in self.ranges)

    def __call__(self) -> None:
        if not len(self.table):
            return
        record = self.record if self.record is not None else self.table
        _prefetch_kernel[(len(self.table),)](self.table, record, LANES=LANES, ISSUE=self.issue,
                                             RECORD=self.record is not None, num_warps=1)

