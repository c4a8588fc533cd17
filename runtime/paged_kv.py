"""A paged key/value cache: fixed-size blocks of positions in one pool, a block table on the device.

Every layer's keys (and values) live in a pool [layers, blocks, kv_heads, block_size, head_dim];
logical block i of the sequence is physical block `block_table[i]`. Blocks are taken from a free
list when positions are reserved and go back when the sequence is truncated, so the pool can be
shared and grown by tables, not copies. Kernels find a position's slot through the table
(runtime/kernels/rope.py writes, attention.py reads).

It keeps the interface of kv_cache.KVCache that generate and ConversationCache use: `length`,
`max_seq_len`, `check_room`, `advance`, `truncate`, `reset`.
"""

from __future__ import annotations

import torch

from .kv_cache import CacheFullError

BLOCK_SIZE = 16


class PagedKVCache:
    """Keys and values of one sequence of up to `max_seq_len` tokens, in blocks of `block_size`."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str, block_size: int = BLOCK_SIZE):
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        self.block_size = block_size
        self.num_blocks = -(-max_seq_len // block_size)
        self.max_seq_len = self.num_blocks * block_size
        shape = (num_layers, self.num_blocks, num_kv_heads, block_size, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # Logical -> physical block; unreserved entries point at block 0 and are never read.
        self.block_table = torch.zeros(self.num_blocks, dtype=torch.int32, device=device)
        self._table: list[int] = []  # host copy of the reserved prefix of the table
        # Handed out last-in first-out from the end of the pool, so logical and physical order
        # differ from the first block on (what the kernels read goes through the table).
        self._free = list(range(self.num_blocks))
        self.length = 0  # tokens stored (the position of the next token)
        self.graphs: dict = {}  # decode steps captured against this cache (engine.py)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value blocks of one layer: [blocks, kv_heads, block_size, head_dim] each."""
        return self.keys[index], self.values[index]

    def check_room(self, n: int) -> None:
        """Raise CacheFullError unless `n` more tokens fit."""
        if self.length + n > self.max_seq_len:
            raise CacheFullError(f"KV cache holds {self.max_seq_len} tokens; {self.length} stored, "
                                 f"{n} more do not fit")

    def reserve(self, n_tokens: int) -> None:
        """Make sure positions 0 .. n_tokens - 1 have blocks (before a step writes them)."""
        if n_tokens > self.max_seq_len:
            raise CacheFullError(f"KV cache holds {self.max_seq_len} tokens; {n_tokens} asked for")
        need = -(-n_tokens // self.block_size)
        if need <= len(self._table):
            return
        start = len(self._table)
        while len(self._table) < need:
            self._table.append(self._free.pop())
        new = torch.tensor(self._table[start:], dtype=torch.int32)
        self.block_table[start:need].copy_(new, non_blocking=False)

    def advance(self, n: int) -> None:
        """Move the position past `n` tokens, once every layer has stored them."""
        self.length += n

    def truncate(self, n: int) -> None:
        """Keep the first `n` stored tokens; blocks past them go back to the free list."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot keep {n} tokens of a cache holding {self.length}")
        self.length = n
        keep = -(-n // self.block_size)
        while len(self._table) > keep:
            self._free.append(self._table.pop())

    def reset(self) -> None:
        """Forget the sequence (buffers are reused, not cleared)."""
        self.truncate(0)
