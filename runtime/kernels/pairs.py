"""Packed bfloat16 pairs for the chunk-scheme matvecs (tiles.py): two 4-bit weights an instruction.

Every value here is an int32 holding two bfloat16 (low half, high half), so the layout is explicit
and the same in the GPU's inline PTX and in the plain-Triton twin the interpreter runs. A bf16 whose
bits b are below 256 is b * 2^-133 exactly (the subnormals and the first normal binade share one
unit), so both nibbles of a 16-bit half's low byte are numbers as they stand: for a word w of a
4-bit plane (code j at bits 4j) and its second bytes v = w >> 8,

    w & 0x000F000F  ==  bf16 pair (u_0, u_4) * 2^-133          w & 0x00F000F0  ==  (u_1, u_5) * 2^-129
    v & 0x000F000F  ==  (u_2, u_6) * 2^-133                    v & 0x00F000F0  ==  (u_3, u_7) * 2^-129

(exact). One fused multiply-add of the pair by (2^126, 2^126) (or 2^122) plus (-ZERO, -ZERO) * 2^-7
makes it the exact small integers (u - ZERO) * 2^-7, and one more multiplies it by the activations of
the same two columns, (x_k, x_{k+4}), into a bf16 pair of running sums. A 32-column chunk (one group
scale) sums 16 products in each half; the two halves are then widened to float32, added and scaled
in float32 as the float path does, and the caller multiplies its row sums by CODE_UNIT (2^7) once at
the end. Every value is exactly 2^-7 times what the codes OR-ed into bf16 128.0 give (a shift per code,
PAIR_MAGIC; grouped_int_batch's arithmetic), so the roundings are the same. Per 8 weights: 1 shift,
4 logic ops, 8 pair FMAs, against 3 shifts, 4 logic ops and 8 pair FMAs that way, and 8 logic ops, 8
adds and 8 FMAs on the float path.

Precision: the pair FMA rounds each running sum to bf16 (8 significant bits), so a chunk's sum of
16 products carries about 2^-9 of its size in rounding; on random weights (groups of 128) and
activations the float32 sums of the chunks miss the float32 product by 0.41% (rms, relative) over
4096 columns and 0.56% over 14336, two to three times what rounding the output to bf16 costs and
far below int4's own quantization error. So it is a candidate the launch tuner may pick for
bfloat16 activations only; float32 and float16 models keep the float path.
"""

from __future__ import annotations

import triton
import triton.language as tl

ONE2 = tl.constexpr(0x3F803F80)  # bf16 pair (1.0, 1.0)
PAIR_MAGIC = 0x43004300  # bf16 pair (128.0, 128.0), passed to the kernels as an argument
LOW_NIBBLES = tl.constexpr(0x000F000F)
HIGH_HALF = tl.constexpr(-65536)  # 0xFFFF0000 as an int32
UP_FIRST = tl.constexpr(0x7E807E80)  # bf16 pair (2^126, 2^126): a half's first nibble to u * 2^-7
UP_SECOND = tl.constexpr(0x7C807C80)  # (2^122, 2^122): its second nibble (u * 2^-129) to u * 2^-7
HIGH_NIBBLES = tl.constexpr(0x00F000F0)
CODE_UNIT = tl.constexpr(128.0)  # word_dot's sums are the products' sums / 2^7


def _pair_bits(value: float) -> int:
    """The int32 bits of the bf16 pair (value, value) (value exact in bf16)."""
    import struct

    bits = struct.unpack("<I", struct.pack("<f", value))[0] >> 16
    word = bits | bits << 16
    return word - (1 << 32) if word >= 1 << 31 else word


def zero_pair(zero: int) -> int:
    """The int32 bits of the bf16 pair (-(128 + zero), -(128 + zero)) (exact for zero < 128): the
    zero point after a code OR-ed into 128.0 (PAIR_MAGIC; grouped_int_batch's arithmetic)."""
    return _pair_bits(-(128.0 + zero))


def code_zero(zero: int) -> int:
    """The int32 bits of the bf16 pair (-zero, -zero) * 2^-7: word_dot's ZERO_BITS."""
    return _pair_bits(-zero / 128.0)


@triton.jit
def _low(p):
    """The low bf16 of pairs p, as float32 (exact)."""
    return (p << 16).to(tl.float32, bitcast=True)


@triton.jit
def _high(p):
    """The high bf16 of pairs p, as float32 (exact)."""
    return (p & HIGH_HALF).to(tl.float32, bitcast=True)


@triton.jit
def _rounded(f):
    """float32 f rounded to bf16, to nearest even, in the upper 16 bits of an int32 (integer
    arithmetic: the interpreter's own conversion truncates). Finite values only."""
    bits = f.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) & HIGH_HALF


@triton.jit
def _to_pair(lo, hi):
    """float32 lo, hi rounded to bf16 (to nearest even) and packed into one int32."""
    return ((_rounded(lo) >> 16) & 0xFFFF) | _rounded(hi)


@triton.jit
def pair_fma(a, b, c, ASM: tl.constexpr):
    """a * b + c on bf16 pairs (int32 [...]), each half rounded once to bf16 (fma.rn.bf16x2).
    Without ASM: the same in float32 (exact products of two bf16), then rounded to bf16."""
    if ASM:
        out = tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                        is_pure=True, pack=1)
    else:
        out = _to_pair(_low(a) * _low(b) + _low(c), _high(a) * _high(b) + _high(c))
    return out


