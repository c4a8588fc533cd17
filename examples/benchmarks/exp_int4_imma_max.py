"""Experiment: exp_int4_imma.py's int8 tensor-core int4 matvec with x given as bfloat16 plus each group's max |x|,
the codes rounded in the kernel and no sums of them.

    python3 examples/benchmarks/exp_int4_imma_max.py check          # CPU (TRITON_INTERPRET=1) or GPU
    python3 examples/benchmarks/exp_int4_imma_max.py bench [qkv,o,gate_up,down]   # GPU: alone, plain and dependent
    python3 examples/benchmarks/exp_int4_imma_max.py sass           # sm_90 instructions after the wait, no GPU

Why (BENCHMARKS Round 22): the step with every int4 matvec on the int8 mma and x's int8 codes, scales and code sums
given (a group of 128) ran 707 tok/s, over the bar; but the kernels before the matvecs own 16 or 32 of its x's
values (a tile of o's or down's rows, of gate/up's activations), not a group of 128, so none can write that
group's scale alone, and a scale a chunk of 32 (exp_int4_imma.py CHUNKS) ran 621. What such a producer can give
is its values and its share of the group's max: an integer atomic max on the bits of |x| (the same result in any
order). The consumer then rounds x itself, knowing the scale (QX without the warp's max and code sums).

Two changes from exp_int4_imma.py:
- the codes as signed: `((w << 4) & 0xF0F0F0F0) ^ 0x80808080` is each even nibble's code minus 8 times 16 as an
  int8 byte, and `(w & 0xF0F0F0F0) ^ 0x80808080` the odd one's (one logic op each, and one shift for the even),
  so the zero point is in A, the four mma of a group (s8 x s8) are one chain, and no code sums of x are needed;
  the sum is 16 times the group's, taken off in the float scale;
- B rounded in the kernel from bfloat16 x and the group's max (`_rounded_x`: a lane 4 values of word g of its
  chunk, then 8 shuffles; no reductions over the warp).

The layouts are exp_int4_imma.py's (the shipped low plane as stored; x's words e0, e1, o0, o1, e2, e3, o2, o3 a
chunk). Not in the runtime: the producers' atomic max (and its reset each step) are not written.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from exp_int4_imma import (  # noqa: E402
    CASES,
    _case,
    _imma,
    _load,
    _shfl,
    _tile_rows,
    dequantized_x,
    errors_against,
    lane_tiles,
    print_case,
    waited_zeros,
)
from int4_lanes import bench_alone, pick, print_sass_counts, run_mode, split4  # noqa: E402


def group_max(x: torch.Tensor) -> torch.Tensor:
    """float32 [K / 128]: each group's max |x|, what the producers' atomic max leaves."""
    return x.float().reshape(-1, 128).abs().amax(1).clamp_min(1e-30).contiguous()


@triton.jit
def _flip_high(w, ASM: tl.constexpr):
    """(w & 0xF0F0F0F0) ^ 0x80808080: one lop3 (ptxas keeps the and and the xor apart when written in Triton)."""
    if ASM:
        out = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF0F0F0F0, 0x80808080, 0x6A;", "=r,r", [w],
                                        dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = (w & -252645136) ^ -2139062144
    return out


@triton.jit
def _even(w, ASM: tl.constexpr):
    """The even nibbles' codes minus 8, times 16, as signed bytes."""
    return _flip_high(w << 4, ASM)


@triton.jit
def _odd(w, ASM: tl.constexpr):
    """The odd nibbles' codes minus 8, times 16, as signed bytes."""
    return _flip_high(w, ASM)


