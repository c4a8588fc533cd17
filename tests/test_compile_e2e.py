"""End to end through the CLIs: thinc compile / inspect / verify / key, thin-exec, and the Python API."""

import json
import shutil
import subprocess

import pytest

from commands import command
from hf_tiny import make_checkpoint
from tiny_tokenizer import write_tokenizer


def _cli(name: str, *args, input: str | None = None):
    return subprocess.run(command(name) + [str(a) for a in args], capture_output=True, text=True, input=input,
                          timeout=300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_checkpoint("qwen3", path, vocab_size=320)
    eos = write_tokenizer(path, vocab_size=300)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}))
    return path


@pytest.fixture(scope="module")
def compiled(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "model.thin"
    run = _cli("thinc", "compile", checkpoint, "-o", out)
    assert run.returncode == 0, run.stderr
    return out, run


def test_compile_prints_stages_and_summary(compiled):
    out, run = compiled
    assert out.is_file()
    for stage in ("load checkpoint", "pass fuse_projections", "write tensors"):
        assert stage in run.stderr
    for row in ("parameters", "tensors", "file bytes", "key", "time"):
        assert row in run.stdout


def test_two_compiles_are_byte_identical(checkpoint, compiled, tmp_path):
    again = tmp_path / "again.thin"
    assert _cli("thinc", "compile", checkpoint, "-o", again, "-q").returncode == 0
    assert again.read_bytes() == compiled[0].read_bytes()


def test_inspect_text_json_and_ir(compiled):
    out, _ = compiled
    text = _cli("thinc", "inspect", out)
    assert text.returncode == 0 and "f32" in text.stdout
    desc = json.loads(_cli("thinc", "inspect", out, "--json").stdout)
    assert isinstance(desc, dict) and desc
    ir = _cli("thinc", "inspect", out, "--ir")
    assert "layers.0.attn.qkv.weight role=attn.qkv" in ir.stdout


def test_verify_passes_then_names_a_flipped_tensor(compiled, tmp_path):
    out, _ = compiled
    ok = _cli("thinc", "verify", out)
    assert ok.returncode == 0, ok.stderr
    from thin.artifacts import open_artifact

    with open_artifact(out) as art:
        name = art.model.tensors[3].name
        offset = art.tensor_entry(name)["offset"]
    bad = tmp_path / "bad.thin"
    data = bytearray(out.read_bytes())
    data[offset + 5] ^= 0x10
    bad.write_bytes(bytes(data))
    run = _cli("thinc", "verify", bad)
    assert run.returncode == 1 and name in run.stderr and "Traceback" not in run.stderr
    run = _cli("thin-exec", bad, "--verify", "--raw", "--prompt", "def", "--max-new-tokens", "2")
    assert run.returncode != 0 and name in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("tool", [("thinc", "inspect"), ("thinc", "verify"), ("thin-exec",)])
def test_bad_files_give_one_line_errors(tool, tmp_path):
    garbage = tmp_path / "garbage.thin"
    garbage.write_bytes(b"not a thin file at all" * 10)
    for path in (garbage, tmp_path / "missing.thin"):
        run = _cli(*tool, path, *(["--prompt", "x"] if tool == ("thin-exec",) else []))
        assert run.returncode != 0
        assert "Traceback" not in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_thin_exec_generates_with_and_without_template(compiled):
    out, _ = compiled
    raw = _cli("thin-exec", out, "--raw", "--prompt", "def fibonacci(n):", "--max-new-tokens", "8")
    assert raw.returncode == 0, raw.stderr
    assert "tok/s" in raw.stderr
    chat = _cli("thin-exec", out, "--prompt", "hello", "--max-new-tokens", "4", "--temperature", "0.8",
                "--top-k", "20", "--top-p", "0.9", "--seed", "3")
    assert chat.returncode == 0, chat.stderr
    again = _cli("thin-exec", out, "--prompt", "hello", "--max-new-tokens", "4", "--temperature", "0.8",
                 "--top-k", "20", "--top-p", "0.9", "--seed", "3")
    assert again.stdout == chat.stdout


def test_key_changes_with_options_and_cache_dir_is_reused(checkpoint, tmp_path):
    k1 = _cli("thinc", "key", checkpoint).stdout.strip()
    assert k1 == _cli("thinc", "key", checkpoint).stdout.strip()
    assert len(k1) == 64 and k1 != _cli("thinc", "key", checkpoint, "--no-fuse").stdout.strip()
    cache = tmp_path / "cache"
    first = _cli("thinc", "compile", checkpoint, "-o", tmp_path / "a.thin", "--cache-dir", cache)
    assert first.returncode == 0 and "cache hit" not in first.stderr
    assert (cache / f"{k1}.thin").is_file()
    second = _cli("thinc", "compile", checkpoint, "-o", tmp_path / "b.thin", "--cache-dir", cache)
    assert second.returncode == 0 and "cache hit" in second.stderr
    assert (tmp_path / "a.thin").read_bytes() == (tmp_path / "b.thin").read_bytes()


def test_dump_ir_and_no_fuse(checkpoint, tmp_path):
    dump = tmp_path / "ir"
    run = _cli("thinc", "compile", checkpoint, "-o", tmp_path / "m.thin", "--dump-ir", dump, "--no-fuse", "-q")
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in dump.iterdir()) == ["00-input.txt", "01-order_tensors.txt", "02-layout_experts.txt"]
    assert "attn.qkv" not in (dump / "01-order_tensors.txt").read_text()


