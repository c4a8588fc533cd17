"""int3, int4, int5, int6: b-bit integer codes with a float16 scale (and offset) per group of
`group_size` columns of a row.

Math, for the code u in [0, 2^b) of a weight in group j of row r:
    symmetric  (asymmetric=0): value = (u - 2^(b-1)) * scales[r, j]
    asymmetric (asymmetric=1): value = u * scales[r, j] + offsets[r, j]

Layout of a weight [N, K] with group size g (parts 16-byte aligned, in this order):
    code planes, uint8 [N, K * w / 8] each, see below
    scales   float16 [N, K / g]
    offsets  float16 [N, K / g]      asymmetric only
The b bits of a code are split into planes of power-of-two width w, so no code straddles a byte:
    int3: codes_low (w=2, bits 0-1) + codes_high (w=1, bit 2)
    int4: codes (w=4)
    int5: codes_low (w=4, bits 0-3) + codes_high (w=1, bit 4)
    int6: codes_low (w=4, bits 0-3) + codes_high (w=2, bits 4-5)
and u = low | (high << width of the low plane). A w-bit plane packs 8 / w consecutive elements of
a row per byte: element i sits in byte i // (8 / w) at bit (i % (8 / w)) * w (int4: element 2i in
the low nibble, 2i + 1 in the high nibble).
Bits per weight: b + 16 / g symmetric, b + 32 / g asymmetric.

Reference quantizer (round to nearest):
    symmetric, llama.cpp Q4_0's trick, which uses all 2^b levels: v = the group's element of
    largest magnitude (with its sign), scale = f16(v / -2^(b-1)) (it may be negative, so v lands
    on code 0 = -2^(b-1) exactly), u = clamp(round(w / scale) + 2^(b-1), 0, 2^b - 1);
    asymmetric: scale = f16((max - min) / (2^b - 1)), offset = f16(min),
    u = clamp(round((w - offset) / scale), 0, 2^b - 1).
Scales are rounded to float16 (clamped to its range) before the codes are computed; a group whose
scale is zero stores the code of zero (symmetric) or 0 (asymmetric). Importance-weighted fits
also try the range scaled by each of `quantized.RANGE_FACTORS`, then the weighted least-squares
scale (and offset) for the codes of the best grid so far.

Why this layout suits a matrix-vector kernel: each plane is one contiguous run of bytes per row,
so a warp streaming a row issues coalesced 16-byte loads of each plane; 8 weights come from one
32-bit word of a 4-bit plane (plus one byte of a 1-bit or one 16-bit word of a 2-bit plane) with
shifts and masks only, since no code crosses a byte. The per-group scales and offsets sit in
their own parts, read once per group; dequantization is one fused multiply-add per weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Param, layout
from .quantized import (
    RANGE_FACTORS,
    GroupQuantizer,
    QuantizedFormat,
    affine_least_squares,
    by_group,
    divide,
    pack_bits,
    to_float16,
    unpack_bits,
)

# Plane widths (low plane first) for each code width.
PLANES = {3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2)}

PARAMS = {
    "group_size": Param((32, 64, 128), 128, "columns sharing one scale (and offset)"),
    "asymmetric": Param((0, 1), 0, "1: value = u * scale + offset; 0: value = (u - 2^(b-1)) * scale"),
}


@dataclass(frozen=True)
class GroupedInt(QuantizedFormat):
    bits: int = 4

    def _check(self, shape, p):
        return self._divisible(shape, p, "group_size")

    def plane_names(self) -> tuple[str, ...]:
        return ("codes",) if len(PLANES[self.bits]) == 1 else ("codes_low", "codes_high")

    def parts(self, shape, params=()):
        shape = tuple(shape)
        p = self.require(shape, params)
        n, k = shape
        groups = k // p["group_size"]
        entries = [(name, "uint8", (n, k * w // 8), n * k * w // 8)
                   for name, w in zip(self.plane_names(), PLANES[self.bits])]
        entries.append(("scales", "float16", (n, groups), 2 * n * groups))
        if p["asymmetric"]:
            entries.append(("offsets", "float16", (n, groups), 2 * n * groups))
        return layout(entries)

    def _values(self, parts, shape, p):
        planes = PLANES[self.bits]
        codes = unpack_bits(parts[self.plane_names()[0]], planes[0])
        if len(planes) == 2:
            codes |= unpack_bits(parts["codes_high"], planes[1]) << planes[0]
        grid = {"scale": parts["scales"].float()}
        if p["asymmetric"]:
            grid["offset"] = parts["offsets"].float()
        return by_group(lambda u, g: values(u, g, self.bits), codes, grid, p["group_size"])

    def _quantizer(self, shape, p):
        return _GroupedIntQuantizer(self, shape, p, block=p["group_size"])


def values(codes, grid, bits: int):
    """What codes u stand for: u * scale + offset when the grid has an offset, else
    (u - 2^(bits-1)) * scale (float32)."""
    if "offset" in grid:
        return codes.float() * grid["scale"] + grid["offset"]
    return (codes.float() - 2 ** (bits - 1)) * grid["scale"]


class _GroupedIntQuantizer(GroupQuantizer):
    def __init__(self, fmt, shape, p, block):
        super().__init__(fmt, shape, p, block)
        self.bits, self.asymmetric = fmt.bits, bool(p["asymmetric"])
        self.mid, self.top = 2 ** (fmt.bits - 1), 2**fmt.bits - 1

    def plain(self, groups):
        if self.asymmetric:
            return self._affine(groups.amin(-1), groups.amax(-1))
        peak = groups.gather(-1, groups.abs().argmax(-1, keepdim=True)).squeeze(-1)
        return {"scale": to_float16(peak / -self.mid).float()}

    def candidates(self, groups, imp):
        if self.asymmetric:
            lo, hi = groups.amin(-1), groups.amax(-1)
            center, half = hi / 2 + lo / 2, hi / 2 - lo / 2  # halves first: no overflow
            for factor in RANGE_FACTORS:
                yield self._affine(center - factor * half, center + factor * half)
        else:
            peak = groups.gather(-1, groups.abs().argmax(-1, keepdim=True)).squeeze(-1)
            for factor in RANGE_FACTORS:
                yield {"scale": to_float16(peak * factor / -self.mid).float()}

    def refine(self, groups, imp, grid):
        """Least-squares scale (and offset) for the codes the best grid so far gives."""
        import torch

        g = {k: v.unsqueeze(-1) for k, v in grid.items()}
        u = self.codes(groups, g).float()
        if self.asymmetric:
            scale, offset = affine_least_squares(groups, u, imp)
            return {"scale": to_float16(scale).float(), "offset": to_float16(offset).float()}
        q = u - self.mid
        den = (imp * q * q).sum(-1)
        scale = (imp * q * groups).sum(-1) / torch.where(den > 0, den, torch.ones_like(den))
        return {"scale": to_float16(torch.where(den > 0, scale, grid["scale"])).float()}

    def _affine(self, lo, hi):
        return {"scale": to_float16(divide(hi - lo, self.top)).float(), "offset": to_float16(lo).float()}

    def codes(self, w, grid):
        import torch

        scale = grid["scale"]
        zero = scale == 0
        safe = torch.where(zero, torch.ones_like(scale), scale)
        if self.asymmetric:
            u = torch.round((w - grid["offset"]) / safe)
            empty = 0
        else:
            u = torch.round(w / safe) + self.mid
            empty = self.mid
        return torch.where(zero, empty, u.clamp(0, self.top)).to(torch.uint8)

    def values(self, codes, grid):
        return values(codes, grid, self.bits)

    def parts(self, codes, grid):
        import torch

        planes = PLANES[self.bits]
        if len(planes) == 1:
            out = {"codes": pack_bits(codes, planes[0])}
        else:
            out = {"codes_low": pack_bits(codes & ((1 << planes[0]) - 1), planes[0]),
                   "codes_high": pack_bits(codes >> planes[0], planes[1])}
        out["scales"] = grid["scale"].to(torch.float16)
        if self.asymmetric:
            out["offsets"] = grid["offset"].to(torch.float16)
        return out


def _grouped(bits: int) -> GroupedInt:
    return GroupedInt(f"int{bits}", f"{bits}-bit integer codes, float16 scale (and offset) per group of columns",
                      params=PARAMS, bits=bits)


INT3, INT4, INT5, INT6 = (_grouped(b) for b in (3, 4, 5, 6))
