"""mxfp4: OCP Microscaling (MX) v1.0 MXFP4: blocks of 32 columns of a row, each an E8M0 shared
scale X and 32 E2M1 elements P_i.

Math: value = P_i * X, X = 2^(scale - 127) for the scale byte (0..254; 255 is E8M0's NaN and is
never written). E2M1 codes: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; magnitudes
of codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 1 is the subnormal 0.5).

Layout of a weight [N, K] (parts 16-byte aligned, in this order):
    values  uint8 [N, K / 2]    element 2i in the low nibble of byte i, 2i + 1 in the high nibble
    scales  uint8 [N, K / 32]   E8M0 biased exponents
Bits per weight: 4 + 8 / 32 = 4.25.

Encoding is the MX spec's conversion (section 6.3), per block of 32:
    shared_exp = floor(log2(max_i |V_i|)) - emax_elem, emax_elem = 2 (E2M1's largest exponent),
    clamped to E8M0's range [-127, 127]; X = 2^shared_exp;
    P_i = V_i / X quantized to E2M1, rounding to nearest with ties to even (ties go to the code
    with mantissa bit 0) and saturating normals to +-6 (values of 6..8 * X become 6 * X).
An all-zero block has log2(0) = -inf, which clamps to the E8M0 minimum: scale byte 0
(X = 2^-127) and zero elements, as the reference implementation (microsoft/microxcaling) does.
The sign of an element that rounds to zero is kept (a negative one is stored as code 8, -0).
NaN or infinite inputs would need the NaN scale, which this format never writes: encode refuses
them with ValueError. Importance-weighted fits may also pick shared_exp + 1 for a block (no
saturation, coarser steps); both are ordinary E8M0 scales any MX decoder reads.

Why this layout suits a matrix-vector kernel: a row's packed nibbles are contiguous (one 16-byte
load brings 32 weights, exactly one block), the scale bytes sit in their own part, and the
decode is a 16-entry table lookup (or a few bit operations) plus an exponent add: on GPUs with
native FP4 (Blackwell) these bytes and scales are the hardware's own block-scaled operands.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .base import layout
from .quantized import GroupQuantizer, QuantizedFormat, by_group, pack_bits, unpack_bits

BLOCK = 32
EMAX_ELEM = 2
SCALE_BIAS = 127
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round to nearest, ties to even, as a sum of comparisons: the magnitude code is the number of
# midpoints passed. At a tie the code moves up only when the upper neighbour's code is even
# (`>=`), else it stays (`>`).
MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


@dataclass(frozen=True)
class MxFp4(QuantizedFormat):
    def _check(self, shape, p):
        return self._divisible(shape, p, by=BLOCK)

    def parts(self, shape, params=()):
        shape = tuple(shape)
        self.require(shape, params)
        n, k = shape
        return layout([("values", "uint8", (n, k // 2), n * k // 2),
                       ("scales", "uint8", (n, k // BLOCK), n * k // BLOCK)])

    def _values(self, parts, shape, p):
        codes = unpack_bits(parts["values"], 4)
        grid = {"exponent": parts["scales"].int() - SCALE_BIAS}
        return by_group(values, codes, grid, BLOCK)

    def _quantizer(self, shape, p):
        return _MxFp4Quantizer(self, shape, p, block=BLOCK)


def values(codes, grid):
    """What E2M1 codes stand for under the shared exponents `grid["exponent"]` (float32)."""
    import torch

    return _table(codes.device)[codes.int()] * torch.exp2(grid["exponent"].float())


@functools.cache
def _table(device):
    """The 16 E2M1 values on `device`, made once per device (GPTQ decodes one column at a time)."""
    import torch

    return torch.tensor(MAGNITUDES + tuple(-m for m in MAGNITUDES), device=device)


def e2m1_codes(p):
    """E2M1 codes (uint8) of float32 values already divided by their block's X."""
    import torch

    magnitude = p.abs()
    code = torch.zeros_like(p, dtype=torch.uint8)
    for midpoint, up_on_tie in MIDPOINTS:  # over the 7 midpoints of the grid, not over data
        code += (magnitude >= midpoint) if up_on_tie else (magnitude > midpoint)
    return code | (torch.signbit(p).to(torch.uint8) << 3)


class _MxFp4Quantizer(GroupQuantizer):
    def plain(self, groups):
        import torch

        amax = groups.abs().amax(-1)
        _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2) = exponent - 1
        shared = torch.where(amax > 0, exponent - 1 - EMAX_ELEM, -SCALE_BIAS)
        return {"exponent": shared.clamp(-SCALE_BIAS, SCALE_BIAS).int()}

    def candidates(self, groups, imp):
        yield {"exponent": (self.plain(groups)["exponent"] + 1).clamp(max=SCALE_BIAS)}

    def codes(self, w, grid):
        import torch

        return e2m1_codes(w * torch.exp2(-grid["exponent"].float()))

    def values(self, codes, grid):
        return values(codes, grid)

    def parts(self, codes, grid):
        import torch

        return {"values": pack_bits(codes, 4), "scales": (grid["exponent"] + SCALE_BIAS).to(torch.uint8)}


MXFP4 = MxFp4("mxfp4", "OCP MX v1.0 MXFP4: E2M1 elements, one E8M0 scale per 32 columns")
