"""Choosing the next token from logits: greedy, or sampling with the usual filters.

Each filter has the semantics of the transformers logits processor of the same name
(RepetitionPenalty, Temperature, TopK, TopP, MinP) and they run in transformers' order:
repetition penalty, then temperature, top-k, top-p, min-p, then a draw. Filters take
logits of shape [..., vocab] and return new logits with removed tokens set to -inf.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .errors import InputError, RunError

# transformers' GenerationConfig defaults, used when an artifact's generation_config is silent.
_HF_DEFAULT_TOP_K = 50
# transformers' default max_length (20 tokens in total) is too short for chat; ours when unset.
DEFAULT_MAX_NEW_TOKENS = 512
_INT32 = (1 << 31) - 1
# Below this a temperature overflows float32 logits (inf / nan probabilities), and it is greedy in effect;
# a repetition penalty outside this range does the same (the server's bounds too).
MIN_TEMPERATURE = 1e-5
PENALTY_RANGE = (0.01, 100.0)


class GenerationOptionError(InputError):
    """A generation option of the wrong type or outside its range (NaN included); names the value."""


class NonFiniteLogitsError(RunError, ArithmeticError):
    """The model produced NaN or inf logits: nothing can be sampled from them."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        # Each check is written so that NaN fails it: comparisons with NaN are all false.
        problems = []
        if not (_is_int(self.max_new_tokens) and 0 <= self.max_new_tokens <= _INT32):
            problems.append(f"max_new_tokens must be an integer in 0..{_INT32}, got {self.max_new_tokens!r}")
        if not (_is_number(self.temperature) and (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature
                                                 < math.inf)):
            problems.append(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got "
                            f"{self.temperature!r}")
        if not (_is_int(self.top_k) and self.top_k >= 0):  # at or past the vocabulary: no filtering
            problems.append(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            problems.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (_is_number(self.repetition_penalty) and PENALTY_RANGE[0] <= self.repetition_penalty
                <= PENALTY_RANGE[1]):
            problems.append(f"repetition_penalty must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got "
                            f"{self.repetition_penalty!r}")
        if self.seed is not None and not (_is_int(self.seed) and -(1 << 63) <= self.seed < 1 << 64):
            problems.append(f"seed must be a 64-bit integer (-2**63..2**64-1), got {str(self.seed)[:40]}")
        if (not isinstance(self.stop_token_ids, tuple)
                or not all(_is_int(t) and 0 <= t <= _INT32 for t in self.stop_token_ids)):
            problems.append(f"stop_token_ids must be a tuple of token ids, got {str(self.stop_token_ids)[:80]}")
        if problems:
            raise GenerationOptionError("invalid generation options: " + "; ".join(problems))

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
        if not isinstance(config, dict):
            raise GenerationOptionError(f"generation_config must be a mapping, got {type(config).__name__}")
        sampling = _config_value(config, "do_sample", False, bool)
        values = {
            "temperature": float(_config_value(config, "temperature", 1.0, float)) if sampling else 0.0,
            "top_k": _config_value(config, "top_k", _HF_DEFAULT_TOP_K, int),
            "top_p": _config_value(config, "top_p", 1.0, float),
            "min_p": _config_value(config, "min_p", 0.0, float),
            "repetition_penalty": _config_value(config, "repetition_penalty", 1.0, float),
            "stop_token_ids": eos_ids(config.get("eos_token_id")),
        }
        if config.get("max_new_tokens") is not None:
            values["max_new_tokens"] = _config_value(config, "max_new_tokens", None, int)
            if values["max_new_tokens"] < 1:  # transformers' GenerationConfig refuses it too
                raise GenerationOptionError(f"generation_config max_new_tokens must be at least 1, got "
                                            f"{values['max_new_tokens']}: it is the default length of every reply")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown generation options: {sorted(unknown)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        stop = values["stop_token_ids"]
        values["stop_token_ids"] = tuple(stop) if isinstance(stop, (list, tuple)) else stop
        return cls(**values)


def _config_value(config: dict, key: str, default, kind: type):
    """config[key] (default when absent or null), refusing a value of another type: no silent coercion."""
    value = config.get(key)
    if value is None:
        return default
    ok = isinstance(value, bool) if kind is bool else _is_int(value) if kind is int else _is_number(value)
    if not ok:
        raise GenerationOptionError(f"generation_config {key} must be {kind.__name__}, got {str(value)[:40]!r}")
    return value


def eos_ids(value) -> tuple[int, ...]:
    """Normalise a generation_config `eos_token_id` (None, int or list of ints) to a tuple of ints."""
    if value is None:
        return ()
    if _is_int(value):
        return (value,)
    if isinstance(value, list) and len(value) <= 4096 and all(_is_int(v) for v in value):
        return tuple(value)
    raise GenerationOptionError(f"generation_config eos_token_id must be an id or a list of ids, got "
                                f"{str(value)[:40]!r}")


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
    try:
        return int(torch.multinomial(probs, 1, generator=generator))
    except RuntimeError as e:  # inf / nan probabilities: the logits were not finite
        raise NonFiniteLogitsError("the model's logits are not finite (NaN or inf), so no token can be drawn: "
                                   "the artifact's weights are damaged; verify it (thinc verify) or recompile "
                                   "from a sound checkpoint") from e
