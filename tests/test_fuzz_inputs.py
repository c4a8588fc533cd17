"""Fuzzed model folders and chat templates: every case ends in a one-line ThinError or a correct result,
quickly and in bounded memory (the artifact reader has its own fuzz test, test_artifact_fuzz.py)."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import tracemalloc

import pytest

import thin.runtime.template_limits as limits
from thin.compiler import CompileConfig, build
from thin.compiler.hf import load_checkpoint
from thin.ir import ThinError
from thin.runtime import ChatTemplateError, load, render_chat

from hf_tiny import make_checkpoint
from tiny_tokenizer import CHATML, write_tokenizer

N_FOLDER_CASES = 400
N_TEMPLATE_CASES = 300
SECRET = "SECRET-c41d"
ABSURD = [float("nan"), float("inf"), float("-inf"), -1, 0, 1, 3, 2**31, 2**63, 10**30, 1e308, 0.5, True, False,
          None, "", "x", "\x1b[2J", "../../etc/passwd", [], {}, [1, 2], [None], {"rope_type": "yarn"},
          {"a": {"b": {}}}, "9" * 30, [[[[[]]]]], "ü" * 100]
CONFIG_KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
               "rope_scaling", "hidden_act", "tie_word_embeddings", "attention_bias", "mlp_bias", "architectures",
               "partial_rotary_factor", "sliding_window", "layer_types", "quantization_config", "intermediate_size"]
AUX_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
             "chat_template.jinja", "chat_template.json"]
TEMPLATE_PIECES = [
    "{{ messages[0].content }}", "{% for m in messages %}{{ m.role }}{% endfor %}", "{{ 'ab' * N }}",
    "{% for i in range(N) %}X{% endfor %}", "{% for i in range(N) %}{% for j in range(N) %}{% endfor %}{% endfor %}",
    "{{ N ** N }}", "{{ 'x'|center(N) }}", "{{ '%Nd' % 1 }}", "{{ '{:>N}'.format(1) }}", "{{ ('a' * N).replace('', 'bb') }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(N) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{{ (['z' * N] * N)|join }}", "{{ [N] * N }}", "{{ range(N)|list|tojson }}", "{{ raise_exception('no') }}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(N) }}",
    "{{ N / 0 }}", "{{ messages[N] }}", "{{ ''.__class__ }}", "{{ messages.append(1) }}", "{% for %}",
    "{{ ('a\\n' * N)|indent(N) }}", "{{ lipsum(N) }}", "{{ dict(a=N)|items|list }}", "{{ 'é' * N|string }}",
    "{{ (messages * N)|length }}", "{% if N %}{{ N }}{% else %}{{ -N }}{% endif %}", "{{ strftime_now('%Y' * N) }}",
]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint("llama", path, vocab_size=320)
    write_tokenizer(path, vocab_size=300)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "do_sample": False}))
    return path


def _edit_json(path, rng):
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        value = {}
    if not isinstance(value, dict):
        value = {}
    keys = list(value) + (CONFIG_KEYS if path.name == "config.json" else ["chat_template", "bos_token",
                                                                          "eos_token_id", "temperature", "top_k"])
    key = rng.choice(keys)
    if rng.random() < 0.2:
        value.pop(key, None)
    else:
        value[key] = rng.choice(ABSURD)
    path.write_text(json.dumps(value))


def _edit_safetensors(path, rng):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = rng.choice([k for k in header if k != "__metadata__"])
    kind = rng.randrange(5)
    if kind == 0:
        header[name][rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(ABSURD)
    elif kind == 1:
        other = rng.choice([k for k in header if k != "__metadata__"])
        header[name]["data_offsets"] = header[other]["data_offsets"]
    elif kind == 2:
        header[name]["data_offsets"] = [v + rng.choice([-4, 4, 2**40]) for v in header[name]["data_offsets"]]
    elif kind == 3:
        path.write_bytes(raw[:rng.randrange(len(raw))])
        return
    else:
        blob = bytearray(raw)
        blob[rng.randrange(min(8 + n, len(blob)))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(blob))
        return
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n:])


def _mutate(folder, rng, outside) -> str:
    kind = rng.randrange(8)
    if kind <= 1:
        _edit_json(folder / "config.json", rng)
        return "config value"
    if kind == 2:
        (folder / "config.json").write_bytes(rng.choice([
            b"", b"{", b"\xff\xfe", b"[" * 50_000, b'{"vocab_size": ' + b"7" * 3000 + b"}", b"NaN", b"null"]))
        return "config text"
    if kind == 3:
        _edit_safetensors(folder / "model.safetensors", rng)
        return "safetensors header"
    if kind == 4:
        shard = rng.choice(["model.safetensors", "/etc/passwd", str(outside), "../model.safetensors", "sub/../x",
                            7, None, "", "model.safetensors\x00"])
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"model.embed_tokens.weight": shard}} if rng.random() < 0.8 else rng.choice(ABSURD)))
        return "index"
    name = rng.choice(AUX_FILES)
    path = folder / name
    if kind == 5:
        if name.endswith(".json"):
            _edit_json(path, rng)
        else:
            path.write_text(rng.choice(TEMPLATE_PIECES).replace("N", str(rng.choice([1, 7, 100000, 10**9]))))
        return "auxiliary value"
    if kind == 6:
        path.write_bytes(rng.choice([b"", b"\xff\xfe\x00", b"{}", b"[]", b'{"model": 5}', b"{{", b"null",
                                     b'{"chat_template": [{"name": "x"}]}', os.urandom(64)]))
        return "auxiliary bytes"
    path.unlink(missing_ok=True)
    choice = rng.randrange(4)
    if choice == 0:
        path.symlink_to(outside)
    elif choice == 1:
        os.mkfifo(path)
    elif choice == 2:
        path.mkdir()
    else:
        path.symlink_to(folder / "nowhere")
    return "file kind"


def _one_line_thin_error(error: BaseException) -> None:
    assert isinstance(error, ThinError), f"{type(error).__name__}: {error}"
    message = str(error)
    assert message and "\n" not in message and SECRET not in message, message


def test_fuzzed_model_folders_fail_cleanly(source, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    rng = random.Random(20260530)
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"bos_token": SECRET, "chat_template": SECRET}))
    outcomes: dict[str, set] = {}
    compiled = 0
    for case in range(N_FOLDER_CASES):
        folder = tmp_path / f"case{case}"
        shutil.copytree(source, folder)
        label = _mutate(folder, rng, outside)
        tracemalloc.start()
        started = time.perf_counter()
        try:
            source_ = load_checkpoint(folder)
            outcome = "loaded"
        except Exception as e:  # noqa: BLE001 -- anything but a one-line ThinError fails the test below
            _one_line_thin_error(e)
            outcome = type(e).__name__
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert time.perf_counter() - started < 20, f"case {case} ({label}) took too long"
        assert peak < 300 << 20, f"case {case} ({label}) traced {peak >> 20} MiB"
        outcomes.setdefault(label, set()).add(outcome)
        if outcome == "loaded" and compiled < 12:  # what loads must compile, open and run
            compiled += 1
            assert SECRET not in (source_.chat_template or "")
            output = tmp_path / f"case{case}.thin"
            build(folder, output, CompileConfig())
            model = load(output)
            assert model.forward([0, 1, 2]).isfinite().all()
            if model.chat_template is not None:
                try:
                    model.render_chat([{"role": "user", "content": "hi"}])
                except ChatTemplateError as e:
                    _one_line_thin_error(e)
        shutil.rmtree(folder, ignore_errors=True)
    refused = set().union(*outcomes.values()) - {"loaded"}
    assert len(outcomes) == 7 and len(refused) >= 5 and compiled >= 5, (outcomes, compiled)


def test_fuzzed_templates_end_in_text_or_one_line_errors(monkeypatch):
    monkeypatch.setattr(limits, "TIME_LIMIT", 0.25)  # the same mechanism, a shorter budget: a faster test
    rng = random.Random(99)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    outcomes = {"text": 0, "error": 0}
    for case in range(N_TEMPLATE_CASES):
        pieces = rng.choices(TEMPLATE_PIECES, k=rng.randint(1, 4))
        template = "".join(p.replace("N", str(rng.choice([0, 1, 3, 64, 1000, 100000, 10**9]))) for p in pieces)
        tracemalloc.start()
        started = time.perf_counter()
        try:
            text = render_chat(template, messages)
            assert isinstance(text, str) and len(text) <= limits.MAX_CHARS
            outcomes["text"] += 1
        except ChatTemplateError as e:
            _one_line_thin_error(e)
            outcomes["error"] += 1
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert time.perf_counter() - started < 20, f"case {case}: {template[:200]!r}"  # a hang, not a slow CI
        assert peak < 200 << 20, f"case {case} traced {peak >> 20} MiB: {template[:200]!r}"
    assert outcomes["text"] > 20 and outcomes["error"] > 20, outcomes
    assert render_chat(CHATML, messages).startswith("<|im_start|>user\nhello")
