"""The distribution builds as a wheel that installs into a fresh venv and provides both commands."""

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_into_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    # Build from a copy so the checkout gains no build/ or egg-info debris. Hidden entries (.git, and a
    # developer's ignored scratch such as virtualenvs) stay behind and symlinks are copied as links: a
    # link back into the checkout would otherwise be followed without end.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".*", "build", "*.egg-info", "__pycache__", "*.thin", "models"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                    str(dist), str(src)], check=True, capture_output=True)
    wheel = next(dist.glob("thin-*.whl"))
    env_dir = tmp_path / "venv"
    # The venv must see the dependencies (torch etc.) that the running interpreter has, but not thin.
    # system_site_packages alone shows the *base* interpreter's packages: when the tests run from a
    # virtualenv, the dependencies live in that virtualenv, so its site-packages are added by a .pth
    # (whose lines are appended to sys.path, after the new venv's own site-packages, where the wheel
    # goes; .pth files inside the added folders, such as an editable thin's, are not processed).
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(purelib) / "_outer_site_packages.pth").write_text("\n".join(sorted(ours)) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True)
    out = subprocess.run([str(env_dir / "bin" / "thinc"), "--help"], check=True, capture_output=True,
                         text=True, cwd=tmp_path)
    assert "compile" in out.stdout
    out = subprocess.run([str(env_dir / "bin" / "thin-exec"), "--help"], check=True, capture_output=True,
                         text=True, cwd=tmp_path)
    assert "--prompt" in out.stdout
    # The installed package comes from the wheel, not the checkout.
    where = subprocess.run([str(py), "-c", "import thin.ir, thin.runtime, thin.artifacts, thin.compiler.hf, "
                            "thin.passes; print(thin.ir.__file__)"],
                           check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert str(env_dir) in where
