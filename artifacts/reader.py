"""Open a .thin file: validate every byte of structure first, then map it and hand out zero-copy views.

The file is untrusted. Nothing it says is used before it is checked: the preamble (magic, version,
CRC, bounds), the header (size limit, sha256, bounded msgpack, schema), the IR (deserialise and
verify), the tensor table (layout, sizes, agreement with the IR) and the sections. Only then is the
file mapped. Tensor data is checked on demand by `verify_checksums` (it means reading every byte).

A file can change underneath: `cp` or `curl -o` over an artifact in use truncates it in place, and
touching a mapped page past the new end kills the process with SIGBUS. `verify_checksums` therefore
reads with pread, so a file that shrinks while it is verified is a TruncatedError. The views that
`buffer` and `numpy` hand out (and the runtime's weights) are the mapping itself: the policy is that
an artifact in use is replaced by rename, as the writer does, never rewritten in place.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import stat
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from thin.ir import Model
from thin.ir import __version__ as THIN_VERSION

from .errors import (
    ArtifactClosedError,
    ArtifactError,
    BadMagicError,
    ChecksumMismatchError,
    CorruptHeaderError,
    LayoutError,
    TensorNotFoundError,
    TruncatedError,
    UnsupportedVersionError,
)
from .sections import decompress_tokenizer, validate_sections
from .spec import (
    FORMAT_VERSION,
    HEADER_KEYS,
    MAGIC,
    MAX_HEADER_BYTES,
    PREAMBLE_SIZE,
    SECTION_NAMES,
    Preamble,
    unpack,
    unpack_preamble,
)
from .validate import TensorEntry, check_tensor_table, parse_ir

_DAMAGED = "the file is damaged: re-download or recompile"
_HASH_CHUNK = 8 << 20


def _pread(fd: int, n: int, offset: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _version(text: str) -> tuple[int, ...]:
    """"0.1.0" as (0, 1, 0); a version that is not dotted numbers ("?") as newer than any."""
    parts = text.split(".")
    return tuple(map(int, parts)) if all(p.isdigit() for p in parts) else (1 << 30,)


def _read_preamble(fd: int, size: int, path: Path) -> Preamble:
    head = _pread(fd, min(size, PREAMBLE_SIZE), 0)
    if not head:
        raise BadMagicError(f"{path} is empty (0 bytes), not a .thin artifact; give the file that `thinc compile` "
                            "wrote, or compile it again")
    if head[:len(MAGIC)] != MAGIC[:len(head)]:
        raise BadMagicError(f"{path} is not a .thin artifact (it starts with {head[:8]!r}); "
                            "give the file that `thinc compile` wrote")
    if len(head) < PREAMBLE_SIZE:
        raise TruncatedError(f"{path} is truncated at {size} bytes, shorter than the {PREAMBLE_SIZE}-byte "
                             "preamble: re-download or recompile")
    pre, reserved, crc, computed = unpack_preamble(head)
    if pre.major != FORMAT_VERSION[0]:
        if pre.major > FORMAT_VERSION[0] and _version(pre.min_thin_version) <= _version(THIN_VERSION):
            # A newer format that a release no newer than this one wrote: the preamble is damaged.
            raise CorruptHeaderError(f"{path} names .thin format {pre.major}.{pre.minor}, which no thin up to "
                                     f"{THIN_VERSION} writes; {_DAMAGED}")
        if pre.major > FORMAT_VERSION[0]:
            need = pre.min_thin_version if pre.min_thin_version != "?" else "a newer release"
            raise UnsupportedVersionError(
                f"{path} uses .thin format {pre.major}.{pre.minor}, which was written by thin >= {need}; "
                f"this is thin {THIN_VERSION} (reads format {FORMAT_VERSION[0]}.x): upgrade thin")
        raise UnsupportedVersionError(
            f"{path} uses the old .thin format {pre.major}.{pre.minor}; this thin {THIN_VERSION} reads "
            f"format {FORMAT_VERSION[0]}.x: recompile the model with this thin")
    if crc != computed:
        raise CorruptHeaderError(f"{path}: the preamble checksum does not match; {_DAMAGED}")
    newer = pre.minor > FORMAT_VERSION[1]
    if not newer and (pre.flags or any(reserved)):
        raise CorruptHeaderError(f"{path}: reserved preamble fields are set in a format "
                                 f"{pre.major}.{pre.minor} file; {_DAMAGED}")
    return pre


def _check_bounds(pre: Preamble, size: int, path: Path) -> None:
    if size < pre.file_size:
        raise TruncatedError(f"{path} is truncated at {size} of {pre.file_size} bytes: re-download or recompile")
    if size > pre.file_size:
        raise LayoutError(f"{path} has {size - pre.file_size} bytes after its recorded end at {pre.file_size}; "
                          f"{_DAMAGED}")
    if not 0 < pre.header_length <= MAX_HEADER_BYTES:
        raise LayoutError(f"{path}: header length {pre.header_length} is outside 1..{MAX_HEADER_BYTES}; {_DAMAGED}")
    if pre.header_offset < PREAMBLE_SIZE or pre.header_offset + pre.header_length != size:
        raise LayoutError(f"{path}: the header at {pre.header_offset}+{pre.header_length} does not end the "
                          f"{size}-byte file; {_DAMAGED}")


def _parse_header(blob: bytes, pre: Preamble, path: Path):
    """(model, entries, sections, header) from checksummed header bytes."""
    header = unpack(blob)
    lenient = pre.minor > FORMAT_VERSION[1]
    if type(header) is not dict:
        raise CorruptHeaderError(f"{path}: the header is not a mapping; {_DAMAGED}")
    missing = [k for k in HEADER_KEYS if k not in header]
    unknown = sorted(set(header) - set(HEADER_KEYS))
    if missing or (unknown and not lenient):
        raise CorruptHeaderError(f"{path}: the header lacks {missing} or has unknown keys {unknown}; {_DAMAGED}")
    model = parse_ir(header["ir"])
    entries = check_tensor_table(header["tensors"], model, pre.header_offset, lenient)
    sections = validate_sections(header["sections"], pre.minor, FORMAT_VERSION[1])
    return model, entries, sections, header


def _with_path(error: ArtifactError, path: Path) -> ArtifactError:
    """The same error class, its message on one line and naming the file."""
    message = " ".join(str(error).split())
    return type(error)(message if message.startswith(str(path)) else f"{path}: {message}")


def missing_artifact(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be an artifact before it is opened, in one line (None when it is a file): no such file, a
    symbolic link that leads nowhere (broken, or a loop) or something that is not a file."""
    path = Path(path)
    if path.is_file():
        return None
    if not os.path.lexists(path):
        return f"no such artifact: {path}"
    if not path.exists():
        return f"{path} is a symbolic link that leads to no file (broken, or a loop)"
    return f"{path} is not a file; give the .thin file that `thinc compile` wrote"


