"""A chat's KV cache is reused across turns: only the new part of each prompt is prefilled, same tokens."""

from pathlib import Path

import pytest

from thin.compiler import compile_model
from thin.runtime import GenerationStats, load

MODEL = Path(__file__).resolve().parent.parent / "examples" / "models" / "tiny-coder"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load(compile_model(MODEL, tmp_path_factory.mktemp("conv") / "tiny.thin"))


def _turn(model, ids, conversation=None, n=12):
    stats = GenerationStats()
    out = list(model.generate(ids, stats=stats, conversation=conversation, max_new_tokens=n, temperature=0.0,
                              stop_token_ids=()))
    return out, stats


def test_second_turn_prefills_only_the_new_tokens_and_matches_a_fresh_run(model):
    conversation = model.new_conversation()
    first = model.encode("def add(a, b):")
    reply, stats = _turn(model, first, conversation)
    assert stats.cached_tokens == 0 and stats.prompt_tokens == len(first)
    second = first + reply + model.encode("\n\ndef sub(a, b):")
    again, stats = _turn(model, second, conversation)
    # Everything fed through the cache last turn is reused: the prompt and all replies but the last.
    assert stats.cached_tokens == len(first) + len(reply) - 1
    assert stats.prompt_tokens == len(second) - stats.cached_tokens
    assert again == _turn(model, second)[0]


def test_a_diverging_prompt_reuses_only_the_shared_prefix(model):
    conversation = model.new_conversation()
    base = model.encode("class Stack:\n    def push(self, x):")
    _turn(model, base, conversation)
    other = base[:3] + model.encode(" pass")
    got, stats = _turn(model, other, conversation)
    assert stats.cached_tokens == 3
    assert got == _turn(model, other)[0]
    # The same prompt again: all but its last token come from the cache.
    got, stats = _turn(model, other, conversation)
    assert stats.cached_tokens == len(other) - 1 and got == _turn(model, other)[0]


def test_outgrowing_the_cache_reallocates(model):
    conversation = model.new_conversation(min_tokens=16)
    ids = model.encode("import os\n")
    _turn(model, ids, conversation, n=2)
    longer = ids + model.encode("import sys\n" * 20)
    got, stats = _turn(model, longer, conversation, n=40)
    assert stats.cached_tokens == 0  # a new, larger cache
    assert got == _turn(model, longer, n=40)[0]
    conversation.clear()
    assert _turn(model, longer, conversation, n=3)[1].cached_tokens == 0


def test_a_turn_too_long_for_the_model_leaves_the_cache_intact(model):
    from thin.runtime import ContextTooLongError

    conversation = model.new_conversation()
    ids = model.encode("def add(a, b):")
    reply, _ = _turn(model, ids, conversation)
    with pytest.raises(ContextTooLongError):
        _turn(model, ids, conversation, n=model.ir.max_position_embeddings)
    _, stats = _turn(model, ids + reply + model.encode("\n"), conversation)
    assert stats.cached_tokens == len(ids) + len(reply) - 1
