"""Small stand-ins for the executor, used by the runtime tests (and a check that they behave).

`FakeExecutor` has the real Executor's interface: `new_cache(max_seq_len)` and
`forward(input_ids[T], cache=None) -> float32 logits [T, vocab]`, appending at
`cache.position` when given a cache. Its logits at a position depend on every token up
to it, so feeding the wrong tokens or positions through the cache changes the output.
"""

import torch


class FakeCache:
    def __init__(self, max_seq_len: int):
        self.max_seq_len = max_seq_len
        self.tokens: list[int] = []

    @property
    def position(self) -> int:
        return len(self.tokens)


class FakeExecutor:
    """Logits at position t are a fixed random row picked by (sum of tokens 0..t) and t."""

    def __init__(self, vocab: int = 32, seed: int = 0, scale: float = 4.0, forced: dict | None = None,
                 max_position_embeddings: int = 128):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.table = torch.randn(vocab, vocab, generator=g) * scale
        self.forced = forced or {}  # {previous token: next token} made overwhelmingly likely
        self.device = "cpu"
        self.caches: list[FakeCache] = []
        self.calls: list[int] = []  # tokens per forward call
        self.max_position_embeddings = max_position_embeddings

    def new_cache(self, max_seq_len: int) -> FakeCache:
        cache = FakeCache(max_seq_len)
        self.caches.append(cache)
        return cache

    def _row(self, history: list[int]) -> torch.Tensor:
        row = self.table[(sum(history) + 3 * len(history)) % self.vocab].clone()
        if history[-1] in self.forced:
            row[self.forced[history[-1]]] = 100.0
        return row

    def forward(self, input_ids: torch.Tensor, cache: FakeCache | None = None) -> torch.Tensor:
        ids = [int(t) for t in input_ids]
        self.calls.append(len(ids))
        history = list(cache.tokens) if cache is not None else []
        rows = []
        for token in ids:
            history.append(token)
            rows.append(self._row(history))
        if cache is not None:
            assert len(history) <= cache.max_seq_len, "cache overflow"
            cache.tokens = history
        return torch.stack(rows).float()


class UniformModel:
    """Every position predicts the uniform distribution over `vocab` tokens."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(input_ids), self.vocab)


def test_fake_executor_cached_equals_uncached():
    ex = FakeExecutor()
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    full = ex.forward(ids)
    cache = ex.new_cache(8)
    parts = [ex.forward(ids[:5], cache), ex.forward(ids[5:6], cache), ex.forward(ids[6:], cache)]
    torch.testing.assert_close(torch.cat(parts), full)
    assert cache.position == 8
    # A different prefix changes later logits: the fake really depends on history.
    assert not torch.equal(ex.forward(torch.tensor([0, 1, 4, 1, 5, 9, 2, 6]))[-1], full[-1])
