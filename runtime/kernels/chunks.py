"""Host-side geometry of the chunk-scheme matvecs (tiles.py): their launch configurations' candidates, how
one configuration runs over a row of chunks (`ChunkLaunch`), and over an elastic prefix of the columns.
The interpreter check, the multiprocessor count and the inline-assembly switch are read from `common` at
each call (tests set them there)."""

from __future__ import annotations

from dataclasses import dataclass

from . import common
from .common import MatvecConfig, interpreter_block, next_power_of_2, prefix_split


def chunk_prefix(config: MatvecConfig, K: int, cols: int | None, columns: int = 32) -> tuple[MatvecConfig, ChunkLaunch]:
    """(configuration, launch) of a chunk-scheme matvec over the first `cols` of its K columns (None:
    all): the kernels keep K for the row strides and stop at the last program's end, so the split
    must divide the prefix's chunks."""
    units = (K if cols is None else cols) // columns
    if cols is not None:
        config = prefix_split(config, units, max(1, config.chunk // columns))
    return config, chunk_launch(units, config, columns)


@dataclass(frozen=True)
class ChunkLaunch:
    """How a chunk-scheme matvec (tiles.py) runs one configuration: `chunks` per loop step (C),
    each program's share of the row's chunks, whether no step needs a mask, whether the
    GPU-only inline assembly is used (not under the interpreter)."""

    chunks: int
    split_chunks: int
    even: bool
    asm: bool


def chunk_launch(total_chunks: int, config: MatvecConfig, columns: int = 32) -> ChunkLaunch:
    """The launch of `config` (its `chunk`: columns per step) over rows of `total_chunks` chunks of
    `columns` columns."""
    chunks = max(1, config.chunk // columns)
    per = -(-total_chunks // config.split)
    even = total_chunks % config.split == 0 and per % chunks == 0
    return ChunkLaunch(chunks, per, even, common.INLINE_ASM and not common.interpreting())


# Rows per program of the chunk-scheme matvecs, by the words a lane loads per row and chunk (all
# planes): a tile's words, activations and sums live in registers, ~4 words x 16 rows at most.
CHUNK_ROWS = {1: (8, 16, 32), 2: (4, 8, 16), 3: (4, 8, 16), 4: (4, 8, 16), 5: (2, 4, 8), 6: (2, 4, 8)}


def chunk_candidates(n: int, k: int, columns: int, mode: str, words: int) -> list[MatvecConfig]:
    """Configurations of a chunk-scheme matvec (tiles.py) over `n` output rows and `k` columns in
    chunks of `columns`, whose lanes load `words` 32-bit words per row and chunk: chunk = columns
    per step (32 chunks a warp), warps 1, 2 or 4, split-K only for partial sums. GLU tiles hold
    two weight rows per output row, so they take half the rows."""
    from .tiles import split_candidates

    total = k // columns
    if common.interpreting():
        return [MatvecConfig(interpreter_block(n, 128), columns * min(next_power_of_2(total), 64), 1, 4)]
    out: list[MatvecConfig] = []
    sms = common.sm_count() if mode == "partial" else 0
    for warps in (1, 2, 4):
        chunks = 32 * warps
        if chunks > total and warps > 1:
            continue
        for rows in CHUNK_ROWS[min(words, 6)]:
            block_n = rows // 2 if mode == "glu" else rows
            units = -(-total // chunks)
            splits = split_candidates(n, block_n, units, sms)[-2:] if mode == "partial" else [1]
            # Partial sums of a short reduction: also one loop step a program (one memory latency
            # a program, not several in a row) where those programs fit 8 a multiprocessor.
            if mode == "partial" and units not in splits and -(-n // block_n) * units <= 8 * sms:
                splits.append(units)
            for split in splits:
                config = MatvecConfig(block_n, columns * chunks, split, warps)
                if config not in out:
                    out.append(config)
    return out
