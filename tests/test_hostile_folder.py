"""A model folder is untrusted: nothing outside it is read, every file is what it claims to be, every
bad value is a one-line FrontendError, and the cache key covers exactly the files a compile reads."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from thin.compiler import CompileConfig, build
from thin.compiler.cli import app
from thin.compiler.hf import CheckpointError, FrontendError, load_checkpoint
from thin.compiler.hf.errors import (
    AuxiliaryFileError,
    ConfigMismatchError,
    InputChangedError,
    OutsideModelFolderError,
)

from commands import command
from hf_tiny import build_model, make_checkpoint
from tiny_tokenizer import write_tokenizer

SECRET = "SECRET-7f3a"  # what a host file holds; it must never reach an error message or an artifact


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint("llama", path, vocab_size=320)
    eos = write_tokenizer(path, vocab_size=300)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}))
    return path


@pytest.fixture
def folder(source, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(source, dst)
    return dst


@pytest.fixture
def host_file(tmp_path):
    """A file outside the model folder standing in for /etc/shadow."""
    path = tmp_path / "host" / "shadow"
    path.parent.mkdir()
    path.write_text(json.dumps({"bos_token": SECRET, "chat_template": SECRET}))
    return path


def _refused(folder, error=FrontendError, match=None) -> str:
    with pytest.raises(error, match=match) as info:
        load_checkpoint(folder)
    message = str(info.value)
    assert "\n" not in message and SECRET not in message, message
    return message


@pytest.mark.parametrize("name", ["special_tokens_map.json", "chat_template.jinja", "tokenizer_config.json",
                                  "generation_config.json", "config.json"])
def test_a_symlink_out_of_the_folder_is_refused(folder, host_file, name):
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(host_file)
    assert "outside the model folder" in _refused(folder, OutsideModelFolderError)


def test_a_symlinked_directory_out_of_the_folder_is_refused(folder, host_file):
    build_model("llama", vocab_size=320).save_pretrained(folder, max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    outside = host_file.parent / "weights"
    outside.mkdir()
    for shard in set(index["weight_map"].values()):
        shutil.move(folder / shard, outside / shard)
    (folder / "shards").symlink_to(outside)
    index["weight_map"] = {t: f"shards/{s}" for t, s in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors").unlink()
    _refused(folder, OutsideModelFolderError)


@pytest.mark.parametrize("shard", ["/etc/passwd", "../model.safetensors", "..", "sub/../../x.safetensors",
                                   "a\\b.safetensors", "", 5, None, ["model.safetensors"]])
def test_index_entries_must_be_plain_names_inside(folder, shard):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": shard}}))
    # Refused for what the name is, before anything it names is opened.
    _refused(folder, CheckpointError, match="not a plain path|must be a string")


def test_symlinks_inside_the_folder_and_hub_snapshots_are_followed(source, tmp_path):
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in source.iterdir():  # the hub cache layout: every file a link into ../../blobs
        blob = repo / "blobs" / f"sha-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    assert load_checkpoint(snapshot).chat_template
    inside = tmp_path / "linked"
    shutil.copytree(source, inside)
    (inside / "real").mkdir()
    shutil.move(inside / "tokenizer.json", inside / "real" / "tokenizer.json")
    (inside / "tokenizer.json").symlink_to("real/tokenizer.json")
    assert "tokenizer.json" in load_checkpoint(inside).tokenizer_files


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_a_fifo_is_refused_without_hanging(folder, tmp_path, name):
    (folder / name).unlink()
    os.mkfifo(folder / name)
    run = subprocess.run(command("thinc") + ["compile", str(folder), "-o", str(tmp_path / "x.thin")],
                         capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "not a regular file" in lines[-1] and lines[-1].startswith("thinc: error:")
    assert not (tmp_path / "x.thin").exists()


@pytest.mark.parametrize("name,content,match", [
    ("tokenizer_config.json", b"{not json", "not valid JSON"),
    ("special_tokens_map.json", b"[1, 2]", "JSON object"),
    ("tokenizer_config.json", b'{"chat_template": 5}', "chat_template"),
    ("tokenizer_config.json", b'{"bos_token": ["<s>"]}', "special token"),
    ("chat_template.jinja", b"\xff\xfe{{ messages }}", "UTF-8"),
    ("chat_template.jinja", b"{% for %}", "does not compile"),
    ("tokenizer.json", b'{"version": "1.0"}', "could not be loaded"),
    ("generation_config.json", b'{"do_sample": true, "temperature": "hot"}', "temperature"),
    ("generation_config.json", b'{"do_sample": "yes"}', "do_sample"),
    ("generation_config.json", b'{"eos_token_id": [1.5]}', "eos_token_id"),
    ("generation_config.json", b'{"top_p": NaN}', "top_p"),
    ("generation_config.json", b'{"max_new_tokens": 0}', "max_new_tokens must be at least 1"),
    ("tokenizer_config.json", b'{"chat_template": [{"name": "default"}]}', "'default' entry has no template"),
])
def test_auxiliary_files_are_parsed_and_checked(folder, name, content, match):
    (folder / name).write_bytes(content)
    _refused(folder, match=match)


def test_a_tokenizer_with_ids_past_the_vocabulary_is_refused(folder):
    write_tokenizer(folder, vocab_size=400)  # the model's vocabulary has 320 entries
    assert "320" in _refused(folder, AuxiliaryFileError, match="vocabulary")


@pytest.mark.parametrize("changes,match", [
    ({"hidden_size": 48}, "does not fit the weights"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"head_dim": 0}, "head_dim"),
    ({"hidden_size": 3, "head_dim": None}, "head_dim"),
    ({"rope_parameters": "fast"}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": "x", "rope_theta": 1e4}}, "factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "factor"),
    ({"rope_parameters": {"rope_type": ["default"], "rope_theta": 1e4}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}}, "rope_theta"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps"),
    # transformers 5 reads the older rope_scaling alone when both are there (its theta too): a guess either way.
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "differ in factor, rope_theta, rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": {"type": "default"}},
     "differ in rope_theta"),
    ({"partial_rotary_factor": 7.0}, "partial_rotary_factor"),
    ({"num_hidden_layers": 300_000_000}, "num_hidden_layers"),
    ({"num_hidden_layers": -1}, "num_hidden_layers"),
    ({"vocab_size": "320"}, "vocab_size"),
    ({"attention_bias": "false"}, "attention_bias"),
    ({"hidden_act": ["silu"]}, "hidden_act"),
    ({"architectures": [["LlamaForCausalLM"]]}, "architectures"),
    ({"architectures": "LlamaForCausalLM"}, "architectures"),
    ({"quantization_config": "awq"}, "pre-quantized"),
])
def test_bad_config_values_are_one_line_errors(folder, changes, match):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    _refused(folder, match=match)


def test_rope_scaling_that_repeats_rope_parameters_is_read(folder):
    config = json.loads((folder / "config.json").read_text())
    before = load_checkpoint(folder).program.model.layers[0].attention.rope
    legacy = dict(config["rope_parameters"])
    legacy["type"] = legacy.pop("rope_type")
    (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": legacy}))
    assert load_checkpoint(folder).program.model.layers[0].attention.rope == before


@pytest.mark.parametrize("text", ['{"vocab_size": ' + "9" * 5000 + "}", "[" * 100_000 + "]" * 100_000,
                                  '{"a": ' + "[" * 3000 + "]" * 3000 + "}", '{"a": 1}' + " " * 10 + "x"],
                         ids=["5000 digits", "deep array", "deep value", "trailing data"])
def test_hostile_json_is_one_line(folder, text):
    (folder / "config.json").write_text(text)
    _refused(folder, CheckpointError)


def _rewrite_header(path, edit, extra: bytes = b""):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob = blob[:-1] + extra + b"}" if extra else blob
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n:])


def test_overlapping_safetensors_offsets_are_refused(folder):
    def overlap(header):
        names = [k for k in header if k != "__metadata__" and header[k]["shape"] == [64]]
        header[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]

    _rewrite_header(folder / "model.safetensors", overlap)
    _refused(folder, CheckpointError, match="overlaps|gap")
    clean = folder.parent / "clean.safetensors"
    shutil.copy(folder / "model.safetensors", clean)
    for extra in (b', "deep": ' + b"[" * 5000 + b"]" * 5000, b', "big": ' + b"7" * 5000,
                  b', "many": [' + b"[]," * 2_000_000 + b"[]]"):
        shutil.copy(clean, folder / "model.safetensors")
        _rewrite_header(folder / "model.safetensors", lambda h: None, extra)
        _refused(folder, CheckpointError)


def test_a_shard_that_changes_after_its_header_was_read_is_refused(folder):
    source = load_checkpoint(folder)
    shard = folder / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # the last tensor's last byte: same size, new content
    shard.write_bytes(bytes(data))
    with pytest.raises(InputChangedError, match="changed"):
        for name in source.program.weights:
            source.program.load(name)


def test_a_config_that_disagrees_with_its_weights_names_the_first_violation(folder):
    config = json.loads((folder / "config.json").read_text())
    config["num_key_value_heads"] = 4  # the k and v weights hold 2 heads
    (folder / "config.json").write_text(json.dumps(config))
    message = _refused(folder, ConfigMismatchError, match="does not fit the weights")
    assert "attn.k" in message and "more)" in message


def test_a_config_that_disagrees_with_its_weights_is_one_line_on_the_cli(folder, tmp_path):
    config = json.loads((folder / "config.json").read_text())
    config["num_key_value_heads"] = 4  # the k and v weights hold 2 heads
    (folder / "config.json").write_text(json.dumps(config))
    run = subprocess.run(command("thinc") + ["compile", str(folder), "-o", str(tmp_path / "x.thin")],
                         capture_output=True, text=True, timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("thinc: error:")]
    assert run.returncode == 1 and "Traceback" not in run.stderr and len(errors) == 1, run.stderr
    assert "does not fit the weights" in errors[0] and run.stderr.strip().splitlines()[-1] == errors[0]


def _shard_into_subfolder(folder):
    build_model("llama", vocab_size=320).save_pretrained(folder, max_shard_size="40KB")
    (folder / "model.safetensors").unlink()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / "shards").mkdir()
    for shard in set(index["weight_map"].values()):
        shutil.move(folder / shard, folder / "shards" / shard)
    index["weight_map"] = {t: f"shards/{s}" for t, s in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return sorted((folder / "shards").iterdir())


def test_the_key_covers_exactly_the_files_a_compile_reads(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    shards = _shard_into_subfolder(folder)
    config = CompileConfig()
    cache = tmp_path / "cache"

    def compile_and_key(name):
        report = build(folder, tmp_path / name, config, cache_dir=cache)
        run = CliRunner().invoke(app, ["key", str(folder)])
        assert run.exit_code == 0, run.output
        assert run.stdout.strip() == report.key, "thinc key and thinc compile must agree"
        return report

    first = compile_and_key("a.thin")
    source = load_checkpoint(folder)
    assert set(source.inputs) >= {f"shards/{s.name}" for s in shards} and not first.cache_hit
    # Files the frontend does not read do not change the key...
    (folder / "README.md").write_text("notes")
    (folder / "pytorch_model.bin").write_bytes(b"stale")
    assert compile_and_key("b.thin").key == first.key
    # ...a changed weight in a subfolder shard does, so the old artifact is not served.
    tensors = {}
    from safetensors.torch import load_file

    tensors = load_file(shards[0])
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, shards[0], metadata={"format": "pt"})
    changed = compile_and_key("c.thin")
    assert changed.key != first.key and not changed.cache_hit
    from thin.runtime import load

    assert not torch.equal(load(tmp_path / "a.thin").forward([1, 2, 3]), load(tmp_path / "c.thin").forward([1, 2, 3]))
