"""Importing the runtime must not pull in the compiler, the passes, transformers, triton, typer or the
server's packages; the `thin-exec` CLI loads the server's packages only when `thin-exec serve` runs."""

import subprocess
import sys

SERVER = ("starlette", "uvicorn", "pydantic", "fastapi", "openai", "httpx")
FORBIDDEN = ("thin.compiler", "thin.passes", "transformers", "triton", "typer", *SERVER)


def test_import_runtime_is_lean():
    code = ("import sys, thin.runtime, thin.runtime.loader, thin.runtime.perplexity\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r} or m.startswith({FORBIDDEN!r}))\n"
            "print(','.join(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"import thin.runtime loaded: {result.stdout.strip()}"


def test_cli_and_serve_modules_load_the_server_packages_only_to_serve():
    code = ("import sys, thin.runtime.cli, thin.runtime.serve, thin.runtime.serve.cli\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {SERVER!r})\n"
            "print(','.join(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"import thin.runtime.cli loaded: {result.stdout.strip()}"
