"""Hostile and careless command lines: each mistake is one line on stderr and a non-zero exit, refused
before any long work where it can be, and nothing on disk is lost: sizes beyond any memory, outputs that
cannot be written, flags that would do nothing, a closed or empty stdin, a bench without a GPU."""

from __future__ import annotations

import errno
import json
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
def source(llama_source):
    return llama_source


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
        assert run.returncode == 1 and len(lines) == 1 and "error:" in lines[0], run.stderr
        assert "the prompt is empty" in lines[0] or "--prompt is empty" in lines[0], run.stderr


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


def test_sampling_options_that_overflow_are_refused_and_nan_logits_are_one_error():
    from thin.runtime.sampling import GenerationOptionError, GenerationOptions, NonFiniteLogitsError, sample_next

    for bad in ({"temperature": 1e-300}, {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e6}):
        with pytest.raises(GenerationOptionError):
            GenerationOptions(**bad)
    # A generation_config can carry them too: refused when read, not at the draw.
    with pytest.raises(GenerationOptionError, match="temperature"):
        GenerationOptions.from_generation_config({"do_sample": True, "temperature": 1e-300})
    logits = torch.randn(50)
    logits[3] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="not finite"):
        sample_next(logits, GenerationOptions(temperature=0.7), generator=torch.Generator().manual_seed(0))
    assert 0 <= sample_next(torch.randn(50), GenerationOptions(temperature=1e-5)) < 50


def test_numbers_past_what_the_header_stores_and_lists_that_do_not_parse(source, tmp_path):
    for args, match in ((["--vram", "8G", "--ctx", "99999999999999999999"], "--ctx must be a number of tokens in"),
                        (["--bpw", "3", "--calib-tokens", str(10**25)], "--calib-tokens must be an integer in"),
                        (["--bpw", "3", "--calib-tokens", str(10**8)], "more than the built-in sample"),
                        (["--quant", "int8", "--max-kld", "nan"], "--max-kld must be a positive finite number")):
        one_error(runner.invoke(thinc_cli.app, ["key", str(source), *args]), "thinc: error:", match)
    one_error(runner.invoke(thinc_cli.app, ["plan", str(source), "--bpw", "2.5,4x"]), "thinc: error:",
              "--bpw takes a comma-separated list")
    for args, match in ((["--bpw", "4,"], "--bpw takes a comma-separated list such as 3.6,5"),
                        (["--vram", "1G,,2G"], "--vram takes a comma-separated list such as 4G,6G"),
                        (["--bpw", "4,4.0"], "--bpw lists 4.0 twice"), (["--vram", "1G,1G"], "--vram lists 1G twice")):
        result = runner.invoke(thinc_cli.app, ["plan", str(source), *args])
        one_error(result, "thinc: error:", match)
        assert "calibrate" not in result.output
    # Budgets that check_budget refuses are refused before calibration runs the model.
    result = runner.invoke(thinc_cli.app, ["plan", str(source), "--vram", "1K,2K", "--device", "cpu"])
    one_error(result, "thinc: error:", "no budget can be met")
    assert "calibrate" not in result.output


def test_ffn_levels_on_a_mixture_of_experts_are_refused_before_calibration(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path / "moe", vocab_size=320)
    write_tokenizer(tmp_path / "moe", vocab_size=300)
    result = runner.invoke(thinc_cli.app, ["compile", str(tmp_path / "moe"), "-o", str(tmp_path / "x.thin"),
                                           "--ffn-levels", "0.5", "--device", "cpu"])
    one_error(result, "thinc: error:", "need dense MLPs")
    assert "calibrate" not in result.output
    # thinc key refuses what the compile's check passes refuse: no key for an artifact that cannot be built.
    one_error(runner.invoke(thinc_cli.app, ["key", str(tmp_path / "moe"), "--ffn-levels", "0.5"]), "thinc: error:",
              "need dense MLPs")


def test_key_refuses_what_compile_refuses(source):
    for args, match in ((["--vram", "8G", "--stream-experts"], "this model has none"),
                        (["--bpw", "3", "--expert-formats", "q2"], "this model has none"),
                        (["--vram", "1K"], "below the smallest model")):
        one_error(runner.invoke(thinc_cli.app, ["key", str(source), *args]), "thinc: error:", match)
    assert runner.invoke(thinc_cli.app, ["key", str(source), "--bpw", "4"]).exit_code == 0


