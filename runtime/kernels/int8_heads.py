"""The attention's output rounded to int8 a head of 128 by its merge, and o's symmetric int4 (group 128) matvec on
the int8 tensor cores from those codes, with the residual norm deferred (deferred_norm.py).

Why: an int4 matvec that multiplies bfloat16 activations spends its time after its wait turning nibbles into
bfloat16 and multiplying (pairs.py); on the int8 mma (mma.sync.m16n8k32, u8 weights x s8 activations, int32 sums)
a group of 128 is four mma a 16-row tile, and a programmatic dependent that loaded its weight before its wait has
little left to do after it. That needs x as int8 with a scale a group of 128, which only a kernel that owns 128 of
x's values can write without another launch: of the kernels before the decode step's matvecs, only the attention's
merge does (a program a query head; a head of 128 is one of o's groups). llama-8b int4 on the H200: 653 tok/s
against 638 for the shipped merge and o (BENCHMARKS.md, Round 26); o launched plainly, 618.

Numbers: the merge writes the head as the bfloat16 it always wrote, then scale = max |head| / 127 (float32) and
codes = head * (127 / max |head|) rounded to nearest even (|code| <= 127), their sum, and the codes in the mma's B
order (below). o's rows are W @ (codes * scale) in float32 (the format's decode of W, exactly: the mma's sums are
exact integers), about 0.6% of relative error against W @ x on random x (`reference_o`), the rounding llama.cpp's
int8-activation kernels make too; then residual += o, rounded as add_rmsnorm rounds it.

Layout. A weight row's low plane holds, for each 32-column chunk, 4 words, word o the columns 8o .. 8o + 7 (column
8o + j at bits 4j), so `w & 0x0F0F0F0F` is the word's even columns as bytes and `w & 0xF0F0F0F0` its odd ones as 16
times bytes. Lane l = 4g + t of a warp loads, for its row tile and group q, the 16 bytes of chunk 4q + t of rows
g and g + 8; the mma takes as A the even (or odd) bytes of words 0 and 1 (then 2 and 3) of both rows, and as B the
int8 activations of the same columns, which the merge lays so that chunk c's 8 words are e0, e1, o0, o1, e2, e3,
o2, o3 (e_j: columns 32c + 8j + 2m, m = 0..3, a byte each; o_j: 32c + 8j + 2m + 1): each mma's two B registers are
adjacent words of one 16-byte load. A group is 2 mma on the even columns and 2 on the odd (16 times the products,
shifted back exactly), then the zero point (-8 times the group's code sum), one int-to-float and one multiply-add a
row. Under the interpreter the mma is lanes.imma's twin, the same sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import dependent, interpreting
from .attention import merged_head
from .common import INLINE_ASM
from .deferred_norm import Deferred, deferred_rows, store_deferred
from .dependent import release_next, wait_previous
from .lanes import imma, load_run, pick, split4, threads

ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: added to a float32 below 2^22 in magnitude, rounds it to even
HEAD = 128  # features a head, columns a group of the weight


@triton.jit
def _merge_codes_kernel(o_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, codes_ptr, xs_ptr, xz_ptr, log_ptr, n_ptr,
                        step_ptr, HQ, SPLITS, SP: tl.constexpr, D: tl.constexpr, SINKS: tl.constexpr,
                        LOG: tl.constexpr, PDL: tl.constexpr = 0):
    """Query head i = program_id(0) of one sequence: attention.py's merge (`merged_head`), stored as bfloat16,
    then rounded to int8: codes (byte ((((c * 2 + jj) * 2 + p) * 2 + jm) * 4 + m of the head's feature
    c * 32 + jj * 16 + jm * 8 + m * 2 + p), scale xs[i] = max |out| / 127, code sum xz[i]. PDL: dependent.py."""
    wait_previous(PDL)
    release_next(PDL)
    i = tl.program_id(0)
    d = tl.arange(0, D)
    out = merged_head(o_ptr, m_ptr, l_ptr, sink_ptr, i, HQ, D, SPLITS, SP, D, SINKS).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + i * D + d, out)
    v = out.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-30)
    code = (v * (127.0 / amax) + ROUND).to(tl.int32, bitcast=True) - 0x4B400000  # round to nearest even
    e = d % 32
    pos = (((((i * 4 + d // 32) * 2 + e // 16) * 2 + e % 2) * 2 + (e // 8) % 2) * 4 + (e % 8) // 2)
    tl.store(codes_ptr + pos, code.to(tl.int8))
    tl.store(xs_ptr + i, amax / 127.0)
    tl.store(xz_ptr + i, tl.sum(code, axis=0))
    if LOG:  # noqa: SIM102  (a constexpr condition, then a run-time one)
        if i == 0:
            s = tl.arange(0, SP)
            n = tl.sum(tl.load(n_ptr + s, mask=s < SPLITS, other=0), axis=0)
            tl.store(log_ptr + tl.load(step_ptr), n)


@triton.jit
def _tile_runs(w_ptr, s_ptr, row, q0, t, GPW: tl.constexpr, groups: tl.constexpr, K: tl.constexpr):
    """A lane's words (16 bytes a group: chunk 4q + t) and scales of rows `row` (g) and row + 8 over its warp's
    groups q0 .. q0 + GPW - 1, all loaded at once (lanes.load_run: one load each, held as one tensor)."""
    ptrs = w_ptr + (row * (K // 8) + (q0 * 4 + t) * 4)[:, None] + tl.arange(0, 4)[None, :]
    s_ptrs = s_ptr + row * groups + q0
    return (load_run(ptrs, q0, GPW, GPW, groups, 16), load_run(ptrs + 8 * (K // 8), q0, GPW, GPW, groups, 16),
            load_run(s_ptrs, q0, GPW, GPW, groups, 1), load_run(s_ptrs + 8 * groups, q0, GPW, GPW, groups, 1))


@triton.jit
def _group_sums(tile, q: tl.constexpr, S: tl.constexpr, x, zero, ASM: tl.constexpr):
    """A group's int32 sums of rows g and g + 8 (a lane's D fragment) from a `_tile_runs` tile and the group's 8
    B words x (e0, e1, o0, o1, e2, e3, o2, o3): two mma on the even columns and two on the odd (16 times the
    codes), each chain from zero, the odd sums shifted back exactly, then the zero point (`zero`: -8 times the
    sum of the group's codes)."""
    g0, g1, g2, g3 = split4(pick(tile[0], q, S))
    h0, h1, h2, h3 = split4(pick(tile[1], q, S))
    x0, x1, x2, x3, x4, x5, x6, x7 = x
    lo = 0x0F0F0F0F
    hi = -252645136  # 0xF0F0F0F0
    z = zero * 0
    even = imma(g0 & lo, h0 & lo, g1 & lo, h1 & lo, x0, x1, (z, z, z, z), ASM)
    even = imma(g2 & lo, h2 & lo, g3 & lo, h3 & lo, x4, x5, even, ASM)
    odd = imma(g0 & hi, h0 & hi, g1 & hi, h1 & hi, x2, x3, (z, z, z, z), ASM)
    odd = imma(g2 & hi, h2 & hi, g3 & hi, h3 & hi, x6, x7, odd, ASM)
    return even[0] + (odd[0] >> 4) + zero, even[2] + (odd[2] >> 4) + zero


@triton.jit
def _tile_rows(acc_g, acc_h, NW: tl.constexpr):
    """A tile's [16] row sums: the warps' sums lane by lane, then rows g (and g + 8) from any lane of quad g."""
    rows_g = tl.max(tl.reshape(tl.sum(tl.reshape(acc_g, [NW, 32]), axis=0), [8, 4]), axis=1)
    rows_h = tl.max(tl.reshape(tl.sum(tl.reshape(acc_h, [NW, 32]), axis=0), [8, 4]), axis=1)
    return tl.reshape(tl.permute(tl.join(rows_g, rows_h), [1, 0]), [16])


@triton.jit
def o_tile_sums(w_ptr, s_ptr, xq_ptr, xs_ptr, xz_ptr, K: tl.constexpr, NW: tl.constexpr, GPW: tl.constexpr,
                ASM: tl.constexpr, PDL: tl.constexpr):
    """float32 [16]: rows 16 * program_id(0) .. + 15 of W @ x from the merge's codes. NW warps split K, GPW groups
    each (past K masked); every weight word and scale of a lane is loaded before the wait (PDL: a programmatic
    dependent of the merge), x's codes, scales and sums after it."""
    groups: tl.constexpr = K // 128
    e = threads(NW, ASM)
    g = (e % 32) // 4
    t = e % 4
    q0 = e // 32 * GPW  # the warp's first group
    a = _tile_runs(w_ptr, s_ptr, tl.program_id(0) * 16 + g, q0, t, GPW, groups, K)
    wait_previous(PDL)
    release_next(PDL)
    acc_g = tl.zeros([32 * NW], dtype=tl.float32)
    acc_h = acc_g
    x_base = (xq_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (q0 * 4 + t) * 8)[:, None] + \
        tl.arange(0, 4)[None, :]
    for q in tl.static_range(GPW):
        ok = q0 + q < groups
        x0, x1, x2, x3 = split4(tl.load(x_base + 32 * q, mask=ok[:, None], other=0))  # e0, e1, o0, o1
        x4, x5, x6, x7 = split4(tl.load(x_base + (32 * q + 4), mask=ok[:, None], other=0))  # e2, e3, o2, o3
        xs = tl.load(xs_ptr + q0 + q, mask=ok, other=0.0)
        zero = -8 * tl.load(xz_ptr + q0 + q, mask=ok, other=0)
        sum_g, sum_h = _group_sums(a, q, GPW, (x0, x1, x2, x3, x4, x5, x6, x7), zero, ASM)
        acc_g += sum_g.to(tl.float32) * xs * pick(a[2], q, GPW).to(tl.float32)
        acc_h += sum_h.to(tl.float32) * xs * pick(a[3], q, GPW).to(tl.float32)
    return _tile_rows(acc_g, acc_h, NW)


@triton.jit
def _o_kernel(w_ptr, s_ptr, xq_ptr, xs_ptr, xz_ptr, res_ptr, norm_ptr, normed_ptr, slots_ptr, n, K: tl.constexpr,
              NW: tl.constexpr, GPW: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = 0):
    """Rows 16 * program_id(0) .. + 15 of W @ x from the merge's codes (`o_tile_sums`), added into the residual
    with the norm deferred (store_deferred: a slot a program)."""
    total = o_tile_sums(w_ptr, s_ptr, xq_ptr, xs_ptr, xz_ptr, K, NW, GPW, ASM, PDL)
    res, w = deferred_rows(res_ptr, norm_ptr, n, 16)
    store_deferred(total, n, 16, res_ptr, False, res_ptr, normed_ptr, slots_ptr, res, w)


@dataclass(frozen=True)
class Int8Heads:
    """The attention output of one sequence as int8 a head of 128 (what `merge_codes` writes and `o_deferred`
    reads): codes int8 [heads * 128] in the mma's B order, scales float32 [heads], code sums int32 [heads]."""

    codes: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor

    @classmethod
    def empty(cls, heads: int, device) -> Int8Heads:
        return cls(torch.zeros(heads * HEAD, dtype=torch.int8, device=device),
                   torch.zeros(heads, dtype=torch.float32, device=device),
                   torch.zeros(heads, dtype=torch.int32, device=device))


def takes(op, head_dim: int) -> bool:
    """Whether a decode step's o projection can run from the merge's int8 codes: symmetric int4 with groups of
    128 over heads of 128 features, no bias, 16-row tiles, at most 16 groups a warp of 8."""
    from .grouped_int import GroupedIntLinear

    return (head_dim == HEAD and isinstance(op, GroupedIntLinear) and op.format == "int4" and not op.asym
            and op.group == HEAD and op.bias is None and op.in_features % HEAD == 0 and op.out_features % 16 == 0
            and op.in_features <= 16 * 8 * HEAD)


def merge_codes(attention, out: torch.Tensor, heads: Int8Heads, sinks=None, log=None, step=None) -> None:
    """DecodeAttention.merge for one sequence of 128-feature heads (attention.py), also writing `heads`."""
    if attention.rows != 1 or attention.head_dim != HEAD or heads.scales.numel() != attention.num_heads:
        raise ValueError(f"int8 heads are written for one sequence of {HEAD}-feature heads, not {attention.rows} "
                         f"of {attention.head_dim} into {heads.scales.numel()} heads")
    sp = triton.next_power_of_2(attention.splits)
    _merge_codes_kernel[(attention.num_heads,)](
        attention.o, attention.m, attention.l, sinks if sinks is not None else attention.m, out, heads.codes,
        heads.scales, heads.sums, log if log is not None else attention.n, attention.n,
        step if step is not None else attention.n, attention.num_heads, attention.splits, SP=sp, D=HEAD,
        SINKS=sinks is not None, LOG=log is not None, num_warps=1 if sp <= 32 else 4, **dependent.kernel_args())


def o_warps(k: int) -> tuple[int, int]:
    """(warps, groups a warp) of o's program over k columns: 4 warps (on llama-8b's o 4096 x 4096 on the H200, 651
    tok/s against 646 on 2 or 8; BENCHMARKS Round 26) up to 16 groups each, else 8."""
    warps = 4 if k <= 16 * 4 * HEAD else 8
    return warps, triton.next_power_of_2(-(-(k // HEAD) // warps))


def o_deferred(op, heads: Int8Heads, residual: torch.Tensor, normed: torch.Tensor, slots: torch.Tensor,
               norm: tuple) -> Deferred:
    """o's matvec_deferred from the merge's int8 heads: residual += W @ x, normed = residual * norm weight, a
    slot a program of 16 rows (deferred_norm.py); returns the Deferred the next projection takes."""
    n, k = op.out_features, op.in_features
    if not takes(op, HEAD) or heads.codes.numel() != k:
        raise ValueError(f"o from int8 heads takes a symmetric int4 [{n}, {k}] weight with groups of {HEAD} and "
                         f"{k} codes, got {op.format} and {heads.codes.numel()}")
    programs = n // 16
    if programs > slots.numel():
        raise ValueError(f"o's {programs} programs need as many norm slots, got {slots.numel()}")
    warps, gpw = o_warps(k)
    _o_kernel[(programs,)](op.low32.reshape(n, k // 8), op.scales.reshape(n, k // HEAD), heads.codes.view(torch.int32),
                           heads.scales, heads.sums, residual, norm[0], normed, slots, n, k, warps, gpw,
                           INLINE_ASM and not interpreting(), num_warps=warps, **dependent.kernel_args())
    return Deferred(residual, normed, slots, norm, programs)


# ---- torch references ----------------------------------------------------------------------------------------


def quantize_heads(x: torch.Tensor, size: int = HEAD) -> tuple[torch.Tensor, torch.Tensor]:
    """x [heads * 128] (the merge's bfloat16 output) -> (codes float32 [heads, 128], scales float32 [heads]): what
    `_merge_codes_kernel` rounds it to (`size`: values a scale, 128 there)."""
    xg = x.float().reshape(-1, size)
    amax = xg.abs().amax(1).clamp_min(1e-30)
    inverse = (127.0 / amax.double()).float()  # rounded once to float32, as the kernel's division
    return torch.round(xg * inverse[:, None]), amax / 127


def b_order(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [heads, 128] -> int8 [heads * 128] in the mma's B order (the module docstring)."""
    k = codes.numel()
    # [chunk, octet pair, octet, byte m, column parity p] -> [chunk, octet pair, p, octet, m]
    return codes.to(torch.int8).reshape(k // 32, 2, 2, 4, 2).permute(0, 1, 4, 2, 3).reshape(k)


def reference_o(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float32 [n]: the decoded weight [n, k] times x rounded as the merge rounds it (`quantize_heads`)."""
    codes, scales = quantize_heads(x)
    return weight.float() @ (codes * scales[:, None]).reshape(-1)


__all__ = ["HEAD", "Int8Heads", "b_order", "merge_codes", "o_deferred", "o_tile_sums", "o_warps", "quantize_heads",
           "reference_o", "takes"]
