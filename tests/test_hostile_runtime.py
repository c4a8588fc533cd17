"""The runtime refuses what it cannot run, by name: hostile templates within bounds, NaN and coerced
options, ids of the wrong type, shape or range, prompts too large, a KV cache that cannot fit; and
thin-exec turns each into one line (in the chat, one line and the session goes on)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import time
import tracemalloc

import pytest
import torch
from test_runtime_loader import write_tiny_artifact
from typer.testing import CliRunner

from thin.ir import IRVerificationError, verify
from thin.runtime import ChatTemplateError, GenerationOptions, load, render_chat
from thin.runtime import cli as exec_cli
from thin.runtime.errors import CacheAllocationError, InputError
from thin.runtime.inputs import MAX_PROMPT_BYTES
from thin.runtime.kv_cache import KVCache

from ir_fixtures import tiny_model

CHAT = [{"role": "user", "content": "hi"}]
HOSTILE_TEMPLATES = {
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "string loops": "{% set s = 'ab' * 3000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "exponential macro": "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "repetition": "{{ 'a' * 10**10 }}",
    "list repetition": "{{ [0] * 10**9 }}",
    "power": "{{ 7 ** 1000000000 }}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "padding": "{{ 'a'.center(10**9) }}{{ 'a'|center(999999999) }}",
    "format width": "{{ '%999999999d' % 1 }}",
    "brace width": "{{ '{:>999999999}'.format(1) }}",
    "replace": "{% set s = 'a' * 1000000 %}{{ s.replace('', s) }}",
    "join": "{% set l = ['a' * 1000000] * 1000 %}{{ l|join }}",
    "print shared": "{% set l = ['a' * 1000000] * 1000 %}{{ l }}",
    "tojson": "{% set l = ['a' * 1000000] * 1000 %}{{ l|tojson(indent=1000) }}",
    "indent": "{{ ('a\\n' * 1000000)|indent(1000000) }}",
    "literal output": "{% for i in range(100000) %}" + "y" * 200 + "{% endfor %}",
    "captured output": "{% set x %}{% for i in range(100000) %}{{ 'y' * 200 }}{% endfor %}{% endset %}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "lipsum": "{{ lipsum(10000000) }}",
    "deep syntax": "{{" + "(" * 50000 + "1" + ")" * 50000 + "}}",
    # A list that holds itself twice, doubled 40 times: 2^40 items once printed, converted or compared.
    **{f"self-doubling {way}": "{% set a = [1] %}{% set b = [1] %}" + "{% set a = [a, a] %}{% set b = (b, b) %}" * 40
       + way for way in ("{{ a|string }}", "{{ a|pprint }}", "{{ a|lower }}", "{{ [a]|join }}", "{{ a ~ '' }}",
                         "{{ a|replace('1', '2') }}", "{{ a == b|list }}", "{{ {'x': a}|length }}")},
    "python error": "{{ 1 / 0 }}",
    "type error": "{{ 'x' + 1 }}",
}


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES.values(), ids=HOSTILE_TEMPLATES.keys())
def test_hostile_templates_end_in_one_line_within_bounds(template):
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ChatTemplateError) as info:
            render_chat(template, CHAT)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.perf_counter() - started < 10
    assert peak < 100 << 20, f"{peak >> 20} MiB"
    assert "\n" not in str(info.value) and str(info.value)


def test_bounded_templates_render_ordinary_loops_and_large_prompts():
    long = [{"role": "user", "content": "x" * 3_000_000}] * 2
    text = render_chat("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", long)
    assert len(text) == 2 * (3_000_000 + 7)
    assert render_chat("{% for i in range(3) %}{{ i }}{% endfor %}{{ 'ab' * 3 }}{{ 2 ** 10 }}", CHAT) == "012ababab1024"


@pytest.mark.parametrize("options", [
    {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -1}, {"temperature": "0.7"},
    {"repetition_penalty": math.nan}, {"repetition_penalty": 0}, {"top_p": math.nan}, {"min_p": math.nan},
    {"top_k": 2.5}, {"top_k": True}, {"max_new_tokens": 3.5}, {"max_new_tokens": -1},
    {"seed": 2**64}, {"seed": -(2**63) - 1}, {"seed": 1.5}, {"stop_token_ids": (1.5,)}, {"stop_token_ids": ("2",)},
], ids=str)
def test_generation_options_refuse_nan_and_coercion(options):
    with pytest.raises(InputError, match=next(iter(options))):
        GenerationOptions(**options)


@pytest.mark.parametrize("config", [
    {"do_sample": True, "temperature": "0.7"}, {"do_sample": "false"}, {"top_k": 2.0},
    {"eos_token_id": [1.5]}, {"eos_token_id": "2"}, {"max_new_tokens": "5"}, {"top_p": math.nan},
], ids=str)
def test_generation_configs_are_type_checked(config):
    with pytest.raises(InputError, match="generation_config|invalid generation options"):
        GenerationOptions.from_generation_config(config)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rt")
    write_tiny_artifact(tmp / "tiny.thin", tmp)
    return tmp / "tiny.thin"


@pytest.fixture(scope="module")
def model(artifact):
    return load(artifact)


@pytest.mark.parametrize("ids,match", [
    ([[1, 2], [3, 4]], "one sequence"), (torch.tensor([[1, 2]]), "one sequence"), ([1.7, 2.2], "integers"),
    (torch.tensor([1.0, 2.0]), "integer dtype"), ([True, False], "integers"), ([1, 10**6], "vocabulary"),
    ([-1], "vocabulary"), (torch.tensor([5, 999_999]), "999999"), ("abc", "sequence of integers"),
])
def test_forward_and_generate_refuse_ids_they_cannot_take(model, ids, match):
    with pytest.raises(InputError, match=match):
        model.forward(ids)
    if not isinstance(ids, str):
        with pytest.raises(InputError):
            list(model.generate(ids, max_new_tokens=1))
    with pytest.raises(InputError, match="integer dtype|vocabulary"):
        model.executor.forward(torch.tensor([0.5]) if match != "vocabulary" else torch.tensor([10**6]))


def test_python_api_misuse_is_refused_not_defaulted(artifact, model):
    from thin.runtime.generate import ContextTooLongError
    from thin.runtime.loader import FFNLevelError

    ids = list(range(1, 40))
    for options, match in (({"context": 0}, "context must be >= 2"), ({"stride": 0}, "stride must be in"),
                           ({"context": 8.5}, "whole number"), ({"stride": True}, "whole number")):
        with pytest.raises(ValueError, match=match):
            model.perplexity(ids, **options)
    for keep in ("0.5", "1", None, 0, 1.5, float("nan")):
        with pytest.raises(FFNLevelError, match=r"a number in \(0, 1\]"):
            model.set_ffn_keep(keep)
    with pytest.raises(InputError, match="belongs to another model"):
        model.generate([1, 2], max_new_tokens=1, conversation=load(artifact).new_conversation())
    limit = model.ir.max_position_embeddings
    with pytest.raises(ContextTooLongError, match="in windows"):
        model.forward([1] * (limit + 1))
    assert model.forward([1] * limit).shape[0] == limit


def test_prompt_text_is_bounded_before_tokenizing(model):
    with pytest.raises(InputError, match=str(MAX_PROMPT_BYTES)):
        model.encode("é" * (MAX_PROMPT_BYTES // 2 + 1))
    with pytest.raises(InputError, match="surrogate"):
        model.encode("ab\udcff")


def test_a_kv_cache_that_cannot_fit_is_refused_by_name(monkeypatch):
    import thin.runtime.kv_cache as kv

    monkeypatch.setattr(kv, "available_memory", lambda device: 1 << 20)
    with pytest.raises(CacheAllocationError, match="GiB"):
        KVCache([(8, 128)] * 32, 100_000, torch.float32)
    monkeypatch.setattr(kv, "available_memory", lambda device: None)
    with pytest.raises(CacheAllocationError, match="could not allocate"):
        KVCache([(8, 128)] * 32, 2**40, torch.float32)  # more than any address space holds


@pytest.mark.parametrize("field", ["embedding.scale", "final_softcap", "weight_offset", "eps", "theta", "scale",
                                   "logit_softcap", "llama3"])
def test_the_verifier_refuses_nan_and_infinity(field):
    model = tiny_model(num_layers=1)
    layer = model.layers[0]
    attention = layer.attention
    if field == "embedding.scale":
        model = dataclasses.replace(model, embedding=dataclasses.replace(model.embedding, scale=math.nan))
    elif field == "final_softcap":
        model = dataclasses.replace(model, lm_head=dataclasses.replace(model.lm_head, final_softcap=math.inf))
    elif field in ("weight_offset", "eps"):
        norm = dataclasses.replace(model.final_norm, **{field: math.nan})
        model = dataclasses.replace(model, final_norm=norm)
    else:
        changes = {"theta": {"rope": dataclasses.replace(attention.rope, theta=math.inf)},
                   "scale": {"scale": math.nan}, "logit_softcap": {"logit_softcap": math.nan},
                   "llama3": {"rope": dataclasses.replace(attention.rope, kind="llama3", factor=8.0,
                                                          low_freq_factor=4.0, high_freq_factor=4.0,
                                                          original_max_position_embeddings=64)}}[field]
        layer = dataclasses.replace(layer, attention=dataclasses.replace(attention, **changes))
        model = dataclasses.replace(model, layers=(layer,))
    with pytest.raises(IRVerificationError):
        verify(model)


runner = CliRunner()


@pytest.mark.parametrize("args,match", [
    (["--repetition-penalty", "nan"], "repetition_penalty"), (["--temperature", "nan"], "temperature"),
    (["--temperature", "inf"], "temperature"), (["--seed", str(2**70)], "seed"), (["--top-p", "nan"], "top_p"),
])
def test_thin_exec_refuses_bad_numbers_in_one_line(artifact, args, match):
    result = runner.invoke(exec_cli.app, [str(artifact), "--prompt", "x", "--max-new-tokens", "2", *args])
    assert result.exit_code == 1 and match in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_thin_exec_refuses_invalid_utf8_on_stdin(artifact):
    run = subprocess.run([sys.executable, "-m", "thin.runtime.cli", str(artifact), "--raw", "--max-new-tokens", "2"],
                         input=b"def f(\xff\xfe):", capture_output=True, timeout=120)
    lines = run.stderr.decode().strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and "UTF-8" in lines[0], run.stderr


def test_a_failing_template_turn_does_not_end_the_chat(tmp_path, monkeypatch, capsys):
    write_tiny_artifact(tmp_path / "bad.thin", tmp_path, chat_template="{{ messages[0].content / 0 }}")
    model = load(tmp_path / "bad.thin")
    lines = iter(["hello", "again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    exec_cli._chat(model, raw=False, options={"max_new_tokens": 2})
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("thin-exec: error:")]
    assert len(errors) == 2 and all("chat template" in e for e in errors)
    assert next(lines, None) is None  # every line was read: the session went on to /exit
