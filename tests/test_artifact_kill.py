"""A compile killed with SIGKILL mid-write never leaves a partial file at the output path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import thin.artifacts as art

from test_artifact_common import write_artifact

HERE = Path(__file__).parent
# Writes a ~8 MB artifact slowly, one tensor at a time, and says when it has started.
CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
import numpy as np
from ir_fixtures import tiny_model
from thin.artifacts import ArtifactWriter
model = tiny_model(num_layers=4, hidden=256, vocab=2048, inter=512)
with ArtifactWriter(sys.argv[1]) as w:
    for i, t in enumerate(model.tensors):
        w.add_tensor(t.name, np.full(t.shape, i, np.float32), align=4096)
        if i == 2:
            print("writing", flush=True)
        time.sleep(0.1)
    w.commit(model, {})
print("done", flush=True)
"""


def _kill_mid_write(path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(HERE)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        time.sleep(0.3)
        temps = [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.tmp-")]
        assert temps and temps[0].stat().st_size > 1 << 20, "the child should be mid-write"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    for p in path.parent.iterdir():  # what a killed writer leaves: only its temp file
        if p.name.startswith(f".{path.name}.tmp-"):
            p.unlink()


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_sigkill_leaves_no_output(tmp_path):
    path = tmp_path / "model.thin"
    _kill_mid_write(path)
    assert not path.exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_sigkill_keeps_the_previous_file(tmp_path):
    path = tmp_path / "model.thin"
    write_artifact(path)
    before = path.read_bytes()
    _kill_mid_write(path)
    assert path.read_bytes() == before
    assert art.verify_file(path) == []
