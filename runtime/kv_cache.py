"""A static key/value cache: one preallocated [kv_heads, positions, head_dim] buffer pair per layer.

The executor writes each layer's new keys and values at the current position and reads
back what its queries can see; `advance` moves the position once every layer has been
written. A full-attention layer keeps the whole prefix. A sliding-window layer keeps only
its last `window` positions, in a ring (position p in slot p % window), so its memory is
bounded by the window whatever the sequence length; it hands back the keys from the first
position the new queries can see, and the executor masks relative to that position.
"""

from __future__ import annotations

import torch

from .errors import CacheAllocationError, RunError


class CacheFullError(RunError, RuntimeError):
    """More tokens were fed than the cache was allocated for."""


class KVCache:
    """Keys and values for every layer of one sequence, up to `max_seq_len` tokens."""

    def __init__(self, shapes: list[tuple[int, int]], max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", windows: list[int | None] | None = None):
        """`shapes` is (num_kv_heads, head_dim) per layer; `windows` the sliding window of each layer
        (None, or a None entry: full attention)."""
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        self.max_seq_len = max_seq_len
        self.windows = list(windows) if windows is not None else [None] * len(shapes)
        if len(self.windows) != len(shapes) or any(w is not None and w <= 0 for w in self.windows):
            raise ValueError(f"windows must give a positive window or None for each of {len(shapes)} layers")
        sizes = [max_seq_len if w is None else min(w, max_seq_len) for w in self.windows]
        device = torch.device(device)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        need = 2 * itemsize * sum(h * d * n for (h, d), n in zip(shapes, sizes))
        free = available_memory(device)
        if free is not None and need > free:
            raise CacheAllocationError(f"a KV cache for {max_seq_len} tokens needs {need / 2**30:.2f} GiB, but "
                                       f"{device.type} has {free / 2**30:.2f} GiB free; lower max_new_tokens or "
                                       "shorten the prompt")
        try:
            self.keys = [torch.zeros(h, n, d, dtype=dtype, device=device) for (h, d), n in zip(shapes, sizes)]
            self.values = [torch.zeros(h, n, d, dtype=dtype, device=device) for (h, d), n in zip(shapes, sizes)]
        except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeError (OutOfMemoryError)
            raise CacheAllocationError(f"could not allocate a KV cache for {max_seq_len} tokens "
                                       f"({need / 2**30:.2f} GiB on {device.type}): {str(e).splitlines()[0][:200]}; "
                                       "lower max_new_tokens or shorten the prompt") from None
        self.length = 0  # tokens already stored (the position of the next token)

    def check_room(self, n: int) -> None:
        """Raise CacheFullError unless `n` more tokens fit."""
        if self.length + n > self.max_seq_len:
            raise CacheFullError(f"KV cache holds {self.max_seq_len} tokens; {self.length} stored, "
                                 f"{n} more do not fit")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [kv_heads, T, head_dim] at the current position; return the layer's keys and values
        for positions first .. length + T - 1, where first is 0, or for a sliding layer the oldest
        position the first new query sees (length - window + 1, at least 0)."""
        start, end = self.length, self.length + k.shape[1]
        window = self.windows[layer]
        if window is None:
            self.keys[layer][:, start:end] = k
            self.values[layer][:, start:end] = v
            return self.keys[layer][:, :end], self.values[layer][:, :end]
        size = self.keys[layer].shape[1]
        # Read the held positions the new queries still see before any slot is overwritten.
        held = torch.arange(max(0, start - window + 1), start, device=k.device) % size
        keys = torch.cat((self.keys[layer][:, held], k), dim=1)
        values = torch.cat((self.values[layer][:, held], v), dim=1)
        kept = min(k.shape[1], size)  # of a long prefill only the last `size` positions stay
        slots = torch.arange(end - kept, end, device=k.device) % size
        self.keys[layer][:, slots] = k[:, -kept:]
        self.values[layer][:, slots] = v[:, -kept:]
        return keys, values

    def advance(self, n: int) -> None:
        """Move the position past `n` tokens, once every layer has stored them."""
        self.length += n

    def keepable(self, n: int) -> int:
        """The most tokens, at most `n`, that `truncate` can keep: `n`, unless a sliding layer's ring has
        overwritten positions the token after them would see; then 0 (start over)."""
        for window, keys in zip(self.windows, self.keys):
            if window is not None and self.length > keys.shape[1] and n - window + 1 < self.length - keys.shape[1]:
                return 0
        return n

    def truncate(self, n: int) -> None:
        """Keep only the first `n` stored tokens (later positions are overwritten as new tokens come)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot keep {n} tokens of a cache holding {self.length}")
        if self.keepable(n) != n:
            raise ValueError(f"cannot keep {n} of {self.length} tokens: a sliding-window layer holds only its "
                             "last window of positions (see keepable)")
        self.length = n

    def reset(self) -> None:
        """Forget the sequence (buffers are reused, not cleared)."""
        self.length = 0


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device`, or None where that cannot be known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
