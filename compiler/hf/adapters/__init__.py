"""Architecture adapters: one file per family, registered by `architectures` name.

An adapter is a function `(config, builder) -> thin.ir.Model` that maps config.json and
the checkpoint's tensor names onto the IR through the builder (which keeps the ledger).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class Adapter:
    architecture: str  # config.json `architectures` entry, e.g. "Qwen3ForCausalLM"
    family: str  # IR family name, e.g. "qwen3"
    build: Callable  # (Config, Builder) -> thin.ir.Model
    # config.json quantization_config methods whose tensors the adapter reads as they are (GPT-OSS:
    # "mxfp4" experts); any other pre-quantized checkpoint is refused.
    quant_methods: tuple[str, ...] = ()


ADAPTERS: dict[str, Adapter] = {}


def register(architecture: str, family: str, quant_methods: tuple[str, ...] = ()):
    """Decorator registering `build` for `architecture`; registering a name twice is an error."""
    def wrap(build: Callable) -> Callable:
        if architecture in ADAPTERS:
            raise ValueError(f"architecture {architecture!r} is registered twice")
        ADAPTERS[architecture] = Adapter(architecture, family, build, quant_methods)
        return build
    return wrap


def get_adapter(architecture: str) -> Adapter:
    """The adapter for `architecture`, or UnsupportedArchitectureError listing the supported ones."""
    try:
        return ADAPTERS[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(ADAPTERS))}") from None


# Importing each family module registers it.
from . import gemma2, gemma3, gpt_oss, llama, mistral, mixtral, olmo2, phi3, qwen2, qwen3, qwen3_moe  # noqa: E402, F401
