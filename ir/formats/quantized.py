"""What the quantized formats share: the reference encoder, a group-wise `GridQuantizer`, bit
packing and rounding to the storage precision of scales.

A quantized format stores each weight as a small code on a grid that is fixed per group of
`block` consecutive columns of a row. Its quantizer describes that grid as a dict of tensors of
shape [rows, groups] (`grid`), and supplies four hooks (the first two elementwise, the grid
broadcast over the columns of its group):

    codes(w, grid)       the nearest code of each weight (round to nearest on the grid)
    values(codes, grid)  what the codes stand for (the format's decode, float32)
    plain(groups)        the round-to-nearest grid of weight groups [rows, groups, block]
    parts(codes, grid)   the blob's parts {name: tensor} from all codes [rows, cols] and grids

`project` is values(codes(w)); `pack` recomputes the codes from projected weights and checks
that they decode to exactly those weights, so whatever `pack` accepts, `decode` reproduces.
Decoders call the same `values` function, so the two can't drift apart.

`fit` takes any whole number of blocks at once: grids are per group and nothing crosses a group,
so fitting every block in one call gives the grids of fitting them one at a time (the test suite
checks this). `encode` fits the whole weight in one call, so no Python loop runs over rows or
groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Format, GridQuantizer

FLOAT16_MAX = 65504.0
E4M3_MAX = 448.0
FLOAT32_MIN_NORMAL = 2.0**-126

# Float32 scales keep 16 significant bits. A scale s that is a 16-bit number makes k*s exact for
# the small integers and 4-bit-mantissa values codes stand for, and rounding to 16 bits absorbs
# the last-bit noise of float32 arithmetic: decoding and encoding again gives the same scale, so
# the reference encoder is idempotent. Against 3- to 8-bit grids the extra rounding (2^-17
# relative) is invisible.
SCALE_SIGNIFICANT_BITS = 16

# Multiples of the plain range tried by importance-weighted fits (clipping search, as llama.cpp's
# make_qx_quants and AWQ's clip search do); the plain choice (1.0) is always a candidate too.
RANGE_FACTORS = (1.1, 1.05, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


# ---- rounding to storage precision --------------------------------------------------------------

def to_float16(x):
    """`x` rounded to float16 (nearest even), clamped to its finite range instead of overflowing."""
    return x.clamp(-FLOAT16_MAX, FLOAT16_MAX).to(_torch().float16)


def to_e4m3(x):
    """`x` rounded to float8 e4m3fn (nearest even), clamped to +-448 (e4m3fn has no infinity)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(_torch().float8_e4m3fn)


def round_significand(x, bits: int = SCALE_SIGNIFICANT_BITS):
    """`x` (float32) rounded to `bits` significant bits, to nearest (even on ties)."""
    torch = _torch()
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2.0**bits), exponent - bits)


def divide(x, constant: float):
    """x / constant, correctly rounded on every device. (torch divides a CUDA tensor by a Python
    number as a multiplication by its reciprocal, which can differ in the last bit; dividing by a
    tensor keeps CPU and GPU encodings byte-identical.)"""
    torch = _torch()
    return x / torch.tensor(constant, dtype=x.dtype, device=x.device)


def tree_sum(x):
    """The sum over the last dimension (a power of two) as a tree of pairwise additions: the same
    bits on every device and for any memory layout, which torch's reductions don't promise."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def float32_scale(amax, top: float):
    """A float32 scale that maps `amax` to `top`: amax / top with 16 significant bits; 1 where that
    is zero or below the normal range (such rows hold nothing a float32 scale can resolve)."""
    torch = _torch()
    scale = round_significand(divide(amax, top))
    return torch.where(scale >= FLOAT32_MIN_NORMAL, scale, torch.ones_like(scale))


# ---- bit packing --------------------------------------------------------------------------------

def pack_bits(codes, bits: int):
    """Codes [rows, cols] (each < 2**bits) packed 8 // bits per byte: element i of a row goes to
    byte i // (8 // bits) at bit (i % (8 // bits)) * bits. Returns uint8 [rows, cols * bits // 8]."""
    torch = _torch()
    per = 8 // bits
    rows, cols = codes.shape
    c = codes.to(torch.uint8).reshape(rows, cols // per, per)
    out = c[..., 0].clone()
    for j in range(1, per):  # over the bit positions of a byte, never over rows or groups
        out |= c[..., j] << (j * bits)
    return out


def unpack_bits(packed, bits: int):
    """The inverse of `pack_bits`: uint8 [rows, bytes] -> codes uint8 [rows, bytes * 8 // bits]."""
    torch = _torch()
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], packed.shape[1] * per)


