"""Experiment: a symmetric int4 (group 128) matvec on the int8 tensor cores, reading the packed planes as they lie,
with the activations as int8 (one scale and one sum of the codes a group of 128).

    python3 examples/benchmarks/exp_int4_imma.py check                 # CPU (TRITON_INTERPRET=1) or GPU
    python3 examples/benchmarks/exp_int4_imma.py bench [qkv,o,gate_up,down]    # GPU: alone, plain and dependent
    python3 examples/benchmarks/exp_int4_imma.py sass                  # sm_90 instructions after the wait, no GPU

Why (BENCHMARKS Round 21): in the step floor, after the wait, the shipped bf16 pairs' arithmetic took a dependent
matvec's step from 801 to 647 tok/s, dp4a's to 746 and two int8 mma.sync a 16-byte chunk to 735, and the whole
dp4a matvec with each row's sum over 128 lanes to 668. With the int8 mma the sum over K happens inside the mma, so
the only sums across lanes are a warp's (one add a lane and warp at the end).

Layout. A weight row's low plane holds, for each 32-column chunk, 4 words, word o the columns 8o .. 8o + 7 (column
8o + j at bits 4j). So `w & 0x0F0F0F0F` is the word's even columns as bytes and `w & 0xF0F0F0F0` its odd ones as 16
times bytes (one logic op each). Lane l = 4g + t of a warp loads, for row tile i and group q, the 16 bytes of chunk
4q + t of rows g and g + 8; mma.sync.m16n8k32 (u8 x s8, int32 sums) takes, as A, the even bytes of words 0 and 1
(or 2 and 3) of both rows, and as B the int8 activations of the same columns, which are the lane's own: the
activations are laid (`quantize_x`) so that chunk c's 8 words are e0, e1, o0, o1, e2, e3, o2, o3, where e_j holds
columns 32c + 8j + 2m (m = 0..3, one a byte) and o_j columns 32c + 8j + 2m + 1, so each mma's two B registers are
adjacent words of a 16-byte load (no register moves). A group (4 chunks, one scale each side) is 2 mma on the even
columns and 2 on the odd (16 times the products, shifted back exactly), each chain from zero, then the zero point
(-8 times the sum of the group's codes), one int-to-float and one multiply-add a row. Every column of B is x, so
each lane holds its rows g and g + 8 (sm_90: 0.70-1.00 instructions a weight after the wait at llama-8b's
shapes, the warps' sums included).

A program: NW warps splitting K (GPW groups each, past K masked), T row tiles of 16 rows; every weight word and
scale of a lane is loaded before the wait (PDL), x's codes, scales and sums after it. Not in the runtime: the
kernels before a matvec would write its int8 activations (here `quantize_x`, in torch), and the activations' int8
rounding adds 6.2e-3 to 7.6e-3 of relative error to each row's sum on Gaussian x (`check`; activations with
outliers not measured). Or (QX) the
kernel takes x as bfloat16 and each warp rounds its groups itself (`_quantized_x`: a lane 4 values, the group's
max and code sum over the warp, 8 shuffles a lane for its chunk's words): no kernel before changes, at 0.45-1.0
more instructions a weight after the wait on sm_90 (1.15-1.95 in all, against 0.70-1.00).

CHUNKS: x's int8 scale a chunk of 32 columns instead of a group of 128, so that a kernel before that owns 32 of its
outputs (a tile of o's or down's rows with the deferred norm, 32 of gate/up's activations) can quantize them
alone. A chunk must then be one mma: the plane is re-laid (`chunk_major`, once at load) so that lane t's 16 bytes
are its word t of each of the group's 4 chunks; the mma takes a word's even columns as A's first k half and its odd
ones shifted down as the second, from zero, and each chunk's sums go to float times its scale; the zero point is
one float a group for every row (the chunks' scale times -8 times their code sum, written with the scales). x's
buffers are padded to every warp's run so its loads need no masks (sm_90: 1.05-1.16 instructions a weight after
the wait, against 0.78-0.89 with groups of 128; `sass`).
"""

from __future__ import annotations

