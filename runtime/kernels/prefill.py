"""Prefill (many rows of activations): how a family's matmul is tiled (MatmulConfig), which tilings
are worth timing (`tile_candidates`), the choice per prompt-length bucket and shape (`choose_matmul`,
cached like the matvec's), and the op side of it (`TiledPrefill`), over an elastic prefix of the
weight where asked (`matmul_prefix`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import interpreting, tuning
from .common import KernelLinear, interpreter_block, next_power_of_2
from .tuning import compile_launches, median_ms_or_inf


@dataclass(frozen=True)
class MatmulConfig:
    """How a prefill matmul (many rows of activations) is tiled: `block_m` tokens x `block_n` output
    rows per program, `block_k` columns per loop step, `num_warps`, `stages` (Triton's software
    pipeline: loads of that many - 1 steps in flight); `kernel` names the family's kernel ("tiled":
    the pipelined one, "plain": the first, untuned one); `split`: programs along K (split-K, their
    float32 partial sums added by a second launch)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    stages: int = 1
    kernel: str = "tiled"
    split: int = 1


@triton.jit
def plain_tile(T, N, n1, block, BM: tl.constexpr, BN: tl.constexpr):
    """Program (i, j) of a family's plain prefill matmul (a grid of token tiles by row tiles): its tokens,
    output rows, their masks, and the weight row of each output row (an elastic prefix, `matmul_prefix`:
    output row r is weight row (r // n1) * block + r % n1)."""
    tok = tl.program_id(0) * BM + tl.arange(0, BM)
    out_rows = tl.program_id(1) * BN + tl.arange(0, BN)
    return tok, out_rows, tok < T, out_rows < N, (out_rows // n1) * block + out_rows % n1


@triton.jit
def store_plain(out_ptr, bias_ptr, acc, tok, out_rows, tok_mask, row_mask, rows, N, HAS_BIAS: tl.constexpr):
    """A plain prefill tile's float32 sums acc [BM, BN], plus the bias of each output's weight row where
    HAS_BIAS, into out [T, N] in out's dtype (`plain_tile` gave the rest)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + tok[:, None] * N + out_rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tok_mask[:, None] & row_mask[None, :])


def token_bucket(T: int) -> int:
    """The row count a prefill matmul of T rows is tuned at: the next power of two, 16 to 4096."""
    return min(max(next_power_of_2(T), 16), 4096)


def matmul_prefix(op: KernelLinear, rows: int | None, cols: int | None, halves: int) -> tuple[int, int, int, int]:
    """(N, K, n1, block) of a prefill matmul over a prefix (LinearOp.prefix): N output rows, K columns
    (x's row length; the weight's rows keep their length), and output row r reads weight row
    (r // n1) * block + r % n1: the first n1 rows of each block of `block` rows, side by side."""
    from ..linear import row_blocks

    row_blocks(op.out_features, rows, halves)
    K = op.in_features if cols is None else cols
    if rows is None:
        return op.out_features, K, op.out_features, 0
    return rows * halves, K, rows, op.out_features // halves


def matmul_blocks(T: int, N: int, K: int) -> tuple[int, int, int]:
    """Tile sizes of the prefill matmuls: (tokens, rows, columns) per program and step."""
    bk = 64 if K % 64 == 0 else 32
    if interpreting():
        return max(16, next_power_of_2(T)), interpreter_block(N, 256), bk
    return (64 if T > 32 else 16 if T <= 16 else 32), 64, bk


def tile_candidates(T: int, K: int, steps: tuple[int, ...], unit: int,
                    wide_sums: int | None = None) -> list[MatmulConfig]:
    """Tilings of a pipelined prefill kernel ("tiled") worth timing for T rows over K columns: tiles of
    tokens x rows (the bucket's rows up to 64 tokens; 64 or 128 beyond), `steps` columns a loop step
    where they divide `unit` (a scale group) and K, three or four stages (three at 128 columns: four
    steps of 128 columns of x and codes overflow shared memory at 128 rows). `wide_sums`: at 128
    columns a step, only tiles of at most that many float32 sums a thread (beyond, the weight tile
    and the accumulator spill at sm_90)."""
    bucket = token_bucket(T)
    tiles = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 4), (128, 128, 8), (128, 256, 8)]
    if bucket <= 64:
        tiles = [(bucket, 32, 4), (bucket, 64, 4), (bucket, 128, 4), (bucket, 128, 8)]
    stages = {32: (4,), 64: (3, 4), 128: (3,)}
    return [MatmulConfig(m, n, k, warps, stage) for m, n, warps in tiles for k in steps
            if unit % k == 0 and K % k == 0 and (k < 128 or wide_sums is None or m * n <= wide_sums * 32 * warps)
            for stage in stages[k]]


