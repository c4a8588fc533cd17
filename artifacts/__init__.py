"""The .thin artifact: one self-describing file holding the IR, every tensor, tokenizer and plans.

Writing streams tensors into a temp file and renames it into place; reading validates every
structure before mapping the file. No torch here: inspecting a file needs only numpy, msgpack and
zstandard. FORMAT.md describes the bytes.
"""

from thin.ir import printable

from .cache import BadCacheEntryError, CompileCache
from .describe import certificate_summary, describe, ffn_level_summary, human_size, render_description
from .errors import (
    ArtifactClosedError,
    ArtifactError,
    ArtifactWriteError,
    BadMagicError,
    ChecksumMismatchError,
    CorruptHeaderError,
    InvalidIRError,
    InvalidSectionError,
    InvalidTensorTableError,
    LayoutError,
    SourceChangedError,
    TensorNotFoundError,
    TruncatedError,
    UnsupportedVersionError,
)
from .key import compute_key, default_hash_cache, hash_files
from .reader import Artifact, missing_artifact, open_artifact, verify_file
from .spec import FORMAT_VERSION, MAGIC, SECTION_NAMES
from .validate import TensorEntry
from .writer import ArtifactWriter, create_temp_beside, replace_with_bytes

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "SECTION_NAMES",
    "Artifact",
    "ArtifactClosedError",
    "ArtifactError",
    "ArtifactWriteError",
    "ArtifactWriter",
    "create_temp_beside",
    "replace_with_bytes",
    "BadCacheEntryError",
    "CompileCache",
    "BadMagicError",
    "ChecksumMismatchError",
    "CorruptHeaderError",
    "InvalidIRError",
    "InvalidSectionError",
    "InvalidTensorTableError",
    "LayoutError",
    "TensorEntry",
    "TensorNotFoundError",
    "TruncatedError",
    "UnsupportedVersionError",
    "certificate_summary",
    "compute_key",
    "default_hash_cache",
    "missing_artifact",
    "describe",
    "ffn_level_summary",
    "human_size",
    "hash_files",
    "open_artifact",
    "printable",
    "render_description",
    "SourceChangedError",
    "verify_file",
]
