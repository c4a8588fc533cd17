"""int8 and fp8_e4m3 (ir/formats/int8.py, fp8.py): one byte a weight, one float32 scale a row.

fp8: each lane of a [BN, BK] tile holds 8 consecutive bytes of every row (BK = 256 per warp),
the same 8 columns as its 16-byte load of the activations, so nothing moves between lanes; the
hardware converts e4m3 pairs to half pairs, then to float32, and a float32 tile accumulates the
products. Launch candidates (picked by the tuner, never the default) load each step's bytes and
activations two steps before it, so their memory latency overlaps a step's math: into registers
(MatvecConfig.ahead), or through shared memory by Triton's pipeliner (MatvecConfig.stages). int8
goes through the bit-plane chunk scheme (tiles.py: 16-column chunks, four words a lane, codes read
as u = v + 128 with the 128 folded into the add). Both apply the row's scale once, after the dot
product. Prefill dequantizes [BN, BK] tiles to the compute dtype and multiplies with tl.dot.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from . import common, dependent, interpreting
from .chunks import chunk_candidates, chunk_prefix
from .common import (
    MAGIC_BITS,
    KernelLinear,
    MatvecConfig,
    interpreter_block,
    next_power_of_2,
    prefix_rows,
    prefix_split,
)
from .deferred_norm import deferred_args, deferred_epilogue, deferred_reads
from .dependent import release_next, wait_previous
from .norm import finish_partials, holds_row, prefetch_norms
from .prefill import matmul_blocks, matmul_prefix, plain_tile, store_plain
from .tiles import (
    dot_tile,
    masked_load,
    octet_dot,
    octet_split,
    plane_load,
    plane_words,
    split_candidates,
    split_words,
    store_tile,
    tile_rows,
    tile_starts,
    upper_halves,
    x_octet,
)


@triton.jit
def _fp8_dot(v_ptr, x_ptr, rows, row_mask, K, split_cols, BK: tl.constexpr, EVEN_N: tl.constexpr,
             EVEN_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """sum_k W[rows, k] x[k] over this program's columns (split `program_id(1)`), float32 [rows].
    STAGES > 1: the loop software-pipelined by Triton over STAGES buffers in shared memory, each
    step's loads issued STAGES - 1 steps ahead as asynchronous copies (cp.async). PDL 1 or 2 (a
    programmatic dependent's code, dependent.py): the first step's weights are loaded before the wait
    for the kernel before, each later step's one step ahead (unstaged; staged: the wait comes first)."""
    begin = tl.program_id(1) * split_cols
    end = tl.minimum(begin + split_cols, K)
    # 8 contiguous columns a lane (not 16): the activations' 16-byte loads are 8 columns a lane.
    ks = tl.max_contiguous(tl.arange(0, BK), 8)
    row_off = rows.to(tl.int64) * K
    acc = tl.zeros([rows.shape[0], BK], dtype=tl.float32)
    if (PDL == 1 or PDL == 2) and STAGES <= 1:
        w_next = _fp8_weights(v_ptr, row_off, row_mask, begin, end, ks, EVEN_N, False)
        wait_previous(PDL)
        release_next(PDL)
        for k0 in range(begin, end, BK):
            w = w_next
            w_next = _fp8_weights(v_ptr, row_off, row_mask, k0 + BK, end, ks, EVEN_N, False)
            acc = _fp8_step(acc, w, x_ptr, k0, end, ks, EVEN_K)
    else:
        wait_previous(PDL)
        release_next(PDL)
        if STAGES > 1:
            for k0 in tl.range(begin, end, BK, num_stages=STAGES):
                w = _fp8_weights(v_ptr, row_off, row_mask, k0, end, ks, EVEN_N, EVEN_K)
                acc = _fp8_step(acc, w, x_ptr, k0, end, ks, EVEN_K)
        else:
            for k0 in range(begin, end, BK):
                w = _fp8_weights(v_ptr, row_off, row_mask, k0, end, ks, EVEN_N, EVEN_K)
                acc = _fp8_step(acc, w, x_ptr, k0, end, ks, EVEN_K)
    return tl.sum(acc, axis=1)


