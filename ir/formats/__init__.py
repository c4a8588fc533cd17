"""Storage and quantization formats: one file per format, one registry that everything looks up.

No other module keeps a table of dtypes or formats: the verifier, the checkpoint reader, the
artifact writer and reader, the passes and the runtime all ask this registry.
"""

from __future__ import annotations

from .base import PART_ALIGN, Format, GridQuantizer, Param, Part
from .dense import BF16, F16, F32
from .fp8 import FP8_E4M3
from .grouped_int import INT3, INT4, INT5, INT6
from .int8 import INT8
from .mxfp4 import MXFP4
from .q1 import Q1_FORMAT
from .q2 import Q2_FORMAT
from .trellis import TRELLIS

FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Add `fmt` under its name; a name registered twice is an error."""
    if fmt.name in FORMATS:
        raise ValueError(f"format {fmt.name!r} is registered twice")
    FORMATS[fmt.name] = fmt
    return fmt


for _fmt in (F32, F16, BF16, FP8_E4M3, INT8, INT3, INT4, INT5, INT6, MXFP4, Q2_FORMAT, Q1_FORMAT, TRELLIS):
    register(_fmt)


def get(name: str) -> Format:
    """The format called `name`; KeyError naming the known formats otherwise."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise KeyError(f"unknown format {name!r}; known formats: {', '.join(FORMATS)}") from None


def nbytes(name: str, shape: tuple[int, ...], params=()) -> int:
    """Bytes a tensor of `shape` takes in format `name` (KeyError / ValueError when it can't)."""
    return get(name).nbytes(tuple(shape), params)


def check(name: str, shape: tuple[int, ...], params=()) -> list[str]:
    """Every reason a tensor of `shape` can't be stored as `name` with `params` ([] when it can)."""
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        return [f"unknown format {name!r} (known: {', '.join(FORMATS)})"]
    return fmt.check(tuple(shape), params)


def dense_formats() -> list[Format]:
    """The formats that store plain elements (the ones a checkpoint's tensors come in)."""
    return [f for f in FORMATS.values() if f.dense]


def from_safetensors_dtype(dtype: str) -> Format | None:
    """The dense format whose safetensors dtype name is `dtype` ("BF16"), or None."""
    for fmt in FORMATS.values():
        if fmt.safetensors_dtype == dtype:
            return fmt
    return None


def encode(name: str, tensor, params=()):
    """The reference encoding of a torch tensor: a flat uint8 tensor (see Format.encode)."""
    return get(name).encode(tensor, params)


def decode(name: str, raw, shape: tuple[int, ...], params=(), dtype=None):
    """The tensor a blob stands for (see Format.decode)."""
    return get(name).decode(raw, tuple(shape), params, dtype)


__all__ = ["FORMATS", "Format", "GridQuantizer", "PART_ALIGN", "Param", "Part", "check", "decode",
           "dense_formats", "encode", "from_safetensors_dtype", "get", "nbytes", "register"]