import os
import sys
from functools import partial

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from int4_lanes import chosen_shapes, pick, print_shipped, run_mode, shipped_weights, split4, threads  # noqa: E402

from thin.runtime.kernels.int8_heads import _group_sums, _tile_rows, _tile_runs, b_order, quantize_heads  # noqa: E402
from thin.runtime.kernels.lanes import dot4 as _dot4  # noqa: E402, F401  (the other scripts')
from thin.runtime.kernels.lanes import imma as _imma


def quantize_x(x: torch.Tensor):
    """x [K] -> (codes int32 [K / 4] in the B order above: a chunk's words e0, e1, o0, o1, e2, e3, o2, o3; scales
    float32 [K / 128]; code sums int32 [K / 128])."""
    q, scale = _codes(x)
    return fragment_words(q), scale.contiguous(), q.sum(1).to(torch.int32)


def fragment_words(q: torch.Tensor) -> torch.Tensor:
    """int8 codes (any shape, K in all) -> int32 [K / 4] in the B order above, 4 codes a word (int8_heads.b_order)."""
    return b_order(q).view(torch.int32)


def dequantized_x(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies by: x rounded to its int8 codes times their group's scale."""
    q, scale = _codes(x)
    return (q * scale[:, None]).reshape(-1)


def quantize_x_chunks(x: torch.Tensor):
    """x [K] -> CHUNKS' int8 activations, one scale a chunk of 32 columns (what a producer owning 32 of its output
    rows can write alone): (codes int32 [K / 4]: group q's 32 words at 32q, lane t's 8 at 32q + 8t, chunk j's two
    at 32q + 8t + 2j, the columns 128q + 32j + 8t + 2m and then 128q + 32j + 8t + 2m + 1, m = 0..3, one a byte;
    float32 [K / 128, 8]: group q's 4 chunk scales, then each chunk's zero point term, its scale times -8 times the
    sum of its codes)."""
    k = x.numel()
    q, scale = _codes(x, 32)
    # [group, chunk j, lane t, byte m, column parity p] -> words [group, t, j, p] of bytes m
    b = q.to(torch.int64).reshape(k // 128, 4, 4, 4, 2).permute(0, 2, 1, 4, 3).reshape(k // 4, 4) & 0xFF
    words = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24
    zero = -8.0 * scale * q.sum(1)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32), torch.cat([scale.reshape(-1, 4),
                                                                         zero.reshape(-1, 4)], 1).contiguous(), None


def padded_chunks(x, k: int, nw: int):
    """`quantize_x_chunks`' buffers padded with zeros to nw warps' runs over k (what CHUNKS loads without masks)."""
    gpw = triton.next_power_of_2(-(-(k // 128) // nw))
    xq, xs, _ = x
    return (torch.nn.functional.pad(xq, (0, gpw * nw * 32 - xq.numel())),
            torch.nn.functional.pad(xs.reshape(-1), (0, gpw * nw * 8 - xs.numel())), None)


def dequantized_x_chunks(x: torch.Tensor) -> torch.Tensor:
    """What the CHUNKS kernel multiplies by: x rounded to int8 codes, one scale a chunk of 32 columns."""
    q, scale = _codes(x, 32)
    return (q * scale[:, None]).reshape(-1)


def chunk_major(words: torch.Tensor) -> torch.Tensor:
    """The low plane [n, K / 8] (int32) re-laid for CHUNKS: in each group of 4 chunks (16 words), word t of chunk
    j moves to 4t + j, so lane t's 16 bytes hold its word of each chunk (one mma a chunk, its columns contiguous)."""
    n, w = words.shape
    return words.reshape(n, w // 16, 4, 4).transpose(2, 3).reshape(n, w).contiguous()


def _codes(x: torch.Tensor, size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [K] -> (int8 codes as float32 [K / size, size], scales float32 [K / size]): int8_heads.quantize_heads."""
    return quantize_heads(x, size)


@triton.jit
def lane_tiles(w_ptr, s_ptr, K: tl.constexpr, NW: tl.constexpr, GPW: tl.constexpr, T: tl.constexpr,
               ASM: tl.constexpr):
    """A 16-row-tile program's lanes and its weight: (g, t of lane 4g + t, the warp's first group q0, the first
    tile, `_tile_runs` of its T (1 or 2) tiles, the second the first again where T is 1)."""
    e = threads(NW, ASM)
    lane = e % 32
    g = lane // 4
    t = lane % 4
    q0 = e // 32 * GPW  # the warp's first group
    tile0 = tl.program_id(0) * T
    a = _tile_runs(w_ptr, s_ptr, tile0 * 16 + g, q0, t, GPW, K // 128, K)
    b = a
    if T == 2:
        b = _tile_runs(w_ptr, s_ptr, tile0 * 16 + 16 + g, q0, t, GPW, K // 128, K)
    return g, t, q0, tile0, a, b


@triton.jit
def waited_zeros(NW: tl.constexpr, PDL: tl.constexpr):
    """After the wait for the kernel before (PDL: a programmatic dependent), four float32 [32 * NW] zeros: a
    program's sums of rows g and g + 8 of its two tiles."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    z = tl.zeros([32 * NW], dtype=tl.float32)
    return z, z, z, z


@triton.jit
def _imma0(a0, a1, a2, a3, b0, b1, ASM: tl.constexpr):
    """Rows g and g + 8 of this lane's D fragment of one mma.sync.m16n8k32 (u8 x s8) from zero (`_imma`'s
    operands; the zero accumulator is the register file's zero register, no moves)."""
    if ASM:
        b0 = tl.broadcast_to(b0, a0.shape)
        b1 = tl.broadcast_to(b1, a0.shape)
        d0, _, d2, _ = tl.inline_asm_elementwise(
            "{ .reg .b32 z; mov.b32 z, 0; mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {$0,$1,$2,$3}, "
            "{$4,$5,$6,$7}, {$8,$9}, {z,z,z,z}; }", "=r,=r,=r,=r,r,r,r,r,r,r", [a0, a1, a2, a3, b0, b1],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        z = a0 * 0
        d0, _, d2, _ = _imma(a0, a1, a2, a3, b0, b1, (z, z, z, z), False)
    return d0, d2


@triton.jit
def _chunk_group_sums(tile, q: tl.constexpr, S: tl.constexpr, x, xs, zero, ASM: tl.constexpr):
    """CHUNKS: a group's float sums of rows g and g + 8 (before the weight's scale) from a `_tile_runs` tile of the
    chunk-major plane (`chunk_major`: word j of the lane's 16 bytes is its word of chunk j) and the group's x: 8 B
    words (chunk j's at 2j, 2j + 1), 4 chunk scales, and `zero` (the group's zero point, the same for every row:
    the sum over its chunks of scale times -8 times the chunk's code sum). One mma a chunk, even columns
    (w & 0x0F0F0F0F) in A's first k half and odd ((w >> 4) & 0x0F0F0F0F) in its second, from zero, then int to
    float times the chunk's scale."""
    lo = 0x0F0F0F0F
    g = split4(pick(tile[0], q, S))
    h = split4(pick(tile[1], q, S))
    fg = zero
    fh = zero
    for j in tl.static_range(4):
        dg, dh = _imma0(g[j] & lo, h[j] & lo, (g[j] >> 4) & lo, (h[j] >> 4) & lo, x[2 * j], x[2 * j + 1], ASM)
        fg += dg.to(tl.float32) * xs[j]
        fh += dh.to(tl.float32) * xs[j]
    return fg, fh


@triton.jit
def _load(ptrs, ok, other, EXACT: tl.constexpr):
    """tl.load, masked by ok unless EXACT (every pointer in bounds: no registers zeroed before the load)."""
    return tl.load(ptrs) if EXACT else tl.load(ptrs, mask=ok, other=other)


@triton.jit
def _scaled_sums(tile, q: tl.constexpr, S: tl.constexpr, x, xs, zero, CHUNKS: tl.constexpr, ASM: tl.constexpr):
    """A group's sums of rows g and g + 8 times x's scales (float32, the weight's scale still to come)."""
    if CHUNKS:
        fg, fh = _chunk_group_sums(tile, q, S, x, xs, zero, ASM)
    else:
        sum_g, sum_h = _group_sums(tile, q, S, x, zero, ASM)
        fg, fh = sum_g.to(tl.float32) * xs, sum_h.to(tl.float32) * xs
    return fg, fh


@triton.jit
def _shfl(v, src, NW: tl.constexpr, ASM: tl.constexpr):
    """[32 * NW] int32: each lane's v from lane `src` (0..31) of its own warp. ASM: shfl.sync.idx; otherwise a
    one-hot sum over the warp (the interpreter's)."""
    if ASM:
        out = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 31, -1;", "=r,r,r", [v, src], dtype=tl.int32,
                                        is_pure=True, pack=1)
    else:
        hit = tl.arange(0, 32)[None, None, :] == tl.reshape(src, [NW, 32, 1])
        out = tl.reshape(tl.sum(tl.where(hit, tl.reshape(v, [NW, 1, 32]), 0), axis=2), [32 * NW])
    return out


@triton.jit
def _warp_all(v, NW: tl.constexpr, MAX: tl.constexpr):
    """[32 * NW]: the max (MAX) or sum of v over each warp, in every lane of it."""
    r = tl.reshape(v, [NW, 32])
    w = tl.max(r, axis=1) if MAX else tl.sum(r, axis=1)
    return tl.reshape(tl.broadcast_to(w[:, None], [NW, 32]), [32 * NW])


@triton.jit
def _quantized_x(x_ptr, group, g, t, ok, NW: tl.constexpr, ASM: tl.constexpr):
    """QX: a group's 8 B words of each lane's chunk (quantize_x's order), its scale and -8 times its code sum,
    made from bf16 x by the warp (every lane of a warp is in the same group): lane 4g + t rounds the 4 values of
    word g of chunk 4 * group + t, the group's max and code sum come over the warp, and 8 shuffles give each lane
    its chunk's words."""
    j = (g // 4) * 2 + g % 2  # word g is octet j's even (p 0) or odd (p 1) columns
    p = (g // 2) % 2
    cols = (group * 4 + t) * 32 + j * 8
    v8 = tl.load(x_ptr + cols[:, None] + tl.arange(0, 8)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(v8, [32 * NW, 4, 2]))
    v = tl.where((p == 0)[:, None], even, odd)  # [L, 4]: columns 8j + p + 2m
    amax = tl.maximum(_warp_all(tl.max(tl.abs(v), axis=1), NW, True), 1e-30)
    codes = (v * (127.0 / amax)[:, None] + 12582912.0).to(tl.int32, bitcast=True) & 0xFF  # round to even, int8 bits
    word = tl.sum(codes << (8 * tl.arange(0, 4))[None, :], axis=1)
    zero = -8 * _warp_all(tl.sum(((codes + 128) & 0xFF) - 128, axis=1), NW, False)
    return ((_shfl(word, t, NW, ASM), _shfl(word, 4 + t, NW, ASM), _shfl(word, 8 + t, NW, ASM),
             _shfl(word, 12 + t, NW, ASM), _shfl(word, 16 + t, NW, ASM), _shfl(word, 20 + t, NW, ASM),
             _shfl(word, 24 + t, NW, ASM), _shfl(word, 28 + t, NW, ASM)), amax / 127.0, zero)


@triton.jit
def _imma_matvec(w_ptr, s_ptr, xq_ptr, xs_ptr, xz_ptr, out_ptr, n, K: tl.constexpr, NW: tl.constexpr,
                 GPW: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, QX: tl.constexpr = False,
                 CHUNKS: tl.constexpr = False):
    """out[rows] = W[rows] @ x over program_id(0)'s T (1 or 2) tiles of 16 rows (see the module docstring). QX: x
    comes as bfloat16 at xq_ptr and each warp rounds its groups to int8 itself (`_quantized_x`). CHUNKS: the plane
    is `chunk_major` and x `quantize_x_chunks` (a scale and a code sum a chunk of 32; `_chunk_group_sums`)."""
    groups: tl.constexpr = K // 128
    g, t, q0, tile0, a, b = lane_tiles(w_ptr, s_ptr, K, NW, GPW, T, ASM)
    acc_ag, acc_ah, acc_bg, acc_bh = waited_zeros(NW, PDL)
    x_base = (xq_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (q0 * 4 + t) * 8)[:, None] + \
        tl.arange(0, 4)[None, :]
    x_chunks = (xq_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + q0 * 32 + t * 8)[:, None] + \
        tl.arange(0, 4)[None, :]
    s_chunks = (xs_ptr + q0 * 8)[:, None] + tl.arange(0, 4)[None, :]
    # no warp's run passes K, or (CHUNKS) x's buffers are padded with zeros to every warp's run: no masks on x
    EXACT: tl.constexpr = groups == GPW * NW or CHUNKS
    for q in tl.static_range(GPW):
        ok = q0 + q < groups
        if CHUNKS:
            x0, x1, x2, x3 = split4(_load(x_chunks + 32 * q, ok[:, None], 0, EXACT))  # chunks 0, 1: e, o
            x4, x5, x6, x7 = split4(_load(x_chunks + (32 * q + 4), ok[:, None], 0, EXACT))  # chunks 2, 3
            xs = split4(_load(s_chunks + 8 * q, ok[:, None], 0.0, EXACT))
            z0, z1, z2, z3 = split4(_load(s_chunks + (8 * q + 4), ok[:, None], 0.0, EXACT))
            zero = (z0 + z1) + (z2 + z3)
        elif QX:
            xw, xs, zero = _quantized_x(xq_ptr, q0 + q, g, t, ok, NW, ASM)
            x0, x1, x2, x3, x4, x5, x6, x7 = xw
        else:
            x0, x1, x2, x3 = split4(tl.load(x_base + 32 * q, mask=ok[:, None], other=0))  # e0, e1, o0, o1
            x4, x5, x6, x7 = split4(tl.load(x_base + (32 * q + 4), mask=ok[:, None], other=0))  # e2, e3, o2, o3
            xs = tl.load(xs_ptr + q0 + q, mask=ok, other=0.0)
            zero = -8 * tl.load(xz_ptr + q0 + q, mask=ok, other=0)
        xw = (x0, x1, x2, x3, x4, x5, x6, x7)
        sum_g, sum_h = _scaled_sums(a, q, GPW, xw, xs, zero, CHUNKS, ASM)
        acc_ag += sum_g * pick(a[2], q, GPW).to(tl.float32)
        acc_ah += sum_h * pick(a[3], q, GPW).to(tl.float32)
        if T == 2:
            sum_g, sum_h = _scaled_sums(b, q, GPW, xw, xs, zero, CHUNKS, ASM)
            acc_bg += sum_g * pick(b[2], q, GPW).to(tl.float32)
            acc_bh += sum_h * pick(b[3], q, GPW).to(tl.float32)
    rows = tile0 * 16 + tl.arange(0, 16)
    tl.store(out_ptr + rows, _tile_rows(acc_ag, acc_ah, NW))
    if T == 2:
        tl.store(out_ptr + rows + 16, _tile_rows(acc_bg, acc_bh, NW))


def matvec(words, scales, xq, xs, xz, n, k, nw, t, asm, pdl=0, out=None, chunks=False):
    """float32 [n]: the weight's (packed low plane as int32 [n, k / 8], float16 scales [n, k / 128]) product with
    the int8 activations (`quantize_x`: xq, xs, xz), or with xq bfloat16 x [k] (xs, xz None) rounded to them in the
    kernel; nw warps split k, t row tiles of 16 a program. chunks: the plane `chunk_major` and xq, xs, xz from
    `quantize_x_chunks`."""
    gpw = triton.next_power_of_2(-(-(k // 128) // nw))
    if n % (16 * t) or k % 128 or t not in (1, 2) or gpw > 16:
        raise ValueError(f"the int8 mma matvec tiles rows by 16 * t (t 1 or 2), columns by 128, at most 16 groups "
                         f"a warp: not [{n}, {k}] with {nw} warps, t={t}")
    out = torch.empty(n, dtype=torch.float32, device=words.device) if out is None else out
    qx = xs is None
    if chunks and xq.numel() < gpw * nw * 32:  # x's buffers padded with zeros to every warp's run (loaded unmasked)
        xq, xs, _ = padded_chunks((xq, xs, None), k, nw)
    xz = xq if qx else (xs if chunks else xz)  # CHUNKS: the zero points are in xs
    _imma_matvec[(n // (16 * t),)](words, scales, xq, xq if qx else xs, xz, out, n, k, nw, gpw, t, asm, pdl, qx,
                                   chunks, num_warps=nw, **({"launch_pdl": True} if pdl else {}))
    return out


def _case(n, k, seed):
    """Random int4 weights as the format stores them, x, and both products: with x as its int8 rounding (the
    kernel's) and with x as it is."""
    from thin.ir import formats

    gen = torch.Generator().manual_seed(seed)
    params = formats.get("int4").normalize({})
    w = 0.02 * torch.randn(n, k, generator=gen)
    raw = formats.encode("int4", w, params)
    parts = formats.get("int4").split(raw, (n, k), params)
    decoded = formats.get("int4").decode(raw, (n, k), params, torch.float32)
    x = torch.randn(k, generator=gen).bfloat16()
    words = parts["codes"].contiguous().view(torch.int32).reshape(n, k // 8)
    return words, parts["scales"].contiguous(), x, decoded, decoded @ x.float()


# How x reaches the kernel: int8 with a scale a group of 128 (quantize_x), bfloat16 rounded in the kernel (QX),
# int8 with a scale a chunk of 32 and the plane chunk-major (CHUNKS)
X_WAYS = ("groups", "kernel", "chunks")


# (n, k, warps, row tiles): groups a warp past K (1792: 14 groups) included.
CASES = [(32, 256, 1, 1), (64, 512, 2, 2), (48, 384, 2, 1), (64, 1792, 4, 2), (32, 1792, 2, 1)]


def errors_against(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """|got - want| / |want| and |got - exact| / |exact|: against what the kernel computes, and against x itself."""
    return ((got - want).norm() / want.norm()).item(), ((got - exact).norm() / exact.norm()).item()


def print_case(n, k, nw, t, err, err_x, way: str = "") -> None:
    """One line of a `check`: the case and its two errors (`errors_against`)."""
    print(f"n={n} k={k} warps={nw} row tiles {t}{', x ' + way if way else ''}: relative error {err:.1e} against the "
          f"int8 x ({err_x:.1e} against x)")


def relative_errors(n, k, nw, t, device, seed: int = 0, way: str = "groups") -> tuple[float, float]:
    """|kernel - reference| / |reference| on a random case (`_case`), the reference the format's decode times x
    rounded to int8 as `way` (one of X_WAYS) rounds it (what the kernel computes) and times x itself: the mma path
    on a GPU, the interpreter twin on the CPU."""
    words, scales, x, decoded, exact = _case(n, k, seed)
    chunks = way == "chunks"
    want = decoded @ (dequantized_x_chunks(x) if chunks else dequantized_x(x))
    if way == "kernel":
        xq = (x.to(device), None, None)
    else:
        xq = tuple(None if a is None else a.to(device) for a in (quantize_x_chunks(x) if chunks else quantize_x(x)))
    plane = chunk_major(words) if chunks else words
    got = matvec(plane.to(device), scales.to(device), *xq, n, k, nw, t, torch.device(device).type == "cuda",
                 chunks=chunks).cpu()
    return errors_against(got, want, exact)


def check(device: str) -> None:
    for n, k, nw, t in CASES:
        for way in X_WAYS:
            err, err_x = relative_errors(n, k, nw, t, device, n + k, way)
            print_case(n, k, nw, t, err, err_x, way)
            # On the GPU the rounding's multiply-add is fused: a value at a half may round the other way than
            # torch's, one code of one column (about 1e-3 of these small sums).
            assert err < (3e-3 if way == "kernel" and device != "cpu" else 1e-5), err


def _weights(n, k):
    """(shipped ops, (low plane words, scales)) of `shipped_weights`: the planes the shipped kernel reads."""
    ops = [op for op, _ in shipped_weights(n, k)]
    return ops, [(op.low32.reshape(n, k // 8), op.scales.reshape(n, k // 128)) for op in ops]


def bench() -> None:
    """The int8 mma matvec against the shipped one, each timed alone (plain and as programmatic dependents)."""
    from bench_kernels import time_graph

    for name, n, k in chosen_shapes():
        ops, planes = _weights(n, k)
        reps = max(1, 20 // len(ops))
        x = torch.randn(k, device="cuda").bfloat16()
        ways = {"groups": quantize_x(x), "kernel": (x, None, None), "chunks": quantize_x_chunks(x)}
        chunk_planes = [(chunk_major(w), sc) for w, sc in planes]
        want = ops[0](x[None])[0].float()
        print_shipped(name, ops, x, reps)
        for nw, t in ([(4, 1), (4, 2), (8, 1)] if k <= 4096 else [(8, 1), (16, 1)]):
            if n % (16 * t):
                continue
            out = torch.empty(n, device="cuda")
            for how, xs in ways.items():
                chunks = how == "chunks"
                use = chunk_planes if chunks else planes
                xs = padded_chunks(xs, k, nw) if chunks else xs  # no padding inside the timed calls
                got = matvec(*use[0], *xs, n, k, nw, t, True, 0, out, chunks)
                err = ((got - want).norm() / want.norm()).item()
                times = [time_graph([partial(matvec, *p, *xs, n, k, nw, t, True, pdl, out, chunks) for p in use]
                                    * reps) for pdl in (0, 1)]
                print(f"  int8 mma warps={nw} row tiles {t}, x {how}: plain {times[0] * 1e6:.2f} us, dependent "
                      f"{times[1] * 1e6:.2f} us, error against shipped {err:.1e}", flush=True)


def sass() -> None:
    """Compile the kernel for sm_90 (sass_budget.py's stand-in driver, no GPU) as a dependent at llama-8b's qkv
    and down shapes, and print its SASS instructions after the wait (griddepcontrol.wait), a weight and lane."""
    from sass_budget import ADDRESS, _Sm90, disassemble
    from triton.runtime import driver

    driver.set_active(_Sm90())
    print("| shape | warps | row tiles | x | instructions after the wait | a weight |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for name, n, k, nw, t in [("qkv", 6144, 4096, 4, 1), ("qkv", 6144, 4096, 8, 2), ("qkv", 6144, 4096, 4, 2),
                              ("down", 4096, 14336, 16, 1), ("down", 4096, 14336, 8, 1)]:
        gpw = triton.next_power_of_2(-(-(k // 128) // nw))
        for way in X_WAYS:
            qx = way == "kernel"
            xq = torch.empty(k, dtype=torch.bfloat16) if qx else torch.empty(k // 4, dtype=torch.int32)
            xs, xz = (xq, xq) if qx else (torch.empty(k // 128), torch.empty(k // 128, dtype=torch.int32))
            if way == "chunks":
                xq, xs = torch.empty(gpw * nw * 32, dtype=torch.int32), torch.empty(gpw * nw * 8)
                xz = xs
            kernel = _imma_matvec.warmup(torch.empty(n, k // 8, dtype=torch.int32),
                                         torch.empty(n, k // 128, dtype=torch.float16), xq, xs, xz, torch.empty(n), n,
                                         k, nw, gpw, t, True, 1, qx, way == "chunks", num_warps=nw,
                                         grid=(n // (16 * t),))
            code = [found.group(2) for found in map(ADDRESS.match, disassemble(kernel).splitlines()) if found]
            after = len(code) - next(i for i, text in enumerate(code) if "ACQBULK" in text)
            print(f"| {name} | {nw} | {t} | {way} | {after} | {after / (16 * t * gpw * 4):.2f} |")


if __name__ == "__main__":
    run_mode({"check": lambda: check("cuda" if torch.cuda.is_available() else "cpu"), "bench": bench, "sass": sass},
             __doc__)