@triton.jit
def _fp8_weights(v_ptr, row_off, row_mask, k0, end, ks, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """The weight bytes of the step at column k0 (EVEN_K False: the step may lie past `end`, masked off)."""
    cols = k0 + ks
    return masked_load(v_ptr, row_off[:, None] + cols[None, :], row_mask[:, None], (cols < end)[None, :], EVEN_N,
                       EVEN_K)


@triton.jit
def _fp8_step(acc, w, x_ptr, k0, end, ks, EVEN_K: tl.constexpr):
    """acc + the products of the step at column k0 (its weight bytes w, `_fp8_weights`)."""
    cols = k0 + ks
    if EVEN_K:  # noqa: SIM108  (constexpr branches: only one is compiled)
        x = tl.load(x_ptr + cols)
    else:
        x = tl.load(x_ptr + cols, mask=cols < end, other=0.0)
    return acc + w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _fp8_ahead_dot(w_ptr, x_ptr, starts, row_mask, K, split_chunks, C: tl.constexpr, EVEN_N: tl.constexpr,
                   EVEN_K: tl.constexpr, ASM: tl.constexpr, AHEAD: tl.constexpr, PDL: tl.constexpr):
    """_fp8_dot with each step's weights and activations loaded AHEAD (1 or 2) steps before it, so
    their memory latency overlaps the math of the steps between instead of following it.

    The same lane layout (a lane's 8 bytes of each row and the 16-byte load of their activations),
    but as chunks of 8 columns (tiles.py's scheme; `starts`: row_starts in chunks) whose bytes are
    two int32 words: the bytes are carried from step to step as they were loaded, two registers a
    row (a byte tensor carried through the loop is held a byte a register and repacked every step).
    The first steps' weights are loaded before the wait for the kernel before (PDL, dependent.py), their
    activations after it."""
    total = K // 8
    begin = tl.program_id(1) * split_chunks
    end = tl.minimum(begin + split_chunks, total)
    acc = tl.zeros([starts.shape[0], C], dtype=tl.float32)
    w_1 = plane_load(w_ptr, starts, row_mask, begin, end, C, 2, EVEN_N, EVEN_K, ASM, True)
    if AHEAD >= 2:
        w_2 = plane_load(w_ptr, starts, row_mask, begin + C, end, C, 2, EVEN_N, EVEN_K, ASM, True)
    wait_previous(PDL)
    release_next(PDL)
    x_1 = _fp8_x(x_ptr, begin, end, C)
    if AHEAD >= 2:
        x_2 = _fp8_x(x_ptr, begin + C, end, C)
    for c0 in range(begin, end, C):
        w, x = w_1, x_1
        if AHEAD >= 2:
            w_1, x_1 = w_2, x_2
            w_2, x_2 = _fp8_words(w_ptr, x_ptr, starts, row_mask, c0 + 2 * C, end, C, EVEN_N, EVEN_K, ASM)
        else:
            w_1, x_1 = _fp8_words(w_ptr, x_ptr, starts, row_mask, c0 + C, end, C, EVEN_N, EVEN_K, ASM)
        words = split_words(w, 2)
        xs = octet_split(x)
        for h in tl.static_range(2):
            f0, f1, f2, f3 = _e4m3_quad(words[h], ASM)
            acc += f0 * xs[4 * h][None, :]
            acc += f1 * xs[4 * h + 1][None, :]
            acc += f2 * xs[4 * h + 2][None, :]
            acc += f3 * xs[4 * h + 3][None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _fp8_words(w_ptr, x_ptr, starts, row_mask, c0, end, C: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
               ASM: tl.constexpr):
    """(words [rows, 2 C], activations [C, 8] unconverted) of the step at chunk c0, which may lie
    past `end` (masked off: never used)."""
    words = plane_load(w_ptr, starts, row_mask, c0, end, C, 2, EVEN_N, EVEN_K, ASM, True)
    return words, _fp8_x(x_ptr, c0, end, C)


@triton.jit
def _fp8_x(x_ptr, c0, end, C: tl.constexpr):
    """The activations [C, 8] (unconverted) of the step at chunk c0, which may lie past `end`."""
    chunk = c0 + tl.arange(0, C)
    return tl.load(x_ptr + (8 * chunk)[:, None] + tl.arange(0, 8)[None, :], mask=(chunk < end)[:, None], other=0.0)


@triton.jit
def _e4m3_quad(word, ASM: tl.constexpr):
    """The four e4m3 bytes of int32 words, lowest first, as float32 (e4m3 pairs -> half pairs ->
    floats, as Triton's own conversion does)."""
    if ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi, a, b, c, d;
            .reg .b32 p, q;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 p, lo;
            cvt.rn.f16x2.e4m3x2 q, hi;
            mov.b32 {a, b}, p;
            mov.b32 {c, d}, q;
            cvt.f32.f16 $0, a;
            cvt.f32.f16 $1, b;
            cvt.f32.f16 $2, c;
            cvt.f32.f16 $3, d;
            }""", "=r,=r,=r,=r,r", [word], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
            pack=1)
    else:
        f0 = (word & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f1 = ((word >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f2 = ((word >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f3 = ((word >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return f0, f1, f2, f3


@triton.jit
def _int8_dot(v_ptr, x_ptr, starts, row_mask, K, split_chunks, flip_lo, flip_hi, C: tl.constexpr, EVEN_N: tl.constexpr,
              EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """sum_k W[rows, k] x[k] over this program's 16-column chunks, float32 [rows]."""
    total = K // 16
    begin = tl.program_id(1) * split_chunks
    end = tl.minimum(begin + split_chunks, total)
    ci = tl.arange(0, C)
    acc = tl.zeros([starts.shape[0], C], dtype=tl.float32)
    for c0 in range(begin, end, C):
        chunk = c0 + ci
        cmask = chunk < end
        words = plane_words(v_ptr, starts, row_mask, c0, end, C, 4, EVEN_N, EVEN_K, ASM)
        uppers = upper_halves(words, 4, ASM)
        for o in tl.static_range(2):
            xs = x_octet(x_ptr, 16 * chunk + 8 * o, cmask, EVEN_K)
            acc = octet_dot(acc, words, uppers, xs, o, 8, 128, 1.0, True, (flip_lo, flip_hi))
    return tl.sum(acc, axis=1)


@triton.jit
def _matvec_kernel(v_ptr, scale_ptr, bias_ptr, x_ptr, out_ptr, n, K, split, flip_lo, flip_hi, FP8: tl.constexpr,
                   BN: tl.constexpr, STEP: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                   ASM: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                   AHEAD: tl.constexpr, STAGES: tl.constexpr, counter_ptr=None, res_ptr=None, finish_bias_ptr=None,
                   post_ptr=None, norm_ptr=None, normed_ptr=None, post_eps=0.0, eps=0.0,
                   FINISH: tl.constexpr = False, FINISH_BIAS: tl.constexpr = False, POST: tl.constexpr = False,
                   NORM: tl.constexpr = False, H_BLOCK: tl.constexpr = 1, N_PARTS: tl.constexpr = 0,
                   PREFETCH: tl.constexpr = False, PDL: tl.constexpr = 0, slots_ptr=None, n_slots=0, H_rows=1,
                   DEFER: tl.constexpr = False, SCALED: tl.constexpr = False, SLOTS: tl.constexpr = 1):
    """Program (i, s): output rows i*BN.., the columns of split s (`split` of them: columns for
    fp8, chunks for int8; STEP per loop step). ACT >= 0: the weight is [gate; up] and the tile
    holds both rows of each output (gate row r, up row n + r), one pass over x. FINISH (with
    PARTIAL): the launch's last program also adds the partial sums into the residual and norms it
    (norm.Finish), so no residual-norm launch follows; PREFETCH: program (0, 0) first asks L2 for the
    norm weights that program reads (bulk prefetches, sm_90), so they are not a DRAM latency at the end.
    DEFER (one split, plain rows): the rows go into the residual and the norm is left to the next
    projection (deferred_norm.Deferred); SCALED: x is such a deferred row, the sums are multiplied by its 1 / rms.
    PDL: launched as a programmatic dependent (dependent.py): fp8 loads its first weights before it waits
    for the kernel before."""
    if PREFETCH:
        prefetch_norms(norm_ptr, post_ptr, n, NORM, POST)
    if PDL == 0:  # the deferred norm's reads of the kernel before, under the loop's loads (deferred_reads)
        rstd, res, w = deferred_reads(slots_ptr, n_slots, H_rows, eps, res_ptr, norm_ptr, n, BN, SCALED, DEFER, SLOTS)
    rows, row_mask = tile_rows(tl.program_id(0), n, BN, ACT >= 0)
    if FP8 and AHEAD:  # v_ptr: int32 words; split and STEP in chunks of 8 columns
        starts = tile_starts(tl.program_id(0), n, K // 8, BN, ACT >= 0, ASM)
        total = _fp8_ahead_dot(v_ptr, x_ptr, starts, row_mask, K, split, STEP, EVEN_N, EVEN_K, ASM, AHEAD, PDL)
    elif FP8:
        total = _fp8_dot(v_ptr, x_ptr, rows, row_mask, K, split, STEP, EVEN_N, EVEN_K, STAGES, PDL)
    else:
        wait_previous(PDL)
        release_next(PDL)
        starts = tile_starts(tl.program_id(0), n, K // 16, BN, ACT >= 0, ASM)
        total = _int8_dot(v_ptr, x_ptr, starts, row_mask, K, split, flip_lo, flip_hi, STEP, EVEN_N, EVEN_K, ASM)
    total *= tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    if PDL != 0:
        rstd, res, w = deferred_reads(slots_ptr, n_slots, H_rows, eps, res_ptr, norm_ptr, n, BN, SCALED, DEFER, SLOTS)
    total = deferred_epilogue(total, rstd, res, w, n, BN, bias_ptr, HAS_BIAS, res_ptr, normed_ptr, slots_ptr, SCALED,
                              DEFER)
    if not DEFER:  # a producer's rows are stored by deferred_epilogue
        store_tile(out_ptr, bias_ptr, total, n, BN, ACT, HAS_BIAS, PARTIAL)
    if FINISH:
        finish_partials(counter_ptr, res_ptr, out_ptr, finish_bias_ptr, post_ptr, norm_ptr, normed_ptr, n,
                        tl.num_programs(1), post_eps, eps, FINISH_BIAS, POST, NORM, H_BLOCK, N_PARTS)


@triton.jit
def _matmul_kernel(x_ptr, v_ptr, scale_ptr, bias_ptr, out_ptr, T, N, K, KS, n1, block, FP8: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """Prefill: out[T, N] = x[T, K] @ W.T with [BN, BK] tiles of W dequantized per step. An elastic
    prefix (prefill.matmul_prefix): output row r is weight row (r // n1) * block + r % n1, the first
    K columns of rows of KS."""
    tok, out_rows, tok_mask, row_mask, rows = plain_tile(T, N, n1, block, BM, BN)
    scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None] * K + cols[None, :], mask=tok_mask[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None].to(tl.int64) * KS + cols[None, :], mask=row_mask[:, None], other=0)
        if FP8:  # noqa: SIM108  (constexpr branches: only one is compiled)
            w = v.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            w = v.to(tl.int8, bitcast=True).to(tl.float32)
        acc += dot_tile(x, (w * scale[:, None]).to(x.dtype), IEEE)
    store_plain(out_ptr, bias_ptr, acc, tok, out_rows, tok_mask, row_mask, rows, N, HAS_BIAS)


class Rowwise8Linear(KernelLinear):
    """An int8 or fp8_e4m3 weight."""

    deferrable = True  # the residual norm left to the next projection (deferred_norm.Deferred)

    def __init__(self, record, raw, bias, dtype, device):
        super().__init__(record, raw, bias, dtype, device)
        self.fp8 = self.format == "fp8_e4m3"
        self.values = self.parts["values"].view(torch.uint8)
        self.words = self.values.view(torch.int32)
        self.scales = self.parts["scales"]

    def candidates(self, mode: str, rows: int | None = None, cols: int | None = None) -> list[MatvecConfig]:
        n, K = self.matvec_shape(mode, rows, cols)
        if not self.fp8:  # the chunk scheme over 16-column chunks, four words a lane
            return chunk_candidates(n, K, 16, mode, 4)
        if interpreting():
            return [MatvecConfig(interpreter_block(n, 128), min(next_power_of_2(K), 512), 1, 4)]
        out = []
        for height, warps in ((4, 4), (8, 4), (4, 2), (8, 2), (16, 2), (8, 1), (16, 1)):
            block_n = height // 2 if mode == "glu" else height
            bk = 256 * warps
            units = -(-K // bk)
            splits = split_candidates(n, block_n, units, _sms()) if mode == "partial" else [1]
            out += [MatvecConfig(block_n, bk, s, warps) for s in splits[-2:]]
        # Each tiling again with its loads two steps ahead, where a program takes more than one step
        # (one step ahead, ptxas issues them at the end of the step before, next to their use); the 1-
        # and 2-warp tilings also pipelined through shared memory, where a program takes 3 steps or
        # more (the pipeline syncs the block every step, cheapest with few warps).
        return (out + [replace(c, ahead=2) for c in out if fp8_steps(K, c) > 1]
                + [replace(c, stages=3) for c in out if c.num_warps <= 2 and fp8_steps(K, c) >= 3])

    # The configuration of `matvec_finish` (norm.choose_finish), None until chosen.
    finish_config: MatvecConfig | None = None

    def matvec_finish(self, x: torch.Tensor, partials: torch.Tensor, finish) -> None:
        """matvec(x, partials=partials) with `finish_config`, whose last program then adds the partial
        sums into the residual and norms it (`finish`, a norm.Finish): add_rmsnorm without a launch."""
        config = self.finish_config
        if config is None or partials.shape[0] < config.split:
            raise ValueError("matvec_finish runs with a chosen finish_config and room for its partial sums")
        self._matvec(x.reshape(self.in_features), partials[:config.split], config, -1, True, finish=finish)

    def finish_candidates(self, max_split: int) -> list[MatvecConfig]:
        """Split-K configurations whose matvec can also finish the residual norm (`matvec_finish`): the
        partial-sum candidates of at most `max_split` splits whose last program holds the out_features-long
        row in registers (norm.holds_row)."""
        out = [c for c in self.candidates("partial")
               if holds_row(c.num_warps, self.out_features) and c.split <= max_split]
        # fp8: the plain tilings again pipelined through shared memory where a program takes 3 steps or more
        # (the partial candidates pipeline only 1- and 2-warp tilings, which cannot hold a 4096 row).
        staged = [replace(c, stages=3) for c in out if self.fp8 and not c.ahead and not c.stages
                  and not interpreting() and fp8_steps(self.in_features, c) >= 3]
        return out + [c for c in staged if c not in out]

    def _matvec(self, x, out, config, act, partial, rows=None, cols=None, finish=None, defer=None, rstd=None):
        n, programs, config = prefix_rows(self, config, act, rows)
        K = self.in_features if cols is None else cols  # the kernels keep in_features for the row strides
        if self.fp8:
            if cols is not None:  # an elastic prefix: whole steps per split, so no program reads past it
                config = prefix_split(config, max(1, K // config.chunk) if K % config.chunk == 0 else 1)
            per = _fp8_share(K, config)
            split, step, even, asm = per, config.chunk, K % (config.split * config.chunk) == 0, False
            values = self.values
            if config.ahead:  # in chunks of 8 columns (int32 word pairs)
                split, step, values = per // 8, config.chunk // 8, self.words
                asm = common.INLINE_ASM and not interpreting()
        else:
            config, launch = chunk_prefix(config, self.in_features, cols, 16)
            split, step, even, asm = launch.split_chunks, launch.chunks, launch.even, launch.asm
            values = self.words
        _matvec_kernel[(programs, config.split)](
            values, self.scales, self.bias if self.bias is not None else x, x, out, n, self.in_features, split,
            MAGIC_BITS | 0x80,
            MAGIC_BITS | 0x8000,
            FP8=self.fp8, BN=config.block_n, STEP=step, EVEN_N=n % config.block_n == 0, EVEN_K=even, ASM=asm,
            ACT=act, HAS_BIAS=self.bias is not None, PARTIAL=partial, AHEAD=config.ahead if self.fp8 else 0,
            STAGES=config.stages if self.fp8 else 0, num_warps=config.num_warps,
            **(finish.launch_args(config.split, n) if finish is not None else {}),
            **deferred_args(defer, rstd, config, programs, n, act, partial), **dependent.kernel_args())
        return config.split

    def _matmul(self, x, rows=None, cols=None, halves=1):
        T = x.shape[0]
        N, K, n1, block = matmul_prefix(self, rows, cols, halves)
        out = torch.empty(T, N, dtype=self.dtype, device=x.device)
        bm, bn, bk = matmul_blocks(T, N, K)
        _matmul_kernel[(-(-T // bm), -(-N // bn))](
            x, self.values, self.scales, self.bias if self.bias is not None else x, out, T, N, K, self.in_features,
            n1, block, FP8=self.fp8,
            BM=bm, BN=bn, BK=bk, HAS_BIAS=self.bias is not None, IEEE=x.dtype == torch.float32 or interpreting(),
            num_warps=4)
        return out


def fp8_steps(K: int, config: MatvecConfig) -> int:
    """Loop steps of one fp8 matvec program of `config` over K columns."""
    return -(-_fp8_share(K, config) // config.chunk)


def _fp8_share(K: int, config: MatvecConfig) -> int:
    """Columns of K one fp8 matvec program of `config` takes: all, or with split-K whole steps."""
    per = -(-K // config.split)
    return -(-per // config.chunk) * config.chunk if config.split > 1 else per


def _sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def make(record, raw, bias, device, dtype):
    """The registry's factory for int8 and fp8_e4m3 weights."""
    if record.shape[1] % 16:
        return None
    return Rowwise8Linear(record, raw.to(device), bias, dtype, device)


def reference(raw: torch.Tensor, shape, params, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the kernels compute, by the format's own decode: x @ decode(W).T in float32."""
    from thin.ir import formats

    return x.float() @ formats.get(fmt).decode(raw, tuple(shape), params, torch.float32).T
