"""The decode loop: prefill the prompt into a KV cache, then one token at a time.

It reads like gpt-fast on purpose. The executor owns the math and the cache owns the
memory; this file only sequences them, picks tokens (runtime.sampling) and decides
when to stop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .errors import RunError
from .inputs import token_list
from .sampling import GenerationOptions, make_generator, sample_next


@dataclass
class GenerationStats:
    """Filled in while `generate` runs; read it after the iterator is exhausted."""

    prompt_tokens: int = 0  # tokens prefilled by this call
    cached_tokens: int = 0  # prompt tokens whose keys/values were already in a reused cache
    prefill_seconds: float = 0.0
    new_tokens: int = 0
    decode_seconds: float = 0.0
    stop_reason: str = ""  # "eos", "length", or "" while running
    # Host-resident experts (runtime/expert_cache.py) copied into a device slot during decode, and their
    # bytes; None when every expert is resident.
    expert_transfers: int | None = None
    expert_transfer_bytes: int = 0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        # The first new token comes out of prefill; decode steps produce the rest.
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def expert_transfers_per_token(self) -> float:
        """Expert pages copied to the device per decode step (nan without steps or streamed experts)."""
        steps = max(self.new_tokens - 1, 0)
        return self.expert_transfers / steps if steps and self.expert_transfers is not None else float("nan")

    def summary(self) -> str:
        """One line for stderr: prefill and decode throughput (and expert transfers when experts stream)."""
        cached = f" (+{self.cached_tokens} cached)" if self.cached_tokens else ""
        line = (f"prefill: {self.prompt_tokens} tokens{cached}, {_rate(self.prefill_tokens_per_second)} | "
                f"decode: {self.new_tokens} tokens, {_rate(self.decode_tokens_per_second)}")
        if self.expert_transfers is not None:
            steps = max(self.new_tokens - 1, 1)
            line += (f", {self.expert_transfers_per_token:.2f} expert transfers/token "
                     f"({self.expert_transfer_bytes / steps / 2**20:.2f} MiB/token)")
        return line


def _rate(tokens_per_second: float) -> str:
    # nan: nothing was timed (--max-new-tokens 0 runs no prefill, 1 runs no decode step).
    return "- tok/s" if math.isnan(tokens_per_second) else f"{tokens_per_second:.1f} tok/s"


class ContextTooLongError(RunError, ValueError):
    """Prompt plus max_new_tokens would run past the positions the model supports."""


def _device(executor) -> torch.device:
    return torch.device(getattr(executor, "device", "cpu"))


def prefill(executor, cache, prompt_ids: torch.Tensor) -> torch.Tensor:
    """Run the whole prompt through the model into `cache`; return the last position's logits [vocab]."""
    return executor.forward(prompt_ids, cache)[-1]


def decode_one_token(executor, cache, token_id: torch.Tensor) -> torch.Tensor:
    """Feed one token (a LongTensor [1]) at the cache's position; return its logits [vocab]."""
    return executor.forward(token_id, cache)[-1]


def decode_n_tokens(executor, cache, first_token: int, n: int, pick, stop_ids: frozenset[int]) -> Iterator[int]:
    """Decode up to `n` tokens after `first_token`, choosing each with `pick(logits) -> int`.

    Yields every token it chooses, a stop token included (the caller decides what to show).
    """
    device = _device(executor)
    token = first_token
    for _ in range(n):
        logits = decode_one_token(executor, cache, torch.tensor([token], dtype=torch.long, device=device))
        token = pick(logits)
        yield token
        if token in stop_ids:
            return


def check_context(prompt_tokens: int, max_new_tokens: int, max_position_embeddings: int | None):
    """Raise ContextTooLongError when the prompt and the new tokens exceed the model's positions."""
    if max_position_embeddings is None:
        return
    total = prompt_tokens + max_new_tokens
    if total > max_position_embeddings:
        raise ContextTooLongError(
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
            f"model's max_position_embeddings ({max_position_embeddings}); shorten the prompt or lower "
            f"max_new_tokens")


