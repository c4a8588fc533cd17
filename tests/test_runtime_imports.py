"""Importing the runtime must not pull in the compiler, the passes, transformers, triton or typer."""

import subprocess
import sys

FORBIDDEN = ("thin.compiler", "thin.passes", "transformers", "triton", "typer")


def test_import_runtime_is_lean():
    code = ("import sys, thin.runtime, thin.runtime.loader, thin.runtime.perplexity\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r} or m.startswith({FORBIDDEN!r}))\n"
            "print(','.join(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"import thin.runtime loaded: {result.stdout.strip()}"