def choose_matmul(op: KernelLinear, T: int, N: int, K: int, candidates: list[MatmulConfig], run) -> MatmulConfig:
    """The matmul configuration `op` runs T rows with (N outputs over K columns: a prefix may be
    smaller than the weight): the first candidate under the interpreter, for an op not to be tuned
    or a small weight (as `choose`), else the cached choice for this device, shape and
    `token_bucket(T)`, else the fastest candidate timed on the real weight with `run(config, x)`
    over random x of the bucket's rows (then cached), after compiling them all on host threads
    (`compile_launches`). A candidate that does not compile is skipped."""
    if tuning.untuned(op, candidates):
        return candidates[0]
    bucket = token_bucket(T)
    key = tuning.cache_key(op, f"matmul {bucket}x{N}x{K}", candidates)
    cache = tuning.TuneCache.get()
    hit = cache.lookup(key, MatmulConfig)
    if hit is not None and hit in candidates:
        return hit
    x = torch.randn(bucket, K, device=op.device).to(op.dtype)
    compile_launches([(op.device, lambda config=config: run(config, x)) for config in candidates], report=False)
    times = {config: median_ms_or_inf(lambda config=config: run(config, x), f"{op.format} matmul {config}", repeats=5,
                                      inner=3) for config in candidates}
    best = min(candidates, key=times.get)
    if times[best] < float("inf"):
        cache.store(key, best)
    return best


class TiledPrefill:
    """The prefill matmul of a KernelLinear whose launch candidates (`matmul_candidates(T, K)`) its
    `_launch_matmul(x, N, K, n1, block, config)` runs: each prompt-length bucket and shape runs the
    configuration `choose_matmul` picked the first time, kept by the op."""

    def _matmul(self, x, rows=None, cols=None, halves=1, config=None):
        T = x.shape[0]
        N, K, n1, block = matmul_prefix(self, rows, cols, halves)
        if config is None:
            chosen = self.__dict__.setdefault("_matmul_configs", {})
            key = (token_bucket(T), N, K)
            if key not in chosen:
                chosen[key] = choose_matmul(self, T, N, K, self.matmul_candidates(T, K),
                                            lambda c, x: self._launch_matmul(x, N, K, n1, block, c))
            config = chosen[key]
        return self._launch_matmul(x, N, K, n1, block, config)

    def matmul_candidates(self, T: int, K: int) -> list[MatmulConfig]:
        """Prefill tilings worth timing: the plain kernel first (the untuned default; float32's only
        one, the exact float32 dot being multiply-adds either way), then under 16-bit activations the
        pipelined one (`tile_candidates`: 64 or 128 columns a step, tiles that do not spill)."""
        bm, bn, bk = matmul_blocks(T, self.out_features, K)
        plain = MatmulConfig(bm, bn, bk, 4, 1, "plain")
        if self.dtype == torch.float32:
            return [plain]
        if interpreting():
            return [plain, MatmulConfig(bm, bn, 64 if K % 64 == 0 else 32, 4, 1)]
        return [plain, *tile_candidates(T, K, (64, 128), 128, wide_sums=64)]