def _begin(prompt: list[int], options: GenerationOptions, max_position_embeddings: int | None, cache,
           stats: GenerationStats) -> int | None:
    """What both generation loops check and count first: the prompt's tokens `cache` already holds (at
    least one left to prefill), or None when there is nothing to generate (max_new_tokens 0)."""
    if not prompt:
        raise ValueError("generate needs at least one prompt token")
    check_context(len(prompt), options.max_new_tokens, max_position_embeddings)
    cached = 0 if cache is None else cache.length
    if cached >= len(prompt):
        raise ValueError(f"the cache holds {cached} tokens; at least one of the {len(prompt)} prompt tokens "
                         "must be left to prefill")
    stats.prompt_tokens, stats.cached_tokens, stats.stop_reason = len(prompt) - cached, cached, ""
    if options.max_new_tokens == 0:
        stats.stop_reason = "length"
        return None
    return cached


def _room(runner, cache, prompt_tokens: int, cached: int, max_new_tokens: int):
    """The cache a generation loop runs on: a fresh one of `runner` (executor or engine) for the prompt and
    max_new_tokens, or the given one, checked to have room for the uncached prompt and the new tokens."""
    if cache is None:
        return runner.new_cache(prompt_tokens + max_new_tokens)
    cache.check_room(prompt_tokens - cached + max_new_tokens)
    return cache


def _counted(stats: GenerationStats, token: int, started: float, stop_ids: frozenset[int], *,
             first: bool = False) -> bool:
    """Count a new token and the seconds since `started` (perf_counter) that made it: the prefill's for the
    `first`, else a decode step's. True when it is a stop token (not yielded): generation ends there."""
    elapsed = time.perf_counter() - started
    if first:
        stats.prefill_seconds, stats.new_tokens = elapsed, 1
    else:
        stats.decode_seconds += elapsed
        stats.new_tokens += 1
    if token in stop_ids:
        stats.stop_reason = "eos"
        return True
    return False


