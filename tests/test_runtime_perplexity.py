"""Perplexity and per-position log-probs against values computed by hand."""

import math

import pytest
import torch

from thin.runtime.perplexity import evaluate_perplexity, iter_logprobs, perplexity, token_logprobs

from test_runtime_fakes import FakeExecutor, UniformModel


class BigramModel:
    """p(next | current) from a fixed table: the answer does not depend on older history."""

    def __init__(self, vocab=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, generator=g) * 2

    def forward(self, input_ids):
        return self.table[input_ids]


def test_uniform_model_has_perplexity_vocab():
    ids = list(range(10)) * 5
    result = evaluate_perplexity(UniformModel(37), ids)
    assert result.num_tokens == len(ids) - 1
    assert result.mean_nll == pytest.approx(math.log(37), rel=1e-6)
    assert result.perplexity == pytest.approx(37.0, rel=1e-6)
    assert perplexity(UniformModel(37), ids, context=8, stride=3) == pytest.approx(37.0, rel=1e-6)


def test_bigram_model_matches_hand_computed_nll():
    model = BigramModel()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 16, (40,), generator=g)
    logp = torch.log_softmax(model.table.double(), dim=-1)
    expected = [float(logp[ids[i - 1], ids[i]]) for i in range(1, len(ids))]
    for context, stride in [(None, None), (8, None), (8, 7), (8, 3), (5, 1), (40, 7)]:
        got = token_logprobs(model, ids, context=context, stride=stride)
        torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=0)
    mean_nll = -sum(expected) / len(expected)
    assert evaluate_perplexity(model, ids, context=8, stride=3).perplexity == pytest.approx(math.exp(mean_nll))


@pytest.mark.parametrize("context,stride", [(6, None), (6, 2), (6, 5), (3, 1), (2, 1), (30, 4)])
def test_windows_score_each_position_once_with_history_in_window(context, stride):
    n = 23
    windows = list(iter_logprobs(UniformModel(5), torch.arange(n) % 5, context=context, stride=stride))
    positions = torch.cat([w.positions for w in windows])
    assert positions.tolist() == list(range(1, n))
    if context < n:
        assert len(windows[0].positions) == context - 1
        assert all(len(w.positions) <= (stride or context - 1) for w in windows[1:])
    for w in windows:
        assert w.logprobs.shape == (len(w.positions), 5)
        assert torch.equal(w.targets, w.positions % 5)


def test_history_dependent_model_uses_the_window_context():
    ex = FakeExecutor(vocab=16)
    ids = torch.arange(12) % 16
    full = token_logprobs(ex, ids)
    logits = ex.forward(ids)
    expected = torch.log_softmax(logits, -1)[torch.arange(11), ids[1:]]
    torch.testing.assert_close(full, expected)
    # With windows, later windows lose the early history, so a history-dependent model differs.
    assert not torch.allclose(token_logprobs(ex, ids, context=4, stride=3), full)


def test_bad_arguments():
    with pytest.raises(ValueError, match="stride"):
        perplexity(UniformModel(4), [1, 2, 3], context=4, stride=4)
    with pytest.raises(ValueError, match="two tokens"):
        perplexity(UniformModel(4), [1])
    with pytest.raises(ValueError, match="context"):
        perplexity(UniformModel(4), [1, 2, 3], context=1)
