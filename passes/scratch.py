"""Scratch: large intermediate tensors that passes hand to later passes, kept out of the annotations.

Annotations are plain data that end up in the artifact; calibration statistics (a second-moment
matrix per linear input) and quantized blobs are neither plain nor small. A pass saves them here
under a string key and records the key in its annotations; a later pass loads them back.

Entries stay in host memory up to `memory_limit` bytes, and go to files under `root` beyond it (the
compiler gives every compile a temporary folder and a quarter of the machine's RAM): an 8B model's
statistics (~32 GB of float32 matrices) fit in a GPU host's RAM and spill to disk on a small one.
Without a root everything stays in memory (tests).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from thin.ir import ThinError


class ScratchError(ThinError, OSError):
    """An intermediate result could not be spilled to the scratch folder (a full disk, mostly)."""


def default_memory_limit() -> int:
    """A quarter of the machine's physical memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30


class Scratch:
    """A key -> {name: tensor or plain value} store: in memory up to `memory_limit` bytes, then on
    disk under `root` (or all in memory when `root` is None)."""

    def __init__(self, root: Path | str | None = None, memory_limit: int | None = None):
        self.root = None if root is None else Path(root)
        self.memory_limit = memory_limit if memory_limit is not None else default_memory_limit()
        self._memory: dict[str, dict] = {}
        self._sizes: dict[str, int] = {}
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / (hashlib.sha1(key.encode()).hexdigest() + ".pt")

    def save(self, key: str, tensors: dict) -> None:
        """Store `tensors` (tensors moved to the CPU) under `key`, replacing what was there."""
        cpu = {k: (v.detach().cpu() if hasattr(v, "detach") else v) for k, v in tensors.items()}
        size = sum(v.numel() * v.element_size() for v in cpu.values() if hasattr(v, "numel"))
        self._memory.pop(key, None)
        held = sum(self._sizes.values()) - self._sizes.pop(key, 0)
        if self.root is not None and self._path(key).is_file():
            self._path(key).unlink()
        if self.root is None or held + size <= self.memory_limit:
            self._memory[key] = cpu
            self._sizes[key] = size
            return
        import torch

        path = self._path(key)
        try:
            torch.save(cpu, path)
        except (OSError, RuntimeError) as e:  # torch reports a short write as a RuntimeError
            path.unlink(missing_ok=True)
            free = shutil.disk_usage(self.root).free
            raise ScratchError(
                f"could not write {size / 2**20:.0f} MiB of intermediate statistics to {self.root} "
                f"({free / 2**20:.0f} MiB free there): point TMPDIR at a disk with more room, or compile "
                f"on a machine with more RAM (up to a quarter of it is used before spilling)") from e

    def has(self, key: str) -> bool:
        return key in self._memory or (self.root is not None and self._path(key).is_file())

    def load(self, key: str) -> dict:
        """What `save` stored under `key`; KeyError when nothing was."""
        if key in self._memory:
            return dict(self._memory[key])
        if self.root is None or not self._path(key).is_file():
            raise KeyError(f"nothing in scratch under {key!r}")
        import torch

        return torch.load(self._path(key), weights_only=True)
