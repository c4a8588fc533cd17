"""A paged key/value cache: fixed-size blocks of positions in one pool, a block table on the device.

Every layer's keys (and values) live in a pool [layers, blocks, kv_heads, block_size, head_dim];
logical block i of the sequence is physical block `block_table[i]`. Blocks are taken from a free
list when positions are reserved and go back when the sequence is truncated, so the pool can be
shared and grown by tables, not copies. Kernels find a position's slot through the table
(runtime/kernels/rope.py writes, attention.py reads).

A sliding-window layer (`windows`) keeps a ring of blocks instead, bounded by its window and not
by the sequence: logical block i lives in ring block i % R, R = ceil((window + chunk) / block_size)
+ 1, its own table (`table(layer)`) fixed. Decode attention reads the last `window` positions, which
the ring always holds; a prefill pass must take at most `chunk` tokens (the engine prefills in chunks),
so the keys its first query needs are not yet overwritten by its last. Rolling back past what a ring
still holds is not possible (`keepable`): a conversation starts over.

It keeps the interface of kv_cache.KVCache that generate and ConversationCache use: `length`,
`max_seq_len`, `check_room`, `advance`, `keepable`, `truncate`, `reset`.
"""

from __future__ import annotations

import torch

from .kv_cache import CacheFullError

BLOCK_SIZE = 16
PREFILL_CHUNK = 512  # tokens a prefill pass may take when sliding layers keep rings


class PagedKVCache:
    """Keys and values of one sequence of up to `max_seq_len` tokens, in blocks of `block_size`."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str, block_size: int = BLOCK_SIZE, windows: list[int | None] | None = None,
                 chunk: int = PREFILL_CHUNK):
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        windows = list(windows) if windows is not None else [None] * num_layers
        if len(windows) != num_layers or any(w is not None and w <= 0 for w in windows) or chunk <= 0:
            raise ValueError(f"windows must give a positive window or None for each of {num_layers} layers, "
                             "and the prefill chunk must be positive")
        self.block_size = block_size
        self.num_blocks = -(-max_seq_len // block_size)
        self.max_seq_len = self.num_blocks * block_size
        # Ring blocks of each sliding layer; None where the whole sequence is kept (no window, or a
        # sequence no longer than the ring).
        rings = [None if w is None else -(-(w + chunk) // block_size) + 1 for w in windows]
        self.rings = [r if r is not None and r < self.num_blocks else None for r in rings]
        self.windows = windows
        self.chunk = chunk if any(self.rings) else None
        ring_blocks = max((r for r in self.rings if r), default=0)
        full = [i for i, r in enumerate(self.rings) if r is None]
        ringed = [i for i, r in enumerate(self.rings) if r is not None]
        self._where = {i: (False, j) for j, i in enumerate(full)} | {i: (True, j) for j, i in enumerate(ringed)}
        shape = (len(full), self.num_blocks, num_kv_heads, block_size, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        shape = (len(ringed), ring_blocks, num_kv_heads, block_size, head_dim)
        self.ring_keys = torch.zeros(shape, dtype=dtype, device=device)
        self.ring_values = torch.zeros(shape, dtype=dtype, device=device)
        self.ring_table = (torch.arange(self.num_blocks, dtype=torch.int32) % max(ring_blocks, 1)).to(device)
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
        return 2 * (self.keys.numel() + self.ring_keys.numel()) * self.keys.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value blocks of one layer: [blocks, kv_heads, block_size, head_dim] each."""
        ring, j = self._where[index]
        return (self.ring_keys[j], self.ring_values[j]) if ring else (self.keys[j], self.values[j])

    def table(self, index: int) -> torch.Tensor:
        """The block table the kernels read for layer `index` (its ring's, for a sliding layer)."""
        return self.ring_table if self._where[index][0] else self.block_table

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

    def keepable(self, n: int) -> int:
        """The most tokens, at most `n`, that `truncate` can keep: `n`, unless a sliding layer's ring no
        longer holds the window the token after them sees; then 0 (start over)."""
        if self.length == 0:
            return n
        last = (self.length - 1) // self.block_size  # the latest block written: the ring holds last - R + 1 ..
        for window, ring in zip(self.windows, self.rings):
            if ring is not None and max(0, n - window + 1) // self.block_size <= last - ring and n > 0:
                return 0
        return n

    def truncate(self, n: int) -> None:
        """Keep the first `n` stored tokens; blocks past them go back to the free list."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot keep {n} tokens of a cache holding {self.length}")
        if self.keepable(n) != n:
            raise ValueError(f"cannot keep {n} of {self.length} tokens: a sliding-window layer holds only the "
                             "last blocks of its window (see keepable)")
        self.length = n
        keep = -(-n // self.block_size)
        while len(self._table) > keep:
            self._free.append(self._table.pop())

    def reset(self) -> None:
        """Forget the sequence (buffers are reused, not cleared)."""
        self.truncate(0)
