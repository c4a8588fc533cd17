"""Triton helpers the linear families share: packed bit planes to floats, the matvec epilogues,
and the activations of a fused gate/up.

Bit planes (grouped int, q2, q1, int8). A plane of width W bits packs 32 / W codes into each
32-bit word, code j at bits W*j .. W*j+W-1 (the formats' own "element i at bit (i % per) * W"
order, read 32 bits at a time). The matvec never converts a code with an integer-to-float
instruction (a quarter-rate unit on recent GPUs): it masks the code in place and ORs in the
exponent of 2^23,

    float(bits & (mask << s) | 0x4B000000) - (2^23 + zero * 2^s)  ==  (u - zero) * 2^s   (exact, s + W <= 16)

so each weight costs one logic op, one add and one fused multiply-add, the format's zero point
folded into the add; codes at bits 16..31 are read from the word shifted right by 16 (one shift
per word), and the 2^s is undone on the activation side (x * 2^-s, per column, shared by every
row of the tile).

How a matvec tile is laid out (the "chunk" scheme). Each lane of a warp owns one chunk of
consecutive columns (32, or 16 for 8-bit codes) of every row of its tile: it loads the chunk's
packed words of each row (16 bytes for a 4-bit plane) and the chunk's activations (one 16-byte
load per 8 columns, split in registers: `x_octet`), so every tensor of the dot product is
indexed by (row, chunk) with the chunk on the lanes and nothing crosses lanes until the final
row sums. Warps take further chunks, so a step covers 32 * num_warps chunks of BN rows; loading
the activations as [chunks, 8] with exactly 8 per lane is what makes the compiler give them the
weights' lane layout (a smaller tile would be spread differently and shuffled through shared
memory on every step).
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2^23: integers below 2^23 OR-ed into its mantissa are exact


@triton.jit
def shr16(w, ASM: tl.constexpr):
    """w >> 16 (logical) for int32 words. ASM: one opaque shift, so the compiler cannot re-derive
    every code of the upper half with its own shift-and-extract (it would, from plain shifts)."""
    if ASM:
        out = tl.inline_asm_elementwise("shr.u32 $0, $1, 16;", "=r,r", [w], dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = (w >> 16) & 0xFFFF
    return out


@triton.jit
def opaque(v, ASM: tl.constexpr):
    """v (int32 or int64), with its contiguity and divisibility hidden from the compiler (ASM): a
    load through it is not vectorised beyond what the caller multiplies back in."""
    if ASM:
        if v.dtype == tl.int64:
            out = tl.inline_asm_elementwise("mov.b64 $0, $1;", "=l,l", [v], dtype=tl.int64, is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = v
    return out


@triton.jit
def tile_rows_of(i, pid, n, BN: tl.constexpr, GLU: tl.constexpr):
    """(weight row, output-row mask) of tile row(s) `i` of program `pid` (see tile_rows)."""
    if GLU:
        out_rows = pid * BN + i // 2
        rows = out_rows + (i % 2) * n
    else:
        out_rows = pid * BN + i
        rows = out_rows
    return rows, out_rows < n


@triton.jit
def tile_rows(pid, n, BN: tl.constexpr, GLU: tl.constexpr):
    """(weight rows, output-row mask) of program `pid`'s tile: BN output rows, or with GLU 2 * BN
    weight rows, gate row r and up row n + r interleaved, so one pass over x serves both halves."""
    return tile_rows_of(tl.arange(0, 2 * BN if GLU else BN), pid, n, BN, GLU)


@triton.jit
def glu_halves(total, BN: tl.constexpr):
    """(gate, up) [BN] of a GLU tile's interleaved row sums [2 * BN]."""
    return tl.split(tl.reshape(total, [BN, 2]))


