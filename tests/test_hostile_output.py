"""The output path never destroys anything, signals clean up, and the compile cache never serves a stale,
damaged or swapped entry."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from thin.artifacts import open_artifact, verify_file
from thin.compiler import CompileConfig, build
from thin.compiler.build import check_output
from thin.compiler.errors import OutputPathError

from commands import command

OLD_NS = 1_600_000_000 * 10**9


@pytest.fixture(scope="module")
def source(llama_source):
    return llama_source


@pytest.fixture
def folder(source, tmp_path):
    return shutil.copytree(source, tmp_path / "model")


@pytest.fixture(autouse=True)
def private_hash_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_outputs_that_would_destroy_something_are_refused(folder, tmp_path):
    weights = folder / "model.safetensors"
    before = weights.read_bytes()
    os.link(folder / "config.json", tmp_path / "hardlink.thin")
    (tmp_path / "symlink.thin").symlink_to(weights)
    os.mkfifo(tmp_path / "fifo.thin")
    (tmp_path / "adir").mkdir()
    refused = [weights, tmp_path / "hardlink.thin", tmp_path / "symlink.thin", tmp_path / "fifo.thin",
               tmp_path / "adir", f"{tmp_path}/newdir/", tmp_path / "missing" / "x.thin"]
    for output in refused:
        with pytest.raises(OutputPathError) as info:
            build(folder, output, CompileConfig())
        assert "\n" not in str(info.value)
    assert weights.read_bytes() == before and json.loads((folder / "config.json").read_text())
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo.thin").st_mode) and (tmp_path / "symlink.thin").is_symlink()
    assert not (tmp_path / "newdir").exists()
    # A device is refused by the first check, before anything is read or written.
    with pytest.raises(OutputPathError, match="not a regular file"):
        check_output("/dev/null")
    with pytest.raises(OutputPathError, match="folder"):
        check_output("some/dir/")


def test_refusals_are_one_line_on_the_cli(folder, tmp_path):
    run = subprocess.run(command("thinc") + ["compile", str(folder), "-o", str(folder / "model.safetensors")],
                         capture_output=True, text=True, timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("thinc: error:")]
    assert run.returncode == 1 and "Traceback" not in run.stderr and len(errors) == 1, run.stderr
    assert "is also an input" in errors[0]


def test_a_long_output_name_compiles(folder, tmp_path):
    output = tmp_path / ("m" * 250 + ".thin")  # 255 bytes: the temp name's suffix must not overflow it
    build(folder, output, CompileConfig())
    assert verify_file(output) == []


def test_a_cache_hit_gets_normal_permissions(folder, tmp_path):
    old = os.umask(0o022)
    try:
        build(folder, tmp_path / "first.thin", CompileConfig(), cache_dir=tmp_path / "cache")
        report = build(folder, tmp_path / "second.thin", CompileConfig(), cache_dir=tmp_path / "cache")
    finally:
        os.umask(old)
    assert report.cache_hit
    for path in (tmp_path / "first.thin", tmp_path / "second.thin", tmp_path / "cache" / f"{report.key}.thin"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


# Compiles FOLDER to OUT slowly (a pause after each tensor), saying when it has started writing. Ctrl-C's
# default handler is put back: a child of a background job inherits SIGINT ignored, as no terminal's would be.
CHILD = r"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import thin.artifacts.writer as writer
from thin.compiler import cli
real = writer.ArtifactWriter.add_tensor
def slow(self, *args, **kwargs):
    real(self, *args, **kwargs)
    print("writing", flush=True)
    time.sleep(0.2)
writer.ArtifactWriter.add_tensor = slow
sys.argv = ["thinc", "compile", sys.argv[1], "-o", sys.argv[2], "-q"]
cli.main()
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_termination_signals_remove_the_temp_file(folder, tmp_path, signum):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    output = out_dir / "model.thin"
    output.write_bytes(b"the previous artifact")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(folder), str(output)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        assert any(p.name.startswith(".model.thin.tmp-") for p in out_dir.iterdir())
        child.send_signal(signum)
        assert child.wait(timeout=60) == 128 + signum
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    stderr = child.stderr.read()
    assert "Traceback" not in stderr and "nothing was written" in stderr, stderr
    assert sorted(p.name for p in out_dir.iterdir()) == ["model.thin"]
    assert output.read_bytes() == b"the previous artifact"


def _compile(folder, tmp_path, name, **options):
    return build(folder, tmp_path / name, CompileConfig(**options), cache_dir=tmp_path / "cache")


def test_a_damaged_cache_entry_is_replaced_not_served(folder, tmp_path):
    first = _compile(folder, tmp_path, "a.thin")
    entry = tmp_path / "cache" / f"{first.key}.thin"
    with open_artifact(entry) as art:
        offset = art.tensor_entry(art.tensor_names()[2]).offset
    data = bytearray(entry.read_bytes())
    data[offset] ^= 0x40
    entry.write_bytes(bytes(data))
    second = _compile(folder, tmp_path, "b.thin")
    assert not second.cache_hit and "checksum" in second.cache_note
    assert verify_file(tmp_path / "b.thin") == [] and verify_file(entry) == []
    assert (tmp_path / "b.thin").read_bytes() == (tmp_path / "a.thin").read_bytes()


def test_a_full_disk_on_a_cache_hit_keeps_the_entry_and_names_the_output(folder, tmp_path, monkeypatch):
    import errno

    import thin.artifacts.cache as cache

    first = _compile(folder, tmp_path, "a.thin")
    entry = tmp_path / "cache" / f"{first.key}.thin"

    def full(source_fd, destination, check=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache, "copy_atomically", full)
    with pytest.raises(OutputPathError, match="writing .*b.thin failed: No space left on device"):
        _compile(folder, tmp_path, "b.thin")  # one error, not "cache entry replaced" and a recompile
    assert verify_file(entry) == [] and not (tmp_path / "b.thin").exists()


@pytest.mark.parametrize("damage", ["swapped", "truncated", "garbage", "fifo", "symlink", "directory"])
def test_a_bad_cache_entry_of_any_kind_is_rebuilt(folder, tmp_path, damage):
    first = _compile(folder, tmp_path, "a.thin")
    entry = tmp_path / "cache" / f"{first.key}.thin"
    other = _compile(folder, tmp_path, "other.thin", fuse_projections=False)  # another key, a valid file
    entry.unlink()
    if damage == "swapped":
        shutil.copy(tmp_path / "other.thin", entry)
    elif damage == "truncated":
        entry.write_bytes((tmp_path / "a.thin").read_bytes()[:-100])
    elif damage == "garbage":
        entry.write_bytes(b"not an artifact" * 100)
    elif damage == "fifo":
        os.mkfifo(entry)
    elif damage == "symlink":
        entry.symlink_to(tmp_path / "other.thin")
    else:
        entry.mkdir()
    again = _compile(folder, tmp_path, "b.thin")
    assert not again.cache_hit and again.key == first.key != other.key and again.cache_note
    assert ".tmp-" not in again.cache_note  # named by the entry, never by the temp copy it was checked in
    if damage in ("truncated", "garbage"):
        assert str(entry) in again.cache_note
    assert (tmp_path / "b.thin").read_bytes() == (tmp_path / "a.thin").read_bytes()
    if damage != "directory":  # a directory is left alone; the compile still runs
        with open_artifact(entry) as art:
            assert art.key == first.key
        assert _compile(folder, tmp_path, "c.thin").cache_hit


def test_a_verified_entry_is_not_hashed_again_until_it_changes(folder, tmp_path, monkeypatch):
    from thin.artifacts.reader import Artifact

    calls = []
    real = Artifact.verify_checksums
    monkeypatch.setattr(Artifact, "verify_checksums", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    first = _compile(folder, tmp_path, "a.thin")
    entry = tmp_path / "cache" / f"{first.key}.thin"
    os.utime(entry, ns=(OLD_NS, OLD_NS))  # old enough that its identity can be trusted
    assert _compile(folder, tmp_path, "b.thin").cache_hit and len(calls) == 1
    assert _compile(folder, tmp_path, "c.thin").cache_hit and len(calls) == 1  # remembered
    time.sleep(0.01)
    os.utime(entry, ns=(OLD_NS + 1, OLD_NS + 1))  # touched: checked again
    assert _compile(folder, tmp_path, "d.thin").cache_hit and len(calls) == 2


def test_the_calibration_file_is_an_input_and_a_regular_file(folder, tmp_path):
    from thin.compiler.config import CompileOptionError
    from thin.compiler.inputs import read_calibration_file

    text = tmp_path / "calib.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    with pytest.raises(OutputPathError, match="is also an input"):
        build(folder, text, CompileConfig(), calib=text)
    assert text.read_text().startswith("def f")
    os.mkfifo(tmp_path / "calib.fifo")
    for bad in (tmp_path / "calib.fifo", tmp_path):
        with pytest.raises(CompileOptionError, match="not a regular file"):
            read_calibration_file(bad)