def test_paths_the_same_or_ending_in_a_slash_and_names_with_escapes(source, artifact, tmp_path):
    same = str(tmp_path / "same")
    one_error(runner.invoke(thinc_cli.app, ["compile", str(source), "-o", same, "--dump-ir", same]), "thinc: error:",
              "are the same path")
    assert not os.path.exists(same)  # no folder made for a compile that was refused
    one_error(runner.invoke(thinc_cli.app, ["inspect", str(artifact), "--precision-map", f"{tmp_path}/m.svg/"]),
              "thinc: error:", "names a folder")
    assert not (tmp_path / "m.svg").exists()
    odd = tmp_path / "e\x1b]0;title\x07.thin"
    shutil.copy(artifact, odd)
    result = runner.invoke(thinc_cli.app, ["verify", str(odd)])
    assert result.exit_code == 0 and "\x1b" not in result.stdout and "\\x1b" in result.stdout


def test_thin_exec_fits_its_default_length_and_says_what_it_ignores(artifact):
    from thin.runtime import load

    # The fixture's model has 256 positions: a prompt of nearly all of them leaves a few, and the default
    # length (512) is cut to them.
    prompt = " ".join(["a"] * 120)
    left = 256 - len(load(artifact).encode(prompt))
    assert 1 <= left < 50
    result = runner.invoke(exec_cli.app, [str(artifact), "--raw", "-p", prompt])
    assert result.exit_code == 0 and f"decode: {left} tokens" in result.stderr, result.output
    result = runner.invoke(exec_cli.app, [str(artifact), "--raw", "-p", prompt, "--max-new-tokens", "50"])
    one_error(result, "thin-exec: error:", "exceeds")  # a length the user gave is kept, and refused
    result = runner.invoke(exec_cli.app, [str(artifact), "--raw", "-p", "x", "--max-new-tokens", "2",
                                          "--top-p", "0.5", "--seed", "1"])
    assert result.exit_code == 0 and "note: decoding is greedy" in result.stderr and "--top-p, --seed" in result.stderr
    one_error(runner.invoke(exec_cli.app, [str(artifact), "-p", "x", "--no-graph"]), "thin-exec: error:",
              "--no-graph is for --device cuda")
    one_error(runner.invoke(exec_cli.app, [str(artifact), "-p", ""], input="piped text"), "thin-exec: error:",
              "--prompt is empty")


def test_a_closed_pipe_ends_thin_exec_quietly(artifact):
    run = subprocess.run(["sh", "-c", '"$@" | head -c 1 >/dev/null', "sh", *command("thin-exec"), str(artifact),
                          "--raw", "-p", "def", "--max-new-tokens", "200"], capture_output=True, text=True, timeout=120)
    assert "error" not in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_serve_refuses_an_empty_api_key(artifact):
    from thin.runtime.serve.cli import app

    one_error(runner.invoke(app, [str(artifact), "--api-key", ""]), "thin-exec serve: error:", "--api-key")


def test_ffn_levels_below_one_superblock_a_layer_are_refused_before_calibration(tmp_path):
    # 512 channels a layer: one 128-channel superblock is a quarter of the FFN bytes, the least a level keeps.
    make_checkpoint("llama", tmp_path / "wide", vocab_size=320, intermediate_size=512)
    write_tokenizer(tmp_path / "wide", vocab_size=300)
    out = tmp_path / "x.thin"
    for args in (["compile", str(tmp_path / "wide"), "-o", str(out), "--device", "cpu"], ["key", str(tmp_path / "wide")]):
        result = runner.invoke(thinc_cli.app, [*args, "--ffn-levels", "0.5,1e-9"])
        line = one_error(result, "thinc: error:", "--ffn-levels 1e-09 keeps fewer FFN bytes than one 128-channel")
        assert "0.25 of them" in line and "ask for 0.25 or more" in line and "calibrate" not in result.output
    assert runner.invoke(thinc_cli.app, ["key", str(tmp_path / "wide"), "--ffn-levels", "0.25"]).exit_code == 0
    assert not out.exists()


def test_keep_lm_head_on_a_tied_model_is_refused(source, tmp_path):
    make_checkpoint("qwen2", tmp_path / "tied", vocab_size=320)
    write_tokenizer(tmp_path / "tied", vocab_size=300)
    for folder, code in ((tmp_path / "tied", 1), (source, 0)):
        result = runner.invoke(thinc_cli.app, ["key", str(folder), "--quant", "int8", "--keep-lm-head"])
        assert result.exit_code == code, result.output
    one_error(runner.invoke(thinc_cli.app, ["compile", str(tmp_path / "tied"), "-o", str(tmp_path / "x.thin"),
                                            "--quant", "int8", "--keep-lm-head"]), "thinc: error:",
              "this model's LM head is its embedding")


