"""q2: 2-bit asymmetric codes; per-group step and offset stored as e4m3 under float32 row scales
(double quantization).

Math, for the code u in 0..3 of a weight in group j of row r:
    value = u * (row_scale[r] * float(scales[r, j])) + row_offset[r] * float(offsets[r, j])

Layout of a weight [N, K] with group size g (parts 16-byte aligned, in this order):
    codes       uint8 [N, K / 4]            element 4i + j at bits 2j..2j+1 of byte i
    scales      float8_e4m3fn [N, K / g]    group step / row_scale
    offsets     float8_e4m3fn [N, K / g]    group offset / row_offset
    row_scale   float32 [N]
    row_offset  float32 [N]
Bits per weight: 2 + 16 / g + 64 / K.

Reference quantizer (round to nearest): per group s_g = (max - min) / 3 (computed as
max / 3 - min / 3, which can't overflow), m_g = min;
row_scale = max_g s_g / 448, row_offset = max_g |m_g| / 448 (each kept to 16 significant bits,
see `quantized.SCALE_SIGNIFICANT_BITS`, and 1 for an all-zero row); the group's stored codes are
e4m3(s_g / row_scale) and e4m3(m_g / row_offset), clamped to +-448; the codes u are then computed
from the effective (decoded) step and offset: u = clamp(round((w - offset) / step), 0, 3), 0 where
the step is 0. `start` takes the row scales from the whole weight; groups fitted later (after
GPTQ's updates) clamp to the e4m3 range under those row scales. Importance-weighted fits also
try the range scaled about its centre by each of `quantized.RANGE_FACTORS`, then the weighted
least-squares step and offset for the codes of the best grid so far.

Why this layout suits a matrix-vector kernel: a row's codes are contiguous (one 16-byte load
brings 64 weights), the group scales and offsets are one byte each in their own parts, and the
row scales are applied per group as two multiplies (step = row_scale * scale, offset =
row_offset * offset) before one fused multiply-add per weight; the offset term can also be
hoisted out of the dot product as offset * sum(x over the group).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Param, layout
from .quantized import (
    E4M3_MAX,
    RANGE_FACTORS,
    GroupQuantizer,
    QuantizedFormat,
    affine_least_squares,
    by_group,
    divide,
    float32_scale,
    pack_bits,
    to_e4m3,
    unpack_bits,
)

TOP = 3
PARAMS = {"group_size": Param((16, 32, 64), 32, "columns sharing one e4m3 step and offset")}


@dataclass(frozen=True)
class Q2(QuantizedFormat):
    def _check(self, shape, p):
        return self._divisible(shape, p, "group_size")

    def parts(self, shape, params=()):
        shape = tuple(shape)
        p = self.require(shape, params)
        n, k = shape
        groups = k // p["group_size"]
        return layout([("codes", "uint8", (n, k // 4), n * k // 4),
                       ("scales", "float8_e4m3fn", (n, groups), n * groups),
                       ("offsets", "float8_e4m3fn", (n, groups), n * groups),
                       ("row_scale", "float32", (n,), 4 * n),
                       ("row_offset", "float32", (n,), 4 * n)])

    def _values(self, parts, shape, p):
        grid = effective(parts["scales"].float(), parts["offsets"].float(),
                         parts["row_scale"], parts["row_offset"])
        return by_group(values, unpack_bits(parts["codes"], 2), grid, p["group_size"])

    def _quantizer(self, shape, p):
        return _Q2Quantizer(self, shape, p, block=p["group_size"])


def effective(scales, offsets, row_scale, row_offset) -> dict:
    """The grid of stored e4m3 group values (as float32 [rows, groups]) under float32 row scales:
    the group's step and offset as the decoder computes them."""
    return {"scales": scales, "offsets": offsets,
            "step": row_scale.unsqueeze(1) * scales, "zero": row_offset.unsqueeze(1) * offsets}


def values(codes, grid):
    """What 2-bit codes stand for: u * step + zero (float32)."""
    return codes.float() * grid["step"] + grid["zero"]


def group_ranges(groups):
    """(s_g, m_g) of weight groups [rows, groups, g]: step (max - min) / 3 and offset min."""
    lo, hi = groups.amin(-1), groups.amax(-1)
    return divide(hi, TOP) - divide(lo, TOP), lo  # divided first: the difference can't overflow


class _Q2Quantizer(GroupQuantizer):
    def start(self, w):
        super().start(w)
        rows, cols = w.shape
        step, offset = group_ranges(w.reshape(rows, cols // self.block, self.block))
        self.row_scale = float32_scale(step.amax(-1), E4M3_MAX)
        self.row_offset = float32_scale(offset.abs().amax(-1), E4M3_MAX)

    def plain(self, groups):
        return self._grid(*group_ranges(groups))

    def _grid(self, step, offset):
        scales = to_e4m3(step / self.row_scale.unsqueeze(1)).float()
        offsets = to_e4m3(offset / self.row_offset.unsqueeze(1)).float()
        return effective(scales, offsets, self.row_scale, self.row_offset)

    def candidates(self, groups, imp):
        lo, hi = groups.amin(-1), groups.amax(-1)
        center, half = hi / 2 + lo / 2, hi / 2 - lo / 2
        for factor in RANGE_FACTORS:
            yield self._grid(divide(2 * factor * half, TOP), center - factor * half)

    def refine(self, groups, imp, grid):
        """Least-squares step and offset for the codes the best grid so far gives."""
        u = self.codes(groups, {k: v.unsqueeze(-1) for k, v in grid.items()})
        return self._grid(*affine_least_squares(groups, u, imp))

    def codes(self, w, grid):
        import torch

        step = grid["step"]
        zero = step == 0
        u = torch.round((w - grid["zero"]) / torch.where(zero, torch.ones_like(step), step))
        return torch.where(zero, 0, u.clamp(0, TOP)).to(torch.uint8)

    def values(self, codes, grid):
        return values(codes, grid)

    def parts(self, codes, grid):
        import torch

        return {"codes": pack_bits(codes, 2),
                "scales": grid["scales"].to(torch.float8_e4m3fn), "offsets": grid["offsets"].to(torch.float8_e4m3fn),
                "row_scale": self.row_scale, "row_offset": self.row_offset}


Q2_FORMAT = Q2("q2", "2-bit asymmetric codes, e4m3 step and offset per group under float32 row scales",
               params=PARAMS)
