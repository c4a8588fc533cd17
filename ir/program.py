"""A program: the IR plus lazy access to its weights and the annotations passes add."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .model import Model

# A weight loader returns the tensor's data when called: for a dense format a torch
# tensor of the stored dtype and shape; for a packed format a flat uint8 torch tensor
# of exactly `formats.nbytes(...)` bytes. Loaders are called one at a time, so a
# model larger than RAM streams through the pipeline.
WeightLoader = Callable[[], Any]


@dataclass(frozen=True)
class Program:
    model: Model
    weights: Mapping[str, WeightLoader]
    # Plain-data facts passes record for later passes and the artifact (plans, statistics).
    annotations: Mapping[str, Any] = field(default_factory=dict)

    def replace(self, **changes) -> Program:
        return dataclasses.replace(self, **changes)

    def load(self, name: str):
        """Materialise one weight."""
        try:
            loader = self.weights[name]
        except KeyError:
            raise KeyError(f"program has no weight loader for tensor {name!r}") from None
        return loader()

    def decoded(self, name: str, device=None):
        """One weight's values as float32 torch tensor of its shape: its stored bytes decoded by its
        encoding's format (on `device`, moved there first, when given)."""
        import torch

        from . import formats

        record = self.model.tensor(name)
        raw = self.load(name)
        if device is not None:
            raw = raw.to(device)
        return formats.get(record.encoding.format).decode(raw, record.shape, record.encoding.params, torch.float32)
