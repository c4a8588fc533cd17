"""The Hugging Face frontend: config.json + safetensors -> thin IR program."""

from .adapters import ADAPTERS, get_adapter, register
from .errors import (
    CheckpointError,
    FrontendError,
    LedgerError,
    PickleCheckpointError,
    UnsupportedArchitectureError,
    UnsupportedConfigError,
)
from .frontend import Source, load_checkpoint

__all__ = [
    "ADAPTERS",
    "CheckpointError",
    "FrontendError",
    "LedgerError",
    "PickleCheckpointError",
    "Source",
    "UnsupportedArchitectureError",
    "UnsupportedConfigError",
    "get_adapter",
    "load_checkpoint",
    "register",
]
