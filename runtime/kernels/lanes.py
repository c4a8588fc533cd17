"""Lane-level pieces of the kernels that run mma.sync by inline assembly (int8_heads.py): the thread that holds
each element, a lane's whole run of loads held as one register tensor (`load_run`, `pick`), a lane's 4 words apart
(`split4`), and one int8 mma.sync.m16n8k32 (`imma`) with its interpreter twin, so the CPU tests run the same
fragment arithmetic the GPU does.

An mma reads its operands from registers by lane, so a kernel that calls it lays its tensors as [32 * warps]
(an element a thread) and takes the lane from %tid.x (`threads`); under the interpreter the element's index
stands for the thread.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def threads(NW: tl.constexpr, ASM: tl.constexpr):
    """[32 * NW]: the thread that holds each element. ASM: read from %tid.x (the mma reads registers by lane, so
    the lane must be the thread's own); in the interpreter's twin, the element's index."""
    e = tl.arange(0, 32 * NW)
    if ASM:
        e = tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [e], dtype=tl.int32, is_pure=True, pack=1)
    return e


@triton.jit
def split4(t):
    """[..., 4] (4 words a lane holds in its registers, the last axis) -> the 4 words, each [...], in order."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _step(ptrs, first, s: tl.constexpr, RUN: tl.constexpr, STEPS: tl.constexpr, STRIDE: tl.constexpr):
    """A lane's words (or scales) of step (group) s of its run, masked past the run and the row."""
    ok = (first + s < STEPS) & (s < RUN)
    if len(ptrs.shape) == 2:
        out = tl.load(ptrs + s * STRIDE, mask=ok[:, None], other=0)
    else:
        out = tl.load(ptrs + s * STRIDE, mask=ok, other=0)
    return out


# _run2 .. _run16: one rung a power of two, each joining two of the rung below. Triton's JIT has no recursion, and a
# loop cannot grow a tensor's shape, so the ladder is written out.
@triton.jit
def _run2(ptrs, first, s: tl.constexpr, RUN: tl.constexpr, STEPS: tl.constexpr, STRIDE: tl.constexpr):
    return tl.join(_step(ptrs, first, s, RUN, STEPS, STRIDE), _step(ptrs, first, s + 1, RUN, STEPS, STRIDE))


@triton.jit
def _run4(ptrs, first, s: tl.constexpr, RUN: tl.constexpr, STEPS: tl.constexpr, STRIDE: tl.constexpr):
    return tl.join(_run2(ptrs, first, s, RUN, STEPS, STRIDE), _run2(ptrs, first, s + 2, RUN, STEPS, STRIDE))


@triton.jit
def _run8(ptrs, first, s: tl.constexpr, RUN: tl.constexpr, STEPS: tl.constexpr, STRIDE: tl.constexpr):
    return tl.join(_run4(ptrs, first, s, RUN, STEPS, STRIDE), _run4(ptrs, first, s + 4, RUN, STEPS, STRIDE))


@triton.jit
def _run16(ptrs, first, s: tl.constexpr, RUN: tl.constexpr, STEPS: tl.constexpr, STRIDE: tl.constexpr):
    return tl.join(_run8(ptrs, first, s, RUN, STEPS, STRIDE), _run8(ptrs, first, s + 8, RUN, STEPS, STRIDE))


@triton.jit
def load_run(ptrs, first, S: tl.constexpr, RUN: tl.constexpr, STEPS: tl.constexpr, STRIDE: tl.constexpr):
    """Every step s < S of a lane's run loaded at once (`_step`), each a load of its own, held in registers as one
    tensor [*ptrs.shape, 2, ..., 2] whose last axis is the step's highest bit (tl.join: nothing moves)."""
    if S == 1:
        out = _step(ptrs, first, 0, RUN, STEPS, STRIDE)
    elif S == 2:
        out = _run2(ptrs, first, 0, RUN, STEPS, STRIDE)
    elif S == 4:
        out = _run4(ptrs, first, 0, RUN, STEPS, STRIDE)
    elif S == 8:
        out = _run8(ptrs, first, 0, RUN, STEPS, STRIDE)
    else:
        out = _run16(ptrs, first, 0, RUN, STEPS, STRIDE)
    return out


@triton.jit
def pick(t, s: tl.constexpr, S: tl.constexpr):
    """Step s of a `load_run` tensor of S steps: its last axes split from the highest bit down."""
    if S >= 16:
        t = tl.split(t)[(s >> 3) & 1]
    if S >= 8:
        t = tl.split(t)[(s >> 2) & 1]
    if S >= 4:
        t = tl.split(t)[(s >> 1) & 1]
    if S >= 2:
        t = tl.split(t)[s & 1]
    return t


