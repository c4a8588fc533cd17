"""The decode loop against a fake executor: cache use, stopping, seeds, options."""

import pytest
import torch

from thin.runtime.generate import ContextTooLongError, GenerationStats, generate
from thin.runtime.sampling import GenerationOptions

from test_runtime_fakes import FakeExecutor


def _greedy_reference(ex: FakeExecutor, prompt: list[int], n: int, stop=()) -> list[int]:
    # No cache: rerun the whole sequence for every token.
    ids = list(prompt)
    out = []
    for _ in range(n):
        token = int(ex.forward(torch.tensor(ids))[-1].argmax())
        if token in stop:
            break
        out.append(token)
        ids.append(token)
    return out


def test_greedy_with_cache_matches_full_recompute():
    ex = FakeExecutor()
    prompt = [5, 3, 8]
    stats = GenerationStats()
    got = list(generate(ex, prompt, GenerationOptions(max_new_tokens=10), stats=stats))
    assert got == _greedy_reference(FakeExecutor(), prompt, 10)
    assert len(got) == 10 and stats.stop_reason == "length" and stats.new_tokens == 10
    # One prefill of the whole prompt, then one token per step, in a cache sized prompt + new tokens.
    assert ex.calls == [3] + [1] * 9
    assert ex.caches[0].max_seq_len == 13 and ex.caches[0].position == 12
    assert stats.prompt_tokens == 3


def test_stops_on_eos_without_yielding_it():
    eos = 7
    ex = FakeExecutor(forced={11: eos, 5: 11})  # after 5 comes 11, after 11 comes eos
    stats = GenerationStats()
    got = list(generate(ex, [1, 5], GenerationOptions(max_new_tokens=20, stop_token_ids=(eos, 30)), stats=stats))
    assert got == [11]
    assert stats.stop_reason == "eos" and stats.new_tokens == 2
    # Without the stop id it keeps going through the eos token.
    more = list(generate(FakeExecutor(forced={11: eos, 5: 11}), [1, 5], GenerationOptions(max_new_tokens=5)))
    assert more[:2] == [11, eos] and len(more) == 5


def test_eos_as_first_token():
    ex = FakeExecutor(forced={5: 2})
    stats = GenerationStats()
    assert list(generate(ex, [5], GenerationOptions(stop_token_ids=(2,)), stats=stats)) == []
    assert stats.stop_reason == "eos"


def test_max_new_tokens_zero_and_context_limit():
    assert list(generate(FakeExecutor(), [1], GenerationOptions(max_new_tokens=0))) == []
    with pytest.raises(ContextTooLongError, match="max_position_embeddings"):
        generate(FakeExecutor(), list(range(10)), GenerationOptions(max_new_tokens=10),
                 max_position_embeddings=16).__next__()
    # Exactly at the limit is fine.
    assert len(list(generate(FakeExecutor(), list(range(6)), GenerationOptions(max_new_tokens=10),
                             max_position_embeddings=16))) == 10


def _sampled(seed, **kw):
    opts = GenerationOptions(max_new_tokens=12, temperature=1.0, seed=seed, **kw)
    return list(generate(FakeExecutor(scale=0.5), [1, 2], opts))


def test_same_seed_same_tokens_different_seed_differs():
    assert _sampled(1) == _sampled(1)
    assert _sampled(1) != _sampled(2)
    assert _sampled(3, top_k=4, top_p=0.9, min_p=0.05) == _sampled(3, top_k=4, top_p=0.9, min_p=0.05)


def test_temperature_zero_is_greedy_regardless_of_seed():
    greedy = list(generate(FakeExecutor(), [4], GenerationOptions(max_new_tokens=8)))
    for seed in (0, 1):
        opts = GenerationOptions(max_new_tokens=8, temperature=0.0, seed=seed, top_k=2)
        assert list(generate(FakeExecutor(), [4], opts)) == greedy


def test_repetition_penalty_discourages_repeats():
    # Token 9 is forced after itself: greedy loops on it; a strong penalty breaks the loop.
    ex_opts = {"forced": {9: 9}}
    plain = list(generate(FakeExecutor(**ex_opts), [9], GenerationOptions(max_new_tokens=4)))
    assert plain == [9, 9, 9, 9]
    penalised = list(generate(FakeExecutor(**ex_opts), [9],
                              GenerationOptions(max_new_tokens=4, repetition_penalty=100.0)))
    assert 9 not in penalised
