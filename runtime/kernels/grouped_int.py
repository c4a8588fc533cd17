"""int3 / int4 / int5 / int6 (ir/formats/grouped_int.py): one matvec for the whole family, the code
width a constexpr (its prefill matmul: grouped_int_prefill.py).

A b-bit code is a low plane of width WL (4, or 2 for int3) plus an optional high plane of width
WH (1 or 2); value = (u - 2^(b-1)) * scale (symmetric) or u * scale + offset (asymmetric), one
float16 scale (and offset) per group of G columns of a row. The matvec runs the chunk scheme
(tiles.py): a lane owns 32 columns of each row of its tile (16 bytes of a 4-bit plane), turns
each code into a float in place with the zero point folded into the same add (one logic op, one
add, one fused multiply-add a code and plane), and applies the group scale once per chunk
(asymmetric: offset * sum of the chunk's x as well). Symmetric int4 under bfloat16 activations has a
second arithmetic the launch tuner may pick (MatvecConfig.packed): two weights an instruction as
bfloat16 pairs, the chunk's sums in bf16 (pairs.py, which also says what that costs in precision).
A split-K matvec may also finish the residual add + RMSNorm in its last program (`matvec_finish`, as
rowwise8's: norm.Finish), also over an elastic prefix of the columns.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from thin.ir.formats.grouped_int import PLANES

from . import dependent
from .chunks import chunk_candidates, chunk_launch, chunk_prefix
from .common import (
    MAGIC_BITS,
    KernelLinear,
    MatvecConfig,
    prefix_rows,
)
from .deferred_norm import deferred_args, deferred_epilogue, deferred_reads
from .dependent import release_next, wait_previous
from .grouped_int_prefill import GroupedIntPrefill
from .norm import finish_partials, holds_row, prefetch_norms
from .pairs import CODE_UNIT, code_zero, pair_sum, word_dot, x_pairs
from .tiles import (
    chunk_side,
    octet_dot,
    plane_load,
    plane_words,
    split_words,
    store_tile,
    tile_rows,
    tile_starts,
    upper_halves,
    x_octet,
    x_sum8,
)


@triton.jit
def _rows_dot(low_ptr, high_ptr, scale_ptr, offset_ptr, x_ptr, n, K: tl.constexpr, split_chunks, magic,
              WL: tl.constexpr, WH: tl.constexpr, MID: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr,
              C: tl.constexpr, BN: tl.constexpr, GLU: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
              ASM: tl.constexpr, PACKED: tl.constexpr, ZERO_BITS: tl.constexpr, AHEAD: tl.constexpr,
              PDL: tl.constexpr):
    """sum_k W[rows, k] * x[k] over the tile's rows (tiles.tile_rows) and this program's chunks
    (split `program_id(1)`), float32 [rows].

    One step covers C chunks of 32 columns of every row (tiles.py, "chunk" scheme): each plane's
    words and the chunk's activations are loaded once per lane, the codes of an octet of columns
    become floats in place (zero point folded in) and go into a per-chunk dot product, which is
    scaled by the chunk's group scale once (a chunk never straddles a group: G >= 32). PACKED
    (symmetric 4-bit codes, bf16 x; ZERO_BITS = pairs.code_zero(MID)): the chunk's products are summed
    as bf16 pairs, word o of a row holding octet o's codes (in units of pairs.CODE_UNIT, put back at the
    end).
    AHEAD >= 1: the group scales (and offsets) are loaded one step ahead. ptxas sinks a load next to
    its first use, and theirs is the end of a step: loaded in the step before, their memory latency
    overlaps a whole step's math instead of following it. AHEAD 2: the low plane's words too, two
    steps ahead (one step ahead, ptxas would issue them at the end of the step before, just ahead of
    their use). PDL (dependent.py): the wait for the kernel before comes after the loads made ahead of
    the loop (the launcher makes a dependent's AHEAD 2), before the first activations."""
    pid = tl.program_id(0)
    rows, row_mask = tile_rows(pid, n, BN, GLU)
    total: tl.constexpr = K // 32  # K a constexpr: the tile's row strides fold into the side loads (row_starts)
    starts = tile_starts(pid, n, total, BN, GLU, ASM)
    begin = tl.program_id(1) * split_chunks
    end = tl.minimum(begin + split_chunks, total)
    ci = tl.arange(0, C)
    groups: tl.constexpr = K // G
    acc = tl.zeros([rows.shape[0], C], dtype=tl.float32)
    if AHEAD >= 2:  # the low plane's words two steps ahead
        words_1 = plane_load(low_ptr, starts, row_mask, begin, end, C, WL, EVEN_N, EVEN_K, ASM, True)
        words_2 = plane_load(low_ptr, starts, row_mask, begin + C, end, C, WL, EVEN_N, EVEN_K, ASM, True)
    if AHEAD:
        scale_ahead, offset_ahead = _sides(scale_ptr, offset_ptr, pid, n, groups, begin, end, G, C, BN, GLU, EVEN_N,
                                           ASYM, ASM)
    wait_previous(PDL)
    release_next(PDL)
    for c0 in range(begin, end, C):
        chunk = c0 + ci
        cmask = chunk < end
        if AHEAD:  # this step's, then the next step's (past the end: masked off)
            scale, offset = scale_ahead, offset_ahead
            scale_ahead, offset_ahead = _sides(scale_ptr, offset_ptr, pid, n, groups, c0 + C, end, G, C, BN, GLU,
                                               EVEN_N, ASYM, ASM)
        if AHEAD >= 2:
            low = split_words(words_1, WL)
            words_1 = words_2
            words_2 = plane_load(low_ptr, starts, row_mask, c0 + 2 * C, end, C, WL, EVEN_N, EVEN_K, ASM, True)
        else:
            low = plane_words(low_ptr, starts, row_mask, c0, end, C, WL, EVEN_N, EVEN_K, ASM)
        xsum = tl.zeros([C], dtype=tl.float32)
        if PACKED:
            pairs = tl.zeros([rows.shape[0], C], dtype=tl.int32)  # bf16 pairs (0, 0)
            for o in tl.static_range(4):
                pairs = word_dot(pairs, low[o], x_pairs(x_ptr, 32 * chunk + 8 * o, cmask, EVEN_K, ASM), ZERO_BITS,
                                 ASM)
            dot = pair_sum(pairs)
        else:
            low_up = upper_halves(low, WL, ASM)
            if WH > 0:
                high = plane_words(high_ptr, starts, row_mask, c0, end, C, WH, EVEN_N, EVEN_K, ASM)
                high_up = upper_halves(high, WH, ASM)
            dot = tl.zeros([rows.shape[0], C], dtype=tl.float32)
            for o in tl.static_range(4):
                xs = x_octet(x_ptr, 32 * chunk + 8 * o, cmask, EVEN_K)
                # Symmetric: u - MID through the low plane's add; the high plane's codes weigh 2^WL.
                dot = octet_dot(dot, low, low_up, xs, o, WL, 0 if ASYM else MID, 1.0, False, magic)
                if WH > 0:
                    dot = octet_dot(dot, high, high_up, xs, o, WH, 0, 1 << WL, False, magic)
                if ASYM:
                    xsum += x_sum8(xs)
        if not AHEAD:
            scale = chunk_side(scale_ptr, pid, n, groups, c0, end, G // 32, C, BN, GLU, EVEN_N, EVEN_K, ASM)
            if ASYM:
                offset = chunk_side(offset_ptr, pid, n, groups, c0, end, G // 32, C, BN, GLU, EVEN_N, EVEN_K, ASM)
        if ASYM:
            acc += scale.to(tl.float32) * dot + offset.to(tl.float32) * xsum[None, :]
        else:
            acc += scale.to(tl.float32) * dot
    if PACKED:
        acc = acc * CODE_UNIT  # the pairs' unit (exact: a power of 2)
    return tl.sum(acc, axis=1)


@triton.jit
def _sides(scale_ptr, offset_ptr, pid, n, groups, c0, end, G: tl.constexpr, C: tl.constexpr, BN: tl.constexpr,
           GLU: tl.constexpr, EVEN_N: tl.constexpr, ASYM: tl.constexpr, ASM: tl.constexpr):
    """(scales, offsets) of the step at c0 (tiles.chunk_side, masked: the step may lie past `end`);
    the offsets are the scales again when symmetric (never used)."""
    scale = chunk_side(scale_ptr, pid, n, groups, c0, end, G // 32, C, BN, GLU, EVEN_N, False, ASM)
    offset = scale
    if ASYM:
        offset = chunk_side(offset_ptr, pid, n, groups, c0, end, G // 32, C, BN, GLU, EVEN_N, False, ASM)
    return scale, offset


@triton.jit
def _matvec_kernel(low_ptr, high_ptr, scale_ptr, offset_ptr, bias_ptr, level_ptr, x_ptr, out_ptr, n, K: tl.constexpr,
                   split_chunks, magic,
                   WL: tl.constexpr, WH: tl.constexpr, MID: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr,
                   C: tl.constexpr, BN: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                   ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, PACKED: tl.constexpr,
                   ZERO_BITS: tl.constexpr, AHEAD: tl.constexpr, LEVEL: tl.constexpr, counter_ptr=None,
                   res_ptr=None, finish_bias_ptr=None, post_ptr=None, norm_ptr=None, normed_ptr=None, post_eps=0.0,
                   eps=0.0, FINISH: tl.constexpr = False, FINISH_BIAS: tl.constexpr = False,
                   POST: tl.constexpr = False, NORM: tl.constexpr = False, H_BLOCK: tl.constexpr = 1,
                   N_PARTS: tl.constexpr = 0, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = 0,
                   slots_ptr=None, n_slots=0, H_rows=1, DEFER: tl.constexpr = False, SCALED: tl.constexpr = False,
                   SLOTS: tl.constexpr = 1):
    """Program (i, s): output rows i*BN.., chunks of split s. With ACT >= 0 the weight is [gate; up]
    and the tile holds both rows of each output (gate row r, up row n + r), one pass over x; LEVEL:
    the product times level_ptr[r] (an elastic FFN level's scale, instead of a launch of its own).
    FINISH (with PARTIAL): the launch's last program also adds the partial sums into the residual and
    norms it (norm.Finish), so no residual-norm launch follows; PREFETCH: program (0, 0) first asks L2
    for the norm weights that program reads (as rowwise8's matvec). DEFER (one split, plain rows): the
    rows go into the residual and the norm is left to the next projection (deferred_norm.Deferred); SCALED: x
    is such a deferred row, the sums are multiplied by its 1 / rms. PDL: launched as a programmatic
    dependent (dependent.py), waiting after its first weights' loads (`_rows_dot`)."""
    if PREFETCH:
        prefetch_norms(norm_ptr, post_ptr, n, NORM, POST)
    if PDL == 0:  # the deferred norm's reads of the kernel before, under the loop's loads (deferred_reads)
        rstd, res, w = deferred_reads(slots_ptr, n_slots, H_rows, eps, res_ptr, norm_ptr, n, BN, SCALED, DEFER, SLOTS)
    total = _rows_dot(low_ptr, high_ptr, scale_ptr, offset_ptr, x_ptr, n, K, split_chunks, magic, WL, WH, MID, ASYM,
                      G, C, BN, ACT >= 0, EVEN_N, EVEN_K, ASM, PACKED, ZERO_BITS, AHEAD, PDL)
    if PDL != 0:
        rstd, res, w = deferred_reads(slots_ptr, n_slots, H_rows, eps, res_ptr, norm_ptr, n, BN, SCALED, DEFER, SLOTS)
    total = deferred_epilogue(total, rstd, res, w, n, BN, bias_ptr, HAS_BIAS, res_ptr, normed_ptr, slots_ptr, SCALED,
                              DEFER)
    if LEVEL:
        store_tile(out_ptr, bias_ptr, total, n, BN, ACT, HAS_BIAS, PARTIAL, level_ptr)
    elif not DEFER:  # a producer's rows are stored by deferred_epilogue
        store_tile(out_ptr, bias_ptr, total, n, BN, ACT, HAS_BIAS, PARTIAL)
    if FINISH:
        finish_partials(counter_ptr, res_ptr, out_ptr, finish_bias_ptr, post_ptr, norm_ptr, normed_ptr, n,
                        tl.num_programs(1), post_eps, eps, FINISH_BIAS, POST, NORM, H_BLOCK, N_PARTS)


class GroupedIntLinear(GroupedIntPrefill, KernelLinear):
    """A grouped-int weight served by the kernels above (its prefill matmul: grouped_int_prefill.py)."""

    def __init__(self, record, raw, bias, dtype, device):
        super().__init__(record, raw, bias, dtype, device)
        bits = int(self.format.removeprefix("int"))
        planes = PLANES[bits]
        self.wl, self.wh = planes[0], (planes[1] if len(planes) == 2 else 0)
        self.mid, self.asym, self.group = 2 ** (bits - 1), self.p["asymmetric"], self.p["group_size"]
        names = self.fmt.plane_names()
        # Word views of the planes (the matvec's unit); byte views for the matmul.
        self.low = self.parts[names[0]]
        self.high = self.parts[names[1]] if self.wh else self.low
        self.scales = self.parts["scales"]
        self.offsets = self.parts["offsets"] if self.asym else self.scales
        self.low32, self.high32 = self.low.view(torch.int32), self.high.view(torch.int32)
        # The bf16-pair arithmetic (pairs.py): one 4-bit plane, a zero point, bfloat16 activations.
        self.pairs = (self.wl, self.wh, self.asym, dtype) == (4, 0, False, torch.bfloat16)

    glu_scale = True  # an elastic FFN level's scale in the gate/up epilogue (_matvec's `scale`)
    deferrable = True  # the residual norm left to the next projection (deferred_norm.Deferred)

    def candidates(self, mode, rows=None, cols=None):
        n, k = self.matvec_shape(mode, rows, cols)
        base = chunk_candidates(n, k, 32, mode, self.wl + self.wh)
        if not self.pairs:
            return base
        packed = [replace(c, packed=True) for c in base]
        # Loads ahead where a program takes more than one step; words two steps ahead hold three
        # steps' words in registers: tiles of up to 8 weight rows.
        rows = 2 if mode == "glu" else 1
        steps = [c for c in packed if _steps(k, c) > 1]
        return (base + packed + [replace(c, ahead=1) for c in steps]
                + [replace(c, ahead=2) for c in steps if c.block_n * rows <= 8])

    # The configuration of `matvec_finish` (norm.choose_finish), None until chosen; over a prefix of the
    # columns (an elastic FFN level's down) each prefix's own, by its columns.
    finish_config: MatvecConfig | None = None
    finish_prefixes: dict[int, MatvecConfig | None] | None = None

    def matvec_finish(self, x: torch.Tensor, partials: torch.Tensor, finish, cols: int | None = None) -> None:
        """matvec(x, partials=partials, cols=cols) with `finish_config` (or `finish_prefixes[cols]`), whose
        last program then adds the partial sums into the residual and norms it (`finish`, a norm.Finish):
        add_rmsnorm without a launch. `cols`: over the first cols columns (x is [cols]), the split cut to
        divide them as `_matvec`'s prefix does."""
        config = self.finish_config if cols is None else (self.finish_prefixes or {}).get(cols)
        if config is None or partials.shape[0] < config.split:
            raise ValueError("matvec_finish runs with a chosen finish_config and room for its partial sums")
        self._matvec(x.reshape(-1), partials[:config.split], config, -1, True, cols=cols, finish=finish)

    def finish_candidates(self, max_split: int, cols: int | None = None) -> list[MatvecConfig]:
        """Split-K configurations whose matvec can also finish the residual norm (`matvec_finish`, over
        the first `cols` columns when given): the partial-sum candidates of at most `max_split` splits
        whose last program holds the out_features-long row in registers (norm.holds_row)."""
        return [c for c in self.candidates("partial", None, cols)
                if holds_row(c.num_warps, self.out_features) and c.split <= max_split]

    def _matvec(self, x, out, config, act, partial, rows=None, cols=None, scale=None, finish=None, defer=None,
                rstd=None):
        n, programs, config = prefix_rows(self, config, act, rows)
        config, launch = chunk_prefix(config, self.in_features, cols)
        bias = self.bias if self.bias is not None else x
        if config.packed and not (self.pairs and x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0):
            raise ValueError(f"{self.format} {config}: bf16 pairs need symmetric int4, bfloat16 activations "
                             f"(got {x.dtype}) and x 4-byte aligned")
        if scale is not None and (act < 0 or scale.shape != out.shape or scale.dtype != out.dtype):
            raise ValueError(f"a gate/up scale must match the output ({tuple(out.shape)} {out.dtype}), got "
                             f"{tuple(scale.shape)} {scale.dtype} (act {act})")
        pdl = dependent.kernel_args()
        # A dependent loads its first two steps' words before it waits for the kernel before (_rows_dot).
        ahead = max(config.ahead, 2) if dependent.preloads(pdl) else config.ahead
        _matvec_kernel[(programs, config.split)](
            self.low32, self.high32, self.scales, self.offsets, bias, x if scale is None else scale, x, out, n,
            self.in_features, launch.split_chunks,
            MAGIC_BITS,
            WL=self.wl, WH=self.wh, MID=self.mid, ASYM=self.asym, G=self.group, C=launch.chunks,
            BN=config.block_n, EVEN_N=n % config.block_n == 0, EVEN_K=launch.even, ASM=launch.asm, ACT=act,
            HAS_BIAS=self.bias is not None, PARTIAL=partial, PACKED=config.packed,
            ZERO_BITS=code_zero(self.mid) if config.packed else 0, AHEAD=ahead, LEVEL=scale is not None,
            num_warps=config.num_warps, **(finish.launch_args(config.split, n) if finish is not None else {}),
            **deferred_args(defer, rstd, config, programs, n, act, partial), **pdl)
        return config.split

def _steps(K: int, config: MatvecConfig) -> int:
    """Loop steps of one program of `config` over K columns."""
    launch = chunk_launch(K // 32, config)
    return -(-launch.split_chunks // launch.chunks)


def make(record, raw, bias, device, dtype):
    """The registry's factory: a GroupedIntLinear, or None for a shape the kernels can't tile."""
    if record.shape[1] % 32:
        return None
    return GroupedIntLinear(record, raw.to(device), bias, dtype, device)


def reference(raw: torch.Tensor, shape, params, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the kernels compute, by the format's own decode: x @ decode(W).T in float32."""
    from thin.ir import formats

    return x.float() @ formats.get(fmt).decode(raw, tuple(shape), params, torch.float32).T