def open_artifact(path: str | os.PathLike, *, writable: bool = True) -> Artifact:
    """Validate and map a .thin file; raises an ArtifactError subclass on any structural problem.

    With `writable=True` (the default) the mapping is private copy-on-write (mmap.ACCESS_COPY):
    numpy views are writable, so torch.frombuffer takes them without a warning or a copy, and a
    write changes only this process's page, never the file. `writable=False` maps read-only.
    """
    path = Path(path)
    # Non-blocking: opening a FIFO for reading would otherwise wait for a writer forever.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadMagicError(f"{path} is not a regular file; give the .thin file that `thinc compile` wrote")
        size = st.st_size
        pre = _read_preamble(fd, size, path)
        _check_bounds(pre, size, path)
        blob = _pread(fd, pre.header_length, pre.header_offset)
        if len(blob) != pre.header_length:
            raise TruncatedError(f"{path} shrank while being read: re-download or recompile")
        if hashlib.sha256(blob).digest() != pre.header_sha256:
            raise ChecksumMismatchError(f"{path}: the header does not match its sha256; {_DAMAGED}")
        try:
            model, entries, sections, header = _parse_header(blob, pre, path)
        except ArtifactError as e:
            raise _with_path(e, path) from None
        del blob
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY if writable else mmap.ACCESS_READ)
        if len(mm) != size:
            mm.close()
            raise TruncatedError(f"{path} changed size while being opened: re-download or recompile")
    except BaseException:
        os.close(fd)
        raise
    return Artifact(path, pre, header, model, entries, sections, mm, fd)


