"""Symmetric int4 matvec products on the tensor cores (mma.sync m16n8k16, bf16 in, float32 sums): a third
arithmetic of the chunk-scheme matvec (grouped_int.py, MatvecConfig.mma), on the chunk scheme's own tiles.

The chunk scheme (tiles.py) gives lane c of a warp the 32 columns of chunk c0 + c of every row of its tile,
so the four lanes of a quad (lanes 4q..4q+3) hold one 128-column group (a group scale: G a multiple of 128),
and the warp's eight quads eight consecutive groups. One mma per 8 codes a lane then multiplies them by the
activations and sums them within the quad, exactly (bf16 products, float32 sums):

- A (16 rows x 16 columns of the instruction) is a pair of tile rows (r, r') per quad: mma row q holds
  quad q's codes of r, row q + 8 those of r'; the instruction's 16 columns are the quad's four lanes times
  the four code pairs a lane gives it (pairs.py's bf16 subnormals, a mask each, one shift a word).
- B (16 x 8) column q is quad q's own activations, so D[q][q] is r's dot product over group q and
  D[q + 8][q] r''s: the diagonal. Lane (q, q // 2) holds both (its d0 / d1 and d2 / d3 by q's parity).
  The other 56 outputs a row pair of the instruction are cross terms, dropped.

The codes stand in the bf16 bits as u * 2^-133 (or u * 2^-129 for a byte's upper nibble), so the
activations are scaled by 2^100 (2^96) once per step, shared by every row: each product is then
u * x * 2^-33, a normal float32. The zero point comes off per group as 8 * sum(x) (a ninth mma per octet
sums the step's activations, A = the activations, B = ones), in float32 after the codes' sum, which the
float32 accumulation keeps exact to float32 rounding: the results match the format's decode to ~1e-7
relative (the bf16 pairs of pairs.py: ~5e-3). Per 8 weights a lane: one mma, one shift, four masks
(against pairs.py's 8 pair FMAs, 4 masks, a shift).

Under the interpreter (no PTX) `mma` is its twin: the same products summed over each quad in float32,
which is what the instruction computes when every column of B is the lane's own activations (the twin's
sum order differs, so the twin is checked to float32 rounding, not bit for bit).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pairs import x_pairs

ONES = tl.constexpr(0x3F803F80)  # bf16 pair (1, 1)
X_UP = tl.constexpr(0x71807180)  # (2^100, 2^100): the activations of a half's first nibble (u * 2^-133)
X_UP4 = tl.constexpr(0x6F806F80)  # (2^96, 2^96): those of its second nibble (u * 2^-129)


@triton.jit
def _lo(p):
    return (p << 16).to(tl.float32, bitcast=True)


@triton.jit
def _hi(p):
    return (p & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _quad_sum(p):
    """p [C] summed over each quad of lanes, broadcast back to the quad's lanes (the twin's mma)."""
    C: tl.constexpr = p.shape[0]
    q = tl.sum(tl.reshape(p, [C // 4, 4]), axis=1)
    return tl.reshape(tl.broadcast_to(q[:, None], [C // 4, 4]), [C])


@triton.jit
def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ASM: tl.constexpr):
    """(d0, d1, d2, d3) = A @ B + C of mma.sync.m16n8k16 (bf16 pairs a*, b*; float32 c*, d*), every operand
    [C] with one element a thread (lane c % 32 of warp c // 32). Under the interpreter: the same where B's
    columns are each lane's own (b*) - rows q and q + 8 of A dotted with the quad's b, summed over the quad."""
    if ASM:
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        first = _quad_sum(_lo(a0) * _lo(b0) + _hi(a0) * _hi(b0) + _lo(a2) * _lo(b1) + _hi(a2) * _hi(b1))
        second = _quad_sum(_lo(a1) * _lo(b0) + _hi(a1) * _hi(b0) + _lo(a3) * _lo(b1) + _hi(a3) * _hi(b1))
        d0, d1, d2, d3 = c0 + first, c1 + first, c2 + second, c3 + second
    return d0, d1, d2, d3


@triton.jit
def _scaled(p, up, ASM: tl.constexpr):
    """bf16 pairs p times the power-of-2 pair `up` (exact)."""
    if ASM:
        out = tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [p, up], dtype=tl.int32,
                                        is_pure=True, pack=1)
    else:
        lo = (_lo(p) * _lo(up)).to(tl.int32, bitcast=True)
        hi = (_hi(p) * _hi(up)).to(tl.int32, bitcast=True)
        out = ((lo >> 16) & 0xFFFF) | (hi & -65536)
    return out


@triton.jit
def step_activations(x_ptr, col, ASM: tl.constexpr):
    """The activations of a step's chunks (`col` [C]: each lane's first column): 16 bf16 pairs a lane
    (octet o's x_pairs at 4 * o .. 4 * o + 3, the first and third scaled by 2^100, the others by 2^96) and
    sum(x) over each lane's quad's group, float32, times 2^100."""
    C: tl.constexpr = col.shape[0]
    up = tl.full([C], X_UP, tl.int32)
    up4 = tl.full([C], X_UP4, tl.int32)
    ones = tl.full([C], ONES, tl.int32)
    z = tl.zeros([C], dtype=tl.float32)
    e0, e1, e2, e3 = z, z, z, z
    f0, f1, f2, f3 = z, z, z, z
    pairs = ()
    for o in tl.static_range(4):
        xp = x_pairs(x_ptr, col + 8 * o, col >= 0, True, ASM)
        xp = (_scaled(xp[0], up, ASM), _scaled(xp[1], up4, ASM), _scaled(xp[2], up, ASM), _scaled(xp[3], up4, ASM))
        # Rows q: the 2^100 pairs, q + 8: the 2^96 ones; B = ones sums each row over the quad (two chains).
        if o % 2 == 0:
            e0, e1, e2, e3 = mma(xp[0], xp[1], xp[2], xp[3], ones, ones, e0, e1, e2, e3, ASM)
        else:
            f0, f1, f2, f3 = mma(xp[0], xp[1], xp[2], xp[3], ones, ones, f0, f1, f2, f3, ASM)
        pairs = pairs + xp
    return pairs, (e0 + f0) + 16.0 * (e2 + f2)


@triton.jit
def _codes(w, S: tl.constexpr):
    """bf16 pairs of word w's codes as they stand: S 0: (u0, u4) * 2^-133, 1: (u1, u5) * 2^-129,
    2: (u2, u6) * 2^-133, 3: (u3, u7) * 2^-129 (pairs.py)."""
    v = w if S < 2 else w >> 8  # arithmetic, harmless: the masks keep bits below 24
    if S % 2 == 0:  # noqa: SIM108  (constexpr branches: only one is compiled)
        out = v & 0x000F000F
    else:
        out = v & 0x00F000F0
    return out


@triton.jit
def words(ptr, row, KW: tl.constexpr, col):
    """The four int32 words of the 32 columns at `col` [C] of row `row` (a scalar; rows of KW words): one
    16-byte load a lane."""
    offs = row.to(tl.int64) * KW + (col // 8)[:, None] + tl.arange(0, 4)[None, :]
    v = tl.load(ptr + offs)
    e, o = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))
    w0, w2 = tl.split(e)
    w1, w3 = tl.split(o)
    return w0, w1, w2, w3


@triton.jit
def pair_words(ptr, first, second, KW: tl.constexpr, col):
    """The words of rows `first` and `second` at `col` (words): a tuple of 8, the first row's 4 then the second's."""
    return words(ptr, first, KW, col) + words(ptr, second, KW, col)


@triton.jit
def pair_rows(w, col, pairs, ASM: tl.constexpr):
    """(the first row's, the second row's) code sums times x over each lane's quad's group of the words `w`
    (pair_words; in units of 2^-33, on the diagonal lanes, see the module doc): 8 mma a lane, in two chains
    of 4 (octets 0-1 and 2-3), so an mma's latency overlaps the other chain's."""
    z = tl.zeros([col.shape[0]], dtype=tl.float32)
    d0, d1, d2, d3 = z, z, z, z
    e0, e1, e2, e3 = z, z, z, z
    for o in tl.static_range(2):
        d0, d1, d2, d3 = mma(_codes(w[o], 0), _codes(w[4 + o], 0), _codes(w[o], 1), _codes(w[4 + o], 1),
                             pairs[4 * o], pairs[4 * o + 1], d0, d1, d2, d3, ASM)
        d0, d1, d2, d3 = mma(_codes(w[o], 2), _codes(w[4 + o], 2), _codes(w[o], 3), _codes(w[4 + o], 3),
                             pairs[4 * o + 2], pairs[4 * o + 3], d0, d1, d2, d3, ASM)
        e0, e1, e2, e3 = mma(_codes(w[2 + o], 0), _codes(w[6 + o], 0), _codes(w[2 + o], 1), _codes(w[6 + o], 1),
                             pairs[8 + 4 * o], pairs[9 + 4 * o], e0, e1, e2, e3, ASM)
        e0, e1, e2, e3 = mma(_codes(w[2 + o], 2), _codes(w[6 + o], 2), _codes(w[2 + o], 3), _codes(w[6 + o], 3),
                             pairs[10 + 4 * o], pairs[11 + 4 * o], e0, e1, e2, e3, ASM)
    odd = (col // 128) % 2 == 1  # the lane's quad q (its group within the warp's 8), by parity
    return tl.where(odd, d1 + e1, d0 + e0), tl.where(odd, d3 + e3, d2 + e2)


@triton.jit
def _row(i: tl.constexpr, pid, n, BN: tl.constexpr, GLU: tl.constexpr):
    """The weight row of tile row i of program pid (tiles.tile_rows' order: GLU, gate and up rows
    interleaved)."""
    if GLU:
        row = pid * BN + i // 2 + (i % 2) * n
    else:
        row = pid * BN + i
    return row


@triton.jit
def _term(acc, value, sx, scale_ptr, row, groups: tl.constexpr, G: tl.constexpr, col, diag):
    """acc + the row's group scale * (its code sum - 8 * sum(x)) on the diagonal lanes."""
    scale = tl.load(scale_ptr + row * groups + col // G).to(tl.float32)
    return acc + tl.where(diag, scale * (value - sx), 0.0)


@triton.jit
def _pairs_words(ptr, s0, s1, s2, s3, s4, s5, s6, s7, KW: tl.constexpr, col, RB: tl.constexpr):
    """pair_words of the tile's row pairs (RB rows: 2, 4 or 8) at `col`, as a tuple of 4 (the unused repeat
    the first, never loaded twice: the same loads)."""
    first = pair_words(ptr, s0, s1, KW, col)
    second = first
    third = first
    fourth = first
    if RB >= 4:
        second = pair_words(ptr, s2, s3, KW, col)
    if RB >= 8:
        third = pair_words(ptr, s4, s5, KW, col)
        fourth = pair_words(ptr, s6, s7, KW, col)
    return first, second, third, fourth


@triton.jit
def rows_dot_mma(low_ptr, scale_ptr, x_ptr, n, K: tl.constexpr, split_chunks, G: tl.constexpr, C: tl.constexpr,
                 BN: tl.constexpr, GLU: tl.constexpr, ASM: tl.constexpr, AHEAD: tl.constexpr = 0):
    """sum_k W[rows, k] * x[k] over the tile's rows (tiles.tile_rows: 2, 4 or 8 weight rows) and this program's
    chunks (split `program_id(1)` of split_chunks, a multiple of 4), float32 [rows]: grouped_int._rows_dot's
    contract for symmetric int4 (zero point 8, G a multiple of 128) under bf16 x, on the tensor cores. Every
    step loads each row's words and the step's activations once per lane, as the chunk scheme does; AHEAD 2:
    the words two steps ahead (as grouped_int's)."""
    pid = tl.program_id(0)
    RB: tl.constexpr = 2 * BN if GLU else BN
    KW: tl.constexpr = K // 8
    groups: tl.constexpr = K // G
    ci = tl.arange(0, C)
    diag = (ci % 4) == ((ci // 4) % 8) // 2  # lane (q, q // 2) of each warp holds the diagonal
    s0 = _row(0, pid, n, BN, GLU)
    s1 = _row(1, pid, n, BN, GLU)
    s2 = _row(2 % RB, pid, n, BN, GLU)
    s3 = _row(3 % RB, pid, n, BN, GLU)
    s4 = _row(4 % RB, pid, n, BN, GLU)
    s5 = _row(5 % RB, pid, n, BN, GLU)
    s6 = _row(6 % RB, pid, n, BN, GLU)
    s7 = _row(7 % RB, pid, n, BN, GLU)
    z = tl.zeros([C], dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = z, z, z, z, z, z, z, z
    begin = tl.program_id(1) * split_chunks
    end = begin + split_chunks
    if AHEAD:  # every row pair's words two steps ahead (the step after the last: the last again, from L2)
        col1 = 32 * (begin + ci)
        col2 = 32 * (tl.minimum(begin + C, end - C) + ci)
        p1 = _pairs_words(low_ptr, s0, s1, s2, s3, s4, s5, s6, s7, KW, col1, RB)
        p2 = _pairs_words(low_ptr, s0, s1, s2, s3, s4, s5, s6, s7, KW, col2, RB)
    for c0 in range(begin, end, C):
        col = 32 * (c0 + ci)
        if AHEAD:
            now = p1
            p1 = p2
            p2 = _pairs_words(low_ptr, s0, s1, s2, s3, s4, s5, s6, s7, KW, 32 * (tl.minimum(c0 + 2 * C, end - C) + ci),
                              RB)
        else:
            now = _pairs_words(low_ptr, s0, s1, s2, s3, s4, s5, s6, s7, KW, col, RB)
        pairs, sx = step_activations(x_ptr, col, ASM)
        sx = (sx * 2.0 ** -100) * (8.0 * 2.0 ** -33)  # 8 * sum(x) in the products' unit
        v0, v1 = pair_rows(now[0], col, pairs, ASM)
        a0 = _term(a0, v0, sx, scale_ptr, s0, groups, G, col, diag)
        a1 = _term(a1, v1, sx, scale_ptr, s1, groups, G, col, diag)
        if RB >= 4:
            v2, v3 = pair_rows(now[1], col, pairs, ASM)
            a2 = _term(a2, v2, sx, scale_ptr, s2, groups, G, col, diag)
            a3 = _term(a3, v3, sx, scale_ptr, s3, groups, G, col, diag)
        if RB >= 8:
            v4, v5 = pair_rows(now[2], col, pairs, ASM)
            a4 = _term(a4, v4, sx, scale_ptr, s4, groups, G, col, diag)
            a5 = _term(a5, v5, sx, scale_ptr, s5, groups, G, col, diag)
            v6, v7 = pair_rows(now[3], col, pairs, ASM)
            a6 = _term(a6, v6, sx, scale_ptr, s6, groups, G, col, diag)
            a7 = _term(a7, v7, sx, scale_ptr, s7, groups, G, col, diag)
    r = tl.arange(0, RB)
    total = tl.where(r == 0, tl.sum(a0), tl.where(r == 1, tl.sum(a1), 0.0))
    if RB >= 4:
        total = tl.where(r == 2, tl.sum(a2), tl.where(r == 3, tl.sum(a3), total))
    if RB >= 8:
        total = tl.where(r == 4, tl.sum(a4), tl.where(r == 5, tl.sum(a5), total))
        total = tl.where(r == 6, tl.sum(a6), tl.where(r == 7, tl.sum(a7), total))
    return total * 2.0 ** 33


__all__ = ["mma", "pair_rows", "rows_dot_mma", "step_activations", "triton", "words"]
