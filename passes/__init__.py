"""IR -> IR passes and the runner that applies them in order."""

from .canonicalize import canonicalize
from .runner import Pass, PassContext, PassError, run_passes

__all__ = ["canonicalize", "Pass", "PassContext", "PassError", "run_passes"]