# ---- grids --------------------------------------------------------------------------------------

def by_group(fn, x, grid: dict, block: int):
    """fn(x, grid) for x [rows, groups * block] and grid tensors [rows, groups]: each grid value
    broadcast over its group's columns. Returns fn's result shaped like x."""
    rows, cols = x.shape
    out = fn(x.reshape(rows, cols // block, block), {k: v.unsqueeze(-1) for k, v in grid.items()})
    return out.reshape(rows, cols)


def affine_least_squares(w, u, imp):
    """The (step, zero) minimizing sum imp * (u * step + zero - w)^2 per group, for weights w and
    codes u [rows, groups, block] and importance imp broadcastable to them; step 0 and zero the
    weighted mean where all codes of a group are equal."""
    torch = _torch()
    u = u.float()
    a, b, c = (imp * u * u).sum(-1), (imp * u).sum(-1), imp.expand_as(u).sum(-1)
    d, e = (imp * u * w).sum(-1), (imp * w).sum(-1)
    det = a * c - b * b
    ok = det > 1e-12 * a * c
    safe = torch.where(ok, det, torch.ones_like(det))
    step = torch.where(ok, (c * d - b * e) / safe, torch.zeros_like(det))
    zero = torch.where(ok, (a * e - b * d) / safe, e / c.clamp_min(1e-30))
    return step, zero


@dataclass(frozen=True)
class QuantizedFormat(Format):
    """A format whose blob holds codes on per-group grids. Subclasses define `parts`, `_values`
    (decode from parts) and `_quantizer`; encoding is the quantizer's own loop."""

    def encode(self, tensor, params=()):
        """Round-to-nearest encoding: start, fit every block (at once, see the module docstring),
        project, pack. Raises ValueError on a shape the format can't take or a NaN/inf weight."""
        torch = _torch()
        q = self.quantizer(tuple(tensor.shape), params)
        w = tensor.detach().to(torch.float32).contiguous()
        q.start(w)
        grid = q.fit(w)
        return q.pack(q.project(w, grid), [grid])

    def decode_parts(self, parts: dict, shape, params=(), dtype=None):
        torch = _torch()
        out = self._values(parts, tuple(shape), dict(self.normalize(params)))
        if dtype is None:
            return out
        return out.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)

    def _values(self, parts: dict, shape: tuple[int, int], p: dict):
        raise NotImplementedError

    def quantizer(self, shape, params=()):
        shape = tuple(shape)
        return self._quantizer(shape, self.require(shape, params))

    def _quantizer(self, shape: tuple[int, int], p: dict) -> GroupQuantizer:
        raise NotImplementedError

    def _divisible(self, shape, p: dict, key: str | None = None, by: int | None = None) -> list[str]:
        """[] when the columns of `shape` split into whole groups, else the one problem."""
        size = p[key] if key else by
        if shape[1] % size:
            what = f"group_size {size}" if key else f"its block size {size}"
            return [f"format {self.name}: in_features {shape[1]} of shape {shape} must be a multiple of {what}"]
        return []


class GroupQuantizer(GridQuantizer):
    """A `GridQuantizer` whose grid is a dict of tensors [rows, groups] (see the module docstring).

    Subclasses set `block` and define `plain`, `codes`, `values` and `parts`; they may add
    `candidates` (grids tried by importance-weighted fits) and `refine` (a grid re-fitted to the
    codes of the best one so far)."""

    def __init__(self, fmt: QuantizedFormat, shape: tuple[int, int], p: dict, block: int):
        self.fmt, self.shape, self.p, self.block = fmt, shape, p, block

    # ---- hooks --------------------------------------------------------------------------------

    def plain(self, groups) -> dict:
        raise NotImplementedError

    def candidates(self, groups, imp):
        return ()

    def refine(self, groups, imp, grid) -> dict | None:
        return None

    def codes(self, w, grid):
        raise NotImplementedError

    def values(self, codes, grid):
        raise NotImplementedError

    def parts(self, codes, grid) -> dict:
        raise NotImplementedError

    # ---- the GridQuantizer protocol -----------------------------------------------------------

    def start(self, w) -> None:
        self.refuse_nonfinite(w)

    def refuse_nonfinite(self, w) -> None:
        torch = _torch()
        if not bool(torch.isfinite(w).all()):
            bad = int((~torch.isfinite(w)).sum())
            raise ValueError(f"format {self.fmt.name}: cannot encode a weight of shape {tuple(w.shape)} "
                             f"holding {bad} NaN or infinite value(s)")

    def fit(self, w_block, importance=None):
        """The grid of one or more whole blocks [rows, n * block]; with `importance` [n * block],
        the candidate grid of least importance-weighted squared error per group, never worse than
        the plain one."""
        torch = _torch()
        rows, cols = w_block.shape
        if cols % self.block:
            raise ValueError(f"format {self.fmt.name}: fit takes whole blocks of {self.block} columns, got {cols}")
        groups = w_block.to(torch.float32).reshape(rows, cols // self.block, self.block).contiguous()
        grid = self.plain(groups)
        if importance is None:
            return grid
        imp = importance.to(torch.float32).reshape(1, cols // self.block, self.block)
        best = self._error(groups, imp, grid)
        for candidate in self.candidates(groups, imp):
            grid, best = self._keep_better(groups, imp, grid, best, candidate)
        candidate = self.refine(groups, imp, grid)
        if candidate is not None:
            grid, best = self._keep_better(groups, imp, grid, best, candidate)
        return grid

    def project(self, w_cols, grid, offset: int = 0):
        torch = _torch()
        return self._on_grid(lambda x, g: self.values(self.codes(x, g), g), w_cols.to(torch.float32), grid, offset)

    def pack(self, w_hat, grids: list):
        torch = _torch()
        grid = {k: torch.cat([g[k] for g in grids], dim=1) for k in grids[0]}
        w_hat = w_hat.to(torch.float32)
        groups = next(iter(grid.values())).shape[1]
        if tuple(w_hat.shape) != self.shape or groups * self.block != self.shape[1]:
            raise ValueError(f"format {self.fmt.name}: pack needs the whole weight {self.shape} and grids "
                             f"for all its blocks, got {tuple(w_hat.shape)} and {groups} block(s)")
        codes = by_group(self.codes, w_hat, grid, self.block)
        off = by_group(self.values, codes, grid, self.block) != w_hat
        if bool(off.any()):
            raise ValueError(f"format {self.fmt.name}: {int(off.sum())} weight(s) of {self.shape} are not on "
                             "their block's grid (pack takes the output of project)")
        return self.fmt.join(self.parts(codes, grid), self.shape, tuple(self.p.items()))

    # ---- helpers ------------------------------------------------------------------------------

    def _on_grid(self, fn, x, grid: dict, offset: int):
        """fn(x, grid) for columns x [rows, n] starting `offset` columns into the span of `grid`."""
        torch = _torch()
        n = x.shape[1]
        if offset % self.block == 0 and n % self.block == 0:
            first = offset // self.block
            return by_group(fn, x, {k: v[:, first:first + n // self.block] for k, v in grid.items()}, self.block)
        first = offset // self.block
        if (offset + n - 1) // self.block == first:  # inside one group (GPTQ's column): its grid broadcast
            return fn(x, {k: v[:, first:first + 1] for k, v in grid.items()})
        index = torch.div(torch.arange(offset, offset + n, device=x.device), self.block, rounding_mode="floor")
        return fn(x, {k: v.index_select(1, index) for k, v in grid.items()})

    def _error(self, groups, imp, grid):
        g = {k: v.unsqueeze(-1) for k, v in grid.items()}
        return (imp * (self.values(self.codes(groups, g), g) - groups) ** 2).sum(-1)

    def _keep_better(self, groups, imp, grid, best, candidate):
        torch = _torch()
        error = self._error(groups, imp, candidate)
        better = error < best
        return ({k: torch.where(better, candidate[k], v) for k, v in grid.items()},
                torch.where(better, error, best))


def _torch():
    import torch

    return torch
