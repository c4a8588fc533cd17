"""trellis (ir/formats/trellis.py): 2- or 3-bit trellis codes with a computed codebook, read in place.

The contract (the format's docstring): every 16 x 16 tile of a weight is one tail-biting sequence of
k-bit chunks in row-major order; row r stores, for each 16-column block b, its 16 chunks as one
(16 k)-bit integer S (chunk j at bits (15 - j) k.., chunk 0 on top; k = 2 a little-endian uint32, k = 3
three little-endian uint16). Weight (r, 16 b + j) decodes the 12-bit state

    both = ((S' mod 2^(12 - k)) << 16 k) | S,   S' = segment b of row 16 (r // 16) + (r - 1) mod 16
    s    = (both >> (15 - j) k) & 4095

and is c(s) * (row_scale[r] / NORM), c(s) = bytesum(s * MUL + ADD mod 2^32) - 510 (an integer).

Decode (`rows_dot`, the expert kernels' and this family's matvec): a lane owns one 16-column block of
each of its tile's rows (the chunk scheme of tiles.py: a step covers NG blocks, 32 a warp, so a lane
loads x's 16 columns of its block once for all its rows). For each row it loads S and S' (the
previous row's segment, a row of the same tile: its cache lines are the tile's; at k = 3 only its low
uint16), and per weight takes a 12-bit window of the two words (a constant shift: one funnel shift
and a mask), one integer multiply-add, the byte sum, c(s) as a float and one FMA with x. DP4A (sm_61+, not the
interpreter): the byte sum is one dp4a with 0x01010101, accumulating onto 2^23's float bits, so the
float c(s) is the dp4a's result as float32 minus 2^23 + 510, no int-to-float conversion; the portable
path (the interpreter's, and the GPU's where DP4A is off) sums the bytes with shifts and masks into
the same bits, the same numbers. The row scale / NORM multiplies the row's sum once.

Prefill (`_matmul_kernel`): tiles of weight rows x 32 or 64 columns decoded into the activations'
dtype (each element's window by a variable 64-bit shift) and multiplied with tl.dot, the tiles timed per
prompt-length bucket (prefill.TiledPrefill).

The contract's torch form is the format's own decode (thin.ir.formats.trellis), which the tests compare
the kernels with; its constants are the format's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thin.ir.formats.trellis import HASH_A, HASH_B, NORM, TILE

from . import common, interpreting
from .common import KernelLinear, MatvecConfig, interpreter_block, next_power_of_2, prefix_rows
from .prefill import MatmulConfig, TiledPrefill, matmul_blocks, plain_tile, store_plain, token_bucket
from .tiles import dot_tile, store_tile, tile_rows, x_octet

MUL, ADD = tl.constexpr(HASH_A), tl.constexpr(HASH_B)  # the codebook's hash: h = s * MUL + ADD mod 2^32
NORM_C = tl.constexpr(NORM)  # the byte sum's standard deviation: c(s) / NORM has unit rms
FLOAT_BITS = tl.constexpr(0x4B000000)  # 2^23's float32 bits: 2^23 + u for an integer u < 2^23 OR-ed or added in
CENTER = tl.constexpr(8388608.0 + 510.0)  # 2^23 + 510: (2^23 + byte sum) - CENTER = c(s)
DP4A_MIN_CAPABILITY = (6, 1)


def dp4a_available(device: torch.device) -> bool:
    """The kernels may use dp4a: inline assembly is on (common.INLINE_ASM), they are compiled, not
    interpreted, and the GPU has it (compute capability 6.1 on)."""
    return (common.INLINE_ASM and not interpreting() and torch.device(device).type == "cuda"
            and torch.cuda.get_device_capability(device) >= DP4A_MIN_CAPABILITY)


# ---- decoding in registers ---------------------------------------------------------------------------

@triton.jit
def centered(s, DP4A: tl.constexpr):
    """c(s) as float32 for 12-bit states s (uint32): the hash's byte sum on top of 2^23's bits, less 2^23 + 510."""
    h = s * MUL + ADD
    if DP4A:  # noqa: SIM108  (constexpr branches: only one is compiled)
        biased = tl.inline_asm_elementwise("dp4a.u32.u32 $0, $1, 16843009, 1258291200;", "=r,r", [h],
                                           dtype=tl.uint32, is_pure=True, pack=1)
    else:
        biased = ((h & 255) + ((h >> 8) & 255)) + (((h >> 16) & 255) + (h >> 24)) + FLOAT_BITS
    return biased.to(tl.float32, bitcast=True) - CENTER


@triton.jit
def _window(w0, w1, SH: tl.constexpr):
    """Bits SH .. SH + 11 of the 64-bit integer whose low and high words are w0, w1 (uint32)."""
    if SH + 12 <= 32:
        s = (w0 >> SH) & 4095
    elif SH >= 32:
        s = (w1 >> (SH - 32)) & 4095
    else:
        s = ((w0 >> SH) | (w1 << (32 - SH))) & 4095
    return s


@triton.jit
def load_segments(codes_ptr, rows, segs, mask, K, BITS: tl.constexpr):
    """(w0, w1): the low and high 32-bit words (uint32 [R, S]) of `both` (the module's note) for blocks
    `segs` [S] of weight rows `rows` [R] of K columns; codes_ptr points at the codes' first byte."""
    prev = rows - rows % 16 + (rows + 15) % 16
    halves = codes_ptr.to(tl.pointer_type(tl.uint16))
    if BITS == 2:
        at = rows[:, None] * (K // 16) + segs[None, :]
        w0 = tl.load(codes_ptr.to(tl.pointer_type(tl.uint32)) + at, mask=mask, other=0)
        low = tl.load(halves + prev[:, None] * (K // 8) + 2 * segs[None, :], mask=mask, other=0)
        w1 = low.to(tl.uint32) & 1023
    else:  # three uint16 a block: bits 0-15, 16-31, 32-47
        at = rows[:, None] * (3 * K // 16) + 3 * segs[None, :]
        lo = tl.load(halves + at, mask=mask, other=0).to(tl.uint32)
        mid = tl.load(halves + at + 1, mask=mask, other=0).to(tl.uint32)
        hi = tl.load(halves + at + 2, mask=mask, other=0).to(tl.uint32)
        low = tl.load(halves + prev[:, None] * (3 * K // 16) + 3 * segs[None, :], mask=mask, other=0)
        w0 = lo | (mid << 16)
        w1 = hi | ((low.to(tl.uint32) & 511) << 16)
    return w0, w1


@triton.jit
def _block_step(acc, w0, w1, x_ptr, segs, smask, BITS: tl.constexpr, DP4A: tl.constexpr):
    """acc [R, NG] + each row's 16 weights of each block times x's 16 columns of the block."""
    xa = x_octet(x_ptr, 16 * segs, smask, False)
    xb = x_octet(x_ptr, 16 * segs + 8, smask, False)
    for j in tl.static_range(16):
        if j < 8:  # noqa: SIM108  (constexpr branches: only one is compiled)
            xj = xa[j]
        else:
            xj = xb[j - 8]
        acc += centered(_window(w0, w1, (15 - j) * BITS), DP4A) * xj[None, :]
    return acc


@triton.jit
def _step_words(codes_ptr, at, prev_at, mask, g0, R: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr):
    """(w0, w1) (uint32 [R, NG]) of blocks g0.. of the tile's rows: `at` / `prev_at` [R * NG] are each
    (row, block)'s offset (in words at k = 2, in uint16 at k = 3) in the row / its previous row, and
    `mask` whether it lies in the weight, flattened row-major (rows_dot's note)."""
    if BITS == 2:
        words = codes_ptr.to(tl.pointer_type(tl.uint32))
        w0 = tl.load(words + at + g0, mask=mask, other=0)
        w1 = tl.load(words + prev_at + g0, mask=mask, other=0) & 1023
    else:  # three uint16 a block: bits 0-15, 16-31, 32-47
        halves = codes_ptr.to(tl.pointer_type(tl.uint16))
        lo = tl.load(halves + at + 3 * g0, mask=mask, other=0).to(tl.uint32)
        mid = tl.load(halves + at + 3 * g0 + 1, mask=mask, other=0).to(tl.uint32)
        hi = tl.load(halves + at + 3 * g0 + 2, mask=mask, other=0).to(tl.uint32)
        low = tl.load(halves + prev_at + 3 * g0, mask=mask, other=0).to(tl.uint32)
        w0 = lo | (mid << 16)
        w1 = hi | ((low & 511) << 16)
    return tl.reshape(w0, [R, NG]), tl.reshape(w1, [R, NG])


@triton.jit
def rows_dot(codes_ptr, scale_ptr, x_ptr, rows, row_mask, K, cols, BITS: tl.constexpr, NG: tl.constexpr,
             PREFETCH: tl.constexpr, DP4A: tl.constexpr):
    """sum_{k < cols} W[rows, k] x[k] of a trellis weight of K columns (codes at codes_ptr, float16 row
    scales at scale_ptr), NG 16-column blocks a step: float32 [R]. PREFETCH: each step's codes are loaded
    before the previous step's math.

    The codes are loaded through offsets flattened to one axis (row-major: a row's NG blocks, then the
    next row's), reshaped to [R, NG] after: a one-axis load has no tie between a row axis and a block
    axis for the compiler to break (k = 3's blocks are 3 uint16 apart, contiguous along neither), so
    lanes take consecutive blocks and each lane's registers its blocks' rows, x's layout."""
    R: tl.constexpr = rows.shape[0]
    blocks = cols // 16
    gi = tl.arange(0, NG)
    per: tl.constexpr = 1 if BITS == 2 else 3  # a block's offset step in the loads' units
    row_len = K // 16 * per
    prev = rows - rows % 16 + (rows + 15) % 16
    at = tl.reshape(rows[:, None] * row_len + per * gi[None, :], [R * NG])
    prev_at = tl.reshape(prev[:, None] * row_len + per * gi[None, :], [R * NG])
    flat_rows = tl.reshape(row_mask[:, None] & (gi >= 0)[None, :], [R * NG])
    flat_gi = tl.reshape(rows[:, None] * 0 + gi[None, :], [R * NG])
    acc = tl.zeros([R, NG], dtype=tl.float32)
    if PREFETCH:
        w0_next, w1_next = _step_words(codes_ptr, at, prev_at, flat_rows & (flat_gi < blocks), 0, R, NG, BITS)
        for g0 in range(0, blocks, NG):
            w0, w1 = w0_next, w1_next
            w0_next, w1_next = _step_words(codes_ptr, at, prev_at, flat_rows & (g0 + NG + flat_gi < blocks),
                                           g0 + NG, R, NG, BITS)
            acc = _block_step(acc, w0, w1, x_ptr, g0 + gi, g0 + gi < blocks, BITS, DP4A)
    else:
        for g0 in range(0, blocks, NG):
            w0, w1 = _step_words(codes_ptr, at, prev_at, flat_rows & (g0 + flat_gi < blocks), g0, R, NG, BITS)
            acc = _block_step(acc, w0, w1, x_ptr, g0 + gi, g0 + gi < blocks, BITS, DP4A)
    scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32) / NORM_C
    return tl.sum(acc, axis=1) * scale


@triton.jit
def decode_tile(codes_ptr, scale_ptr, rows, row_mask, cols, K, BITS: tl.constexpr, DP4A: tl.constexpr):
    """W[rows, cols] (float32 [R, C]) of a trellis weight of K columns: each element's window by a
    variable shift of its block's 64-bit `both`."""
    w0, w1 = load_segments(codes_ptr, rows, cols // 16, row_mask[:, None], K, BITS)
    both = (w1.to(tl.uint64) << 32) | w0.to(tl.uint64)
    shift = ((15 - cols % 16) * BITS).to(tl.uint64)
    states = ((both >> shift[None, :]) & 4095).to(tl.uint32)
    scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32) / NORM_C
    return centered(states, DP4A) * scale[:, None]


# ---- the linear family: matvec and prefill matmul ---------------------------------------------------

@triton.jit
def _matvec_kernel(c_ptr, s_ptr, bias_ptr, x_ptr, out_ptr, n, K, cols, BITS: tl.constexpr, NG: tl.constexpr,
                   BN: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                   DP4A: tl.constexpr):
    """Program i: output rows i*BN.. (ACT >= 0: act(gate) * up, gate row r and up row n + r in one tile)."""
    rows, row_mask = tile_rows(tl.program_id(0), n, BN, ACT >= 0)
    total = rows_dot(c_ptr, s_ptr, x_ptr, rows, row_mask, K, cols, BITS, NG, False, DP4A)
    store_tile(out_ptr, bias_ptr, total, n, BN, ACT, HAS_BIAS, PARTIAL)


@triton.jit
def _matmul_kernel(x_ptr, c_ptr, s_ptr, bias_ptr, out_ptr, T, N, K, KS, n1, block, BITS: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                   IEEE: tl.constexpr, DP4A: tl.constexpr):
    """Prefill: out[T, N] = x[T, K] @ W.T with [BN, BK] tiles of W decoded per step; an elastic prefix
    (prefill.matmul_prefix): output row r is weight row (r // n1) * block + r % n1, the first K columns
    of rows of KS."""
    tok, out_rows, tok_mask, row_mask, rows = plain_tile(T, N, n1, block, BM, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None] * K + cols[None, :], mask=tok_mask[:, None], other=0.0)
        w = decode_tile(c_ptr, s_ptr, rows, row_mask, cols, KS, BITS, DP4A)
        acc += dot_tile(x, w.to(x.dtype), IEEE)
    store_plain(out_ptr, bias_ptr, acc, tok, out_rows, tok_mask, row_mask, rows, N, HAS_BIAS)


def block_candidates(n: int, k: int, mode: str) -> list[MatvecConfig]:
    """Matvec tiles of a trellis weight of n outputs over k columns: `chunk` columns a step (16 a lane,
    32 lanes a warp), 1, 2 or 4 warps, 4-16 weight rows a program (half as many outputs for gate/up)."""
    blocks = k // TILE
    if interpreting():
        return [MatvecConfig(interpreter_block(n, 128), TILE * min(next_power_of_2(blocks), 64), 1, 4)]
    out = []
    for warps in (1, 2, 4):
        if 32 * warps > blocks and warps > 1:
            continue
        for rows in (8, 16, 4):
            out.append(MatvecConfig(rows // 2 if mode == "glu" else rows, TILE * 32 * warps, 1, warps))
    return out


class TrellisLinear(TiledPrefill, KernelLinear):
    """A trellis weight (k = 2 or 3 bits a weight): matvec (split-K of one: partial sums are one row) and
    the prefill matmul, its tiles timed per prompt-length bucket (prefill.TiledPrefill)."""

    def __init__(self, record, raw, bias, dtype, device):
        super().__init__(record, raw, bias, dtype, device)
        self.bits = int(self.p["bits"])
        self.codes = self.parts["codes"].view(torch.uint8)
        self.row_scale = self.parts["row_scale"]
        self.dp4a = dp4a_available(self.device)

    def candidates(self, mode: str, rows: int | None = None, cols: int | None = None) -> list[MatvecConfig]:
        n, k = self.matvec_shape(mode, rows, cols)
        return block_candidates(n, k, mode)

    def _matvec(self, x, out, config, act, partial, rows=None, cols=None):
        cols = self.in_features if cols is None else cols
        if cols % TILE:
            raise ValueError(f"a trellis prefix of {cols} columns is not whole 16-column blocks")
        n, programs, config = prefix_rows(self, config, act, rows)
        _matvec_kernel[(programs,)](
            self.codes, self.row_scale, self.bias if self.bias is not None else x, x, out, n, self.in_features, cols,
            BITS=self.bits, NG=config.chunk // TILE, BN=config.block_n, ACT=act, HAS_BIAS=self.bias is not None,
            PARTIAL=partial, DP4A=self.dp4a, num_warps=config.num_warps)
        return None

    def matmul_candidates(self, T: int, K: int) -> list[MatmulConfig]:
        """Prefill tilings (one kernel: a [rows x columns] tile of W decoded a step): the untimed default
        first (prefill.matmul_blocks); on a GPU also tokens x rows of the bucket's tokens (64 and 128 beyond
        64) x 32-128 rows, 32 or 64 columns a step, Triton's pipeline over 1 or 3 stages. Under the
        interpreter the default and one of 32 columns a step."""
        bm, bn, bk = matmul_blocks(T, self.out_features, K)
        first = MatmulConfig(bm, bn, bk if K % bk == 0 else TILE, 4, 1, "plain")
        if interpreting():
            return [first, MatmulConfig(bm, bn, 32 if K % 32 == 0 else TILE, 4, 1, "plain")]
        bucket = token_bucket(T)
        tiles = [(bucket, 32, 4), (bucket, 64, 4), (bucket, 128, 4)] if bucket <= 64 else \
            [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8)]
        out = [first]
        for m, n, warps in tiles:
            for k in (32, 64):
                for stages in (1, 3):
                    config = MatmulConfig(m, n, k, warps, stages, "plain")
                    if K % k == 0 and config not in out:
                        out.append(config)
        return out

    def _launch_matmul(self, x, N, K, n1, block, config: MatmulConfig):
        if K % TILE or K % config.block_k or config.split != 1:
            raise ValueError(f"trellis {config}: whole steps of 16-column blocks of the {K} columns, no split-K")
        T = x.shape[0]
        out = torch.empty(T, N, dtype=self.dtype, device=x.device)
        _matmul_kernel[(-(-T // config.block_m), -(-N // config.block_n))](
            x, self.codes, self.row_scale, self.bias if self.bias is not None else x, out, T, N, K, self.in_features,
            n1, block, BITS=self.bits, BM=config.block_m, BN=config.block_n, BK=config.block_k,
            HAS_BIAS=self.bias is not None, IEEE=x.dtype == torch.float32 or interpreting(), DP4A=self.dp4a,
            num_warps=config.num_warps, num_stages=config.stages)
        return out


def make(record, raw, bias, device, dtype):
    """The registry's factory for trellis weights."""
    if record.shape[0] % TILE or record.shape[1] % TILE:
        return None
    return TrellisLinear(record, raw.to(device), bias, dtype, device)
