"""int4 weights (ir/formats/grouped_int.py, one 4-bit plane) times a few rows of activations: the
linear layers of a batched decode step (runtime/batch_engine.py), 2 to 64 sequences.

Between the matrix-vector product (one row: every weight used once) and the prefill matmul (many
rows: compute-bound), a batched step is still bound by reading the weight once, so the tiles are
shaped for bandwidth: each program takes a band of BN output rows (16, 32 or 64, timed per shape
and batch size: narrow bands fill the device without split-K, wide ones read the activations fewer
times) and walks its columns BK at a time, loading the band's packed codes as 32-bit words (eight
codes a word, in the format's order: code j of a word at bits 4j), turning them into the compute
dtype with the group's scale (one scale a row and step: BK divides the group) and multiplying with
tl.dot against all the rows of activations at once. Every output row is computed from its own
activations only, whatever the other rows hold.

Two schemes, timed against each other per shape and row count (`candidates`):
- "rows": the band's codes unpacked into a [BN, BK] tile (a reshape of [BN, BK / 8, 8]) for one
  tl.dot a step; the reshape moves every code between lanes through shared memory.
- "nibble": no reshape. Code position j (0..7) of every word is one [BN, BK / 8] tile by itself,
  the codes of columns k0 + 8c + j, so a step is eight tl.dots of [BM, BK / 8] activations (a
  stride-8 load of x, cheap: x is a few KB and stays in cache) against those tiles. Each word is
  loaded once and shifted in place; the group scale (and offset) is one [BN, BK / 8] load a step
  (BK / 8 consecutive words never cross a group of 32 or more).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import next_power_of_2
from .tiles import dot_tile


@triton.jit
def _dequant(codes, scale, offset, MID: tl.constexpr, ASYM: tl.constexpr):
    """Codes (0..15) to float32 weights with their group's scale (and offset)."""
    if ASYM:  # noqa: SIM108  (constexpr branches: only one is compiled)
        w = codes.to(tl.float32) * scale + offset
    else:
        w = (codes - MID).to(tl.float32) * scale
    return w


@triton.jit
def _rows_kernel(x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, M, N, K, MID: tl.constexpr,
                 ASYM: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 NIBBLE: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """Program i: out[:M, i*BN:(i+1)*BN] = x[:M] @ W[rows].T (+ bias), W read once; NIBBLE: by code
    position (eight dots a step), else one [BN, BK] tile a step."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    tok = tl.arange(0, BM)
    tok_mask = tok < M
    c = tl.arange(0, BK // 8)
    row_words = rows[:, None].to(tl.int64) * (K // 8)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        # The band's codes: BK / 8 words a row, 16-byte loads along the row.
        words = tl.load(w_ptr + row_words + (k0 // 8 + c)[None, :])
        if NIBBLE:
            side = rows[:, None].to(tl.int64) * (K // G) + ((k0 + 8 * c) // G)[None, :]
            scale = tl.load(scale_ptr + side).to(tl.float32)
            offset = tl.load(offset_ptr + side).to(tl.float32) if ASYM else scale
            x_row = x_ptr + tok[:, None] * K + (k0 + 8 * c)[None, :]
            for j in tl.static_range(8):
                w = _dequant((words >> (4 * j)) & 0xF, scale, offset, MID, ASYM)
                x = tl.load(x_row + j, mask=tok_mask[:, None], other=0.0)
                acc += dot_tile(x, w.to(x.dtype), IEEE)
        else:
            codes = tl.reshape((words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF, [BN, BK])
            side = rows.to(tl.int64) * (K // G) + k0 // G
            scale = tl.load(scale_ptr + side).to(tl.float32)[:, None]
            offset = tl.load(offset_ptr + side).to(tl.float32)[:, None] if ASYM else scale
            w = _dequant(codes, scale, offset, MID, ASYM)
            x = tl.load(x_ptr + tok[:, None] * K + (k0 + tl.arange(0, BK))[None, :], mask=tok_mask[:, None],
                        other=0.0)
            acc += dot_tile(x, w.to(x.dtype), IEEE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
    tl.store(out_ptr + tok[:, None] * N + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=tok_mask[:, None])


MAX_ROWS = 64


def takes(op) -> bool:
    """Whether `rows_matmul` runs this LinearOp: a Triton int4 weight (one plane, no high bits) whose
    shape the tiles divide."""
    return (getattr(op, "implementation", "") == "triton" and op.format == "int4"
            and getattr(op, "wh", None) == 0 and op.out_features % 16 == 0 and _block_k(op) is not None)


def _block_k(op) -> int | None:
    group = op.group
    block = min(group, 128)
    if group % block or op.in_features % block or block % 32:
        return None
    return block


def block_candidates(op) -> list[int]:
    """Output rows per program worth timing for `op`: narrow bands fill the device, wide ones read
    the activations fewer times (every program reads all of them)."""
    return [bn for bn in (16, 32, 64) if op.out_features % bn == 0]


SCHEMES = ("rows", "nibble")


def candidates(op) -> list[tuple[str, int]]:
    """(scheme, band width) pairs worth timing for `op` (the nibble scheme needs 128 columns a
    step: eight dots of at least 16)."""
    out = [("rows", bn) for bn in block_candidates(op)]
    if op.in_features % 128 == 0 and op.group % 32 == 0:
        out += [("nibble", bn) for bn in block_candidates(op)]
    return out


def rows_matmul(op, x: torch.Tensor, block_n: int = 16, scheme: str = "rows") -> torch.Tensor:
    """x [M, K] (M <= 64) @ W.T (+ bias) -> [M, N] in x's dtype, for an op `takes` accepts, in bands
    of `block_n` output rows, by `scheme` ((scheme, block_n) one of candidates(op))."""
    M, K = x.shape
    N = op.out_features
    if (not takes(op) or op.in_features != K or not 1 <= M <= MAX_ROWS
            or (scheme, block_n) not in candidates(op)):
        raise ValueError(f"rows_matmul takes int4 weights, 1..{MAX_ROWS} rows of {op.in_features} and a scheme and "
                         f"band of candidates(op), got {op!r}, {tuple(x.shape)}, {scheme} and {block_n}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bn = block_n
    bias = op.bias if op.bias is not None else x
    nibble = scheme == "nibble"
    _rows_kernel[(N // bn,)](
        x.contiguous(), op.low32, op.scales, op.offsets, bias, out, M, N, K, MID=op.mid, ASYM=op.asym, G=op.group,
        BM=max(16, next_power_of_2(M)), BN=bn, BK=128 if nibble else _block_k(op), NIBBLE=nibble,
        HAS_BIAS=op.bias is not None, IEEE=x.dtype == torch.float32 or interpreting(), num_warps=4,
        num_stages=3 if nibble else 4)
    return out
