"""thin's semantic IR: frozen dataclasses describing a model, its verifier, serialiser and printer."""

from .errors import IRError, ThinError, one_line
from .model import (
    MLP,
    Attention,
    DecoderLayer,
    Embedding,
    Encoding,
    FFNLevel,
    Linear,
    LMHead,
    Model,
    MoE,
    Norm,
    RoPE,
    Tensor,
)
from .printer import format_ir, printable
from .program import Program
from .serialize import IRSchemaError, from_plain, to_plain
from .sizes import parse_size
from .verify import IRVerificationError, verify
from .version import IR_VERSION, __version__

__all__ = [
    "Attention", "DecoderLayer", "Embedding", "Encoding", "FFNLevel", "Linear", "LMHead", "MLP", "Model", "MoE",
    "Norm", "RoPE", "Tensor", "format_ir", "Program", "IRSchemaError", "from_plain", "to_plain",
    "IRVerificationError", "verify", "IR_VERSION", "__version__", "IRError", "ThinError", "one_line", "printable",
    "parse_size",
]
