"""int8: symmetric 8-bit integers, one scale per output row.

Math: value[r, c] = values[r, c] * scales[r], values in [-127, 127] (-128 is never written, so
the grid is symmetric about zero).

Layout of a weight [N, K] (parts 16-byte aligned, in this order):
    values  int8 [N, K]      row-major, one byte per weight
    scales  float32 [N]      one per row
Bits per weight: 8 + 32 / K.

Reference quantizer (round to nearest): scale = amax_row / 127, kept to 16 significant bits (see
`quantized.SCALE_SIGNIFICANT_BITS`), 1 for an all-zero row; values = clamp(round(w / scale),
-127, 127), rounding half to even. Importance-weighted fits also try amax times each of
`quantized.RANGE_FACTORS` (clipping).

Why this layout suits a matrix-vector kernel: a row's K bytes are contiguous, so loads are fully
coalesced and a 16-byte load yields 16 weights; int8 converts to float in one instruction (or
feeds an int8 dot-product instruction directly). The row's scale is applied once, after the dot
product, from its own small array.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import layout
from .quantized import RANGE_FACTORS, GroupQuantizer, QuantizedFormat, float32_scale

TOP = 127


@dataclass(frozen=True)
class Int8(QuantizedFormat):
    def parts(self, shape, params=()):
        shape = tuple(shape)
        self.require(shape, params)
        n, k = shape
        return layout([("values", "int8", (n, k), n * k), ("scales", "float32", (n,), 4 * n)])

    def _values(self, parts, shape, p):
        return values(parts["values"], {"scale": parts["scales"].unsqueeze(1)})

    def _quantizer(self, shape, p):
        return _Int8Quantizer(self, shape, p, block=shape[1])


def values(codes, grid):
    """What int8 codes stand for under per-row `grid["scale"]` (float32)."""
    return codes.float() * grid["scale"]


class _Int8Quantizer(GroupQuantizer):
    """One grid per row: the row's scale."""

    def plain(self, groups):
        return {"scale": float32_scale(groups.abs().amax(-1), TOP)}

    def candidates(self, groups, imp):
        amax = groups.abs().amax(-1)
        for factor in RANGE_FACTORS:
            yield {"scale": float32_scale(amax * factor, TOP)}

    def codes(self, w, grid):
        import torch

        return torch.round(w / grid["scale"]).clamp(-TOP, TOP).to(torch.int8)

    def values(self, codes, grid):
        return values(codes, grid)

    def parts(self, codes, grid):
        return {"values": codes, "scales": grid["scale"][:, 0]}


INT8 = Int8("int8", "symmetric int8 per weight, one float32 scale per row")
