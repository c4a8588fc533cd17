"""A static key/value cache: one preallocated [kv_heads, max_seq_len, head_dim] buffer pair per layer.

The executor writes each layer's new keys and values at the current position and reads
back the whole prefix; `advance` moves the position once every layer has been written.
Sliding-window layers keep the full history too (the mask hides the old keys), which
keeps positions and indexing identical across layers.
"""

from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """More tokens were fed than the cache was allocated for."""


class KVCache:
    """Keys and values for every layer of one sequence, up to `max_seq_len` tokens."""

    def __init__(self, shapes: list[tuple[int, int]], max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """`shapes` is (num_kv_heads, head_dim) per layer."""
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        self.max_seq_len = max_seq_len
        self.keys = [torch.zeros(h, max_seq_len, d, dtype=dtype, device=device) for h, d in shapes]
        self.values = [torch.zeros(h, max_seq_len, d, dtype=dtype, device=device) for h, d in shapes]
        self.length = 0  # tokens already stored (the position of the next token)

    def check_room(self, n: int) -> None:
        """Raise CacheFullError unless `n` more tokens fit."""
        if self.length + n > self.max_seq_len:
            raise CacheFullError(f"KV cache holds {self.max_seq_len} tokens; {self.length} stored, "
                                 f"{n} more do not fit")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [kv_heads, T, head_dim] at the current position; return the layer's keys and values
        for positions 0 .. length + T - 1."""
        start, end = self.length, self.length + k.shape[1]
        self.keys[layer][:, start:end] = k
        self.values[layer][:, start:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def advance(self, n: int) -> None:
        """Move the position past `n` tokens, once every layer has stored them."""
        self.length += n

    def truncate(self, n: int) -> None:
        """Keep only the first `n` stored tokens (later positions are overwritten as new tokens come)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot keep {n} tokens of a cache holding {self.length}")
        self.length = n

    def reset(self) -> None:
        """Forget the sequence (buffers are reused, not cleared)."""
        self.length = 0
