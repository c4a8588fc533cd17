"""The compiler driver's own errors (the frontend's live in hf/errors.py, the passes' in thin.passes)."""

from __future__ import annotations

from thin.ir import ThinError


class CompileError(ThinError):
    """Base of the errors the compile driver raises about its arguments."""


class OutputPathError(CompileError):
    """The output path would destroy something (an input, a device, a directory) or cannot be written."""
