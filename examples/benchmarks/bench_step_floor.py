"""A bound on the int4 decode step if every grouped-int matvec cost only the reading of its bytes: `thin-exec bench`
in a fresh process with each matvec launch replaced by a kernel that reads the weight's packed words and scales at
the best rate bench_read_floor.py found (8 warps, 16 loads of 16 bytes a lane issued at once, launched as a
programmatic dependent that waits for the kernel before only after its loads) and writes zeros where the matvec
would have written its output. With --with-x each program also loads all of the matvec's activations after its
wait (as a matvec program over whole rows must), so the bound keeps the step's chain of activations. With
--plain the reads launch plainly (stream order, no wait in the kernel). Two stand-ins for what a real matvec has
and the reads have not, to tell which one costs a dependent its gain in the step (Round 20: real matvecs as
dependents lose where the reads gain 10%): --loads N, N 16-byte loads a lane (32: about twice the registers held
across the wait, half the programs), and --chain N, N dependent float multiply-adds a lane after the wait (about 4
cycles each; a matvec's x loads, products and sums take some hundreds to a few thousand cycles). And --work N, N
independent multiply-adds a loaded word after the wait (16: about int4's 2 instructions a weight, all of them done
after the wait on what was loaded before it), and --l2: the loads after the wait, the bytes asked of L2 before it
(one bulk prefetch a lane, no registers held), the way a matvec could start its reads early and keep its registers;
--post N: N more loads a lane issued right after the wait, before the work on what came before it (a matvec that
loads only part of its share early and streams the rest while it works). --arith NAME: after the wait, a
matvec's arithmetic on the loaded words against constant activations (sm_90 inline assembly; `_arith`,
`_dp4a_rows`, `_dp4a_runs` say what each does): pairs (the shipped bf16 pairs), dp4a, imma (int8 activations,
mma.sync.m16n8k32), hmma (the mma-fragment layout's bf16 mma.sync.m16n8k16), fp8mma (x as e4m3, no scales:
a word's nibbles masked to bytes are e4m3 subnormals, code times 2^-9, into two mma.sync.m16n8k32 e4m3 a chunk,
the odd nibbles shifted down first), and whole-matvec models of dp4a
with the activations quantized in the kernel (dp4a-rows) or already int8 (dp4a-rows-q8, dp4a-runs-q8), sums
over rows included. --imma: each matvec is exp_int4_imma.py's whole int8 mma kernel (its weight loaded before the
wait, a constant int8 x after it; symmetric int4 only), the step a real-arithmetic bound for int8 activations.
With IMMA_ONLY="NxK,..." only the matvecs of those weight shapes are replaced, the others run as shipped (pick ones
that do not produce the deferred norm's state, which the stand-in does not write: qkv 6144x4096, the fused gate/up
28672x4096 and the LM head 32000x4096 at llama-8b; not o or down).

    python examples/benchmarks/bench_step_floor.py MODEL.thin [--runs 5] [--with-x] [--plain] [--loads N] [--chain N]
        [--work N] [--post N] [--l2] [--arith NAME] [--imma]
    python examples/benchmarks/bench_step_floor.py --sass      # each --arith's sm_90 instructions, no GPU needed

The attention, the embedding, the sampler and every other kernel of the step run as shipped; every matvec's output
(and the LM head's) is zeros, so the tokens are meaningless (token 0; the run's checks compare the patched step with
itself) and the result is a bound, never a way to run: what the step would cost with matvecs as fast as reading
their bytes can be, their launches kept. Use a launch-configuration cache of its own (THIN_CACHE_DIR).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from int4_lanes import split4  # noqa: E402

from thin.runtime.kernels.pairs import (  # noqa: E402
    HIGH_NIBBLES,
    LOW_NIBBLES,
    UP_FIRST,
    UP_SECOND,
    _codes,
    code_zero,
    pair_fma,
)

ZERO_8 = tl.constexpr(code_zero(8))


def _option(name: str, default: int) -> int:
    """The integer after `name` on the command line (removed from it), or default."""
    if name not in sys.argv:
        return default
    i = sys.argv.index(name)
    value = int(sys.argv[i + 1])
    del sys.argv[i:i + 2]
    return value


NW = 8  # bench_read_floor.py's best for every int4 matvec size of llama-8b (BENCHMARKS Round 20)
PER = _option("--loads", 16)  # 16-byte loads a lane (16: that best; 32: twice the registers, half the programs)
CHAIN = _option("--chain", 0)  # dependent float multiply-adds after the wait (a matvec's post-wait work, stood in)
WORK = _option("--work", 0)  # independent float multiply-adds a loaded word after the wait (a matvec's arithmetic)
ARITHMETIC = ("none", "pairs", "dp4a", "imma", "dp4a-rows", "dp4a-rows-q8", "dp4a-runs-q8", "hmma", "fp8mma")
# --arith's values inside the kernel (constexpr globals)
PAIRS, DP4A, IMMA, DP4A_ROWS, DP4A_ROWS_Q8, DP4A_RUNS_Q8, HMMA, FP8MMA = (tl.constexpr(i) for i in range(1, 9))


def _arith_option() -> int:
    """The index in ARITHMETIC of the name after --arith (removed from the command line), 0 without it."""
    if "--arith" not in sys.argv:
        return 0
    i = sys.argv.index("--arith")
    name = sys.argv[i + 1]
    del sys.argv[i:i + 2]
    if name not in ARITHMETIC:
        raise SystemExit(f"--arith {name}: not one of {', '.join(ARITHMETIC)}")
    return ARITHMETIC.index(name)


ARITH = _arith_option()  # int4 arithmetic on the words after the wait (sm_90 inline assembly: GPU only)
POST = _option("--post", 0)  # 16-byte loads a lane issued after the wait, before the work on those before it
if POST and ARITHMETIC[ARITH].startswith("dp4a-"):
    raise SystemExit(f"--arith {ARITHMETIC[ARITH]} models a whole matvec on the loads before the wait: not with --post")
IMMA_STEP = "--imma" in sys.argv  # every matvec is exp_int4_imma.py's whole kernel (int8 x, constant), not the reads
L2 = "--l2" in sys.argv  # before the wait, ask L2 for the program's bytes (one bulk prefetch a lane); load after it
CHUNK = 32 * NW * (PER + POST) * 4  # int32 words a program reads
WITH_X = "--with-x" in sys.argv  # every program also loads the matvec's x after its wait
PLAIN = "--plain" in sys.argv  # plain launches (in stream order, no wait inside the kernel)


@triton.jit
def _read_zero(words_ptr, n_words, scales_ptr, n_scales, out_ptr, n_out, per_program, programs_words, x_ptr, k,
               PER: tl.constexpr, NW: tl.constexpr, XPER: tl.constexpr, PDL: tl.constexpr = True,
               CHAIN: tl.constexpr = 0, WORK: tl.constexpr = 0, L2: tl.constexpr = False, POST: tl.constexpr = 0,
               ARITH: tl.constexpr = 0):
    """Programs below programs_words read CHUNK words of the codes, the rest of the scales (as int32), all at once;
    then (PDL) the wait for the kernel before, WORK multiply-adds a word, CHAIN dependent multiply-adds a lane, and
    zeros into the program's share of out. L2: the loads come after the wait, and before it each lane asks L2 for
    its 16 * PER bytes of the program's (one bulk prefetch, sm_90; no registers held across the wait)."""
    lanes: tl.constexpr = 32 * NW
    pid = tl.program_id(0)
    offs = (tl.arange(0, PER)[None, :, None] * lanes + tl.arange(0, lanes)[:, None, None]) * 4 + \
        tl.arange(0, 4)[None, None, :]
    if pid < programs_words:
        src, n_src, base = words_ptr, n_words, pid.to(tl.int64) * (lanes * (PER + POST) * 4)
    else:
        src, n_src, base = scales_ptr, n_scales, (pid - programs_words).to(tl.int64) * (lanes * (PER + POST) * 4)
    if L2:
        _ask_l2(src, base, n_src, PER, NW)
    else:
        words = tl.load(src + base + offs, mask=base + offs < n_src, other=0)
    if ARITH >= DP4A_ROWS and ARITH <= DP4A_RUNS_Q8:  # a group scale for each row of a lane's chunk, early
        si = (tl.arange(0, lanes)[:, None] * PER + tl.arange(0, PER)[None, :]) % n_scales
        wscale = (tl.load(scales_ptr + si) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if L2:
        words = tl.load(src + base + offs, mask=base + offs < n_src, other=0)
    if POST:  # the rest of the program's share, loaded after the wait and before any work
        offs_post = (tl.arange(0, POST)[None, :, None] * lanes + tl.arange(0, lanes)[:, None, None]) * 4 + \
            tl.arange(0, 4)[None, None, :]
        base_post = base + lanes * PER * 4
        later = tl.load(src + base_post + offs_post, mask=base_post + offs_post < n_src, other=0)
    if ARITH == DP4A_RUNS_Q8:
        seen = _dp4a_runs(words, wscale, x_ptr, k)
    elif ARITH >= DP4A_ROWS and ARITH <= DP4A_ROWS_Q8:  # the two dp4a-rows models
        seen = _dp4a_rows(words, wscale, x_ptr, k, ARITH == DP4A_ROWS)
    else:
        seen = _xor_all(_arith(_work(words, WORK), ARITH))
    if POST:
        seen ^= _xor_all(_arith(_work(later, WORK), ARITH))
    if XPER:  # the activations after the wait, as a matvec's program loads them (all K of them)
        xi = tl.arange(0, lanes)[:, None] + lanes * tl.arange(0, XPER)[None, :]
        seen ^= (tl.sum(tl.load(x_ptr + xi, mask=xi < k, other=0.0).to(tl.float32)) > 1e30).to(tl.int32)
    if CHAIN:  # each waits for the one before: about 4 cycles each
        v = (seen & 1).to(tl.float32) + tl.arange(0, lanes).to(tl.float32)
        for _ in range(CHAIN):
            v = v * 0.999 + 0.5
        seen ^= (tl.max(v, axis=0) < -1.0).to(tl.int32)
    i = pid * per_program + tl.arange(0, 1024)
    zero = tl.where(seen == 0x2545F491, 1.0, 0.0)  # zeros that depend on the loads: they cannot be left out
    for start in range(0, per_program, 1024):
        j = i + start
        tl.store(out_ptr + j, zero.to(out_ptr.dtype.element_ty), mask=(j < n_out) & (j < (pid + 1) * per_program))


@triton.jit
def _work(words, WORK: tl.constexpr):
    """WORK multiply-adds on each word, independent across the words (bound by issue, as a matvec's arithmetic on
    what it loaded); the words back, changed only where a sum went below -1 (never)."""
    if WORK:
        w = words.to(tl.float32)
        for _ in range(WORK):
            w = w * 0.999 + 0.5
        words ^= (w < -1.0).to(tl.int32)
    return words


@triton.jit
def _arith(words, ARITH: tl.constexpr):
    """The words [lanes, loads, 4] (a load's 4 words: one 32-column chunk of a row) through an int4 matvec's
    arithmetic against constant activations, sums chained over a load's 4 words and independent across loads, so
    the step pays that arithmetic's issue after the wait (sm_90 inline assembly; 0: none). 1 pairs: the shipped
    bf16 pairs (pairs.word_dot: one shift, four logic ops, eight pair FMAs a word); 2 dp4a: x as int8, the word's
    even and odd nibbles masked to bytes (one shift, two logic ops) into two dp4a; 3 imma: x as int8, a chunk's
    even nibbles as bytes and its odd nibbles as 16 times bytes (one logic op a word each) into two
    mma.sync.m16n8k32 (u8 x s8) a chunk."""
    if ARITH == PAIRS:
        w0, w1, w2, w3 = split4(words)
        acc = tl.zeros(w0.shape, dtype=tl.int32)
        xp = (w0 * 0 + 0x3F803F80, w0 * 0 + 0x3E003E00, w0 * 0 + 0x3F003F00, w0 * 0 + 0x3E803E80)
        acc = _pairs_word(_pairs_word(_pairs_word(_pairs_word(acc, w0, xp), w1, xp), w2, xp), w3, xp)
        words = tl.join(tl.join(acc, w1), tl.join(w2, w3)).reshape(words.shape)  # the xor keeps acc
    elif ARITH == DP4A:
        w0, w1, w2, w3 = split4(words)
        acc = tl.zeros(w0.shape, dtype=tl.int32)
        lo, hi = acc + 0x05FD0307, acc + 0x7F81FE02  # constant int8 activations
        acc = _dp4a_pair(_dp4a_pair(_dp4a_pair(_dp4a_pair(acc, w0, lo, hi), w1, lo, hi), w2, lo, hi), w3, lo, hi)
        words = tl.join(tl.join(acc, w1), tl.join(w2, w3)).reshape(words.shape)  # the xor keeps acc
    elif ARITH == HMMA:
        w0, w1, w2, w3 = split4(words)
        z = tl.zeros(w0.shape, dtype=tl.float32)
        d = (z, z, z, z)
        d = _hmma_word(_hmma_word(_hmma_word(_hmma_word(d, w0), w1), w2), w3)
        c0, c1, c2, c3 = d
        words = tl.join(tl.join(c0.to(tl.int32, bitcast=True), c1.to(tl.int32, bitcast=True)),
                        tl.join(c2.to(tl.int32, bitcast=True), c3.to(tl.int32, bitcast=True))).reshape(words.shape)
    elif ARITH == FP8MMA:
        w0, w1, w2, w3 = split4(words)
        z = tl.zeros(w0.shape, dtype=tl.float32)
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            "{ .reg .b32 a<4>, b<4>; and.b32 a0, $4, 0x0F0F0F0F; and.b32 a1, $5, 0x0F0F0F0F; "
            "and.b32 a2, $6, 0x0F0F0F0F; and.b32 a3, $7, 0x0F0F0F0F; shr.u32 b0, $4, 4; shr.u32 b1, $5, 4; "
            "shr.u32 b2, $6, 4; shr.u32 b3, $7, 4; and.b32 b0, b0, 0x0F0F0F0F; and.b32 b1, b1, 0x0F0F0F0F; "
            "and.b32 b2, b2, 0x0F0F0F0F; and.b32 b3, b3, 0x0F0F0F0F; "
            "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {$0,$1,$2,$3}, {a0,a1,a2,a3}, {$8,$8}, {$0,$1,$2,$3}; "
            "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {$0,$1,$2,$3}, {b0,b1,b2,b3}, {$8,$8}, "
            "{$0,$1,$2,$3}; }",
            "=f,=f,=f,=f,r,r,r,r,r,0,1,2,3", [w0, w1, w2, w3, w0 * 0 + 0x38403C44, z, z, z, z],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        words = tl.join(tl.join(c0.to(tl.int32, bitcast=True), c1.to(tl.int32, bitcast=True)),
                        tl.join(c2.to(tl.int32, bitcast=True), c3.to(tl.int32, bitcast=True))).reshape(words.shape)
    elif ARITH == IMMA:
        w0, w1, w2, w3 = split4(words)
        z = tl.zeros(w0.shape, dtype=tl.int32)
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            "{ .reg .b32 a<4>, b<4>; and.b32 a0, $4, 0x0F0F0F0F; and.b32 a1, $5, 0x0F0F0F0F; "
            "and.b32 a2, $6, 0x0F0F0F0F; and.b32 a3, $7, 0x0F0F0F0F; and.b32 b0, $4, 0xF0F0F0F0; "
            "and.b32 b1, $5, 0xF0F0F0F0; and.b32 b2, $6, 0xF0F0F0F0; and.b32 b3, $7, 0xF0F0F0F0; "
            "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {$0,$1,$2,$3}, {a0,a1,a2,a3}, {$8,$8}, {$0,$1,$2,$3}; "
            "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {$0,$1,$2,$3}, {b0,b1,b2,b3}, {$8,$8}, {$0,$1,$2,$3}; }",
            "=r,=r,=r,=r,r,r,r,r,r,0,1,2,3", [w0, w1, w2, w3, z + 0x05FD0307, z, z, z, z],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        words = tl.join(tl.join(c0, c1), tl.join(c2, c3)).reshape(words.shape)
    return words


@triton.jit
def _dp4a_rows(words, wscale, x_ptr, k, QUANT: tl.constexpr):
    """A model of a whole dp4a matvec's work after its wait (sm_90): lane l holds one 32-column chunk (l % 128) of
    PER rows (words [lanes, PER, 4], a load a row) and their group scales (wscale [lanes, PER]); 128 lanes make a
    row. QUANT: the lane loads its chunk of x (bf16) and quantizes it to int8 itself (absmax, scale, round, pack);
    else x is int8 already (the kernel before wrote it so: 32 bytes and a scale a chunk). Then per row: two dp4a
    a word, the zero point, int to float times both scales, and the rows' sums over their 128 lanes. The xor of
    the sums' bits."""
    L: tl.constexpr = words.shape[0]
    P: tl.constexpr = words.shape[1]
    chunk = tl.arange(0, L) % 128
    if QUANT:
        xv = tl.load(x_ptr + (chunk[:, None] * 32 + tl.arange(0, 32)[None, :]) % k).to(tl.float32)  # [L, 32]
        xs = tl.maximum(tl.max(tl.abs(xv), axis=1), 1e-30) / 127.0
        q = (xv * (1.0 / xs)[:, None] + 12582912.0).to(tl.int32, bitcast=True) & 0xFF  # int8 bits
        even, odd = tl.split(tl.reshape(q, [L, 4, 4, 2]))  # [L, octet, j]: columns 8o + 2j, 8o + 2j + 1
        shifts = (8 * tl.arange(0, 4))[None, None, :]
        x_lo = tl.sum(even << shifts, axis=2)  # [L, 4]: an octet's even columns' bytes
        x_hi = tl.sum(odd << shifts, axis=2)
        zsum = tl.sum(((q + 128) & 0xFF) - 128, axis=1)
    else:
        x32 = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        xw = tl.load(x32 + (chunk[:, None] * 8 + tl.arange(0, 8)[None, :]) % (k // 2))  # [L, 8]: a chunk's int8
        x_lo, x_hi = tl.split(tl.reshape(xw, [L, 4, 2]))
        xs = tl.load(x_ptr + (chunk * 7 + 1) % k).to(tl.float32)  # the chunk's scale and sum (stand-ins, in x)
        zsum = tl.load(x32 + (chunk * 3 + 5) % (k // 2)) & 0xFFFF
    w0, w1, w2, w3 = split4(words)
    l0, l1, l2, l3 = split4(tl.broadcast_to(x_lo[:, None, :], [L, P, 4]))  # the lane's x, for each of its rows
    h0, h1, h2, h3 = split4(tl.broadcast_to(x_hi[:, None, :], [L, P, 4]))
    acc = tl.broadcast_to((-8 * zsum)[:, None], [L, P])
    acc = _dp4a_pair(_dp4a_pair(_dp4a_pair(_dp4a_pair(acc, w0, l0, h0), w1, l1, h1), w2, l2, h2), w3, l3, h3)
    f = acc.to(tl.float32) * wscale * xs[:, None]
    rows = tl.sum(tl.reshape(f, [L // 128, 128, P]), axis=1)
    return tl.xor_sum(tl.xor_sum(rows.to(tl.int32, bitcast=True), axis=1), axis=0)


@triton.jit
def _dp4a_runs(words, wscale, x_ptr, k):
    """_dp4a_rows' work with x int8 already, and a lane holding a run of PER chunks of one row (words [lanes, PER,
    4]; 8 lanes a row): its x is PER chunks of int8 (two 16-byte loads a chunk), its sums go group by group (4
    chunks, one x scale) into float, and a row's sum is over 8 lanes only."""
    L: tl.constexpr = words.shape[0]
    P: tl.constexpr = words.shape[1]
    chunk = ((tl.arange(0, L) % 8)[:, None] * P + tl.arange(0, P)[None, :]) % (k // 32)  # [L, P]
    x32 = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    xw = tl.load(x32 + chunk[:, :, None] * 8 + tl.arange(0, 8)[None, None, :])  # [L, P, 8] (chunk < K / 32)
    x_lo, x_hi = tl.split(tl.reshape(xw, [L, P, 4, 2]))
    w0, w1, w2, w3 = split4(words)
    l0, l1, l2, l3 = split4(x_lo)
    h0, h1, h2, h3 = split4(x_hi)
    acc = -8 * (tl.load(x32 + chunk) & 0xFFFF)  # the zero point (a stand-in sum)
    acc = _dp4a_pair(_dp4a_pair(_dp4a_pair(_dp4a_pair(acc, w0, l0, h0), w1, l1, h1), w2, l2, h2), w3, l3, h3)
    groups = tl.sum(tl.reshape(acc, [L, P // 4, 4]), axis=2)  # [L, P / 4]: one x scale and one w scale each
    xs = tl.load(x_ptr + tl.reshape(chunk, [L, P // 4, 4]).max(axis=2) * 4 + 1).to(tl.float32)
    ws = tl.sum(tl.reshape(wscale, [L, P // 4, 4]), axis=2)
    rows = tl.sum(tl.reshape(tl.sum(groups.to(tl.float32) * ws * xs, axis=1), [L // 8, 8]), axis=1)
    return tl.xor_sum(rows.to(tl.int32, bitcast=True), axis=0)


@triton.jit
def _dp4a_pair(acc, w, x_lo, x_hi):
    """acc + a word's even nibbles (bytes) . x_lo + its odd nibbles . x_hi, all one shape: two dp4a."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 l, h; and.b32 l, $1, 0x0F0F0F0F; shr.u32 h, $1, 4; and.b32 h, h, 0x0F0F0F0F; "
        "dp4a.u32.s32 $0, l, $2, $4; dp4a.u32.s32 $0, h, $3, $0; }", "=r,r,r,r,r", [w, x_lo, x_hi, acc],
        dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _hmma_word(d, w):
    """d + one mma.sync.m16n8k16 (bf16, float32 sums) of a word as the mma-fragment layout's A (one shift, four
    masks: exp_int4_fragments.py's arithmetic) against constant x pairs."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 s, a<4>; shr.u32 s, $4, 8; and.b32 a0, $4, 0x000F000F; and.b32 a1, $4, 0x00F000F0; "
        "and.b32 a2, s, 0x000F000F; and.b32 a3, s, 0x00F000F0; "
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {a0,a1,a2,a3}, {$5,$5}, {$0,$1,$2,$3}; }",
        "=f,=f,=f,=f,r,r,0,1,2,3", [w, w * 0 + 0x71807180, d[0], d[1], d[2], d[3]],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _pairs_word(acc, w, xp):
    """pairs.word_dot's arithmetic (symmetric int4, zero point 8) on the GPU, x pairs as w's shape."""
    second = w >> 8
    acc = pair_fma(_codes(w & LOW_NIBBLES, UP_FIRST, ZERO_8, True), xp[0], acc, True)
    acc = pair_fma(_codes(w & HIGH_NIBBLES, UP_SECOND, ZERO_8, True), xp[1], acc, True)
    acc = pair_fma(_codes(second & LOW_NIBBLES, UP_FIRST, ZERO_8, True), xp[2], acc, True)
    return pair_fma(_codes(second & HIGH_NIBBLES, UP_SECOND, ZERO_8, True), xp[3], acc, True)


@triton.jit
def _xor_all(words):
    return tl.xor_sum(tl.xor_sum(tl.xor_sum(words, axis=2), axis=1), axis=0)


@triton.jit
def _ask_l2(src, base, n_src, PER: tl.constexpr, NW: tl.constexpr):
    """Each lane asks L2 for 16 * PER contiguous bytes of the program's share (a lane whose bytes run past n_src
    words asks for none: a bulk prefetch is whole, and the end of the buffer is a few bytes of the whole)."""
    lane = tl.arange(0, 32 * NW).to(tl.int64)
    start = base + lane * (PER * 4)
    ok = start + PER * 4 <= n_src
    size = tl.where(ok, 16 * PER, 0)
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
                              "mov.u32 $0, 0; }", "=r,l,r", [src + start, size], dtype=tl.int32, is_pure=False, pack=1)


def _read_matvec(self, x, out, config, act, partial, rows=None, cols=None, scale=None, finish=None, defer=None,
                 rstd=None):
    """GroupedIntLinear._matvec's signature: read the weight, write zeros."""
    words = self.low32.reshape(-1)
    scales = self.scales.reshape(-1).view(torch.int32) if self.scales.numel() % 2 == 0 else words[:0]
    programs_words = -(-words.numel() // CHUNK)
    programs = programs_words + -(-scales.numel() // CHUNK)
    flat = out.reshape(-1)
    _read_zero[(programs,)](words, words.numel(), scales, scales.numel(), flat, flat.numel(),
                            -(-flat.numel() // programs), programs_words, x, x.numel(), PER, NW,
                            triton.next_power_of_2(-(-x.numel() // (32 * NW))) if WITH_X else 0, not PLAIN, CHAIN, WORK,
                            L2, POST, ARITH,
                            num_warps=NW, **({} if PLAIN else {"launch_pdl": True}))
    return config.split


_IMMA_STATE: dict[int, Callable] = {}
_SHIPPED_MATVEC = None  # GroupedIntLinear._matvec as shipped (main() sets it before patching)
# --imma's tiling a weight shape, "N:K:WARPS:TILES,..." in IMMA_TILES (warps and 16-row tiles a program); else 4
# warps and one tile at K <= 4096, 8 warps beyond (exp_int4_imma.py bench's best alone at llama-8b's shapes)
# IMMA_CHUNKS=1: --imma with x's scales a chunk of 32 (exp_int4_imma.py CHUNKS, the plane re-laid chunk-major)
IMMA_CHUNKS = os.environ.get("IMMA_CHUNKS") == "1"
# IMMA_MAX=1: --imma with x as bfloat16 and its groups' max, rounded in the kernel (exp_int4_imma_max.py)
IMMA_MAX = os.environ.get("IMMA_MAX") == "1"
# IMMA_COLS=1: --imma with x's scales a chunk of 16, each chunk in its own column of B (exp_int4_imma_cols.py)
IMMA_COLS = os.environ.get("IMMA_COLS") == "1"
# IMMA_EMIT=1 (with IMMA_COLS): each matvec also writes its rows as int8 codes and chunk scales (a producer's work)
IMMA_EMIT = os.environ.get("IMMA_EMIT") == "1"
# IMMA_ONLY="NxK,...": --imma replaces only the matvecs of these weight shapes (out x in features); the others run
# as shipped. Without it every int4 matvec is replaced.
IMMA_ONLY = {tuple(int(v) for v in item.split("x")) for item in os.environ.get("IMMA_ONLY", "").split(",") if item}
IMMA_TILES = {(int(n), int(k)): (int(w), int(t)) for n, k, w, t in
              (item.split(":") for item in os.environ.get("IMMA_TILES", "").split(",") if item)}


def _imma_step_matvec(self, x, out, config, act, partial, rows=None, cols=None, scale=None, finish=None, defer=None,
                      rstd=None):
    """GroupedIntLinear._matvec's signature: exp_int4_imma.py's int8 mma matvec over the whole weight, against a
    constant int8 x (random, quantized once an op) loaded after its wait, into a float32 scratch of the op's rows;
    `out` is left as it was (zeros: the engine's buffers start so), so the tokens are meaningless."""
    from exp_int4_imma import chunk_major, matvec, padded_chunks, quantize_x, quantize_x_chunks
    from exp_int4_imma_cols import matvec as cols_matvec
    from exp_int4_imma_cols import quantize_x_cols
    from exp_int4_imma_max import group_max
    from exp_int4_imma_max import matvec as max_matvec

    n, k = self.out_features, self.in_features
    if IMMA_ONLY and (n, k) not in IMMA_ONLY:
        return _SHIPPED_MATVEC(self, x, out, config, act, partial, rows, cols, scale, finish, defer, rstd)
    if id(self) not in _IMMA_STATE:  # the op's launch, all but its launch mode bound once
        gen = torch.Generator(device=x.device).manual_seed(n + k)
        x = torch.randn(k, generator=gen, device=x.device)
        nw, t = IMMA_TILES.get((n, k), (4, 1) if k <= 4096 else (8, 1))
        words, scales = self.low32.reshape(n, k // 8), self.scales.reshape(n, k // 128)
        tiling = (n, k, nw, t, True)
        scratch = torch.empty(n, dtype=torch.float32, device=x.device)
        if IMMA_COLS:  # int8 codes and a scale a chunk of 16 (exp_int4_imma_cols.py)
            emit = (torch.empty(n // 4, dtype=torch.int32, device=x.device), torch.empty(n // 16, device=x.device))
            run = functools.partial(cols_matvec, words, scales, *quantize_x_cols(x), *tiling, out=scratch,
                                    emit=emit if IMMA_EMIT else None)
        elif IMMA_MAX:  # bfloat16 x and its groups' max (exp_int4_imma_max.py)
            run = functools.partial(max_matvec, words, scales, x.bfloat16(), group_max(x), *tiling, out=scratch)
        elif IMMA_CHUNKS:
            xq = padded_chunks(quantize_x_chunks(x), k, nw)
            run = functools.partial(matvec, chunk_major(words), scales, *xq, *tiling, out=scratch, chunks=True)
        else:
            run = functools.partial(matvec, words, scales, *quantize_x(x), *tiling, out=scratch)
        _IMMA_STATE[id(self)] = run
    _IMMA_STATE[id(self)](pdl=0 if PLAIN else 1)
    return config.split


def sass_counts() -> None:
    """Compile the read kernel for sm_90 once with each --arith (sass_budget.py's stand-in driver, no GPU) and print
    its SASS instructions, and those added to the kernel without arithmetic per weight a lane (16 loads of 8 int4
    weights a word, 4 words each)."""
    from sass_budget import ADDRESS, _Sm90, disassemble
    from triton.runtime import driver

    driver.set_active(_Sm90())
    words, scales = torch.empty(1 << 20, dtype=torch.int32), torch.empty(1 << 14, dtype=torch.int32)
    out, x = torch.empty(4096, dtype=torch.bfloat16), torch.empty(8192, dtype=torch.bfloat16)
    counts = []
    for arith in range(len(ARITHMETIC)):
        kernel = _read_zero.warmup(words, words.numel(), scales, scales.numel(), out, out.numel(), 16, 10, x, 4096,
                                   16, NW, 16, True, 0, 0, False, 0, arith, num_warps=NW, grid=(11,))
        counts.append(sum(1 for line in disassemble(kernel).splitlines() if ADDRESS.match(line)))
    print("| --arith | sm_90 instructions | added a weight |\n| --- | ---: | ---: |")
    for name, count in zip(ARITHMETIC, counts, strict=True):
        print(f"| {name} | {count} | {(count - counts[0]) / (16 * 4 * 8):.2f} |")


def main() -> None:
    if "--sass" in sys.argv:
        return sass_counts()
    args = [a for a in sys.argv[1:] if a not in ("--with-x", "--plain", "--l2", "--imma")]
    if not args:
        raise SystemExit(__doc__)
    if IMMA_CHUNKS + IMMA_MAX + IMMA_COLS > 1 or (IMMA_EMIT and not IMMA_COLS) or (
            (IMMA_CHUNKS or IMMA_MAX or IMMA_COLS or IMMA_TILES or IMMA_ONLY) and not IMMA_STEP):
        raise SystemExit("bench_step_floor.py: IMMA_CHUNKS, IMMA_MAX and IMMA_COLS are ways of --imma, one at a time; "
                         "IMMA_EMIT goes with IMMA_COLS; IMMA_TILES and IMMA_ONLY go with --imma")
    import thin.runtime.kernels.grouped_int as grouped_int
    from thin.runtime.cli import main as thin_exec

    global _SHIPPED_MATVEC
    _SHIPPED_MATVEC = grouped_int.GroupedIntLinear._matvec
    grouped_int.GroupedIntLinear._matvec = _imma_step_matvec if IMMA_STEP else _read_matvec
    sys.argv = ["thin-exec", "bench", *args, "--json"]
    thin_exec()


if __name__ == "__main__":
    main()
