"""trellis: a tail-biting bitshift trellis code (QTIP-like) at k = 2 or 3 bits a weight, one float16
scale per row. An expert format (the planner offers it to routed experts only).

Parameters: `bits` k in (2, 3), default 2. Constants: L = 12 state bits, TILE = 16. A weight [N, K]
(rows = out features, reduction along K) needs N and K multiples of 16.

Codebook, computed (no table): for a 12-bit state s,
    h = (s * 0x2F6B4E95 + 0x1D3C5A17) mod 2^32
    c(s) = byte0(h) + byte1(h) + byte2(h) + byte3(h) - 510            (an integer in [-510, 510])
    value(r, s) = row_scale[r] * c(s) / NORM,   NORM = sqrt(4 * (2^16 - 1) / 12) = sqrt(21845) = 147.8005...
(a sum of four near-uniform bytes is close to a Gaussian of unit variance after the division).

Sequence: each 16 x 16 tile (rows 16a..16a+15, columns 16b..16b+15) is one circular sequence of
T = 256 weights in row-major order t = 16 i + j (i: row in the tile, j: column in the tile), stored
as a tail-biting stream of k-bit chunks b_0..b_255; weight t decodes the state
    s_t = sum_{m=0}^{L/k - 1} b_{(t - m) mod 256} << (k m)      (s_t's low k bits are b_t)
so neighbours share L - k bits and the stream is exactly k bits a weight.

Layout of a weight [N, K] (parts 16-byte aligned, in this order):
    codes      uint8 [N, K * k / 8]   row r: K/16 segments of 2k bytes; segment b holds the chunks
                                      t = 16 i .. 16 i + 15 (i = r % 16) of tile (r // 16, b) as one
                                      16k-bit integer S, chunk j at bits [(15 - j) k, (16 - j) k)
                                      (chunk 0 on top), stored little-endian (k = 2: a uint32;
                                      k = 3: 6 bytes, i.e. three little-endian uint16 low, mid, high)
    row_scale  float16 [N]            the row's rms (of the weight handed to the quantizer); 0 for a
                                      zero row
Bits per weight: k + 16 / K.

Decode of weight (r, 16 b + j), the form a kernel uses (reference: `segment_values`):
    prev = segment b of row 16 (r // 16) + (r - 1) mod 16   (the tile's previous row, circularly)
    both = ((prev mod 2^(L - k)) << 16 k) | S               (42 bits at k = 2, 57 at k = 3)
    s    = (both >> ((15 - j) k)) & (2^L - 1)
    w    = c(s) * (row_scale[r] / NORM)                       (float32; row_scale / NORM rounded once)
A matvec: y[r] = row_scale[r] / NORM * (sum_c bytesum(h_rc) x_c - 510 sum(x)).

Why this suits a kernel: a row's codes are contiguous (16 bytes hold 64 weights at k = 2); one segment
plus the previous row's segment (L - k bits of it) give 16 states by shifts and masks; each weight
is one integer multiply-add, a byte sum (dp4a against 0x01010101), an int-to-float and an FMA, with
the 510 sum(x) term and the scale per row. Rows of two weights stack part by part (gate over up,
experts in a page): the 16-row tile bands stay whole as long as N is a multiple of 16.

Quantizer (`TrellisQuantizer`): row scale first (rms, rounded to float16), then 16-column blocks,
each block's tiles (all row bands) coded jointly by Viterbi over the 2^L states (squared error of
the weights: each row's error counted at its scale^2, and each column's at its importance when GPTQ
gives diag(H)), tail-biting by two passes (QTIP's trick: a
free-start pass over the sequence rotated by T/2 gives the L - k bits the best path crosses the wrap
with; a second pass holds the first state's high bits and the last state's low bits to them). GPTQ
drives it block by block (passes/gptq.py: BlockLDLQ, the error of a whole block fed forward).
Cost: about 5 x 2^12 float operations a weight a pass, two passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import GridQuantizer, Param, layout
from .quantized import QuantizedFormat, divide, to_float16

L = 12  # state bits
TILE = 16  # a sequence is a TILE x TILE tile: T = 256 weights
T = TILE * TILE
HASH_A = 0x2F6B_4E95  # odd multiplier of the codebook's multiply-add
HASH_B = 0x1D3C_5A17
NORM = math.sqrt(4 * (2**16 - 1) / 12)  # the standard deviation of a sum of four uniform bytes
# Tiles per Viterbi call: its back pointers take T x 2^(L - k) x (2^k - 1) bytes a tile (768 KiB at k = 2,
# 896 KiB at k = 3): 100 MiB on the CPU, 1.75 GiB on a GPU.
CHUNK = {"cpu": 128, "cuda": 2048}
PARAMS = {"bits": Param((2, 3), 2, "bits per weight of the trellis code (k)")}


# ---- the code ----------------------------------------------------------------------------------

def codeword(states):
    """c(s): the integer codeword (int64, in [-510, 510]) of each L-bit state."""
    h = (states.long() * HASH_A + HASH_B) & 0xFFFF_FFFF
    return (h & 0xFF) + ((h >> 8) & 0xFF) + ((h >> 16) & 0xFF) + (h >> 24) - 510


def codebook(device=None):
    """The 2^L values c(s) / NORM (float32) the encoder compares weights / row_scale with."""
    import torch

    return (codeword(torch.arange(2**L, device=device)).double() / NORM).float()


def segment_values(segments, row_scale, k: int):
    """The weights [N, 16 * nb] that segments [N, nb] (int64, the integers S) and row_scale [N]
    (float16) decode to, as float32: the contract's decode, vectorised. N is whole tile bands."""
    import torch

    n, blocks = segments.shape
    bands = segments.reshape(n // TILE, TILE, blocks)
    prev = torch.roll(bands, 1, dims=1).reshape(n, blocks)  # row i's previous row, 15 for row 0
    both = ((prev & (2 ** (L - k) - 1)) << (TILE * k)) | segments
    shifts = k * torch.arange(TILE - 1, -1, -1, device=segments.device)
    states = (both.unsqueeze(-1) >> shifts) & (2**L - 1)  # [N, nb, 16]
    factor = divide(row_scale.float(), NORM).unsqueeze(1)
    table = codeword(torch.arange(2**L, device=segments.device)).float()  # c(s) looked up: one gather a weight
    return table[states].reshape(n, blocks * TILE) * factor


def segments_from_bytes(codes, k: int):
    """The integers S [N, K/16] (int64) of a codes part uint8 [N, K * k / 8]."""
    n = codes.shape[0]
    b = codes.reshape(n, -1, 2 * k).long()
    return sum(b[..., i] << (8 * i) for i in range(2 * k))


def segments_to_bytes(segments, k: int):
    """The codes part uint8 [N, K * k / 8] of the integers S [N, K/16]: each 2k bytes little-endian."""
    import torch

    n = segments.shape[0]
    b = torch.stack([(segments >> (8 * i)) & 0xFF for i in range(2 * k)], -1)
    return b.to(torch.uint8).reshape(n, -1)


def tiles(w):
    """[N, 16 * nb] -> [N / 16 * nb, 256]: each tile's weights row-major, tiles band by band."""
    n, cols = w.shape
    return w.reshape(n // TILE, TILE, cols // TILE, TILE).permute(0, 2, 1, 3).reshape(-1, T)


def segments_from_states(states, n: int, k: int):
    """The integers S [N, nb] of tail-biting states [N / 16 * nb, 256] (tiles as `tiles` orders them)."""
    import torch

    chunks = (states & (2**k - 1)).reshape(n // TILE, -1, TILE, TILE)  # band, block, row i, column j
    shifts = k * torch.arange(TILE - 1, -1, -1, device=states.device)
    s = (chunks << shifts).sum(-1)  # disjoint bits: the sum is the bitwise or
    return s.permute(0, 2, 1).reshape(n, -1)


# ---- Viterbi ------------------------------------------------------------------------------------

def viterbi(x, values, k: int, bits: int, overlap=None, weight=None):
    """States [B, T] (int64) of the path through the trellis of 2^bits states minimising
    sum_t weight[:, t] * (x[:, t] - values[s_t])^2 (weight: [B, T], default 1). `overlap` [B]
    (optional): the first state's high bits - k bits and the last state's low bits - k bits are both
    held to it (a tail-biting path); without it the first state is free. Every step is separate
    elementwise operations and exact minima, so the result is the same on every device."""
    import torch

    batch, steps = x.shape
    n, low, fan = 2**bits, 2 ** (bits - k), 2**k
    device = x.device
    v = values.float().to(device)
    v2 = v * v
    x2 = 2 * x.float()
    a = None if weight is None else weight.float()
    big = torch.finfo(torch.float32).max / 4
    state = torch.arange(n, device=device)

    # Every step writes into buffers made once (a fresh [B, 2^bits] tensor a step costs the CPU a
    # page-faulting allocation as much as the arithmetic).
    term = torch.empty(batch, n, device=device)

    def step_cost(t):  # weight * (v^2 - 2 x v): the squared error less x^2, the same for every state
        torch.mul(x2[:, t:t + 1], v, out=term)
        torch.sub(v2, term, out=term)
        return term if a is None else term.mul_(a[:, t:t + 1])

    cost = step_cost(0).clone()  # [B, 2^bits]
    if overlap is not None:
        cost = torch.where((state[None] >> k) == overlap[:, None], cost, big)
    # The predecessors of s' are m * 2^(bits - k) + (s' >> k), m < 2^k. Their minimum is a knockout
    # tournament of pairwise comparisons (torch's min with indices over a strided dimension is several
    # times slower); each step keeps the 2^k - 1 outcomes, and the way back replays the winner's path.
    back = torch.empty(steps, batch, fan - 1, low, dtype=torch.bool, device=device)
    rounds = [torch.empty(batch, fan >> (r + 1), low, device=device) for r in range(k)]
    for t in range(1, steps):
        field, at = cost.view(batch, fan, low), 0
        for winners in rounds:
            left, right = field[:, 0::2], field[:, 1::2]
            torch.lt(right, left, out=back[t, :, at:at + left.shape[1]])
            at += left.shape[1]
            field = torch.minimum(left, right, out=winners)
        torch.add(step_cost(t).view(batch, low, fan), field.view(batch, low, 1), out=cost.view(batch, low, fan))
    if overlap is not None:
        cost = torch.where((state[None] & (low - 1)) == overlap[:, None], cost, big)
    states = torch.empty(batch, steps, dtype=torch.int64, device=device)
    states[:, -1] = cost.argmin(1)
    rows = torch.arange(batch, device=device)
    for t in range(steps - 1, 0, -1):
        below = states[:, t] >> k
        node, at = torch.zeros_like(below), fan - 2  # the final's outcome is the last one kept
        for level in range(k):
            node = 2 * node + back[t, rows, at + node, below].long()
            at -= 2 ** (level + 1)
        states[:, t - 1] = node * low + below
    return states


def tail_biting(x, values, k: int, bits: int, weight=None, chunk: int | None = None):
    """Tail-biting states [B, T] for the sequences x [B, T] (two Viterbi passes, see the module
    docstring), `chunk` sequences at a time (default: CHUNK for x's device)."""
    import torch

    if bits % k or k >= bits:
        raise ValueError(f"a state of {bits} bits must be a multiple of k={k} bits, larger than k")
    chunk = chunk or CHUNK.get(x.device.type, CHUNK["cpu"])
    out = []
    for i in range(0, x.shape[0], chunk):
        part = x[i:i + chunk]
        part_weight = None if weight is None else weight[i:i + chunk]
        half = part.shape[1] // 2
        rolled = None if weight is None else torch.roll(part_weight, -half, 1)
        first = viterbi(torch.roll(part, -half, 1), values, k, bits, weight=rolled)
        overlap = first[:, half] >> k  # the state at position 0: its high bits cross the wrap
        out.append(viterbi(part, values, k, bits, overlap, part_weight))
    return torch.cat(out)


# ---- the format ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Trellis(QuantizedFormat):
    def _check(self, shape, p):
        n, k = shape
        if n % TILE or k % TILE:
            return [f"format {self.name}: shape {shape} must have rows and columns that are multiples of {TILE} "
                    f"(its {TILE} x {TILE} tiles)"]
        return []

    def parts(self, shape, params=()):
        shape = tuple(shape)
        p = self.require(shape, params)
        n, k = shape
        return layout([("codes", "uint8", (n, k * p["bits"] // 8), n * k * p["bits"] // 8),
                       ("row_scale", "float16", (n,), 2 * n)])

    def _values(self, parts, shape, p):
        return segment_values(segments_from_bytes(parts["codes"], p["bits"]), parts["row_scale"], p["bits"])

    def _quantizer(self, shape, p):
        return TrellisQuantizer(self, shape, p)

    # A row decodes with its tile's previous row: row subsets are decoded a whole tile band at a time.

    def decode_rows(self, raw, shape, params=(), rows=None, dtype=None):
        import torch

        shape = tuple(shape)
        if isinstance(rows, slice):
            start, stop, step = rows.indices(shape[0])
            if step == 1:
                return self.decode_prefix(raw, shape, params, slice(start, stop), None, dtype)
            rows = torch.arange(start, stop, step)
        rows = rows.to(raw.device)
        bands, inverse = torch.unique(torch.div(rows, TILE, rounding_mode="floor"), return_inverse=True)
        picked = (bands.unsqueeze(1) * TILE + torch.arange(TILE, device=raw.device)).reshape(-1)
        parts = {name: t.index_select(0, picked) for name, t in self.split(raw, shape, params).items()}
        out = self.decode_parts(parts, (picked.numel(), shape[1]), params, dtype)
        return out.index_select(0, inverse * TILE + rows % TILE)

    def decode_prefix(self, raw, shape, params=(), rows=None, cols=None, dtype=None):
        shape = tuple(shape)
        start, stop, step = (rows or slice(None)).indices(shape[0])
        if step != 1:
            raise ValueError(f"{self.name}: decode_prefix takes a slice of consecutive rows, got {rows}")
        first, last = start // TILE * TILE, -(-stop // TILE) * TILE
        parts = {name: t[first:last] for name, t in self.split(raw, shape, params).items()}
        if cols is not None:
            parts = self.prefix_parts(parts, shape, cols)
        out = self.decode_parts(parts, (last - first, shape[1] if cols is None else cols), params, dtype)
        return out[start - first:stop - first]

    def prefix_parts(self, parts, shape, cols):
        if cols % TILE:
            raise ValueError(f"{self.name}: a column prefix must be whole {TILE}-column segments, got {cols}")
        return super().prefix_parts(parts, shape, cols)


class TrellisQuantizer(GridQuantizer):
    """The GridQuantizer of `trellis`. Its "grid" for a span of whole 16-column blocks is the coded
    span itself, {"segments": S [N, blocks] int64, "values": what they decode to [N, 16 * blocks]}:
    `fit` runs Viterbi on the block's tiles (under the columns' importance when given), `project`
    returns the fitted values whatever columns it is handed (a block is coded jointly, so GPTQ feeds a
    whole block's error forward: BlockLDLQ). Rows are coded apart in 16-row bands, so one fit over the
    stacked rows of several weights, each row with its own weight's importance, codes each as alone."""

    block = TILE
    joint = True

    def __init__(self, fmt: Trellis, shape: tuple[int, int], p: dict):
        self.fmt, self.shape, self.p, self.k = fmt, shape, p, p["bits"]

    def start(self, w) -> None:
        import torch

        if not bool(torch.isfinite(w).all()):
            bad = int((~torch.isfinite(w)).sum())
            raise ValueError(f"format {self.fmt.name}: cannot encode a weight of shape {tuple(w.shape)} "
                             f"holding {bad} NaN or infinite value(s)")
        # in float64, so no device's summation order moves the float16 (through float32 on every device)
        self.row_scale = to_float16(w.double().pow(2).mean(1).sqrt().float())

    def fit(self, w_block, importance=None):
        """Viterbi-code whole 16-column blocks [N, 16 * nb]; with `importance` ([16 * nb], or [N, 16 * nb]
        for rows of several weights), each column's squared error counts at its importance (GPTQ passes
        diag(H)), relative to the row's largest in the block."""
        import torch

        rows, cols = w_block.shape
        if cols % TILE or rows != self.shape[0]:
            raise ValueError(f"format {self.fmt.name}: fit takes all {self.shape[0]} rows and whole blocks of "
                             f"{TILE} columns, got {tuple(w_block.shape)}")
        scale = self.row_scale.float().to(w_block.device)
        live = scale > 0
        safe = torch.where(live, scale, torch.ones_like(scale)).unsqueeze(1)
        x = torch.where(live.unsqueeze(1), w_block.float() / safe, torch.zeros_like(safe))
        # Each row's squared error counts at its scale^2 (the weight's own error), relative to the
        # tile's largest row so huge scales cannot overflow the path costs.
        band = scale.reshape(-1, TILE)
        top = band.amax(1, keepdim=True)
        relative = torch.where(top > 0, band / torch.where(top > 0, top, torch.ones_like(top)), 0.0)
        weight = (relative * relative).reshape(rows, 1).expand(rows, cols)
        if importance is not None:
            imp = importance.float().to(w_block.device).expand(rows, cols).reshape(rows, cols // TILE, TILE)
            most = imp.amax(2, keepdim=True)
            imp = torch.where(most > 0, imp / torch.where(most > 0, most, torch.ones_like(most)), 1.0)
            weight = weight * imp.reshape(rows, cols)
        states = tail_biting(tiles(x), codebook(w_block.device), self.k, L, tiles(weight.contiguous()))
        segments = segments_from_states(states, rows, self.k)
        return {"segments": segments, "values": segment_values(segments, self.row_scale.to(w_block.device), self.k)}

    def project(self, w_cols, grid, offset: int = 0):
        return grid["values"][:, offset:offset + w_cols.shape[1]]

    def pack(self, w_hat, grids: list):
        import torch

        segments = torch.cat([g["segments"] for g in grids], dim=1)
        if tuple(w_hat.shape) != self.shape or segments.shape[1] * TILE != self.shape[1]:
            raise ValueError(f"format {self.fmt.name}: pack needs the whole weight {self.shape} and grids "
                             f"for all its blocks, got {tuple(w_hat.shape)} and {segments.shape[1]} block(s)")
        off = segment_values(segments, self.row_scale.to(segments.device), self.k) != w_hat.float()
        if bool(off.any()):
            raise ValueError(f"format {self.fmt.name}: {int(off.sum())} weight(s) of {self.shape} are not on "
                             "their block's code (pack takes the output of project)")
        return self.fmt.join(self.parts(segments, grids), self.shape, tuple(self.p.items()))

    def parts(self, segments, grids) -> dict:
        """The blob's parts from all segments [N, K/16]."""
        return {"codes": segments_to_bytes(segments, self.k), "row_scale": self.row_scale}


TRELLIS = Trellis("trellis", "tail-biting trellis code, k = 2 or 3 bits a weight, L = 12, float16 row scales",
                  params=PARAMS, experts_only=True)
