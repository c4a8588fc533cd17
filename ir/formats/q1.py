"""q1: one sign bit per weight; a per-group magnitude stored as e4m3 under a float32 row scale.

Math, for the sign bit b of a weight in group j of row r:
    value = (2b - 1) * (row_scale[r] * float(scales[r, j]))      (b = 1: +, b = 0: -)

Layout of a weight [N, K] with group size g (parts 16-byte aligned, in this order):
    signs      uint8 [N, K / 8]            element 8i + j at bit j of byte i
    scales     float8_e4m3fn [N, K / g]    group magnitude / row_scale
    row_scale  float32 [N]
Bits per weight: 1 + 8 / g + 32 / K: 1.25 plus the row scale at the default g = 32, at most 1.5
all in for any K >= 128. (A group of 16 would cost 1.5 + 32 / K, just over 1.5, for 0.15 dB of SQNR
on Gaussian weights: not offered.)

Reference quantizer (round to nearest): the sign of each weight (its sign bit, so -0.0 stores
0); per group s_g = mean |w|, the magnitude minimizing the squared error of a sign quantizer;
row_scale = max_g s_g / 448 (kept to 16 significant bits, see
`quantized.SCALE_SIGNIFICANT_BITS`, 1 for an all-zero row); scales = e4m3(s_g / row_scale),
clamped to +-448. `start` takes the row scale from the whole weight. Importance-weighted fits use
the weighted mean sum(imp * |w|) / sum(imp), tried at both e4m3 values around it.

Why this layout suits a matrix-vector kernel: a row's sign bits are contiguous (one 16-byte load
brings 128 weights); a group's dot product is step * (2 * sum(x where b) - sum(x)), so the
kernel needs only masked additions per bit and one multiply per group, with the group
magnitudes in their own byte-per-group part.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Param, layout
from .quantized import (
    E4M3_MAX,
    GroupQuantizer,
    QuantizedFormat,
    by_group,
    float32_scale,
    pack_bits,
    to_e4m3,
    tree_sum,
    unpack_bits,
)

PARAMS = {"group_size": Param((32, 64, 128), 32, "columns sharing one e4m3 magnitude")}


@dataclass(frozen=True)
class Q1(QuantizedFormat):
    def _check(self, shape, p):
        return self._divisible(shape, p, "group_size")

    def parts(self, shape, params=()):
        shape = tuple(shape)
        p = self.require(shape, params)
        n, k = shape
        groups = k // p["group_size"]
        return layout([("signs", "uint8", (n, k // 8), n * k // 8),
                       ("scales", "float8_e4m3fn", (n, groups), n * groups),
                       ("row_scale", "float32", (n,), 4 * n)])

    def _values(self, parts, shape, p):
        grid = effective(parts["scales"].float(), parts["row_scale"])
        return by_group(values, unpack_bits(parts["signs"], 1), grid, p["group_size"])

    def _quantizer(self, shape, p):
        return _Q1Quantizer(self, shape, p, block=p["group_size"])


def effective(scales, row_scale) -> dict:
    """The grid of stored e4m3 magnitudes (float32 [rows, groups]) under the float32 row scale."""
    return {"scales": scales, "step": row_scale.unsqueeze(1) * scales}


def values(bits, grid):
    """What sign bits stand for: +step where the bit is 1, -step where it is 0 (float32)."""
    import torch

    return torch.where(bits.bool(), grid["step"], -grid["step"])


def mean_magnitude(groups):
    """mean |w| over the last dimension: divided before summing (by a power of two, so exactly)
    so that a sum of huge weights can't overflow, and summed in a fixed order (`tree_sum`) so that
    CPU and GPU encodings agree to the byte."""
    return tree_sum(groups.abs() * (1.0 / groups.shape[-1]))


class _Q1Quantizer(GroupQuantizer):
    def start(self, w):
        super().start(w)
        rows, cols = w.shape
        self.row_scale = float32_scale(mean_magnitude(w.reshape(rows, cols // self.block, self.block)).amax(-1),
                                       E4M3_MAX)

    def plain(self, groups):
        return self._grid(mean_magnitude(groups))

    def _grid(self, magnitude):
        return effective(to_e4m3(magnitude / self.row_scale.unsqueeze(1)).float(), self.row_scale)

    def candidates(self, groups, imp):
        """The e4m3 value nearest the weighted mean |w| (the weighted optimum) and its two
        neighbours: the error is a parabola in the magnitude, so the best stored value is one of
        the two around the optimum."""
        import torch

        weight = imp.expand_as(groups).sum(-1)
        best = (imp * groups.abs()).sum(-1) / torch.where(weight > 0, weight, torch.ones_like(weight))
        nearest = to_e4m3(best / self.row_scale.unsqueeze(1))
        code = nearest.view(torch.uint8).int()  # non-negative e4m3: the next code is the next value
        for step in (0, -1, 1):
            neighbour = (code + step).clamp(0, 0x7E).to(torch.uint8).view(torch.float8_e4m3fn)
            yield effective(neighbour.float(), self.row_scale)

    def codes(self, w, grid):
        import torch

        return (~torch.signbit(w)).to(torch.uint8)

    def values(self, codes, grid):
        return values(codes, grid)

    def parts(self, codes, grid):
        import torch

        return {"signs": pack_bits(codes, 1), "scales": grid["scales"].to(torch.float8_e4m3fn),
                "row_scale": self.row_scale}


Q1_FORMAT = Q1("q1", "1-bit signs, e4m3 magnitude per group under a float32 row scale", params=PARAMS)
