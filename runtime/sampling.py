"""Choosing the next token from logits: greedy, or sampling with the usual filters.

Each filter has the semantics of the transformers logits processor of the same name
(RepetitionPenalty, Temperature, TopK, TopP, MinP) and they run in transformers' order:
repetition penalty, then temperature, top-k, top-p, min-p, then a draw. Filters take
logits of shape [..., vocab] and return new logits with removed tokens set to -inf.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# transformers' GenerationConfig defaults, used when an artifact's generation_config is silent.
_HF_DEFAULT_TOP_K = 50
# transformers' default max_length (20 tokens in total) is too short for chat; ours when unset.
DEFAULT_MAX_NEW_TOKENS = 512


@dataclass(frozen=True)
class GenerationOptions:
    """How to generate. `temperature == 0` means greedy; filters then do nothing."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    seed: int | None = None  # None: a fresh random draw each run
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        problems = []
        if self.max_new_tokens < 0:
            problems.append(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if problems:
            raise ValueError("invalid generation options: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_generation_config(cls, config: dict | None, **overrides) -> GenerationOptions:
        """Defaults from a Hugging Face generation_config dict, then `overrides` (None values ignored).

        do_sample false (or absent) gives greedy, as in transformers; a caller that passes a
        temperature > 0 turns sampling on with the config's top-k/top-p/min-p.
        """
        config = config or {}
        sampling = bool(config.get("do_sample", False))
        values = {
            "temperature": float(_or(config.get("temperature"), 1.0)) if sampling else 0.0,
            "top_k": int(_or(config.get("top_k"), _HF_DEFAULT_TOP_K)),
            "top_p": float(_or(config.get("top_p"), 1.0)),
            "min_p": float(_or(config.get("min_p"), 0.0)),
            "repetition_penalty": float(_or(config.get("repetition_penalty"), 1.0)),
            "stop_token_ids": eos_ids(config.get("eos_token_id")),
        }
        if config.get("max_new_tokens") is not None:
            values["max_new_tokens"] = int(config["max_new_tokens"])
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown generation options: {sorted(unknown)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        values["stop_token_ids"] = tuple(int(t) for t in values["stop_token_ids"])
        return cls(**values)


def _or(value, default):
    return default if value is None else value


def eos_ids(value) -> tuple[int, ...]:
    """Normalise a generation_config `eos_token_id` (None, int or list) to a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """Penalise every token in `seen_ids` (prompt and generated): positive logits / penalty, negative * penalty.

    `logits` is [vocab] with `seen_ids` [n], or [batch, vocab] with `seen_ids` [batch, n].
    """
    if penalty == 1.0 or seen_ids.numel() == 0:
        return logits
    seen = torch.gather(logits, -1, seen_ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(-1, seen_ids, seen)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide logits by a temperature > 0."""
    return logits if temperature == 1.0 else logits / temperature


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep tokens whose logit is >= the k-th largest (ties at the boundary all stay)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= top_p (at least one)."""
    if top_p >= 1.0:
        return logits
    ascending, order = torch.sort(logits, dim=-1, descending=False)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    # Sorted ascending, a token can go when the mass at or below it is <= 1 - p: the tokens
    # above it still hold >= p. The most likely token is never removed.
    remove_sorted = cumulative <= (1.0 - top_p)
    remove_sorted[..., -1] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Remove tokens whose probability is below min_p times the most likely token's probability."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    remove = probs < threshold
    # The argmax always survives, even when min_p == 1 and rounding puts it below itself.
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(remove, float("-inf"))


def process_logits(logits: torch.Tensor, options: GenerationOptions,
                   seen_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Apply every filter `options` asks for, in transformers' order; float32 in, float32 out."""
    logits = logits.float()
    if seen_ids is not None:
        logits = apply_repetition_penalty(logits, seen_ids, options.repetition_penalty)
    if options.greedy:
        return logits
    logits = apply_temperature(logits, options.temperature)
    logits = apply_top_k(logits, options.top_k)
    logits = apply_top_p(logits, options.top_p)
    return apply_min_p(logits, options.min_p)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on `device`, seeded with `seed` or, when None, from fresh entropy."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


def sample_next(logits: torch.Tensor, options: GenerationOptions, seen_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> int:
    """The next token id from one position's logits [vocab]: argmax when greedy, else a seeded draw."""
    processed = process_logits(logits, options, seen_ids)
    if options.greedy:
        return int(processed.argmax(dim=-1))
    probs = processed.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