class Artifact:
    """An open, validated .thin file. Views it hands out point into the mapping (zero copy)."""

    def __init__(self, path: Path, preamble: Preamble, header: dict, model: Model, entries: list[TensorEntry],
                 sections: dict, mm: mmap.mmap, fd: int):
        self.path = path
        self.preamble = preamble
        self.header = header  # the decoded header, plain data (treat as read-only)
        self.model = model
        self._entries = {e.name: e for e in entries}
        self._sections = sections
        self._mm: mmap.mmap | None = mm
        self._fd: int | None = fd  # for pread: reads that survive the file shrinking
        self._close_fd = weakref.finalize(self, os.close, fd)  # an artifact never closed must not leak it
        self.file_size = preamble.file_size

    # -- metadata -----------------------------------------------------------------------------
    @property
    def format_version(self) -> tuple[int, int]:
        return (self.preamble.major, self.preamble.minor)

    def section(self, name: str):
        """A section's value (the tokenizer as {file name: bytes}); KeyError for a name not in the file."""
        if name == "tokenizer":
            return self.tokenizer_files()
        if name in self._sections:
            return self._sections[name]
        if name in self.header["sections"] and name not in SECTION_NAMES:
            return self.header["sections"][name]  # from a newer minor version: unchecked plain data
        raise KeyError(f"no section {name!r}; sections: {', '.join(SECTION_NAMES)}")

    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer files, decompressed (bounded by their declared sizes)."""
        return decompress_tokenizer(self._sections["tokenizer"])

    chat_template = property(lambda self: self._sections["chat_template"], doc="The chat template or None.")
    generation_config = property(lambda self: self._sections["generation_config"])
    compile_config = property(lambda self: self._sections["compile_config"])
    provenance = property(lambda self: self._sections["provenance"])
    key = property(lambda self: self._sections["key"], doc="The cache key the artifact was compiled under.")

    def tensor_names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._entries)

    def tensor_entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise TensorNotFoundError(f"no tensor {name!r} in {self.path}") from None

    # -- data -----------------------------------------------------------------------------------
    def _map(self) -> mmap.mmap:
        if self._mm is None:
            raise ArtifactClosedError(f"{self.path} is closed")
        return self._mm

    def buffer(self, name: str) -> memoryview:
        """The tensor's bytes as a memoryview into the mapping (zero copy; see the module doc on SIGBUS)."""
        e = self.tensor_entry(name)
        return memoryview(self._map())[e.offset:e.offset + e.size]

    def span(self, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length) of the file as a memoryview into the mapping (zero copy): an
        expert's page (thin.artifacts.pages). ValueError for a range outside the file."""
        if not (type(offset) is int and type(length) is int and offset >= 0 and length > 0
                and offset + length <= self.file_size):
            raise ValueError(f"{self.path}: range ({offset!r}, {length!r}) is not inside the file")
        return memoryview(self._map())[offset:offset + length]

    def numpy(self, name: str) -> np.ndarray:
        """The tensor's bytes as a flat uint8 array over the mapping (zero copy)."""
        e = self.tensor_entry(name)
        if e.size == 0:
            return np.zeros(0, np.uint8)
        return np.frombuffer(self._map(), dtype=np.uint8, count=e.size, offset=e.offset)

    def _descriptor(self) -> int:
        if self._fd is None:
            raise ArtifactClosedError(f"{self.path} is closed")
        return self._fd

    def verify_checksums(self, names=None, *, workers: int | None = None) -> list[str]:
        """Names of tensors whose bytes fail their sha256 or whose zero padding before them is not zero.

        Reads with pread, never through the mapping: a file truncated meanwhile raises TruncatedError."""
        fd = self._descriptor()
        entries = [self.tensor_entry(n) for n in (self.tensor_names() if names is None else names)]
        total = sum(e.size for e in entries)
        # hashlib releases the GIL on large buffers, so threads hash several tensors at once.
        workers = workers or (min(8, os.cpu_count() or 1) if total > (64 << 20) else 1)
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                ok = list(pool.map(lambda e: _tensor_ok(fd, e, self.path), entries))
        else:
            ok = [_tensor_ok(fd, e, self.path) for e in entries]
        return [e.name for e, good in zip(entries, ok) if not good]

    def close(self) -> None:
        """Unmap the file; views still alive keep the mapping until they go."""
        mm, self._mm = self._mm, None
        self._fd = None
        self._close_fd()
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # numpy arrays or memoryviews still point in; the mapping dies with them

    @property
    def closed(self) -> bool:
        return self._mm is None

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Artifact {self.path} {self.model.architecture} {len(self._entries)} tensors>"


def _tensor_ok(fd: int, e: TensorEntry, path: Path) -> bool:
    padding = e.offset - e.padding_start
    if _pread(fd, padding, e.padding_start).count(0) != padding:
        return False
    h = hashlib.sha256()
    for start in range(e.offset, e.offset + e.size, _HASH_CHUNK):
        want = min(_HASH_CHUNK, e.offset + e.size - start)
        chunk = _pread(fd, want, start)
        if len(chunk) != want:
            raise TruncatedError(f"{path} shrank while it was verified (tensor {e.name!r} ends past the new end); "
                                 "the file was replaced or truncated underneath: re-download or recompile")
        h.update(chunk)
    return h.hexdigest() == e.sha256


def verify_file(path: str | os.PathLike, *, workers: int | None = None) -> list[str]:
    """Open `path` (raising ArtifactError on structural problems) and return the tensors whose bytes fail."""
    with open_artifact(path, writable=False) as artifact:
        return artifact.verify_checksums(workers=workers)
