"""What a model accepts from a caller: token ids of the right type, shape and range; prompts of bounded size.

Nothing is coerced: floats are not truncated to ids, a batch is not flattened into one sequence,
an id past the vocabulary is named instead of failing inside an embedding lookup.
"""

from __future__ import annotations

import numbers

import torch

from .errors import InputError

# Prompt text is bounded before it is tokenized: tokenizing costs ~100 bytes of memory per input
# byte, and a prompt this long exceeds any context window in use.
MAX_PROMPT_BYTES = 8 << 20


def check_prompt_text(text) -> str:
    """`text` if it is a string of at most MAX_PROMPT_BYTES UTF-8 bytes; InputError otherwise."""
    if not isinstance(text, str):
        raise InputError(f"a prompt is a string, got {type(text).__name__}")
    # Measuring in characters first avoids encoding a huge string just to find it too long.
    if len(text) > MAX_PROMPT_BYTES:
        raise InputError(f"the prompt is longer than {MAX_PROMPT_BYTES} bytes, the limit on prompt text")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:  # a lone surrogate: bytes that were not UTF-8, decoded leniently
        raise InputError(f"the prompt is not valid Unicode text (character {e.start} is a lone surrogate, "
                         "as from bytes that are not UTF-8)") from None
    if size > MAX_PROMPT_BYTES:
        raise InputError(f"the prompt is longer than {MAX_PROMPT_BYTES} bytes, the limit on prompt text")
    return text


def token_list(ids, vocab_size: int | None, what: str = "prompt") -> list[int]:
    """A sequence of token ids as a list of ints, each in 0..vocab_size-1; InputError otherwise."""
    if isinstance(ids, (str, bytes)):
        raise InputError(f"{what} token ids must be a sequence of integers, got {type(ids).__name__}")
    if isinstance(ids, torch.Tensor):
        return token_tensor(ids, vocab_size, what).tolist()
    try:
        values = list(ids)
    except TypeError:
        raise InputError(f"{what} token ids must be a sequence of integers, got {type(ids).__name__}") from None
    for i, t in enumerate(values):
        if getattr(t, "shape", None) == () and hasattr(t, "item"):  # a 0-d tensor or numpy scalar
            values[i] = t = t.item()
        if isinstance(t, (list, tuple)) or len(getattr(t, "shape", ())) > 0:
            raise InputError(f"{what} token ids must be one sequence of shape [T]; item {i} is itself a sequence: "
                             "batches are not supported, call once per sequence")
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InputError(f"{what} token ids must be integers; item {i} is {str(t)[:40]!r} "
                             f"({type(t).__name__})")
    values = [int(t) for t in values]
    _check_range(min(values, default=0), max(values, default=0), vocab_size, what)
    return values


def token_tensor(ids, vocab_size: int | None, what: str = "input") -> torch.Tensor:
    """One sequence of token ids as a 1-D int64 CPU tensor (or on its own device), checked."""
    if not isinstance(ids, torch.Tensor):
        if hasattr(ids, "dtype") and hasattr(ids, "shape"):  # numpy arrays keep their dtype and shape
            ids = torch.as_tensor(ids)
        else:
            return torch.tensor(token_list(ids, vocab_size, what), dtype=torch.long)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InputError(f"{what} token ids must have an integer dtype, got {ids.dtype}")
    if ids.dim() != 1:
        raise InputError(f"{what} token ids must be one sequence of shape [T], got shape {tuple(ids.shape)}; "
                         "batches are not supported: call once per sequence")
    check_tensor_range(ids, vocab_size, what)
    return ids.to(torch.long)


def check_tensor_range(ids: torch.Tensor, vocab_size: int | None, what: str = "input") -> None:
    """Refuse ids outside the vocabulary. Ids already on an accelerator are not read back (that would
    add a device sync per decoded token); those come from the decode loop, which samples them from
    vocabulary-sized logits."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InputError(f"{what} token ids must have an integer dtype, got {ids.dtype}")
    if ids.numel() and ids.device.type == "cpu":
        _check_range(int(ids.min()), int(ids.max()), vocab_size, what)


def _check_range(low: int, high: int, vocab_size: int | None, what: str) -> None:
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        raise InputError(f"{what} token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})"
                         if vocab_size is not None else f"{what} token id {bad} is negative")
