"""`thin-exec`: errors are one line without a traceback; one-shot, stdin and chat modes stream text."""

import subprocess
import sys

import pytest
import torch
from test_runtime_loader import write_tiny_artifact
from typer.testing import CliRunner

from thin.runtime import cli


def _exec(*args, stdin=""):
    return subprocess.run([sys.executable, "-m", "thin.runtime.cli", *map(str, args)], input=stdin, check=False,
                          capture_output=True, text=True, timeout=120)


def _one_line_error(result):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("thin-exec: error:"), result.stderr
    return lines[0]


def test_missing_file_is_one_line_error(tmp_path):
    line = _one_line_error(_exec(tmp_path / "nope.thin", "--prompt", "hi"))
    assert "nope.thin" in line


def test_garbage_file_is_one_line_error(tmp_path):
    garbage = tmp_path / "garbage.thin"
    garbage.write_bytes(b"\x00garbage" * 100)
    _one_line_error(_exec(garbage, "--prompt", "hi"))


def test_empty_file_and_directory_are_one_line_errors(tmp_path):
    empty = tmp_path / "empty.thin"
    empty.write_bytes(b"")
    for path in (empty, tmp_path):
        result = runner.invoke(cli.app, [str(path), "--prompt", "hi"])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


runner = CliRunner()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    write_tiny_artifact(tmp / "tiny.thin", tmp)
    return tmp / "tiny.thin"


def test_help_lists_the_options():
    result = runner.invoke(cli.app, ["--help"])
    assert result.exit_code == 0
    for option in ("--prompt", "--raw", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--min-p",
                   "--repetition-penalty", "--seed", "--device", "--verify"):
        assert option in result.output


def test_one_shot_prompt_streams_text_and_reports_speed(artifact):
    result = runner.invoke(cli.app, [str(artifact), "--prompt", "def push", "--max-new-tokens", "5"])
    assert result.exit_code == 0, result.output
    assert "tok/s" in result.stderr and "prefill" in result.stderr and "decode" in result.stderr
    again = runner.invoke(cli.app, [str(artifact), "--prompt", "def push", "--max-new-tokens", "5"])
    assert again.stdout == result.stdout  # greedy by default: reproducible


def test_raw_stdin_prompt_and_seeded_sampling(artifact):
    args = [str(artifact), "--raw", "--max-new-tokens", "6", "--temperature", "1.2", "--seed", "4",
            "--top-k", "40", "--top-p", "0.95", "--min-p", "0.01", "--repetition-penalty", "1.1"]
    first = runner.invoke(cli.app, args, input="class Stack:\n")
    second = runner.invoke(cli.app, args, input="class Stack:\n")
    assert first.exit_code == 0, first.output
    assert first.stdout == second.stdout


def test_bad_options_and_devices_are_one_line_errors(artifact):
    result = runner.invoke(cli.app, [str(artifact), "--prompt", "x", "--top-p", "3"])
    assert result.exit_code == 1 and "top_p" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = runner.invoke(cli.app, [str(artifact), "--prompt", "x", "--max-new-tokens", "100000"])
    assert result.exit_code == 1 and "max_position_embeddings" in result.stderr
    result = runner.invoke(cli.app, [str(artifact), "--raw"], input="")
    assert result.exit_code == 1 and "empty" in result.stderr
    if not torch.cuda.is_available():
        result = runner.invoke(cli.app, [str(artifact), "--prompt", "x", "--device", "cuda"])
        assert result.exit_code == 1 and "needs a CUDA GPU" in result.stderr


def test_verify_reports_damaged_tensor(artifact, tmp_path):
    from thin.artifacts import open_artifact

    data = bytearray(artifact.read_bytes())
    entry = open_artifact(artifact).tensor_entry("final_norm.weight")
    data[entry.offset] ^= 0x55
    damaged = tmp_path / "damaged.thin"
    damaged.write_bytes(bytes(data))
    assert runner.invoke(cli.app, [str(damaged), "--prompt", "x", "--max-new-tokens", "1"]).exit_code == 0
    result = runner.invoke(cli.app, [str(damaged), "--verify", "--prompt", "x"])
    assert result.exit_code == 1 and "final_norm.weight" in result.stderr


def test_interactive_chat_keeps_history_and_resets(artifact, monkeypatch, capsys):
    from thin.runtime import load

    model = load(artifact)
    seen_prompts = []
    original = model.generate
    monkeypatch.setattr(model, "generate", lambda ids, **kw: seen_prompts.append(model.tokenizer.decode(ids))
                        or original(ids, **kw))
    lines = iter(["hello", "again", "/reset", "fresh", "/exit", "never read"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    cli._chat(model, raw=False, options={"max_new_tokens": 3})
    assert len(seen_prompts) == 3
    assert seen_prompts[1].count("<|im_start|>user") == 2 and "hello" in seen_prompts[1]
    assert "<|im_start|>assistant\n" in seen_prompts[1].split("again")[0]  # the first reply is in history
    assert seen_prompts[2].count("<|im_start|>user") == 1 and "hello" not in seen_prompts[2]
    assert "tok/s" in capsys.readouterr().err
