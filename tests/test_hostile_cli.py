"""Hostile and careless command lines: each mistake is one line on stderr and a non-zero exit, refused
before any long work where it can be, and nothing on disk is lost: sizes beyond any memory, outputs that
cannot be written, flags that would do nothing, a closed or empty stdin, a bench without a GPU."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from thin.artifacts import ArtifactWriter
from thin.compiler import CompileConfig, build
from thin.compiler import cli as thinc_cli
from thin.compiler.errors import OutputPathError
from thin.runtime import cli as exec_cli

from commands import command
from hf_tiny import make_checkpoint
from tiny_tokenizer import write_tokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint("llama", path, vocab_size=320)
    write_tokenizer(path, vocab_size=300)
    return path


@pytest.fixture(scope="module")
def artifact(source, tmp_path_factory):
    output = tmp_path_factory.mktemp("artifact") / "tiny.thin"
    build(source, output, CompileConfig())
    return output


@pytest.fixture(autouse=True)
def private_hash_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def one_error(result, prefix: str, match: str) -> str:
    """The single error line of a failed CliRunner result (after any progress lines), checked to contain
    `match`."""
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line]
    assert result.exit_code == 1 and len(errors) == 1 and lines[-1] == errors[0], result.output
    assert errors[0].startswith(prefix) and match in errors[0] and "Traceback" not in result.output, errors[0]
    return errors[0]


def test_a_size_beyond_any_memory_is_one_line(source, artifact, tmp_path):
    # msgpack stores 64-bit integers: a --vram past them once reached the header writer as a traceback.
    for args in (["key", str(source)], ["compile", str(source), "-o", str(tmp_path / "x.thin")]):
        one_error(runner.invoke(thinc_cli.app, [*args, "--vram", "99999999999999999999T"]), "thinc: error:",
                  "larger than any device's memory")
    one_error(runner.invoke(exec_cli.app, [str(artifact), "-p", "x", "--vram", "2000T"]), "thin-exec: error:",
              "larger than any device's memory")
    assert not (tmp_path / "x.thin").exists()


def test_outputs_that_cannot_be_written_are_refused_before_the_compile(source, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the output was checked")

    monkeypatch.setattr("thin.compiler.hf.load_checkpoint", never)
    with pytest.raises(OutputPathError, match="cannot write output /proc/"):
        build(source, "/proc/model.thin", CompileConfig())  # no file can be created in /proc, even by root
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(OutputPathError, match="--dump-ir .* is not a folder"):
        build(source, tmp_path / "x.thin", CompileConfig(), dump_ir=tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "keep" and not (tmp_path / "x.thin").exists()


def test_a_write_that_fails_names_the_output_and_leaves_nothing(source, tmp_path, monkeypatch):
    (tmp_path / "out.thin").write_bytes(b"previous")

    def full(self, name, data, align=64):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ArtifactWriter, "add_tensor", full)
    with pytest.raises(OutputPathError, match=r"writing .*out\.thin failed: No space left on device"):
        build(source, tmp_path / "out.thin", CompileConfig())
    assert set(os.listdir(tmp_path)) - {"xdg"} == {"out.thin"}  # no temp file left beside it
    assert (tmp_path / "out.thin").read_bytes() == b"previous"


def test_flags_that_would_do_nothing_or_cannot_work_are_refused_early(source, tmp_path):
    out = str(tmp_path / "x.thin")
    (tmp_path / "cache-file").write_text("")
    cases = [
        (["--keep-lm-head"], "need --quant FORMAT"),
        (["--formats", "int4"], "--formats: planner options"),
        (["--cache-dir", str(tmp_path / "cache-file")], "is a file, not a folder"),
    ]
    for args, match in cases:
        line = one_error(runner.invoke(thinc_cli.app, ["compile", str(source), "-o", out, *args]), "thinc: error:",
                         match)
        assert "probe_windows" not in line
    # A dense model has no experts to stream: refused before calibration runs the model.
    result = runner.invoke(thinc_cli.app, ["compile", str(source), "-o", out, "--vram", "1G", "--stream-experts",
                                           "--device", "cpu"])
    one_error(result, "thinc: error:", "this model has none")
    assert "calibrate" not in result.output
    # The config file given for its folder.
    one_error(runner.invoke(thinc_cli.app, ["compile", str(source / "config.json"), "-o", out]), "thinc: error:",
              "is a file, not a checkpoint folder")
    assert not os.path.exists(out)


def test_a_folder_without_a_tokenizer_compiles_with_a_warning(source, tmp_path):
    folder = shutil.copytree(source, tmp_path / "model")
    (folder / "tokenizer.json").unlink()
    result = runner.invoke(thinc_cli.app, ["compile", str(folder), "-o", str(tmp_path / "x.thin"), "-q"])
    assert result.exit_code == 0, result.output
    assert "no tokenizer.json" in result.stderr and "cannot take text" in result.stderr
    result = runner.invoke(thinc_cli.app, ["compile", str(source), "-o", str(tmp_path / "y.thin"), "-q"])
    assert result.exit_code == 0 and "warning" not in result.stderr


def test_a_ctx_beyond_the_model_is_said(source, tmp_path):
    result = runner.invoke(thinc_cli.app, ["compile", str(source), "-o", str(tmp_path / "x.thin"), "--bpw", "8",
                                           "--ctx", "100000000", "--device", "cpu", "--calib-tokens", "256", "-q"])
    assert result.exit_code == 0, result.output
    assert "not --ctx 100000000" in result.stderr


def test_the_precision_map_is_written_like_an_output(artifact, tmp_path):
    before = artifact.read_bytes()
    (tmp_path / "adir").mkdir()
    (tmp_path / "null.svg").symlink_to("/dev/null")
    os.mkfifo(tmp_path / "fifo.svg")
    for target, match in ((artifact, "is also an input"), ("/dev/null", "not a regular file"),
                          (tmp_path / "null.svg", "not a regular file"), (tmp_path / "fifo.svg", "not a regular file"),
                          (tmp_path / "adir", "is a directory"), (tmp_path / "missing" / "m.svg", "does not exist")):
        one_error(runner.invoke(thinc_cli.app, ["inspect", str(artifact), "--precision-map", str(target)]),
                  "thinc: error:", match)
    assert artifact.read_bytes() == before
    result = runner.invoke(thinc_cli.app, ["inspect", str(artifact), "--precision-map", str(tmp_path / "m.svg")])
    assert result.exit_code == 0 and (tmp_path / "m.svg").read_text().startswith("<svg")
    assert not [name for name in os.listdir(tmp_path) if ".tmp-" in name]
    one_error(runner.invoke(thinc_cli.app, ["inspect", str(tmp_path / "none.thin")]), "thinc: error:",
              "no such artifact")
    assert runner.invoke(thinc_cli.app, ["-h"]).exit_code == 0


def test_a_closed_or_blank_stdin_is_an_empty_prompt(artifact):
    base = command("thin-exec") + [str(artifact), "--max-new-tokens", "2"]
    runs = [subprocess.run(["sh", "-c", 'exec "$@" <&-', "sh", *base], capture_output=True, text=True, timeout=120),
            subprocess.run(base + ["--raw"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120),
            subprocess.run(base, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120),
            subprocess.run(base + ["-p", " \n "], capture_output=True, text=True, timeout=120)]
    for run in runs:
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 1 and lines == ["thin-exec: error: the prompt is empty: give --prompt TEXT or pipe "
                                                 "text on stdin"], run.stderr


def test_device_and_bench_mistakes_are_one_line(artifact):
    one_error(runner.invoke(exec_cli.app, [str(artifact), "-p", "x", "--device", "foo"]), "thin-exec: error:",
              "unknown device 'foo': use cpu, cuda or cuda:N")
    bench = exec_cli.bench_app
    one_error(runner.invoke(bench, [str(artifact), "--device", "cpu"]), "thin-exec: error:",
              "use --device cuda or cuda:N, not cpu")
    if not torch.cuda.is_available():
        line = one_error(runner.invoke(bench, [str(artifact)]), "thin-exec: error:", "needs a CUDA GPU")
        assert "was requested" not in line


def test_speed_lines_never_print_nan_and_level_one_is_the_model(artifact):
    result = runner.invoke(exec_cli.app, [str(artifact), "-p", "x", "--raw", "--max-new-tokens", "0"])
    assert result.exit_code == 0 and "nan" not in result.stderr and "- tok/s" in result.stderr, result.output
    result = runner.invoke(exec_cli.app, [str(artifact), "-p", "x", "--raw", "--max-new-tokens", "2", "--ffn-keep", "1"])
    assert result.exit_code == 0 and "UNCERTIFIED" not in result.stderr and "exact" in result.stderr, result.output


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
