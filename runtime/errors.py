"""The runtime's errors: one base class, `RunError`, for every refusal while loading or running a model."""

from __future__ import annotations

from thin.ir import ThinError


class RunError(ThinError):
    """Any failure to run an artifact that the caller can act on: bad ids or options, no room, no device."""


class InputError(RunError, ValueError):
    """Token ids, prompts or options that the model cannot take (wrong type, shape, range or size)."""


class CacheAllocationError(RunError, MemoryError):
    """The KV cache asked for does not fit in the device's free memory."""