@triton.jit
def group_chain_s8(tile, q: tl.constexpr, S: tl.constexpr, lo, hi, ASM: tl.constexpr):
    """16 times a group's sums (the zero point included), this lane's int32 D fragment, from a `lane_tiles` tile
    and the lane's 8 B words: `lo` (e0, e1, o0, o1) with words 0 and 1 of its chunk, `hi` (e2, e3, o2, o3) with
    words 2 and 3. Four s8 mma in one chain."""
    g0, g1, g2, g3 = split4(pick(tile[0], q, S))
    h0, h1, h2, h3 = split4(pick(tile[1], q, S))
    e0, e1, o0, o1 = lo
    e2, e3, o2, o3 = hi
    z = g0 * 0
    d = _imma(_even(g0, ASM), _even(h0, ASM), _even(g1, ASM), _even(h1, ASM), e0, e1, (z, z, z, z), ASM, True)
    d = _imma(_even(g2, ASM), _even(h2, ASM), _even(g3, ASM), _even(h3, ASM), e2, e3, d, ASM, True)
    d = _imma(_odd(g0, ASM), _odd(h0, ASM), _odd(g1, ASM), _odd(h1, ASM), o0, o1, d, ASM, True)
    return _imma(_odd(g2, ASM), _odd(h2, ASM), _odd(g3, ASM), _odd(h3, ASM), o2, o3, d, ASM, True)


