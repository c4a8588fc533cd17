"""Triton helpers the linear families share: packed bit planes to floats, the matvec epilogues,
and the activations of a fused gate/up.

Bit planes (grouped int, q2, q1, int8). A plane of width W bits packs 16 / W codes into each
16-bit half-word, code j at bits W*j .. W*j+W-1 (the formats' own "element i at bit (i % per) * W"
order, read 16 bits at a time). The matvec never converts a code with an integer-to-float
instruction (a quarter-rate unit on recent GPUs): it masks the code in place and ORs in the
exponent of 2^23,

    float(bits(half) & (mask << W*j) | 0x4B000000) - 2^23  ==  u * 2^(W*j)     (exact, W*j+W <= 16)

so each weight costs one logic op, one add and one fused multiply-add; the 2^(W*j) is undone on
the activation side (x_j * 2^-(W*j), per column, shared by every row of the tile). Codes are
unsigned; each format adds its zero point through the sum of x over the group (`xsum`).
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2^23: integers below 2^23 OR-ed into its mantissa are exact


@triton.jit
def plane_dot(plane_ptr, rows, row_mask, halves_per_row, g0, x_ptr,
              W: tl.constexpr, G: tl.constexpr, GPI: tl.constexpr, FLIP: tl.constexpr, XSCALE: tl.constexpr):
    """Dot products of `GPI` groups of `G` columns (starting at group `g0`) of a W-bit plane with x.

    Returns (dot [BN, GPI, HPG], xsum [GPI, HPG]): for every row, group and half-word, the sum of
    code * x over the half-word's 16 / W columns (times XSCALE), and the plain sum of those x.
    `halves_per_row` is the plane's row stride in half-words (an argument, so the compiler knows
    its alignment and loads 16 bytes at a time). FLIP: the codes are signed bytes (W = 8); they are
    read as u = v + 128. The codes of a half-word are taken one position at a time (unrolled), so
    every tensor keeps the layout of the loaded tile and nothing crosses threads until the end."""
    HPG: tl.constexpr = G * W // 16
    CPH: tl.constexpr = 16 // W
    gi = tl.arange(0, GPI)
    hi = tl.arange(0, HPG)
    # One contiguous run of GPI * HPG half-words per row.
    offs = rows[:, None, None] * halves_per_row + ((g0 + gi) * HPG)[None, :, None] + hi[None, None, :]
    half = tl.load(plane_ptr + offs, mask=row_mask[:, None, None], other=0).to(tl.int32) & 0xFFFF
    if FLIP:
        half = half ^ 0x8080
    first = (g0 + gi)[:, None] * G + hi[None, :] * CPH  # column of each half-word's code 0
    dot = tl.zeros(half.shape, dtype=tl.float32)
    xsum = tl.zeros(first.shape, dtype=tl.float32)
    for j in tl.static_range(CPH):
        bits = (half & (((1 << W) - 1) << (W * j))) | MAGIC
        codes = bits.to(tl.float32, bitcast=True) - 8388608.0  # u * 2^(W*j), exact
        x = tl.load(x_ptr + first + j).to(tl.float32)
        dot += codes * (x * (XSCALE / (1 << (W * j))))[None, :, :]
        xsum += x
    return dot, xsum


@triton.jit
def plane_codes(plane_ptr, rows, cols, row_mask, bytes_per_row, W: tl.constexpr):
    """Codes [BN, BK] (int32) of a W-bit plane at `rows` x `cols` (the prefill matmul's tiles,
    where dequantization is amortised over many tokens and plain shifts do)."""
    per: tl.constexpr = 8 // W
    byte = tl.load(plane_ptr + rows[:, None] * bytes_per_row + (cols // per)[None, :],
                   mask=row_mask[:, None], other=0).to(tl.int32)
    return (byte >> ((cols % per) * W)[None, :]) & ((1 << W) - 1)


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
def store_glu(out_ptr, bias_ptr, rows, row_mask, gate, up, n, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    """Gate/up epilogue: act(gate) * up, each step rounded to the output dtype as the torch path
    rounds it (the projection's output, the activation, the product)."""
    if HAS_BIAS:
        gate += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + n + rows, mask=row_mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = activate(gate, ACT).to(dtype).to(tl.float32)
    tl.store(out_ptr + rows, (act * up).to(dtype), mask=row_mask)


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


__all__ = ["MAGIC", "activate", "dot_tile", "plane_codes", "plane_dot", "split_candidates", "store_glu",
           "store_rows", "triton"]