@triton.jit
def x_octet(x_ptr, first, cmask, EVEN: tl.constexpr):
    """x at columns first + 0..7 for each chunk (`first` [C]): a tuple of eight float32 [C].

    One 16-byte load per lane ([C, 8], 8 per lane when C >= the program's lanes), split in
    registers: the eight results keep the chunk-per-lane layout of the weight tiles."""
    offs = first[:, None] + tl.arange(0, 8)[None, :]
    if EVEN:  # noqa: SIM108  (constexpr branches: only one is compiled)
        xs = tl.load(x_ptr + offs)
    else:
        xs = tl.load(x_ptr + offs, mask=cmask[:, None], other=0.0)
    return octet_split(xs)


@triton.jit
def octet_split(xs):
    """[C, 8] activations (8 a lane) -> a tuple of eight float32 [C], column j of each chunk."""
    xs = tl.reshape(xs.to(tl.float32), [xs.shape[0], 2, 2, 2])
    a0, a1 = tl.split(xs)
    b00, b01 = tl.split(a0)
    b10, b11 = tl.split(a1)
    x0, x4 = tl.split(b00)
    x2, x6 = tl.split(b01)
    x1, x5 = tl.split(b10)
    x3, x7 = tl.split(b11)
    return (x0, x1, x2, x3, x4, x5, x6, x7)


@triton.jit
def x_sum8(xs):
    return ((xs[0] + xs[1]) + (xs[2] + xs[3])) + ((xs[4] + xs[5]) + (xs[6] + xs[7]))


