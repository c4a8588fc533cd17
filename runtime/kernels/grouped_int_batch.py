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

The schemes, timed against each other per shape and row count (`candidates`):
- "rows": the band's codes unpacked into a [BN, BK] tile (a reshape of [BN, BK / 8, 8]) for one
  tl.dot a step; the reshape moves every code between lanes through shared memory.
- "nibble": no reshape. Code position j (0..7) of every word is one [BN, BK / 8] tile by itself,
  the codes of columns k0 + 8c + j, so a step is eight tl.dots of [BM, BK / 8] activations (a
  stride-8 load of x, cheap: x is a few KB and stays in cache) against those tiles. Each word is
  loaded once and shifted in place; the group scale (and offset) is one [BN, BK / 8] load a step
  (BK / 8 consecutive words never cross a group of 32 or more).
- "trans": the transposed product, out.T [BN, BM] = W [BN, BK] @ x.T [BK, BM], so the weights are the
  dot's first operand: on Hopper (wgmma, BN of 64 or 128) that operand may live in registers and
  the band's codes are dequantized in place, in the operand's own layout, while the small
  activation block is the shared-memory operand. No conversion of the weight tile through shared
  memory: the tile's columns are taken in the order the operand layout hands them to a thread, and
  x.T is permuted to match (`_trans_kernel`). Symmetric int4 under bfloat16 activations; the
  K range may be split over programs (float32 partial sums, then `_sum_splits`, or handed on as
  they are: `rows_matmul`'s `partial`) when the bands alone are too few to fill the device.
- "transw": "trans" with the band's codes copied into shared memory as one row-major tile, 16 bytes
  a copy, and a warpgroup per 64 rows of the band (`_trans_kernel`'s WIDE).
- "mma": the same column order and in-place dequantization as "trans", neither operand through
  shared memory: one warp a program, mma.sync (m16n8k16, both operands in registers) of the
  activations [16, BK] as the first operand against the band's dequantized codes [BK, BN] as the
  second. A thread's codes (4 H contiguous bytes of each of its weight rows, H = BK / 32) and its
  activations (the 8 H columns those bytes hold, of each of its two tokens) come straight from global
  memory into the registers the operands need, so a step has none of the "trans" loop's STS of x.T,
  generic-to-async proxy fence (MEMBAR) and block-wide barriers (only the group scales' move into the
  accumulator's layout, one STS and two LDS within the warp), and the codes are loaded two steps
  before their use (loop-carried registers, as the one-row matvec's `ahead`), the activations one
  step ahead. Up to 16 rows (`MMA_ROWS`).

Every scheme also runs a fused [gate; up] weight as the gated MLP's first half (`rows_matmul`'s
`activation`): a band then holds matching gate and up rows (`_band_rows`) and its epilogue stores
act(gate) * up, so the batched step has no separate activation launch (split: the partial sums and
the activation in one launch, activation.glu_partials).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .activation import glu_partials
from .common import ACTIVATION_CODES, next_power_of_2
from .pairs import ONE2, PAIR_MAGIC, zero_pair
from .tiles import activate, dot_tile, split_sum


@triton.jit
def _dequant(codes, scale, offset, MID: tl.constexpr, ASYM: tl.constexpr):
    """Codes (0..15) to float32 weights with their group's scale (and offset)."""
    if ASYM:  # noqa: SIM108  (constexpr branches: only one is compiled)
        w = codes.to(tl.float32) * scale + offset
    else:
        w = (codes - MID).to(tl.float32) * scale
    return w


@triton.jit
def _band_rows(r, band, n, BN: tl.constexpr, GLU: tl.constexpr):
    """The weight rows that band `band`'s positions r (0 .. BN - 1) compute: band * BN + r; with GLU
    (a fused [gate; up] weight of 2 n rows) the first half of the band gate rows band * BN / 2 + r and
    the second half the matching up rows, n further on, so that a program holds both halves of its
    BN / 2 outputs."""
    if GLU:  # noqa: SIM108  (constexpr branches: only one is compiled)
        rows = band * (BN // 2) + r + tl.where(r < BN // 2, 0, n - BN // 2)
    else:
        rows = band * BN + r
    return rows


@triton.jit
def _store_glu(out_ptr, bias_ptr, gate, up, tok, cols, M, n, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    """out[tok, cols] = act(gate) * up for float32 [BM, BN / 2] gate and up sums (plus the gate and up
    bias), each step rounded to out's dtype as the unfused path (the projection's output, then
    activation.glu) rounds it."""
    if HAS_BIAS:
        gate += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + n + cols).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = activate(gate, ACT).to(dtype).to(tl.float32)
    tl.store(out_ptr + tok[:, None] * n + cols[None, :], (act * up).to(dtype), mask=(tok < M)[:, None])


@triton.jit
def _glu_epilogue(acc, out_ptr, bias_ptr, band, M, n, BM: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
                  ACT: tl.constexpr):
    """A GLU band's [BM, BN] sums (gate columns, then up columns: `_band_rows`) into act(gate) * up."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, [BM, 2, BN // 2]), (0, 2, 1)))
    _store_glu(out_ptr, bias_ptr, gate, up, tl.arange(0, BM), band * (BN // 2) + tl.arange(0, BN // 2), M, n,
               HAS_BIAS, ACT)


@triton.jit
def _rows_kernel(x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, M, N, K, MID: tl.constexpr,
                 ASYM: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 NIBBLE: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, ACT: tl.constexpr = -1):
    """Program i: out[:M, i*BN:(i+1)*BN] = x[:M] @ W[rows].T (+ bias), W read once; NIBBLE: by code
    position (eight dots a step), else one [BN, BK] tile a step. ACT >= 0: W is a fused [gate; up]
    weight (N = 2 n rows) and out [M, n] gets act(gate) * up (`_band_rows`, `_glu_epilogue`)."""
    rows = _band_rows(tl.arange(0, BN), tl.program_id(0), N // 2, BN, ACT >= 0)
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
    if ACT >= 0:
        _glu_epilogue(acc, out_ptr, bias_ptr, tl.program_id(0), M, N // 2, BM, BN, HAS_BIAS, ACT)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
        tl.store(out_ptr + tok[:, None] * N + rows[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tok_mask[:, None])


def _code_asm(shift: int, halves: bool = False) -> str:
    """PTX for `_codes`: the code at bits `shift`..`shift`+3 of each int16 half of a register, OR-ed
    into bf16 128.0 (lop3 0xea: (a & b) | c) and 128 + 8 taken off by one pair fma (t * 1 - 136); the
    constants are pairs.py's (ONE2, PAIR_MAGIC, zero_pair(8)). halves (`_code_pairs`): the bf16 pair
    handed out as two 16-bit results, low half first."""
    word = "$2" if halves else "$1"
    source = f"shr.u32 t, {word}, {shift}; " if shift else ""
    operand = "t" if shift else word
    result, split = ("d", " mov.b32 {$0, $1}, d;") if halves else ("$0", "")
    return (f"{{ .reg .b32 t, o, z{', d' if halves else ''}; "
            f"mov.b32 o, 0x{ONE2.value:08X}; mov.b32 z, 0x{zero_pair(8) & 0xFFFFFFFF:08X}; {source}"
            f"lop3.b32 t, {operand}, 0x000F000F, 0x{PAIR_MAGIC:08X}, 0xea; fma.rn.bf16x2 {result}, t, o, z;{split} }}")


_CODES_0 = tl.constexpr(_code_asm(0))
_CODES_4 = tl.constexpr(_code_asm(4))
_CODES_8 = tl.constexpr(_code_asm(8))
_CODES_12 = tl.constexpr(_code_asm(12))


@triton.jit
def _codes(h, S: tl.constexpr, MID: tl.constexpr, ASM: tl.constexpr):
    """u - MID for the 4-bit code u at bits S..S+3 of each int16 `h` (a half of a packed word). ASM
    (bfloat16, MID 8): two halves a register, the codes OR-ed into the mantissa of 128.0 (0x4300,
    exact: its unit is 1) by one logic op and 136 subtracted by one pair fma (t * 1 - 136, exact
    small integers; sm_80 and up; `_code_asm`); else float32 (the interpreter's twin)."""
    if ASM:
        if S == 0:
            asm: tl.constexpr = _CODES_0
        elif S == 4:
            asm: tl.constexpr = _CODES_4
        elif S == 8:
            asm: tl.constexpr = _CODES_8
        else:
            asm: tl.constexpr = _CODES_12
        out = tl.inline_asm_elementwise(asm, "=r,r", [h], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        out = (((h >> S) & 0xF) - MID).to(tl.float32)
    return out


@triton.jit
def _trans_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, row_halves, k_len, MID: tl.constexpr,
                  G: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PARTIAL: tl.constexpr,
                  HAS_BIAS: tl.constexpr, ASM: tl.constexpr, WIDE: tl.constexpr = False, ACT: tl.constexpr = -1):
    """Program (i, s): out.T[i*BN:(i+1)*BN, :M] over columns s*k_len .. (s+1)*k_len, W's band as the
    dot's first operand. PARTIAL: float32 sums into out[s] (a [splits, M, N] buffer), else plus the
    bias in out's dtype; ACT >= 0 (not PARTIAL): act(gate) * up of a fused [gate; up] weight into out
    [M, N / 2] (`_band_rows`, `_glu_epilogue`).

    WIDE (the "transw" scheme): a step's codes are loaded as one [BN, 8 H] tile of int16 halves (a
    row's 16 H bytes in a row), its column offset declared a multiple of 8 H: Triton then copies
    them 16 bytes at a time (cp.async.cg) into a row-major shared tile, which the lane groups of
    eight rows read without bank conflicts. Without it the [BN, 4, 2 H] tile is copied 8 bytes at
    a time into a tile ordered lane group first (sm_90: LDGSTS.E.64, and each LDS.128 of the codes
    4-way bank-conflicted: the four lane groups of a row 1024 bytes apart). Same values either way.

    Column order of a step's tile (BK = 32 H columns, H words a row per lane group): tile column
    32 hi + 16 s1 + 8 s0 + 2 t + half is the code at bits 4 (2 s1 + s0) of int16 half `half` of
    word H t + hi, i.e. real column 8 (H t + hi) + 4 half + 2 s1 + s0. That is the order in which
    the wgmma register operand gives a thread its values (pairs of columns in one register, lanes
    t = 0..3 two columns apart, then registers 8 columns apart), so the four code positions of
    the loaded halves, joined, are the operand as they stand; x.T is the same permutation of the
    step's columns. The group scale multiplies each step's [BN, BM] sums (BK divides the group):
    the tile holds the exact integers u - MID."""
    H: tl.constexpr = BK // 32
    rows = _band_rows(tl.arange(0, BN), tl.program_id(0), N // 2, BN, ACT >= 0)
    k_first = tl.program_id(1) * k_len
    tok = tl.arange(0, BM)
    tok_mask = tok < M
    # Lane group t's H words of each row, as 2 H int16 halves: one 4 H-byte load (row_halves = K / 4
    # is an argument of its own so that the compiler sees its divisibility by 16 and vectorises).
    halves = w_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + rows[:, None, None].to(tl.int64) * row_halves
    lane_halves = 2 * H * tl.arange(0, 4)[None, :, None] + tl.arange(0, 2 * H)[None, None, :]
    band_halves = (w_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + rows[:, None].to(tl.int64) * row_halves
                   + tl.arange(0, 8 * H)[None, :])
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(k_first, k_first + k_len, BK):
        scale = tl.load(scale_ptr + rows.to(tl.int64) * (K // G) + k0 // G).to(tl.float32)
        if WIDE:  # noqa: SIM108  (constexpr branches: only one is compiled)
            h = tl.load(band_halves + tl.multiple_of(k0 // 4, 8 * H))
        else:
            h = tl.load(halves + k0 // 4 + lane_halves)
        h = tl.permute(tl.reshape(h, [BN, 4, H, 2]), (0, 2, 1, 3))  # [BN, hi, t, half]
        pairs = tl.join(tl.join(_codes(h, 0, MID, ASM), _codes(h, 4, MID, ASM)),
                        tl.join(_codes(h, 8, MID, ASM), _codes(h, 12, MID, ASM)))  # [BN, hi, t, half, s0, s1]
        w = tl.reshape(tl.permute(pairs, (0, 1, 5, 4, 2, 3)), [BN, BK])
        # The step's activations, one contiguous load (16 bytes a lane), permuted in registers.
        x = tl.load(x_ptr + tok[:, None] * K + (k0 + tl.arange(0, BK))[None, :], mask=tok_mask[:, None], other=0.0)
        xt = tl.reshape(tl.permute(tl.reshape(x, [BM, 4, H, 2, 2, 2]), (2, 4, 5, 1, 3, 0)), [BK, BM])
        if ASM:  # noqa: SIM108  (constexpr branches: only one is compiled)
            part = tl.dot(w, xt)
        else:
            part = tl.dot(w, xt.to(tl.float32), input_precision="ieee")
        acc += part * scale[:, None]
    if PARTIAL:
        dest = out_ptr + tl.program_id(1) * M * N + tok[None, :] * N + rows[:, None]
        tl.store(dest, acc, mask=tok_mask[None, :])
    elif ACT >= 0:
        _glu_epilogue(tl.trans(acc), out_ptr, bias_ptr, tl.program_id(0), M, N // 2, BM, BN, HAS_BIAS, ACT)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
        tl.store(out_ptr + tok[None, :] * N + rows[:, None], acc.to(out_ptr.dtype.element_ty), mask=tok_mask[None, :])


_PAIRS_0 = tl.constexpr(_code_asm(0, halves=True))
_PAIRS_4 = tl.constexpr(_code_asm(4, halves=True))
_PAIRS_8 = tl.constexpr(_code_asm(8, halves=True))
_PAIRS_12 = tl.constexpr(_code_asm(12, halves=True))


@triton.jit
def _code_pairs(words, S: tl.constexpr, MID: tl.constexpr, ASM: tl.constexpr):
    """[..., 2]: u - MID for the codes at bits S..S+3 of the low and the high int16 half of each
    32-bit word (what `_codes` gives for a word's two halves, without splitting the word first).
    ASM: bfloat16 by `_code_asm` (halves); else float32 (the interpreter's twin)."""
    if ASM:
        if S == 0:
            asm: tl.constexpr = _PAIRS_0
        elif S == 4:
            asm: tl.constexpr = _PAIRS_4
        elif S == 8:
            asm: tl.constexpr = _PAIRS_8
        else:
            asm: tl.constexpr = _PAIRS_12
        low, high = tl.inline_asm_elementwise(asm, "=h,=h,r", [words], dtype=(tl.bfloat16, tl.bfloat16),
                                              is_pure=True, pack=1)
    else:
        low = (((words >> S) & 0xF) - MID).to(tl.float32)
        high = (((words >> (16 + S)) & 0xF) - MID).to(tl.float32)
    return tl.join(low, high)


@triton.jit
def _mma_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, row_words, k_len, MID: tl.constexpr,
                G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PARTIAL: tl.constexpr,
                HAS_BIAS: tl.constexpr, ASM: tl.constexpr, ACT: tl.constexpr = -1):
    """Program (i, s), one warp: out[:M, i*BN:(i+1)*BN] over columns s*k_len .. (s+1)*k_len, x as the
    dot's first operand and the band's codes, dequantized in registers, as its second. PARTIAL, the
    bias and ACT (act(gate) * up of a fused [gate; up] weight) as in `_trans_kernel`.

    A step's tile columns are `_trans_kernel`'s order (H = BK / 32 words a row per lane group t):
    tile column 32 hi + 16 s1 + 8 s0 + 2 t + half is real column 8 (H t + hi) + 4 half + 2 s1 + s0.
    The m16n8k16 operands give lane (g, t) the tile columns 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of each 16,
    of its token rows g, g + 8 (first operand) and of weight row g of each 8 (second), i.e. the real
    columns 8 H t .. 8 H t + 8 H - 1 of the step: the H words of its rows, the 8 H activations of its
    tokens, each one contiguous load. The loads are shaped so that this is the layout they get
    ([row tile, g, t, word] and [word, token tile, g, t, column]): the permutation into tile order
    is then a renaming of registers (and, for x, moving bf16 halves between them), never a trip
    through shared memory. The codes (and group scales) of step k + 2 and the activations of step
    k + 1 are loaded while step k is computed (past the last step: the last step again), so a load of
    codes has a whole step between its issue and its first use: ptxas moves the loop-carried
    registers at the top of the next step (sm_90 SASS of a 64-row band: 600 of the loop's 639
    instructions between each LDG.E.128 of codes and its first reader)."""
    H: tl.constexpr = BK // 32
    band = tl.program_id(0)
    k_first = tl.program_id(1) * k_len
    k_last = k_first + k_len - BK
    # Codes: [BN / 8, 8, 4, H] int32, weight row 8 n + g, lane group t's H words.
    n = tl.arange(0, BN // 8)[:, None, None, None]
    g = tl.arange(0, 8)[None, :, None, None]
    t = tl.arange(0, 4)[None, None, :, None]
    words = (w_ptr + _band_rows(8 * n + g, band, N // 2, BN, ACT >= 0).to(tl.int64) * row_words + H * t
             + tl.arange(0, H)[None, None, None, :])
    # Activations: [H, BM / 8, 8, 4, 8], token 8 a + g, real column 8 H t + 8 c + e.
    c5 = tl.arange(0, H)[:, None, None, None, None]
    tok5 = 8 * tl.arange(0, BM // 8)[None, :, None, None, None] + tl.arange(0, 8)[None, None, :, None, None]
    t5 = tl.arange(0, 4)[None, None, None, :, None]
    x_cols = x_ptr + tok5 * K + 8 * H * t5 + 8 * c5 + tl.arange(0, 8)[None, None, None, None, :]
    x_mask = tl.broadcast_to(tok5 < M, [H, BM // 8, 8, 4, 8])
    rows = _band_rows(tl.arange(0, BN), band, N // 2, BN, ACT >= 0)
    side = scale_ptr + rows.to(tl.int64) * (K // G)
    codes_1 = tl.load(words + tl.multiple_of(k_first // 8, 4 * H))
    scale_1 = tl.load(side + k_first // G)
    x_1 = tl.load(x_cols + k_first, mask=x_mask, other=0.0)
    k_second = tl.minimum(k_first + BK, k_last)
    codes_2 = tl.load(words + tl.multiple_of(k_second // 8, 4 * H))
    scale_2 = tl.load(side + k_second // G)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(k_first, k_first + k_len, BK, num_stages=1):
        codes, scale, x = codes_1, scale_1.to(tl.float32), x_1
        k_ahead = tl.minimum(k0 + 2 * BK, k_last)
        codes_1, scale_1 = codes_2, scale_2
        codes_2 = tl.load(words + tl.multiple_of(k_ahead // 8, 4 * H))
        scale_2 = tl.load(side + k_ahead // G)
        x_1 = tl.load(x_cols + tl.minimum(k0 + BK, k_last), mask=x_mask, other=0.0)
        h = tl.permute(tl.reshape(codes, [BN, 4, H]), (0, 2, 1))  # [BN, hi, t]
        pairs = tl.join(tl.join(_code_pairs(h, 0, MID, ASM), _code_pairs(h, 4, MID, ASM)),
                        tl.join(_code_pairs(h, 8, MID, ASM), _code_pairs(h, 12, MID, ASM)))  # [BN, hi, t, half, s0, s1]
        wt = tl.reshape(tl.permute(pairs, (1, 5, 4, 2, 3, 0)), [BK, BN])
        # [c, a, g, t, e] -> [token, t, hi = c, half, s1, s0] -> [token, hi, s1, s0, t, half]
        xr = tl.reshape(tl.permute(x, (1, 2, 3, 0, 4)), [BM, 4, H, 2, 2, 2])
        xo = tl.reshape(tl.permute(xr, (0, 2, 4, 5, 1, 3)), [BM, BK])
        if ASM:  # noqa: SIM108  (constexpr branches: only one is compiled)
            part = tl.dot(xo, wt)
        else:
            part = tl.dot(xo.to(tl.float32), wt, input_precision="ieee")
        acc += part * scale[None, :]
    tok = tl.arange(0, BM)
    if PARTIAL:
        tl.store(out_ptr + tl.program_id(1) * M * N + tok[:, None] * N + rows[None, :], acc, mask=(tok < M)[:, None])
    elif ACT >= 0:
        _glu_epilogue(acc, out_ptr, bias_ptr, band, M, N // 2, BM, BN, HAS_BIAS, ACT)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
        tl.store(out_ptr + tok[:, None] * N + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=(tok < M)[:, None])


@triton.jit
def _sum_splits(part_ptr, bias_ptr, out_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK: tl.constexpr):
    """out = the sum over SPLITS of part[s] (+ bias), in out's dtype, in a fixed order."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    total = split_sum(part_ptr, i, mask, MN, bias_ptr, i % N, SPLITS, HAS_BIAS)
    tl.store(out_ptr + i, total.to(out_ptr.dtype.element_ty), mask=mask)


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


SCHEMES = ("rows", "nibble", "trans", "transw", "mma")
SPLITS = (1, 2, 4, 8)
MMA_ROWS = 16  # the "mma" scheme's activations: one m16 tile of tokens


def candidates(op, rows: int | None = None) -> list[tuple[str, int, int]]:
    """(scheme, band width, splits of the columns) worth timing for `op` at `rows` rows (None: any
    count up to MAX_ROWS): the nibble scheme needs 128 columns a step (eight dots of at least 16);
    the transposed one symmetric codes, bfloat16 activations and bands of 64 or 128 rows, its column
    range split in up to 8 parts of at least two steps each ("transw" the same); "mma" the same codes
    and activations, bands of 32 or 64 rows, the same splits, and at most MMA_ROWS rows. Where "trans"
    runs, "nibble" is left out from 16 rows up (the H200 timed it slower than "trans" for every
    llama-8b shape at 16 and 64 rows)."""
    out = [("rows", bn, 1) for bn in block_candidates(op)]
    bf16_pairs = not op.asym and op.mid == 8 and op.dtype == torch.bfloat16
    if op.in_features % 128 == 0 and op.group % 32 == 0 and not (bf16_pairs and rows is not None and rows >= 16):
        out += [("nibble", bn, 1) for bn in block_candidates(op)]
    if bf16_pairs:
        steps = op.in_features // _block_k(op)
        splits = [s for s in SPLITS if steps % s == 0 and (s == 1 or steps // s >= 2)]
        out += [(scheme, bn, s) for scheme in ("trans", "transw") for bn in (64, 128) if op.out_features % bn == 0
                for s in splits]
        if rows is not None and rows <= MMA_ROWS:
            out += [("mma", bn, s) for bn in (32, 64) if op.out_features % bn == 0 for s in splits]
    return out


def rows_matmul(op, x: torch.Tensor, choice: tuple[str, int, int] = ("rows", 16, 1), *, partial: bool = False,
                activation: str | None = None) -> torch.Tensor:
    """x [M, K] (M <= 64) @ W.T (+ bias) -> [M, N] in x's dtype, for an op `takes` accepts, by
    `choice` = (scheme, band width, splits), one of candidates(op).

    partial: where the choice splits the columns, the float32 partial sums [splits, M, N] as they
    are, bias not added (for add_rmsnorm's `partials`, which sums them with the bias); else the
    output as without it. activation: W is a fused [gate; up] weight (N = 2 n) and the result is
    act(gate) * up [M, n], rounded as activation.glu of the plain output rounds it: in the kernel's
    epilogue, or where the columns are split summed from the partial sums by activation.glu_partials
    (one launch either way, none for `_sum_splits`)."""
    M, K = x.shape
    N = op.out_features
    if (not takes(op) or op.in_features != K or not 1 <= M <= MAX_ROWS or tuple(choice) not in candidates(op, M)
            or (choice[0] in ("trans", "transw", "mma") and x.dtype != op.dtype)):
        raise ValueError(f"rows_matmul takes int4 weights, 1..{MAX_ROWS} rows of {op.in_features} and a choice of "
                         f"candidates(op), got {op!r}, {tuple(x.shape)} {x.dtype} and {choice}")
    if activation is not None and (partial or activation not in ACTIVATION_CODES):
        raise ValueError(f"rows_matmul's activation is one of {', '.join(ACTIVATION_CODES)} and not partial, got "
                         f"{activation!r} (partial={partial})")
    act = -1 if activation is None else ACTIVATION_CODES[activation]
    scheme, bn, splits = choice
    bias = op.bias if op.bias is not None else x
    if scheme in ("trans", "transw"):
        written = _trans(op, x.contiguous(), bn, splits, bias, wide=scheme == "transw", act=act)
    elif scheme == "mma":
        written = _mma(op, x.contiguous(), bn, splits, bias, act=act)
    else:
        written = torch.empty(M, N if act < 0 else N // 2, dtype=x.dtype, device=x.device)
        nibble = scheme == "nibble"
        _rows_kernel[(N // bn,)](
            x.contiguous(), op.low32, op.scales, op.offsets, bias, written, M, N, K, MID=op.mid, ASYM=op.asym,
            G=op.group, BM=max(16, next_power_of_2(M)), BN=bn, BK=128 if nibble else _block_k(op), NIBBLE=nibble,
            HAS_BIAS=op.bias is not None, IEEE=x.dtype == torch.float32 or interpreting(), ACT=act, num_warps=4,
            num_stages=3 if nibble else 4)
    if splits == 1 or partial:
        return written
    if act >= 0:
        return glu_partials(written, activation, op.bias, x.dtype)
    return _summed(written, op.bias, x.dtype)


def _trans(op, x: torch.Tensor, bn: int, splits: int, bias: torch.Tensor, wide: bool = False,
           act: int = -1) -> torch.Tensor:
    """The "trans" scheme, one launch; what it wrote (`_outputs`). wide: "transw", the codes copied
    as one row-major tile (`_trans_kernel`'s WIDE) by a warpgroup per 64 rows of the band (8 warps at
    128 rows: half the registers a thread of 4 warps needs there). act >= 0: the fused [gate; up]
    epilogue (`_trans_kernel`'s ACT; unsplit only)."""
    M, K = x.shape
    N = op.out_features
    written = _outputs(x, N, splits, act)
    _trans_kernel[(N // bn, splits)](
        x, op.low32, op.scales, bias, written, M, N, K, K // 4, K // splits, MID=op.mid, G=op.group,
        BM=max(16, next_power_of_2(M)), BN=bn, BK=_block_k(op), PARTIAL=splits > 1, HAS_BIAS=op.bias is not None,
        ASM=not interpreting(), WIDE=wide, ACT=act if splits == 1 else -1, num_warps=bn // 16 if wide else 4,
        num_stages=4)
    return written


def _mma(op, x: torch.Tensor, bn: int, splits: int, bias: torch.Tensor, act: int = -1) -> torch.Tensor:
    """The "mma" scheme: one launch of one-warp programs; what it wrote, as `_trans`."""
    M, K = x.shape
    N = op.out_features
    written = _outputs(x, N, splits, act)
    _mma_kernel[(N // bn, splits)](
        x, op.low32, op.scales, bias, written, M, N, K, K // 8, K // splits, MID=op.mid, G=op.group, BM=MMA_ROWS,
        BN=bn, BK=_block_k(op), PARTIAL=splits > 1, HAS_BIAS=op.bias is not None,
        ASM=not interpreting(), ACT=act if splits == 1 else -1, num_warps=1, num_stages=1)
    return written


def _outputs(x: torch.Tensor, N: int, splits: int, act: int) -> torch.Tensor:
    """What a launch writes: the output [M, N] (or [M, N / 2] after a GLU epilogue) in x's dtype, or
    with split columns float32 partial sums [splits, M, N]."""
    M = x.shape[0]
    if splits == 1:
        return torch.empty(M, N if act < 0 else N // 2, dtype=x.dtype, device=x.device)
    return torch.empty(splits, M, N, dtype=torch.float32, device=x.device)


def _summed(part: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The float32 partial sums `part` [splits, M, N] summed (`_sum_splits`: in split order, then
    the bias) into [M, N] in `dtype`."""
    splits, M, N = part.shape
    out = torch.empty(M, N, dtype=dtype, device=part.device)
    block = 1024
    _sum_splits[(triton.cdiv(M * N, block),)](part, bias if bias is not None else part, out, M * N, N,
                                              SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block)
    return out
