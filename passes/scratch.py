"""Scratch: large intermediate tensors that passes hand to later passes, kept out of the annotations.

Annotations are plain data that end up in the artifact; calibration statistics (a second-moment
matrix per linear input) and quantized blobs are neither plain nor small. A pass saves them here
under a string key and records the key in its annotations; a later pass loads them back. With a
folder (the compiler gives every compile a temporary one) they live on disk, so an 8B model's
statistics need not sit in RAM; without one they stay in memory (tests).
"""

from __future__ import annotations

import hashlib
from pathlib import Path


class Scratch:
    """A key -> {name: torch tensor} store, on disk under `root` or in memory when `root` is None."""

    def __init__(self, root: Path | str | None = None):
        self.root = None if root is None else Path(root)
        self._memory: dict[str, dict] = {}
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / (hashlib.sha1(key.encode()).hexdigest() + ".pt")

    def save(self, key: str, tensors: dict) -> None:
        """Store `tensors` (tensors moved to the CPU) under `key`, replacing what was there."""
        cpu = {k: (v.detach().cpu() if hasattr(v, "detach") else v) for k, v in tensors.items()}
        if self.root is None:
            self._memory[key] = cpu
            return
        import torch

        torch.save(cpu, self._path(key))

    def has(self, key: str) -> bool:
        return key in self._memory if self.root is None else self._path(key).is_file()

    def load(self, key: str) -> dict:
        """What `save` stored under `key`; KeyError when nothing was."""
        if self.root is None:
            try:
                return dict(self._memory[key])
            except KeyError:
                raise KeyError(f"nothing in scratch under {key!r}") from None
        path = self._path(key)
        if not path.is_file():
            raise KeyError(f"nothing in scratch under {key!r}")
        import torch

        return torch.load(path, weights_only=True)