def generate(executor, prompt_ids: Sequence[int], options: GenerationOptions, *,
             max_position_embeddings: int | None = None, stats: GenerationStats | None = None,
             cache=None) -> Iterator[int]:
    """Stream new token ids for `prompt_ids`; stops after a token in `options.stop_token_ids`
    (not yielded) or after `options.max_new_tokens`.

    Without `cache`, a fresh KV cache of prompt + max_new_tokens positions is made. A given
    `cache` must already hold `prompt_ids[:cache.length]` (fewer than all of them) and have room
    for the rest plus max_new_tokens: only the uncached part is prefilled (see ConversationCache).
    `stats`, when given, receives the token counts, timings and why generation stopped.
    """
    stats = stats if stats is not None else GenerationStats()
    model = getattr(executor, "model", None)
    prompt = token_list(prompt_ids, getattr(model, "vocab_size", None))
    cached = _begin(prompt, options, max_position_embeddings, cache, stats)
    if cached is None:
        return
    device = _device(executor)
    stop_ids = frozenset(options.stop_token_ids)
    generator = make_generator(options.seed, device)
    # Every token so far, for the repetition penalty (transformers counts the prompt too).
    history = torch.empty(len(prompt) + options.max_new_tokens, dtype=torch.long, device=device)
    history[:len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    length = len(prompt)

    def pick(logits: torch.Tensor) -> int:
        nonlocal length
        penalised = history[:length] if options.repetition_penalty != 1.0 else None
        token = sample_next(logits, options, penalised, generator)
        history[length] = token
        length += 1
        return token

    cache = _room(executor, cache, len(prompt), cached, options.max_new_tokens)
    start = time.perf_counter()
    token = pick(prefill(executor, cache, history[cached:len(prompt)].clone()))  # pick() reads back: a sync
    if _counted(stats, token, start, stop_ids, first=True):
        return
    yield token
    experts = getattr(executor, "expert_cache", None)
    counted = experts.counters() if experts is not None else None
    if counted is not None:
        stats.expert_transfers, stats.expert_transfer_bytes = 0, 0
    # Time only the steps themselves, not what the consumer does between two tokens.
    start = time.perf_counter()
    for step_token in decode_n_tokens(executor, cache, token, options.max_new_tokens - 1, pick, stop_ids):
        if counted is not None:
            transfers, nbytes = experts.counters()
            stats.expert_transfers, stats.expert_transfer_bytes = transfers - counted[0], nbytes - counted[1]
        if _counted(stats, step_token, start, stop_ids):
            return
        yield step_token
        start = time.perf_counter()
    stats.stop_reason = "length"


class ConversationCache:
    """A KV cache kept across generate calls, for chat: when a new prompt starts with tokens the
    cache already holds (the conversation so far), only the rest is prefilled."""

    def __init__(self, executor, max_position_embeddings: int | None, min_tokens: int = 1024):
        self.executor = executor
        self.limit = max_position_embeddings
        self.min_tokens = min_tokens  # first allocation: room for a few turns without regrowing
        self.cache = None
        self.tokens: list[int] = []  # exactly the tokens whose keys/values the cache holds

    def prepare(self, prompt: Sequence[int], max_new_tokens: int):
        """The cache to pass to `generate` for `prompt`, truncated to the prefix it shares with it.
        Raises ContextTooLongError, before touching the cache, when the turn cannot fit."""
        check_context(len(prompt), max_new_tokens, self.limit)
        need = len(prompt) + max_new_tokens
        if self.cache is None or self.cache.max_seq_len < need:
            # Grow geometrically so a long chat reallocates (and re-prefills) rarely.
            size = max(need, 2 * self.cache.max_seq_len if self.cache is not None else self.min_tokens)
            self.cache = self.executor.new_cache(min(size, self.limit) if self.limit else size)
            self.tokens = []
        common = 0
        for a, b in zip(self.tokens, prompt[:-1]):  # leave at least one token to prefill
            if a != b:
                break
            common += 1
        keepable = getattr(self.cache, "keepable", None)  # a sliding-window ring can't roll back far
        if keepable is not None:
            common = keepable(common)
        self.cache.truncate(common)
        self.tokens = list(prompt[:common])
        return self.cache

    def record(self, prompt: Sequence[int], generated: Sequence[int]) -> None:
        """After a generate call: remember which tokens the cache now holds."""
        self.tokens = (list(prompt) + list(generated))[:self.cache.length]

    def clear(self) -> None:
        self.tokens = []
        if self.cache is not None:
            self.cache.reset()


def engine_generate(engine, prompt_ids: Sequence[int], options: GenerationOptions, *,
                    max_position_embeddings: int | None = None, stats: GenerationStats | None = None,
                    cache=None) -> Iterator[int]:
    """`generate`'s contract on a DecodeEngine (engine.py): stream new token ids, stop after a stop token (not
    yielded) or max_new_tokens; with `cache` holding a prefix of the prompt, prefill only the rest."""
    stats = stats if stats is not None else GenerationStats()
    prompt = [int(t) for t in prompt_ids]
    cached = _begin(prompt, options, max_position_embeddings, cache, stats)
    if cached is None:
        return
    cache = _room(engine, cache, len(prompt), cached, options.max_new_tokens)
    cache.reserve(len(prompt) + options.max_new_tokens)
    stop_ids = frozenset(options.stop_token_ids)
    sampler = engine.sampler(options)
    engine.start(cache, prompt, options)
    begin = time.perf_counter()
    engine.prefill(cache, torch.tensor(prompt[cached:], dtype=torch.long), sampler)
    token = int(engine.token)  # the first token: one read-back after prefill
    if _counted(stats, token, begin, stop_ids, first=True):
        return
    yield token
    length, fed = cache.length, 0
    try:
        begin = time.perf_counter()
        for token in engine.decode_n_tokens(cache, options.max_new_tokens - 1, sampler, stop_ids):
            fed += 1
            if _counted(stats, token, begin, stop_ids):
                return
            yield token
            begin = time.perf_counter()
        stats.stop_reason = "length"
    finally:
        # The keys and values kept: the prompt and every generated token fed back (a step launched
        # past a stop token wrote one more, beyond this length).
        cache.length = length + fed