def test_unknown_architecture_and_missing_dir_are_one_line_errors(checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FrobnicatorForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    messages = []
    for src in (bad, tmp_path / "nowhere"):
        run = _cli("thinc", "compile", src, "-o", tmp_path / "x.thin")
        assert run.returncode != 0 and "Traceback" not in run.stderr
        # Progress lines may precede it; the error itself is one line, and the last.
        errors = [line for line in run.stderr.splitlines() if line.startswith("thinc: error:")]
        assert len(errors) == 1 and run.stderr.strip().splitlines()[-1] == errors[0], run.stderr
        messages.append(errors[0])
    assert "FrobnicatorForCausalLM" in messages[0] and "nowhere" in messages[1]
    assert not (tmp_path / "x.thin").exists()


def test_python_api_round_trip(checkpoint, tmp_path):
    import torch

    from thin.compiler import compile_model
    from thin.runtime import load

    from hf_tiny import load_reference

    path = compile_model(checkpoint, tmp_path / "api.thin", fuse_projections=False)
    model = load(path)
    ids = torch.arange(3, 40)
    ours = model.forward(ids)
    with torch.no_grad():
        ref = load_reference(checkpoint)(ids[None]).logits[0].float()
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cos.min() > 0.9999 and torch.equal(ours.argmax(-1), ref.argmax(-1))
    with pytest.raises(Exception, match="unknown compile option"):
        compile_model(checkpoint, tmp_path / "x.thin", quantise="int4")


def test_interactive_chat_in_a_real_terminal(compiled):
    """thin-exec with a terminal on stdin chats: a prompt, answers, /reset, /exit."""
    import os
    import pty
    import select

    out, _ = compiled
    cmd = command("thin-exec")
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd + [str(out), "--max-new-tokens", "4"], stdin=slave, stdout=slave,
                            stderr=slave, close_fds=True)
    os.close(slave)
    seen = bytearray()

    def read_until(marker: bytes, count: int) -> None:
        while seen.count(marker) < count:
            ready, _, _ = select.select([master], [], [], 120)
            assert ready, f"no {marker!r} from thin-exec; got {bytes(seen)!r}"
            try:
                seen.extend(os.read(master, 4096))
            except OSError:  # the child closed the terminal
                break

    try:
        read_until(b">>> ", 1)
        os.write(master, b"hello\n")
        read_until(b">>> ", 2)
        os.write(master, b"/reset\n")
        read_until(b">>> ", 3)
        os.write(master, b"/exit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        os.close(master)
    assert b"tok/s" in seen and b"Traceback" not in seen
