"""Artifacts built to hurt the reader: memory bombs in the header and tokenizer, files truncated while in
use, control characters in names and provenance, bytes in sections."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import zstandard
from typer.testing import CliRunner

import thin.artifacts as art
from thin.compiler.cli import app

from commands import command
from ir_fixtures import tiny_model
from test_artifact_common import SECTIONS, reseal, split, write_artifact

ESC = "\x1b]0;owned\x07\x1b[2J"  # retitle the terminal, clear the screen


@pytest.fixture(scope="module")
def blob(tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / "base.thin"
    write_artifact(path, tiny_model(num_layers=1))
    return path.read_bytes()


# Opens PATH and reads its tokenizer; prints the outcome and the peak resident memory in bytes (VmHWM:
# ru_maxrss would include the parent's memory at the fork).
OPEN = r"""
import sys
import thin.artifacts as art
try:
    with art.open_artifact(sys.argv[1]) as a:
        a.tokenizer_files()
    outcome = "opened"
except art.ArtifactError as e:
    assert "\\n" not in str(e)
    outcome = type(e).__name__
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(outcome, peak * 1024)
"""


def _open_bounded(path, limit: int) -> str:
    """Open `path` in a child process (so C allocations count too): its outcome, within `limit` bytes."""
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", OPEN, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-1000:]
    outcome, peak = run.stdout.split()
    assert int(peak) < limit, f"{outcome}: peak resident memory {int(peak) >> 20} MiB"
    assert time.perf_counter() - started < 60
    return outcome


def test_a_header_of_millions_of_empty_arrays_is_refused_in_bounded_memory(blob, tmp_path):
    pre, header, _ = split(blob)
    header["sections"]["provenance"]["filler"] = [[]] * 9_000_000  # 9 MB of msgpack, ~600 MB as lists
    path = tmp_path / "bomb.thin"
    path.write_bytes(reseal(blob, header))
    assert _open_bounded(path, 400 << 20) == "CorruptHeaderError"


def test_a_tokenizer_of_thousands_of_compressed_files_is_refused(blob, tmp_path):
    pre, header, _ = split(blob)
    megabyte = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 20))
    files = {f"f{i}.json": {"size": 1 << 20, "zstd": megabyte} for i in range(3000)}
    header["sections"]["tokenizer"]["files"] = files
    path = tmp_path / "bomb.thin"
    path.write_bytes(reseal(blob, header))
    assert _open_bounded(path, 400 << 20) == "InvalidSectionError"
    header["sections"]["tokenizer"]["files"] = dict(list(files.items())[:16])
    big = zstandard.ZstdCompressor(level=1).compress(bytes(40 << 20))
    for entry in header["sections"]["tokenizer"]["files"].values():
        entry.update(size=40 << 20, zstd=big)  # each within its own limit, 640 MiB together
    path.write_bytes(reseal(blob, header))
    assert _open_bounded(path, 400 << 20) == "InvalidSectionError"


# Verifies an artifact truncated in place (what cp over a file in use does) after it was opened; or
# runs a model while its file is replaced by rename (what thinc compile does), the policy for files in use.
IN_USE = r"""
import os, sys
from thin.artifacts import ArtifactError, open_artifact
path, other, mode = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "verify":
    with open_artifact(path) as art:
        os.truncate(path, 4096)
        try:
            art.verify_checksums()
        except ArtifactError as e:
            print("refused:", type(e).__name__)
else:
    from thin.runtime import load
    model = load(path)
    before = model.forward([1, 2, 3])
    os.replace(other, path)
    same = bool((model.forward([1, 2, 3]) == before).all())
    print("same:", same, "new:", not bool((load(path).forward([1, 2, 3]) == before).all()))
"""


@pytest.mark.parametrize("mode,expected", [("verify", "refused: TruncatedError"),
                                           ("replace", "same: True new: True")])
def test_a_file_changed_while_in_use_is_not_a_crash(tmp_path, mode, expected):
    model = tiny_model(num_layers=2, hidden=256, inter=512, vocab=2048)
    sections = {**SECTIONS, "tokenizer": {}}  # runs on ids: no tokenizer needed
    path, other = tmp_path / "model.thin", tmp_path / "other.thin"
    write_artifact(path, model, align=4096, sections=sections)
    write_artifact(other, model, align=4096, sections=sections, seed=1)
    run = subprocess.run([sys.executable, "-c", IN_USE, str(path), str(other), mode], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, f"exit {run.returncode} (SIGBUS is -7): {run.stderr[-500:]}"
    assert run.stdout.strip() == expected


def test_inspect_escapes_what_the_file_says(tmp_path):
    import dataclasses

    model = dataclasses.replace(tiny_model(num_layers=1), architecture=f"Llama{ESC}", family=f"llama{ESC}")
    sections = {**SECTIONS, "provenance": {"source_config_sha256": ESC,
                                           "raw": b"\x00\x01", f"key{ESC}": 1},
                "compile_config": {"schema": 1, f"opt{ESC}": ESC}}
    path = tmp_path / "evil.thin"
    write_artifact(path, model, sections=sections)
    runner = CliRunner()
    for args in (["inspect", str(path)], ["inspect", str(path), "--ir"], ["inspect", str(path), "--json"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.output and "\x07" not in result.output, args
    described = json.loads(runner.invoke(app, ["inspect", str(path), "--json"]).stdout)
    assert described["provenance"]["raw"] == {"hex": "0001"}
    assert "\\x1b" in runner.invoke(app, ["inspect", str(path)]).stdout


def test_the_object_count_matches_the_decoder():
    import random

    from thin.artifacts.spec import count_objects, pack

    def objects(value) -> int:
        if isinstance(value, dict):
            return 1 + sum(1 + objects(v) for v in value.values())
        if isinstance(value, list):
            return 1 + sum(objects(v) for v in value)
        return 1

    def build(rng, depth=0):
        kind = rng.randrange(9 if depth < 4 else 6)
        leaves = [None, True, rng.randrange(-2**63, 2**64), rng.random(), "x" * rng.choice([0, 5, 40, 300]),
                  bytes(rng.choice([0, 3, 300]))]
        if kind < 6:
            return leaves[kind]
        n = rng.choice([0, 1, 3, 20])
        if kind == 6:
            return [build(rng, depth + 1) for _ in range(n)]
        return {f"k{i}": build(rng, depth + 1) for i in range(n)}

    rng = random.Random(7)
    # Every length field width once: str8/16/32, bin8/16/32, array16/32, map16/32.
    wide = ["x" * 70_000, "y" * 300, bytes(70_000), bytes(300), list(range(70_000)), [None] * 300,
            {f"k{i}": i for i in range(70_000)}, {f"k{i}": i for i in range(300)}]
    for value in [wide, *(build(rng) for _ in range(200))]:
        assert count_objects(pack(value), 10**9) == objects(value)
    with pytest.raises(art.CorruptHeaderError, match="more than 10 msgpack objects"):
        count_objects(pack(list(range(20))), 10)


@pytest.mark.parametrize("tool", [["thinc", "inspect"], ["thinc", "verify"], ["thin-exec"]])
def test_a_fifo_in_place_of_an_artifact_does_not_hang(tmp_path, tool):
    fifo = tmp_path / "model.thin"
    os.mkfifo(fifo)
    extra = ["--prompt", "x"] if tool == ["thin-exec"] else []
    run = subprocess.run(command(tool[0]) + tool[1:] + [str(fifo), *extra], capture_output=True, text=True,
                         timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert "regular file" in lines[0] or "not a file" in lines[0], lines[0]