@triton.jit
def masked_load(ptr, offs, rm, cm, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """ptr[offs], zero where the row mask `rm` or the chunk mask `cm` (both broadcastable to offs)
    is false; a mask known to be all true (EVEN_*) is left out: no predicates, no zeroed
    destinations."""
    if EVEN_N and EVEN_K:
        t = tl.load(ptr + offs)
    elif EVEN_K:
        t = tl.load(ptr + offs, mask=rm, other=0)
    elif EVEN_N:
        t = tl.load(ptr + offs, mask=cm, other=0)
    else:
        t = tl.load(ptr + offs, mask=rm & cm, other=0)
    return t


@triton.jit
def row_starts(i, pid, n, row_len, BN: tl.constexpr, GLU: tl.constexpr, ASM: tl.constexpr):
    """int64 offsets of the starts of tile rows `i` of program `pid` (tile_rows_of) in rows of
    `row_len` entries: an opaque run-time base (the program's first row, and with GLU the up rows'
    n rows further) plus i's own offset within the tile. Only the base's divisibility is hidden (a
    caller multiplies back what its loads may assume); with `row_len` a constexpr the in-tile part
    is a constant per register, which the compiler folds into the loads' immediate offsets, so a
    row costs no address arithmetic."""
    if GLU:
        base = opaque((pid * BN + (i % 2) * n).to(tl.int64) * row_len, ASM)
        local = i // 2
    else:
        base = opaque((pid * BN).to(tl.int64) * row_len, ASM)
        local = i
    return base + local.to(tl.int64) * row_len


@triton.jit
def tile_starts(pid, n, row_len, BN: tl.constexpr, GLU: tl.constexpr, ASM: tl.constexpr):
    """row_starts of every row of program `pid`'s tile (tile_rows' order)."""
    return row_starts(tl.arange(0, 2 * BN if GLU else BN), pid, n, row_len, BN, GLU, ASM)


@triton.jit
def plane_words(ptr, starts, row_mask, c0, end, C: tl.constexpr, NW: tl.constexpr, EVEN_N: tl.constexpr,
                EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """The NW (1, 2 or 4) int32 words of each of the C chunks c0.. of a plane, one NW * 4-byte load
    per row and lane: a tuple of NW [BN, C]. `starts`: row_starts of the tile's rows in chunks.

    Loaded as one [BN, C * NW] run per row: the chunk axis is then the only contiguous one (a tie
    between the row and chunk axes is broken differently by different compiler versions), and the
    row offsets are divisible by exactly NW words, so no lane's vector spans two chunks. Each row's
    offset stays opaque (unlike the side loads'): folded into immediate offsets of one base, ptxas
    sinks each row's load next to its first use, a memory latency a row instead of one a step."""
    return split_words(plane_load(ptr, starts, row_mask, c0, end, C, NW, EVEN_N, EVEN_K, ASM, False), NW)


@triton.jit
def plane_load(ptr, starts, row_mask, c0, end, C: tl.constexpr, NW: tl.constexpr, EVEN_N: tl.constexpr,
               EVEN_K: tl.constexpr, ASM: tl.constexpr, AHEAD: tl.constexpr):
    """plane_words' load, [BN, C * NW] unsplit. AHEAD: a step that may lie past `end` (loaded ahead
    of its use): with EVEN_K a step is all in or all out, so one predicate covers it, and a step
    past the end leaves its registers as they were (never used)."""
    wi = tl.arange(0, C * NW)
    offs = (opaque(starts, ASM) * NW)[:, None] + (c0 * NW + wi)[None, :]
    if AHEAD and EVEN_K and EVEN_N:
        t = tl.load(ptr + offs, mask=(c0 + 0 * wi < end)[None, :])  # one predicate (a tensor, for the interpreter)
    elif AHEAD and EVEN_K:
        t = tl.load(ptr + offs, mask=row_mask[:, None] & (c0 + 0 * wi < end)[None, :], other=0)
    else:
        t = masked_load(ptr, offs, row_mask[:, None], (c0 + wi // NW < end)[None, :], EVEN_N, EVEN_K)
    return t


@triton.jit
def split_words(t, NW: tl.constexpr):
    """[BN, C * NW] words, each chunk's NW together -> a tuple of NW [BN, C]: word w of every chunk."""
    C: tl.constexpr = t.shape[1] // NW
    if NW == 1:
        words = (t,)
    elif NW == 2:
        w0, w1 = tl.split(tl.reshape(t, [t.shape[0], C, 2]))
        words = (w0, w1)
    else:
        e, o = tl.split(tl.reshape(t, [t.shape[0], C, 2, 2]))
        w0, w2 = tl.split(e)
        w1, w3 = tl.split(o)
        words = (w0, w1, w2, w3)
    return words


@triton.jit
def chunk_side(ptr, pid, n, row_len, c0, end, PER: tl.constexpr, C: tl.constexpr, BN: tl.constexpr,
               GLU: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """ptr[row, chunk // PER] for the tile's rows (rows of `row_len` entries; a constexpr folds the
    rows' offsets into the loads, row_starts) and chunks c0..c0+C: one entry per chunk (a group
    scale, offset or block scale), [rows, C].

    Loaded flat, one element per lane (a 1-D load has no axes to tie; the row base is opaque, so
    nothing is vectorised), then reshaped: lanes on chunks, rows in registers, like the words."""
    RB: tl.constexpr = 2 * BN if GLU else BN
    f = tl.arange(0, RB * C)
    _, rmask = tile_rows_of(f // C, pid, n, BN, GLU)
    chunk = c0 + f % C
    offs = row_starts(f // C, pid, n, row_len, BN, GLU, ASM) + chunk // PER
    v = masked_load(ptr, offs, rmask, chunk < end, EVEN_N, EVEN_K)
    return tl.reshape(v, [RB, C])


@triton.jit
def upper_halves(words, NW: tl.constexpr, ASM: tl.constexpr):
    """shr16 of each of the NW words."""
    if NW == 1:
        out = (shr16(words[0], ASM),)
    elif NW == 2:
        out = (shr16(words[0], ASM), shr16(words[1], ASM))
    else:
        out = (shr16(words[0], ASM), shr16(words[1], ASM), shr16(words[2], ASM), shr16(words[3], ASM))
    return out


@triton.jit
def code_term(acc, words, uppers, x, BIT: tl.constexpr, W: tl.constexpr, ZERO: tl.constexpr, XMUL: tl.constexpr,
              FLIP: tl.constexpr, magic):
    """acc + (u - ZERO) * XMUL * x for the W-bit code u at bit BIT of a chunk's words (a helper of
    its own so its constants stay compile-time: a name bound inside an unrolled loop would not)."""
    LOW: tl.constexpr = BIT % 32
    if LOW < 16:
        src = words[BIT // 32]
        S: tl.constexpr = LOW
    else:
        src = uppers[BIT // 32]
        S: tl.constexpr = LOW - 16
    MASK: tl.constexpr = ((1 << W) - 1) << S
    # FLIP: magic is (2^23 | 0x80, 2^23 | 0x8000), run-time values the compiler cannot split apart.
    if FLIP:  # noqa: SIM108  (constexpr branches: only one is compiled)
        bits = (src & MASK) ^ magic[S // 8]
    else:
        bits = (src & MASK) | magic
    code = bits.to(tl.float32, bitcast=True) - (8388608.0 + ZERO * (1 << S))
    return acc + code * (x * (XMUL / (1 << S)))[None, :]


@triton.jit
def octet_dot(acc, words, uppers, xs, o: tl.constexpr, W: tl.constexpr, ZERO: tl.constexpr, XMUL: tl.constexpr,
              FLIP: tl.constexpr, magic):
    """acc [BN, C] + sum over the 8 columns of octet `o` of each chunk of (u - ZERO) * XMUL * x,
    u the W-bit codes of a plane (words / uppers: its words and their upper halves). FLIP: the
    codes are signed bytes, read as u = v + 128 (ZERO must then be 128; `magic` is then the pair
    of 2^23's bits with bit 7, and with bit 15, set)."""
    for p in tl.static_range(8):
        acc = code_term(acc, words, uppers, xs[p], W * (8 * o + p), W, ZERO, XMUL, FLIP, magic)
    return acc


@triton.jit
def plane_codes(plane_ptr, rows, cols, row_mask, bytes_per_row, W: tl.constexpr):
    """Codes [BN, BK] (int32) of a W-bit plane at `rows` x `cols` (the prefill matmul's tiles,
    where dequantization is amortised over many tokens and plain shifts do)."""
    per: tl.constexpr = 8 // W
    byte = tl.load(plane_ptr + rows[:, None] * bytes_per_row + (cols // per)[None, :],
                   mask=row_mask[:, None], other=0).to(tl.int32)
    return (byte >> ((cols % per) * W)[None, :]) & ((1 << W) - 1)


@triton.jit
def split_sum(ptr, offs, mask, split_stride, bias_ptr, bias_offs, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """float32 sum of SPLITS split-K partial sums (ptr + s * split_stride + offs, in split order), then
    the bias at bias_ptr + bias_offs: the one order every consumer of partial sums adds them in, so a
    projection's output is the same whichever kernel sums it."""
    total = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLITS):
        total += tl.load(ptr + s * split_stride + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + bias_offs, mask=mask, other=0.0).to(tl.float32)
    return total


@triton.jit
def activate(x, ACT: tl.constexpr):
    """The IR activation with code ACT (common.ACTIVATION_CODES) of float32 x."""
    if ACT == 0:  # silu (exp's argument bounded: no inf on the way to -0)
        y = x / (1.0 + tl.exp(tl.minimum(-x, 80.0)))
    elif ACT == 1:  # gelu (erf)
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACT == 2:  # gelu, tanh approximation
        inner = tl.minimum(tl.maximum(0.7978845608028654 * (x + 0.044715 * x * x * x), -40.0), 40.0)
        y = x * (1.0 - 1.0 / (tl.exp(2.0 * inner) + 1.0))  # 0.5 * (1 + tanh(inner)); tanh(40) == 1
    else:  # relu
        y = tl.maximum(x, 0.0)
    return y


@triton.jit
def store_rows(out_ptr, bias_ptr, rows, row_mask, acc, split_index, n,
               HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """Plain epilogue: float32 partial sums into out[split_index, rows] (PARTIAL), or
    acc + bias rounded to the output's dtype into out[rows]."""
    if PARTIAL:
        tl.store(out_ptr + split_index * n + rows, acc, mask=row_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def store_glu(out_ptr, bias_ptr, rows, row_mask, gate, up, n, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
              scale_ptr=None):
    """Gate/up epilogue: act(gate) * up, each step rounded to the output dtype as the torch path
    rounds it (the projection's output, the activation, the product); with `scale_ptr` (an elastic
    FFN level's per-channel scale, in the output dtype) times scale[rows], rounded again."""
    if HAS_BIAS:
        gate += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + n + rows, mask=row_mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = activate(gate, ACT).to(dtype).to(tl.float32)
    product = (act * up).to(dtype)
    if scale_ptr is not None:
        product = (product.to(tl.float32) * tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32))
        product = product.to(dtype)
    tl.store(out_ptr + rows, product, mask=row_mask)


@triton.jit
def store_tile(out_ptr, bias_ptr, total, n, BN: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
               PARTIAL: tl.constexpr, scale_ptr=None):
    """The epilogue of a tile program (tile_rows): `total` [rows] are its row sums; with ACT >= 0
    the gate and up rows interleaved (store_glu, times scale_ptr's entries when given), else plain
    rows (store_rows)."""
    out_rows = tl.program_id(0) * BN + tl.arange(0, BN)
    out_mask = out_rows < n
    if ACT >= 0:
        gate, up = glu_halves(total, BN)
        store_glu(out_ptr, bias_ptr, out_rows, out_mask, gate, up, n, HAS_BIAS, ACT, scale_ptr)
    else:
        store_rows(out_ptr, bias_ptr, out_rows, out_mask, total, tl.program_id(1), n, HAS_BIAS, PARTIAL)


@triton.jit
def dot_tile(x, w, IEEE: tl.constexpr):
    """x [BM, BK] @ w[BN, BK].T in float32. IEEE: in exact float32 arithmetic (no tf32), for float32
    models and under the interpreter (whose 16-bit dot is wrong; bf16 x bf16 products are exact in
    float32, so this is the same function as the tensor-core path up to summation order)."""
    if IEEE:
        out = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        out = tl.dot(x, tl.trans(w))
    return out


@triton.jit
def matmul_tile(T, N, n1, block, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """A prefill matmul program's tile, in grouped order: GROUP_M token tiles run per band of BN
    weight rows before the next band (so the band's codes come from L2 after the first). Returns the
    tile's tokens, output rows, their masks, and the weight row of each output row (an elastic prefix,
    prefill.matmul_prefix: output row r is weight row (r // n1) * block + r % n1)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(T, BM)
    tiles_n = tl.cdiv(N, BN)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    tok = pid_m * BM + tl.arange(0, BM)
    out_rows = pid_n * BN + tl.arange(0, BN)
    rows = (out_rows // n1) * block + out_rows % n1
    return tok, out_rows, tok < T, out_rows < N, rows


def split_candidates(n_rows: int, block_n: int, units: int, sms: int) -> list[int]:
    """Split-K factors that divide `units` (the reduction's loop steps) and bring the program count
    near two waves of `sms` multiprocessors (1 always included)."""
    programs = -(-n_rows // block_n)
    out = [1]
    split = 2
    while split <= units and programs * split <= 4 * sms:
        if units % split == 0 and programs * split >= sms // 2:
            out.append(split)
        split *= 2
    return out


__all__ = ["activate", "chunk_side", "code_term", "dot_tile", "glu_halves", "MAGIC", "masked_load", "matmul_tile",
           "octet_dot", "octet_split", "opaque", "plane_codes", "plane_load", "plane_words", "row_starts", "shr16",
           "split_candidates", "split_sum", "split_words", "store_glu", "store_rows", "store_tile", "tile_rows",
           "tile_rows_of", "tile_starts", "triton", "upper_halves", "x_octet", "x_sum8"]
