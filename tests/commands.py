"""The console scripts of the thin under test, never another installation's found on PATH."""

from __future__ import annotations

import sys
from pathlib import Path

MODULES = {"thinc": "thin.compiler.cli", "thin-exec": "thin.runtime.cli"}


def command(name: str) -> list[str]:
    """argv prefix running `name` with the interpreter running the tests: the script installed beside
    it (its venv's bin/), else `python -m` the module; a `thinc` elsewhere on PATH may be another thin."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.is_file() else [sys.executable, "-m", MODULES[name]]