@triton.jit
def _codes(nibbles, up, ZERO_BITS: tl.constexpr, ASM: tl.constexpr):
    """A pair of nibbles as they stand (bf16 u * 2^-133 or u * 2^-129) to (u - ZERO) * 2^-7, exactly
    (`up`: UP_FIRST or UP_SECOND; ZERO_BITS: code_zero(ZERO))."""
    return pair_fma(nibbles, tl.full([1, 1], up, tl.int32), tl.full([1, 1], ZERO_BITS, tl.int32), ASM)


@triton.jit
def _halves(a, b, HIGH: tl.constexpr, ASM: tl.constexpr):
    """The low (or with HIGH the high) 16 bits of a and of b, as one int32 (a's in its low half).
    ASM: one byte permute (the compiler's own is a logic op and a shifted add)."""
    if ASM:
        if HIGH:
            out = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r", [a, b], dtype=tl.int32,
                                            is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [a, b], dtype=tl.int32,
                                            is_pure=True, pack=1)
    elif HIGH:
        out = ((a >> 16) & 0xFFFF) | (b & HIGH_HALF)
    else:
        out = (a & 0xFFFF) | (b << 16)
    return out


@triton.jit
def x_pairs(x_ptr, first, cmask, EVEN: tl.constexpr, ASM: tl.constexpr):
    """bf16 activations at columns first + 0..7 of each chunk (`first` [C], even) as the four pairs
    (x_k, x_{k+4}), k = 0..3, each int32 [C]: one 16-byte load per lane of the columns' four words
    ((x_0, x_1), (x_2, x_3), ...), regrouped in registers (byte permutes, shared by every row)."""
    words_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    offs = (first // 2)[:, None] + tl.arange(0, 4)[None, :]
    if EVEN:  # noqa: SIM108  (constexpr branches: only one is compiled)
        t = tl.load(words_ptr + offs)
    else:
        t = tl.load(words_ptr + offs, mask=cmask[:, None], other=0)
    e, o = tl.split(tl.reshape(t, [first.shape[0], 2, 2]))
    w0, w2 = tl.split(e)
    w1, w3 = tl.split(o)
    # (x0, x4), (x1, x5), (x2, x6), (x3, x7)
    return (_halves(w0, w2, False, ASM), _halves(w0, w2, True, ASM), _halves(w1, w3, False, ASM),
            _halves(w1, w3, True, ASM))


@triton.jit
def word_dot(acc, word, xp, ZERO_BITS: tl.constexpr, ASM: tl.constexpr):
    """acc (bf16 pairs [rows, C]) + the products of the 8 codes of `word` [rows, C] with their
    activations (xp: x_pairs of the word's 8 columns; ZERO_BITS: code_zero(ZERO)), in units of
    2^-7 (CODE_UNIT): pair k holds columns k and k + 4. The shift is arithmetic, harmless: the masks
    keep bits up to 23 of the shifted word."""
    second = word >> 8
    acc = pair_fma(_codes(word & LOW_NIBBLES, UP_FIRST, ZERO_BITS, ASM), xp[0][None, :], acc, ASM)
    acc = pair_fma(_codes(word & HIGH_NIBBLES, UP_SECOND, ZERO_BITS, ASM), xp[1][None, :], acc, ASM)
    acc = pair_fma(_codes(second & LOW_NIBBLES, UP_FIRST, ZERO_BITS, ASM), xp[2][None, :], acc, ASM)
    return pair_fma(_codes(second & HIGH_NIBBLES, UP_SECOND, ZERO_BITS, ASM), xp[3][None, :], acc, ASM)


PAIR_SIGNS = tl.constexpr(-2147450880)  # 0x80008000 as an int32
X_UP_PAIR = tl.constexpr(0x71807180)  # the bf16 pair (2^100, 2^100): mxfp4's x, so products stay normal
SUM_UP = tl.constexpr(67108864.0)  # 2^26 = 2^126 / 2^100: an mxfp4 chunk's pair sum back to value * x


@triton.jit
def e2m1_pair(w, k: tl.constexpr):
    """2^-126 * E2M1 of the mxfp4 codes k and k + 4 of words w as bf16 pairs (low half code k): each
    code's magnitude bits to bits 6..8 of its half, its sign to bit 15 (bf16 has float32's exponent
    range, so 2^-126 times a value is exact, subnormal for the code 0.5). Times x_pairs' pair k scaled by
    X_UP_PAIR, every product is value * x * 2^-26, a normal number."""
    MS: tl.constexpr = 6 - 4 * k
    if MS >= 0:  # noqa: SIM108  (constexpr branches: only one is compiled)
        magnitude = (w << MS) & 0x01C001C0
    else:
        magnitude = (w >> -MS) & 0x01C001C0
    return magnitude | ((w << (12 - 4 * k)) & PAIR_SIGNS)


@triton.jit
def e2m1_word_dot(acc, word, xp, ASM: tl.constexpr):
    """acc (bf16 pairs [rows, C]) + value * x * 2^-26 over the 8 mxfp4 codes of `word` [rows, C] (xp:
    x_pairs of the word's 8 columns): pair k holds columns k and k + 4. Sum with pair_sum, times SUM_UP."""
    up = tl.full([1], X_UP_PAIR, tl.int32)
    zero = tl.zeros([1], dtype=tl.int32)
    for k in tl.static_range(4):
        xk = pair_fma(xp[k], up, zero, ASM)  # exact: a power of 2
        acc = pair_fma(e2m1_pair(word, k), xk[None, :], acc, ASM)
    return acc


@triton.jit
def pair_sum(acc):
    """The two halves of bf16 pairs, widened to float32 and added."""
    return _low(acc) + _high(acc)


__all__ = ["CODE_UNIT", "PAIR_MAGIC", "SUM_UP", "code_zero", "e2m1_word_dot", "pair_fma", "pair_sum", "triton",
           "word_dot", "x_pairs", "zero_pair"]
