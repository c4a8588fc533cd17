"""Sampling filters against transformers' logits processors, and seeded determinism."""

import pytest
import torch

from thin.runtime.sampling import (
    GenerationOptions,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    make_generator,
    process_logits,
    sample_next,
)

lp = pytest.importorskip("transformers.generation.logits_process")

VOCAB = 64


def _logits(seed=0, batch=4, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    # Spread out so filters cut at different places in each row; a few exact ties too.
    logits = torch.randn(batch, vocab, generator=g) * 3
    logits[:, 5] = logits[:, 6]
    return logits


def _seen(batch=4, n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, n), generator=g)  # duplicates on purpose


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.5])
def test_temperature_matches_transformers(temperature):
    x = _logits()
    expected = lp.TemperatureLogitsWarper(temperature)(None, x.clone())
    torch.testing.assert_close(apply_temperature(x, temperature), expected)


@pytest.mark.parametrize("top_k", [1, 5, 20, VOCAB - 1])
def test_top_k_matches_transformers(top_k):
    x = _logits()
    expected = lp.TopKLogitsWarper(top_k)(None, x.clone())
    got = apply_top_k(x, top_k)
    torch.testing.assert_close(got, expected)
    assert (got.isfinite().sum(-1) >= top_k).all()


@pytest.mark.parametrize("top_p", [0.01, 0.3, 0.8, 0.95, 0.999])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_p_matches_transformers(top_p, seed):
    x = _logits(seed)
    expected = lp.TopPLogitsWarper(top_p)(None, x.clone())
    got = apply_top_p(x, top_p)
    assert torch.equal(got.isinf(), expected.isinf())
    torch.testing.assert_close(got, expected)
    kept = got.softmax(-1)
    # The kept set holds at least p of the original mass, and at least one token survives.
    assert (x.softmax(-1).masked_fill(got.isinf(), 0).sum(-1) >= top_p - 1e-5).all()
    assert (kept.isfinite().any(-1)).all()


def test_top_p_keeps_one_token_when_p_is_tiny():
    x = _logits()
    got = apply_top_p(x, 1e-9)
    assert (got.isfinite().sum(-1) == 1).all()
    assert torch.equal(got.argmax(-1), x.argmax(-1))


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_transformers(min_p):
    x = _logits()
    expected = lp.MinPLogitsWarper(min_p)(None, x.clone())
    torch.testing.assert_close(apply_min_p(x, min_p), expected)


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    x, seen = _logits(), _seen()
    expected = lp.RepetitionPenaltyLogitsProcessor(penalty)(seen, x.clone())
    torch.testing.assert_close(apply_repetition_penalty(x, seen, penalty), expected)
    # One sequence, unbatched: the same numbers.
    torch.testing.assert_close(apply_repetition_penalty(x[0], seen[0], penalty), expected[0])


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    x = torch.tensor([2.0, -2.0, 1.0])
    got = apply_repetition_penalty(x, torch.tensor([0, 1]), 2.0)
    assert got.tolist() == [1.0, -4.0, 1.0]


def test_full_chain_matches_transformers_in_order():
    x, seen = _logits(3), _seen()
    opts = GenerationOptions(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05, repetition_penalty=1.2)
    chain = lp.LogitsProcessorList([
        lp.RepetitionPenaltyLogitsProcessor(1.2), lp.TemperatureLogitsWarper(0.8), lp.TopKLogitsWarper(30),
        lp.TopPLogitsWarper(0.9), lp.MinPLogitsWarper(0.05)])
    torch.testing.assert_close(process_logits(x, opts, seen), chain(seen, x.clone()))


def test_temperature_zero_is_greedy():
    x = _logits(batch=1)[0]
    opts = GenerationOptions(temperature=0.0, top_k=3, top_p=0.5, seed=123)
    for seed in range(5):
        token = sample_next(x, opts, generator=make_generator(seed))
        assert token == int(x.argmax())


def _draws(seed, n=20):
    opts = GenerationOptions(temperature=1.0)
    flat = torch.zeros(VOCAB)  # uniform: any difference in the stream shows
    generator = make_generator(seed)
    return [sample_next(flat, opts, generator=generator) for _ in range(n)]


def test_same_seed_same_tokens_and_different_seed_differs():
    assert _draws(7) == _draws(7)
    assert _draws(7) != _draws(8)


def test_sampling_respects_the_filters():
    x = _logits(batch=1)[0]
    opts = GenerationOptions(temperature=1.0, top_k=3)
    allowed = set(torch.topk(x, 3).indices.tolist())
    generator = make_generator(0)
    assert {sample_next(x, opts, generator=generator) for _ in range(50)} <= allowed


def test_options_from_generation_config():
    greedy = GenerationOptions.from_generation_config({"do_sample": False, "temperature": 0.6,
                                                       "eos_token_id": [5, 7]})
    assert greedy.greedy and greedy.stop_token_ids == (5, 7)
    sampled = GenerationOptions.from_generation_config(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2,
         "max_new_tokens": 64})
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.max_new_tokens) == (0.6, 0.95, 20, 64)
    assert sampled.stop_token_ids == (2,)
    # Caller overrides win; None means "keep the default"; temperature 0 turns sampling off.
    over = GenerationOptions.from_generation_config({"do_sample": True, "temperature": 0.6},
                                                    temperature=0.0, top_p=None, seed=3)
    assert over.greedy and over.top_p == 1.0 and over.seed == 3
    # A greedy config with a caller temperature samples with transformers' default top_k.
    assert GenerationOptions.from_generation_config({}, temperature=0.7).top_k == 50


def test_options_are_validated():
    with pytest.raises(ValueError, match="top_p"):
        GenerationOptions(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        GenerationOptions(temperature=-1.0)
    with pytest.raises(TypeError, match="unknown"):
        GenerationOptions.from_generation_config({}, top_q=0.5)
