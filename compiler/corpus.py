"""Text for training, evaluating and calibrating small code models.

Nothing here is committed text: every helper reads, at run time, the ``.py``
files of the standard library of the Python that is running
(``sysconfig.get_paths()["stdlib"]``). The result is deterministic for a given
Python installation, and differs (slightly) between Python versions.

Splits:

- **held out**: the modules named in :data:`HELDOUT_MODULES`, concatenated by
  :func:`heldout_text`. They are never used for training or calibration, so a
  model trained on :func:`training_files` can be scored on them.
- **training**: every other stdlib ``.py`` file (:func:`training_files`), minus
  site-packages, test suites and byte-code caches, minus files that are not
  valid UTF-8.
- **calibration**: :func:`calibration_text`, a deterministic sample of the
  training side (never of the held-out side).

Standard library only; no torch.
"""

from __future__ import annotations

import functools
import os
import random
import sysconfig
from pathlib import Path

__all__ = [
    "HELDOUT_MODULES",
    "HELDOUT_SEPARATOR",
    "calibration_text",
    "heldout_files",
    "heldout_text",
    "stdlib_dir",
    "training_files",
]

#: Top-level single-file stdlib modules held out from training. Each exists,
#: under this name, in every CPython from 3.10 to 3.14; the order is the order
#: of concatenation in :func:`heldout_text`. Changing this tuple changes every
#: held-out number, so don't.
HELDOUT_MODULES: tuple[str, ...] = (
    "textwrap.py",
    "difflib.py",
    "fractions.py",
    "statistics.py",
    "heapq.py",
    "bisect.py",
    "shlex.py",
    "calendar.py",
    "colorsys.py",
    "glob.py",
)

#: Placed between held-out modules: a plain Python comment naming the next
#: module (no special tokens). ``{name}`` is the file name.
HELDOUT_SEPARATOR = "\n\n# ---- {name} ----\n\n"

# Directory names whose whole subtree is skipped: installed third-party
# packages, the test suites (test/, tests/, idlelib/idle_test, lib2to3/tests,
# ...), and byte-code caches.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})



class SampleTooSmallError(ValueError):
    """The standard library sample holds fewer characters than asked; `available` says how many."""

    def __init__(self, message: str, available: int):
        super().__init__(message)
        self.available = available

def stdlib_dir() -> Path:
    """Return the directory of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _read_utf8(path: Path) -> str | None:
    """Return the file's text, or None when it is not valid UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


@functools.lru_cache(maxsize=4)
def _usable_files(root: Path) -> tuple[Path, ...]:
    """All readable UTF-8 ``.py`` files under ``root``, sorted by relative path.

    Skips the directories in ``_SKIP_DIRS`` (at any depth below ``root``).
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # prune: never descend into them
        base = Path(dirpath).relative_to(root)
        found.extend(base / f for f in filenames if f.endswith(".py") and (Path(dirpath) / f).is_file())
    found.sort(key=lambda rel: rel.as_posix())
    return tuple(root / rel for rel in found if _read_utf8(root / rel) is not None)


def heldout_files(root: Path | None = None) -> list[Path]:
    """Return the paths of :data:`HELDOUT_MODULES`, in that order.

    Raises FileNotFoundError when one is missing (a stripped-down Python).
    """
    root = stdlib_dir() if root is None else Path(root)
    paths = [root / name for name in HELDOUT_MODULES]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"held-out stdlib modules missing under {root}: {missing}")
    return paths


def training_files(root: Path | None = None) -> list[Path]:
    """Return the training ``.py`` files: the stdlib minus the held-out modules.

    Sorted by path relative to the stdlib directory; deterministic for a given
    Python installation.
    """
    root = stdlib_dir() if root is None else Path(root)
    held = {root / name for name in HELDOUT_MODULES}
    return [p for p in _usable_files(root) if p not in held]


def heldout_text(root: Path | None = None) -> str:
    """Return the held-out modules concatenated in :data:`HELDOUT_MODULES` order.

    Each module is preceded by :data:`HELDOUT_SEPARATOR` (a comment line naming
    it); the text contains no special tokens.
    """
    parts = []
    for path in heldout_files(root):
        text = _read_utf8(path)
        if text is None:
            raise ValueError(f"held-out module {path} is not valid UTF-8")
        parts.append(HELDOUT_SEPARATOR.format(name=path.name).lstrip("\n"))
        parts.append(text)
    return "".join(parts)


def calibration_text(n_chars: int, root: Path | None = None, chunk_chars: int = 2048, seed: int = 0) -> str:
    """Return ``n_chars`` characters of training-side text for calibration.

    Takes up to ``chunk_chars`` characters from the start of each training
    file, visiting the files in a fixed pseudo-random order (``seed``), so a
    short sample still spans many modules. Chunks are joined with a blank line.
    Deterministic for a given Python installation and arguments; disjoint from
    :func:`heldout_text`. Raises ValueError if the training side is too small.
    """
    if n_chars <= 0:
        return ""
    files = training_files(root)
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    out: list[str] = []
    total = 0
    for i in order:
        text = _read_utf8(files[i]) or ""
        chunk = text[:chunk_chars].strip("\n")
        if not chunk:
            continue
        piece = chunk + "\n\n"
        out.append(piece)
        total += len(piece)
        if total >= n_chars:
            return "".join(out)[:n_chars]
    raise SampleTooSmallError(f"training side has only {total} characters, {n_chars} asked", total)
