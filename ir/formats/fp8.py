"""fp8_e4m3: one float8 e4m3fn value per weight, scaled per output row.

Math: value[r, c] = float(values[r, c]) * scales[r].

Layout of a weight [N, K] (parts 16-byte aligned, in this order):
    values  float8_e4m3fn [N, K]   row-major, one byte per weight
    scales  float32 [N]            one per row
Bits per weight: 8 + 32 / K.

Reference quantizer (round to nearest): scale = amax_row / 448 (448 is e4m3fn's largest finite
value), kept to 16 significant bits (see `quantized.SCALE_SIGNIFICANT_BITS`), 1 for an all-zero
row; values = e4m3(clamp(w / scale, -448, 448)), rounding to nearest even. Importance-weighted
fits also try amax times each of `quantized.RANGE_FACTORS` (clipping).

Why this layout suits a matrix-vector kernel: a row's K bytes are contiguous, so a warp reading
one row issues fully coalesced 16-byte loads, and on GPUs with fp8 support the bytes convert to
half precision in one instruction. The row's scale is applied once, after the dot product, from
a separate small array that stays in cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import layout
from .quantized import E4M3_MAX, RANGE_FACTORS, GroupQuantizer, QuantizedFormat, float32_scale, to_e4m3


@dataclass(frozen=True)
class Fp8E4M3(QuantizedFormat):
    def parts(self, shape, params=()):
        shape = tuple(shape)
        self.require(shape, params)
        n, k = shape
        return layout([("values", "float8_e4m3fn", (n, k), n * k), ("scales", "float32", (n,), 4 * n)])

    def _values(self, parts, shape, p):
        return values(parts["values"], {"scale": parts["scales"].unsqueeze(1)})

    def _quantizer(self, shape, p):
        return _Fp8Quantizer(self, shape, p, block=shape[1])


def values(codes, grid):
    """What e4m3 codes stand for under per-row `grid["scale"]` (float32)."""
    return codes.float() * grid["scale"]


class _Fp8Quantizer(GroupQuantizer):
    """One grid per row: the row's scale."""

    def plain(self, groups):
        return {"scale": float32_scale(groups.abs().amax(-1), E4M3_MAX)}

    def candidates(self, groups, imp):
        amax = groups.abs().amax(-1)
        for factor in RANGE_FACTORS:
            yield {"scale": float32_scale(amax * factor, E4M3_MAX)}

    def codes(self, w, grid):
        return to_e4m3(w / grid["scale"])

    def values(self, codes, grid):
        return values(codes, grid)

    def parts(self, codes, grid):
        return {"values": codes, "scales": grid["scale"][:, 0]}


FP8_E4M3 = Fp8E4M3("fp8_e4m3", "float8 e4m3fn per weight, one float32 scale per row")