def test_a_checkpoint_with_nan_weights_is_refused(source, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan"
    shutil.copytree(source, folder)
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(shard)
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    tensors[name].view(-1)[[3, 7]] = torch.tensor([float("nan"), float("-inf")], dtype=tensors[name].dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    line = one_error(runner.invoke(thinc_cli.app, ["compile", str(folder), "-o", str(tmp_path / "x.thin")]),
                     "thinc: error:", f"tensor {name!r} holds 2 NaN or infinite value(s)")
    assert "damaged" in line and not (tmp_path / "x.thin").exists()


def test_an_interruption_mentions_the_output_only_where_there_is_one(capsys):
    def terminated():
        raise thinc_cli._Terminated(15)

    for writes, said in ((True, "terminated by SIGTERM; nothing was written at the output path"),
                         (False, "terminated by SIGTERM")):
        with pytest.raises(thinc_cli.typer.Exit) as info:
            thinc_cli._guard(terminated, writes=writes)
        assert info.value.exit_code == 128 + 15
        assert capsys.readouterr().err.strip() == f"thinc: error: {said}"


def test_chat_template_kwargs_cannot_break_the_template_call(artifact):
    from thin.runtime import load
    from thin.runtime.serve.errors import ApiError
    from thin.runtime.serve.protocol import ChatRequest, chat_prompt

    model = load(artifact)

    def prompt(**kwargs):
        request = ChatRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], **kwargs)
        return model.tokenizer.decode(chat_prompt(model, request))

    opened = prompt()
    assert opened.rstrip().endswith("assistant")
    assert prompt(chat_template_kwargs={"add_generation_prompt": True}) == opened
    assert not prompt(chat_template_kwargs={"add_generation_prompt": False}).rstrip().endswith("assistant")
    for kwargs, match in (({"add_generation_prompt": "yes"}, "must be true or false"),
                          ({"messages": []}, "cannot set 'messages'"), ({"tools": []}, "cannot set 'tools'")):
        with pytest.raises(ApiError, match=match) as info:
            prompt(chat_template_kwargs=kwargs)
        assert info.value.status == 400 and info.value.param == "chat_template_kwargs"


def test_chat_turns_that_fail_say_what_to_do(source, artifact, tmp_path, monkeypatch, capsys):
    # A template's own refusal (raise_exception) is named as the template's, with the way around it.
    folder = tmp_path / "refusing"
    shutil.copytree(source, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ raise_exception('nope') }}"}))
    build(folder, tmp_path / "refusing.thin", CompileConfig())
    one_error(runner.invoke(exec_cli.app, [str(tmp_path / "refusing.thin"), "-p", "hello"]), "thin-exec: error:",
              "the chat template refused the prompt: nope (--raw sends the text without the template)")
    # Bytes that are not UTF-8: the position is in the text given, not in the rendered template.
    run = subprocess.run([*command("thin-exec"), str(artifact), "-p", b"ab\xff"], capture_output=True, timeout=120)
    assert run.returncode == 1 and b"character 2 is a lone surrogate" in run.stderr, run.stderr
    # A conversation that outgrows the context: the history is the prompt's bulk, and /reset is the way out.
    from thin.runtime import load

    lines = iter([" ".join(["a"] * 100)] * 3)

    def typed(_prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", typed)
    exec_cli._chat(load(artifact), False, {"max_new_tokens": 4})
    err = capsys.readouterr().err
    assert "exceeds the model's max_position_embeddings" in err and "/reset clears it" in err, err


def test_an_artifact_path_that_leads_nowhere_gets_one_message_everywhere(tmp_path):
    from thin.runtime.serve.cli import app as serve_app

    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "folder.thin").mkdir()
    cases = ((tmp_path / "loop1", "is a symbolic link that leads to no file (broken, or a loop)"),
             (tmp_path / "gone.thin", "no such artifact"), (tmp_path / "folder.thin", "is not a file"))
    for path, match in cases:
        for app, args, prefix in ((thinc_cli.app, ["inspect", str(path)], "thinc: error:"),
                                  (thinc_cli.app, ["verify", str(path)], "thinc: error:"),
                                  (exec_cli.app, [str(path), "-p", "x"], "thin-exec: error:"),
                                  (serve_app, [str(path)], "thin-exec serve: error:")):
            one_error(runner.invoke(app, args), prefix, match)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
