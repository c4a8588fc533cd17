"""Teacher-forced scoring: per-position log-probabilities, mean NLL and perplexity.

The text is scored in windows of `context` tokens, each ending `stride` tokens after the
previous one (the sliding-window evaluation of the Hugging Face perplexity guide). Each
window is a fresh full-sequence forward and scores only the positions no earlier window
scored, so every token after the first is scored exactly once, with at least
`context - stride` tokens of history. (Unlike the guide with stride == context, no token
at a window's start goes unscored.) `iter_logprobs` yields the full log-softmax per window so quality
metrics (KL, top-1 agreement) can compare two models window by window in bounded memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .inputs import token_tensor


@dataclass(frozen=True)
class Window:
    """One scored window: log-probabilities predicting `targets`, which sit at `positions`."""

    positions: torch.Tensor  # [n] LongTensor: positions in the text of the scored tokens
    targets: torch.Tensor  # [n] LongTensor: the tokens at those positions
    logprobs: torch.Tensor  # [n, vocab] float32 log-softmax of the logits predicting them
    logits: torch.Tensor | None = None  # [n, vocab] float32: the logits themselves


def _forward(model, ids: torch.Tensor) -> torch.Tensor:
    # A ThinModel and an Executor both take a full sequence and return float32 logits [T, vocab].
    return model.forward(ids)


def _windows(num_tokens: int, context: int, stride: int) -> Iterator[tuple[int, int, int]]:
    # (begin, end, first scored position) for each window. The first window scores positions
    # 1..end-1; each later one ends `stride` tokens further and scores just those new positions,
    # with the rest of its `context` tokens as history (at least one, since stride < context).
    end, scored_until = min(context, num_tokens), 1  # position 0 has no history: never scored
    while True:
        yield max(0, end - context), end, scored_until
        if end == num_tokens:
            return
        scored_until, end = end, min(end + stride, num_tokens)


def iter_logprobs(model, token_ids: Sequence[int] | torch.Tensor, *, context: int | None = None,
                  stride: int | None = None) -> Iterator[Window]:
    """Yield a `Window` per forward pass over `token_ids`, in order; together they score positions 1..N-1.

    `model` has `.forward(LongTensor[T]) -> float32 logits [T, vocab]` (ThinModel or Executor).
    `context` (tokens per forward) defaults to the whole text, capped at the model's
    max_position_embeddings when it has one; `stride` (new positions scored per window after the
    first) must be below `context` and defaults to `context - 1`, the least overlap that still
    gives every scored token some history.
    """
    ids = token_tensor(token_ids, getattr(_ir(model), "vocab_size", None), "perplexity")
    limit = _max_positions(model)
    for name, value in (("context", context), ("stride", stride)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be a whole number of tokens, got {value!r}")
    if context is None:
        context = min(len(ids), limit) if limit else len(ids)
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    if context < 2:
        raise ValueError(f"context must be >= 2 tokens to score anything, got {context}")
    if stride is None:
        stride = context - 1
    if not 0 < stride < context:
        raise ValueError(f"stride must be in [1, context - 1 = {context - 1}], got {stride}")
    if limit and context > limit:
        raise ValueError(f"context {context} exceeds the model's max_position_embeddings {limit}")
    device = torch.device(getattr(model, "device", "cpu"))
    for begin, end, first in _windows(len(ids), context, stride):
        window = ids[begin:end].to(device)
        with torch.no_grad():
            logits = _forward(model, window)
        # logits[i] predicts window[i + 1]; keep the rows whose targets were not scored before.
        rows = logits[first - begin - 1:end - begin - 1].float()
        yield Window(positions=torch.arange(first, end), targets=ids[first:end],
                     logprobs=torch.log_softmax(rows, dim=-1).cpu(), logits=rows.cpu())


def _ir(model):
    return getattr(model, "ir", None) or getattr(model, "model_ir", None) or getattr(model, "model", None)


def _max_positions(model) -> int | None:
    return getattr(_ir(model), "max_position_embeddings", None)


def token_logprobs(model, token_ids: Sequence[int] | torch.Tensor, *, context: int | None = None,
                   stride: int | None = None) -> torch.Tensor:
    """log p(token_i | earlier tokens in its window) for i = 1..N-1: a float32 tensor [N-1]."""
    parts = [w.logprobs.gather(-1, w.targets[:, None])[:, 0] for w in
             iter_logprobs(model, token_ids, context=context, stride=stride)]
    return torch.cat(parts)


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per scored token
    num_tokens: int  # scored tokens: N - 1


def evaluate_perplexity(model, token_ids, *, context: int | None = None,
                        stride: int | None = None) -> PerplexityResult:
    """Perplexity, mean negative log-likelihood (nats) and the number of scored tokens."""
    logprobs = token_logprobs(model, token_ids, context=context, stride=stride).double()
    mean_nll = float(-logprobs.mean())
    return PerplexityResult(perplexity=math.exp(mean_nll), mean_nll=mean_nll, num_tokens=len(logprobs))


def perplexity(model, token_ids, *, context: int | None = None, stride: int | None = None) -> float:
    """exp(mean NLL) of `token_ids` under `model`, teacher-forced; see `evaluate_perplexity` for the NLL."""
    return evaluate_perplexity(model, token_ids, context=context, stride=stride).perplexity