@triton.jit
def _rounded_x(x_ptr, m_ptr, group, g, t, ok, NW: tl.constexpr, ASM: tl.constexpr, EXACT: tl.constexpr):
    """A group's 8 B words of each lane's chunk (as `group_chain_s8` takes them: e0, e1, o0, o1 and e2, e3, o2, o3)
    and the group's scale, from bf16 x and the group's max: lane 4g + t
    rounds the 4 values of word g of chunk 4 * group + t (x * 127 / max, to nearest even), 8 shuffles give each
    lane its chunk's words."""
    j = (g // 4) * 2 + g % 2  # word g is octet j's even (p 0) or odd (p 1) columns
    p = (g // 2) % 2
    cols = (group * 4 + t) * 32 + j * 8
    v8 = _load(x_ptr + cols[:, None] + tl.arange(0, 8)[None, :], ok[:, None], 0.0, EXACT).to(tl.float32)
    even, odd = tl.split(tl.reshape(v8, [32 * NW, 4, 2]))
    v = tl.where((p == 0)[:, None], even, odd)  # [L, 4]: columns 8j + p + 2m
    amax = _load(m_ptr + group, ok, 1.0, EXACT)
    codes = (v * (127.0 / amax)[:, None] + 12582912.0).to(tl.int32, bitcast=True) & 0xFF  # round to even, int8 bits
    word = tl.sum(codes << (8 * tl.arange(0, 4))[None, :], axis=1)
    return ((_shfl(word, t, NW, ASM), _shfl(word, 4 + t, NW, ASM), _shfl(word, 8 + t, NW, ASM),
             _shfl(word, 12 + t, NW, ASM)), (_shfl(word, 16 + t, NW, ASM), _shfl(word, 20 + t, NW, ASM),
            _shfl(word, 24 + t, NW, ASM), _shfl(word, 28 + t, NW, ASM)), amax * (1.0 / (127.0 * 16.0)))


@triton.jit
def _max_matvec(w_ptr, s_ptr, x_ptr, m_ptr, out_ptr, n, K: tl.constexpr, NW: tl.constexpr, GPW: tl.constexpr,
                T: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    """out[rows] = W[rows] @ x over program_id(0)'s T (1 or 2) tiles of 16 rows: every weight word and scale of a
    lane loaded before the wait (PDL), x and the groups' max after it."""
    groups: tl.constexpr = K // 128
    EXACT: tl.constexpr = groups == GPW * NW  # no warp's run passes K: x's loads need no mask
    g, t, q0, tile0, a, b = lane_tiles(w_ptr, s_ptr, K, NW, GPW, T, ASM)
    acc_ag, acc_ah, acc_bg, acc_bh = waited_zeros(NW, PDL)
    for q in tl.static_range(GPW):
        ok = q0 + q < groups
        lo, hi, xs = _rounded_x(x_ptr, m_ptr, q0 + q, g, t, ok, NW, ASM, EXACT)
        d = group_chain_s8(a, q, GPW, lo, hi, ASM)
        acc_ag += d[0].to(tl.float32) * (pick(a[2], q, GPW).to(tl.float32) * xs)
        acc_ah += d[2].to(tl.float32) * (pick(a[3], q, GPW).to(tl.float32) * xs)
        if T == 2:
            d = group_chain_s8(b, q, GPW, lo, hi, ASM)
            acc_bg += d[0].to(tl.float32) * (pick(b[2], q, GPW).to(tl.float32) * xs)
            acc_bh += d[2].to(tl.float32) * (pick(b[3], q, GPW).to(tl.float32) * xs)
    rows = tile0 * 16 + tl.arange(0, 16)
    tl.store(out_ptr + rows, _tile_rows(acc_ag, acc_ah, NW))
    if T == 2:
        tl.store(out_ptr + rows + 16, _tile_rows(acc_bg, acc_bh, NW))


def matvec(words, scales, x, gmax, n, k, nw, t, asm, pdl=0, out=None):
    """float32 [n]: the weight's (packed low plane int32 [n, k / 8], float16 scales [n, k / 128]) product with
    bfloat16 x [k] rounded to int8 a group of 128 by its max (`group_max`); nw warps split k, t row tiles of 16."""
    gpw = triton.next_power_of_2(-(-(k // 128) // nw))
    if n % (16 * t) or k % 128 or t not in (1, 2) or gpw > 16:
        raise ValueError(f"the int8 mma matvec tiles rows by 16 * t (t 1 or 2), columns by 128, at most 16 groups "
                         f"a warp: not [{n}, {k}] with {nw} warps, t={t}")
    out = torch.empty(n, dtype=torch.float32, device=words.device) if out is None else out
    _max_matvec[(n // (16 * t),)](words, scales, x, gmax, out, n, k, nw, gpw, t, asm, pdl, num_warps=nw,
                                  **({"launch_pdl": True} if pdl else {}))
    return out


def relative_errors(n, k, nw, t, device, seed: int = 0) -> tuple[float, float]:
    """|kernel - reference| / |reference| on exp_int4_imma's random case, the reference the format's decode times
    x rounded to int8 by its groups' max, and times x itself."""
    words, scales, x, decoded, exact = _case(n, k, seed)
    want = decoded @ dequantized_x(x)
    got = matvec(words.to(device), scales.to(device), x.to(device), group_max(x).to(device), n, k, nw, t,
                 torch.device(device).type == "cuda").cpu()
    return errors_against(got, want, exact)


def check(device: str) -> None:
    for n, k, nw, t in CASES:
        err, err_x = relative_errors(n, k, nw, t, device, n + k)
        print_case(n, k, nw, t, err, err_x)
        # On the GPU the division and the rounding's multiply-add may round a value at a half the other way.
        assert err < (3e-3 if device != "cpu" else 1e-5), err


def bench() -> None:
    """The kernel against the shipped matvec, each timed alone (plain and as programmatic dependents)."""
    bench_alone("int8 mma, x rounded by its groups' max", lambda x: (x, group_max(x)), matvec)


def sass() -> None:
    """sm_90 instructions after the wait (no GPU), a weight and lane."""
    print_sass_counts(lambda n, k, nw, gpw, t: _max_matvec.warmup(
        torch.empty(n, k // 8, dtype=torch.int32), torch.empty(n, k // 128, dtype=torch.float16),
        torch.empty(k, dtype=torch.bfloat16), torch.empty(k // 128), torch.empty(n), n, k, nw, gpw, t, True, 1,
        num_warps=nw, grid=(n // (16 * t),)))


if __name__ == "__main__":
    run_mode({"check": lambda: check("cuda" if torch.cuda.is_available() else "cpu"), "bench": bench, "sass": sass},
             __doc__)
