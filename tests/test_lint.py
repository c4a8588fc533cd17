"""The tree passes the linter with the project's configuration (pyproject.toml [tool.ruff])."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_check_is_clean():
    # The ruff installed with the dev extra beside this interpreter, not whichever is first on PATH.
    if importlib.util.find_spec("ruff") is not None:
        ruff = [sys.executable, "-m", "ruff"]
    elif shutil.which("ruff"):
        ruff = [shutil.which("ruff")]
    else:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    run = subprocess.run([*ruff, "check", "--no-cache", str(ROOT)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
