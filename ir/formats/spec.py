"""Format specs: what each stored encoding is and how many bytes a tensor takes. No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class FormatSpec:
    name: str  # standard name: "f32", "bf16", "fp8_e4m3", "int4", ...
    bits: float  # storage bits per element, scales included
    # Dense formats store one element per `bits` with no side data; their torch dtype name.
    torch_dtype: str | None = None
    description: str = ""

    def nbytes(self, shape: tuple[int, ...], params: tuple = ()) -> int:
        """Bytes of a tensor of `shape` in this format."""
        if self.torch_dtype is None:
            raise NotImplementedError(f"format {self.name} must define nbytes")
        return prod(shape) * int(self.bits) // 8


FORMATS: dict[str, FormatSpec] = {}


def register(spec: FormatSpec) -> FormatSpec:
    if spec.name in FORMATS:
        raise ValueError(f"format {spec.name!r} is registered twice")
    FORMATS[spec.name] = spec
    return spec


register(FormatSpec("f32", 32, "float32", "IEEE float32, stored as is"))
register(FormatSpec("f16", 16, "float16", "IEEE float16, stored as is"))
register(FormatSpec("bf16", 16, "bfloat16", "bfloat16, stored as is"))

# Dense dtype names as they appear in safetensors headers.
SAFETENSORS_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


def get(name: str) -> FormatSpec:
    try:
        return FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown format {name!r}; known formats: {', '.join(sorted(FORMATS))}") from None


def nbytes(format: str, shape: tuple[int, ...], params: tuple = ()) -> int:
    """Bytes a tensor of `shape` takes in `format` (raises KeyError on an unknown format)."""
    return get(format).nbytes(tuple(shape), params)
