"""Every way a .thin file can be refused, as one exception family.

Callers catch `ArtifactError`; each subclass names one kind of problem so tools can
react to it (re-download on truncation, upgrade on a newer format). Messages are one
line and say what the user can do.
"""

from __future__ import annotations

from thin.ir import ThinError


class ArtifactError(ThinError):
    """Base of every error raised while reading, validating or writing a .thin artifact."""


class BadMagicError(ArtifactError):
    """The file does not start with the .thin magic bytes."""


class UnsupportedVersionError(ArtifactError):
    """The file uses a major format version this thin cannot read."""


class TruncatedError(ArtifactError):
    """The file is shorter than its preamble says."""


class CorruptHeaderError(ArtifactError):
    """The preamble or header is damaged or malformed (bad checksum of the preamble, bad msgpack, bad schema)."""


class LayoutError(ArtifactError):
    """The preamble points outside the file, or the file has bytes its layout does not explain."""


class ChecksumMismatchError(ArtifactError):
    """The header bytes do not match the sha256 recorded in the preamble."""


class InvalidTensorTableError(ArtifactError):
    """The tensor table is malformed, inconsistent with the file layout, or disagrees with the IR."""


class InvalidIRError(ArtifactError):
    """The embedded IR does not deserialise or does not verify."""


class InvalidSectionError(ArtifactError):
    """A header section has the wrong type, an unknown name, or data that does not decode within bounds."""


class TensorNotFoundError(ArtifactError, KeyError):
    """A tensor name asked for is not in the artifact."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ArtifactClosedError(ArtifactError):
    """The artifact was used after close()."""


class ArtifactWriteError(ArtifactError):
    """The writer was misused or its inputs disagree (missing tensors, wrong sizes, unknown sections)."""


class SourceChangedError(ArtifactError):
    """A source file changed while it was being hashed for the cache key, or since it was read."""
