"""Imports run one way: ir <- passes <- compiler; ir, artifacts <- runtime; compiler -> runtime."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "ir": {"ir"},
    "artifacts": {"ir", "artifacts"},
    "passes": {"ir", "passes"},
    "runtime": {"ir", "artifacts", "runtime"},
    "compiler": {"ir", "passes", "compiler", "runtime", "artifacts"},
}


def _imports(path: Path):
    """(line, imported module) for every import in a file, relative ones resolved to thin.*."""
    package = "thin." + ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                yield node.lineno, ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.lineno, node.module


def test_imports_run_one_way():
    violations = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            for line, module in _imports(path):
                parts = module.split(".")
                if parts[0] == "thin" and len(parts) > 1 and parts[1] not in allowed:
                    violations.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
                if layer == "artifacts" and parts[0] == "torch":
                    violations.append(f"{path.relative_to(ROOT)}:{line} imports torch (artifacts must not)")
    assert not violations, "\n".join(violations)


def test_only_the_server_imports_the_server_packages():
    """starlette, uvicorn and pydantic are the `serve` extra: nothing outside runtime/serve/ may need them."""
    violations = []
    for layer in ALLOWED:
        for path in sorted((ROOT / layer).rglob("*.py")):
            if path.is_relative_to(ROOT / "runtime" / "serve"):
                continue
            violations += [f"{path.relative_to(ROOT)}:{line} imports {module}" for line, module in _imports(path)
                           if module.split(".")[0] in ("starlette", "uvicorn", "pydantic", "fastapi")]
    assert not violations, "\n".join(violations)


def test_ir_is_plain_data_without_torch():
    code = ("import sys, thin.ir, thin.ir.formats, thin.artifacts; "
            "bad = [m for m in ('torch', 'transformers', 'triton') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_runtime_import_is_lean():
    code = ("import sys, thin.runtime; "
            "bad = [m for m in sys.modules if m.startswith(('thin.compiler', 'thin.passes', 'transformers', "
            "'triton'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