@triton.jit
def _byte(a, m: tl.constexpr, SIGNED: tl.constexpr):
    """Byte m of each word of a, signed (SIGNED) or not."""
    return (a << (24 - 8 * m)) >> 24 if SIGNED else (a >> (8 * m)) & 0xFF


@triton.jit
def dot4(a, b, SIGNED_A: tl.constexpr = False):
    """sum over the 4 bytes of a (unsigned, or signed where SIGNED_A) times those of b (signed)."""
    s = _byte(a, 0, SIGNED_A) * ((b << 24) >> 24)
    for m in tl.static_range(1, 4):
        s += _byte(a, m, SIGNED_A) * ((b << (24 - 8 * m)) >> 24)
    return s


@triton.jit
def mma_asm(a0, a1, a2, a3, b0, b1, c, SIGNED_A: tl.constexpr):
    """c + this lane's D fragment of one mma.sync.m16n8k32 with int32 sums (A u8, or s8 where SIGNED_A; B s8), its
    accumulators in place: sm_80 and later."""
    cg, cg2, ch, ch2 = c
    if SIGNED_A:
        out = tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
            "{$10,$11,$12,$13};", "=r,=r,=r,=r,r,r,r,r,r,r,0,1,2,3", [a0, a1, a2, a3, b0, b1, cg, cg2, ch, ch2],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        out = tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
            "{$10,$11,$12,$13};", "=r,=r,=r,=r,r,r,r,r,r,r,0,1,2,3", [a0, a1, a2, a3, b0, b1, cg, cg2, ch, ch2],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    return out


@triton.jit
def imma(a0, a1, a2, a3, b0, b1, c, ASM: tl.constexpr, SIGNED_A: tl.constexpr = False):
    """c + this lane's D fragment (D[g][2t], D[g][2t + 1], D[g + 8][2t], D[g + 8][2t + 1]) of one
    mma.sync.m16n8k32, int32 [L] each (L a multiple of 32, the lanes): A u8, or s8 where SIGNED_A (a0, a2 row g's
    k = 4t.., 16 + 4t.., a1, a3 row g + 8's), B s8 (b0: B[4t ..][g], b1: B[16 + 4t ..][g]; with every column of B
    the same vector, each lane's rows g and g + 8 in all four). ASM: the mma, its accumulators in place; otherwise
    its interpreter twin, every column's products from the quad's A and B registers."""
    b0 = tl.broadcast_to(b0, a0.shape)
    b1 = tl.broadcast_to(b1, a0.shape)
    cg, cg2, ch, ch2 = c
    if ASM:
        out = mma_asm(a0, a1, a2, a3, b0, b1, c, SIGNED_A)
    else:
        NW: tl.constexpr = a0.shape[0] // 32
        bb0 = tl.reshape(b0, [NW, 1, 8, 4])  # [warp, ., column n = the lane's g, k block = the lane's t]
        bb1 = tl.reshape(b1, [NW, 1, 8, 4])
        dg = tl.sum(dot4(tl.reshape(a0, [NW, 8, 1, 4]), bb0, SIGNED_A)
                    + dot4(tl.reshape(a2, [NW, 8, 1, 4]), bb1, SIGNED_A), axis=3)
        dh = tl.sum(dot4(tl.reshape(a1, [NW, 8, 1, 4]), bb0, SIGNED_A)
                    + dot4(tl.reshape(a3, [NW, 8, 1, 4]), bb1, SIGNED_A), axis=3)
        g0, g1 = tl.split(tl.reshape(dg, [NW, 8, 4, 2]))  # [warp, row g, t, column parity]: columns 2t, 2t + 1
        h0, h1 = tl.split(tl.reshape(dh, [NW, 8, 4, 2]))
        out = (cg + tl.reshape(g0, [32 * NW]), cg2 + tl.reshape(g1, [32 * NW]), ch + tl.reshape(h0, [32 * NW]),
               ch2 + tl.reshape(h1, [32 * NW]))
    return out


@triton.jit
def warps_sum(acc, NW: tl.constexpr):
    """[32 * NW] lane values -> [32]: the sum over the warps, lane by lane."""
    return tl.sum(tl.reshape(acc, [NW, 32]), axis=0)


__all__ = ["dot4", "imma", "load_run", "mma_asm", "pick", "split4", "threads", "triton", "warps_sum"]
