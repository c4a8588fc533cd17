"""The root of thin's error hierarchy.

Every layer has one base class derived from `ThinError` (`IRError` here, `ArtifactError`,
`FrontendError`, `PassError`, the runtime's `RunError`, the compiler's `CompileError`).
An error of this family means "the input was refused, and the message says why": the CLIs
print it as one line and exit non-zero. Anything else that escapes is a bug in thin.
"""

from __future__ import annotations


class ThinError(Exception):
    """Base of every error thin raises on purpose about its inputs."""


class IRError(ThinError, ValueError):
    """The IR layer's base: a model description that is malformed or breaks an invariant."""


def one_line(error: BaseException, limit: int = 2000) -> str:
    """`error`'s message on one line (whitespace runs collapsed), at most `limit` characters."""
    text = " ".join(str(error).split()) or type(error).__name__.replace("str", "error")
    return text if len(text) <= limit else text[:limit - 3] + "..."
