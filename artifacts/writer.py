"""Stream tensors into a .thin file and publish it atomically.

The writer appends each tensor as the compiler produces it (so the whole model is never in
memory), writes the header after the last tensor, then fills the preamble at offset 0. All of
this happens in a temp file beside the target; only a complete, fsynced file is renamed onto
the target path, so an interrupted compile leaves the target untouched.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import weakref
from pathlib import Path

import numpy as np

from thin.ir import IRVerificationError, Model, to_plain, verify
from thin.ir.formats import nbytes

from .errors import ArtifactWriteError
from .sections import encode_sections
from .spec import (
    FORMAT_VERSION,
    MAJOR_INTRODUCED_IN,
    MAX_ALIGN,
    MAX_NAME_CHARS,
    MIN_ALIGN,
    PREAMBLE_SIZE,
    Preamble,
    align_up,
    pack,
    valid_align,
)

_ZEROS = bytes(MAX_ALIGN)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# File names are limited to 255 bytes on common filesystems; a temp name is the target's name plus
# a dot, ".tmp-" and 12 hex digits, so the target's part is cut to leave room for them.
_NAME_MAX = 255
_TEMP_EXTRA = len(".") + len(".tmp-") + 12


def create_temp_beside(path: str | os.PathLike) -> tuple[int, str]:
    """(descriptor, path) of a new, empty temp file in `path`'s folder, named after it.

    Created exclusively with mode 0o666 minus the umask (what the final file will have after the
    rename); the name fits the 255-byte limit whatever the length of `path`'s own name."""
    path = Path(path)
    stem = os.fsencode(path.name)[:_NAME_MAX - _TEMP_EXTRA].decode("utf-8", "ignore")  # whole characters
    name = f".{stem}.tmp-{secrets.token_hex(6)}"
    tmp = str(path.parent / name)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    return fd, tmp


def replace_with_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to a temp file beside `path` and rename it onto `path`: a reader sees the old file or
    the whole new one, and a failed or interrupted write leaves `path` as it was (the temp file removed)."""
    fd, tmp = create_temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _byte_view(data, name: str) -> memoryview:
    """A flat unsigned-byte view of `data` without copying it."""
    if isinstance(data, np.ndarray):
        if data.dtype.hasobject or not data.flags.c_contiguous:
            raise ArtifactWriteError(f"tensor {name!r}: numpy data must be C-contiguous and not of object dtype")
        return memoryview(data.reshape(-1).view(np.uint8))
    try:
        view = memoryview(data)
    except TypeError:
        raise ArtifactWriteError(
            f"tensor {name!r}: got {type(data).__name__}; pass bytes, a memoryview or a contiguous numpy array "
            "(from torch: t.contiguous().view(torch.uint8).numpy())") from None
    if not view.c_contiguous:
        raise ArtifactWriteError(f"tensor {name!r}: the buffer is not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class ArtifactWriter:
    """Write one .thin file: `add_tensor` for each tensor, then `commit(model, sections)`.

    Use as a context manager: an exception inside the block, or leaving it without commit,
    removes the temp file and leaves `path` as it was.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        # The random part keeps concurrent compiles apart; it never enters the file's bytes.
        fd, self._tmp = create_temp_beside(self.path)
        self._file = os.fdopen(fd, "w+b", buffering=1 << 20)
        self._cleanup = weakref.finalize(self, _remove, self._tmp)
        self._file.write(bytes(PREAMBLE_SIZE))  # filled in last, once the header's place is known
        self._pos = PREAMBLE_SIZE
        self._entries: dict[str, dict] = {}
        self._state = "open"

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._state != "open":
            return
        self.abort()
        if exc_type is None:
            raise ArtifactWriteError(f"the writer for {self.path} was closed without commit(); nothing written")

    def add_tensor(self, name: str, data, *, align: int = 64) -> None:
        """Append one tensor's bytes (bytes, memoryview or contiguous numpy array) at an `align` offset."""
        self._check_open()
        if type(name) is not str or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ArtifactWriteError(f"tensor names must be strings of 1 to {MAX_NAME_CHARS} characters")
        if name in self._entries:
            raise ArtifactWriteError(f"tensor {name!r} was added twice")
        if not valid_align(align):
            raise ArtifactWriteError(f"tensor {name!r}: align must be a power of two in "
                                     f"[{MIN_ALIGN}, {MAX_ALIGN}], got {align!r}")
        view = _byte_view(data, name)
        offset = align_up(self._pos, align)
        try:
            self._file.write(_ZEROS[:offset - self._pos])
            self._file.write(view)
        except BaseException:
            self.abort()  # a half-written tensor cannot be undone
            raise
        self._pos = offset + view.nbytes
        self._entries[name] = {"offset": offset, "size": view.nbytes, "align": align,
                               "sha256": hashlib.sha256(view).hexdigest()}

    def commit(self, model: Model, sections: dict | None = None) -> Path:
        """Check the tensors against `model`, write the header, fsync and rename onto `path`."""
        self._check_open()
        try:
            header = self._header(model, sections)
            try:
                blob = pack(header)
            except TypeError as e:
                raise ArtifactWriteError(f"a section is not plain data: {e}") from None
            pre = Preamble(FORMAT_VERSION[0], FORMAT_VERSION[1], MAJOR_INTRODUCED_IN[FORMAT_VERSION[0]], 0,
                           self._pos + len(blob), self._pos, len(blob), hashlib.sha256(blob).digest())
            self._file.write(blob)
            self._file.seek(0)
            self._file.write(pre.pack())
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self._state = "committed"
        self._cleanup.detach()
        _fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Discard everything written; the target path is left as it was. Safe to call twice."""
        if self._state == "committed":
            return
        self._state = "aborted"
        try:
            self._file.close()
        except OSError:
            pass
        self._cleanup()

    def _check_open(self) -> None:
        if self._state != "open":
            raise ArtifactWriteError(f"the writer for {self.path} is already {self._state}")

    def _header(self, model: Model, sections: dict | None) -> dict:
        if not isinstance(model, Model):
            raise ArtifactWriteError(f"commit needs a thin.ir.Model, got {type(model).__name__}")
        try:
            verify(model)
        except IRVerificationError as e:
            raise ArtifactWriteError(f"the IR does not verify: {e}") from e
        stored_sections = encode_sections(sections)
        ir_names = [t.name for t in model.tensors]
        problems = [f"missing tensor {n!r}" for n in ir_names if n not in self._entries]
        problems += [f"tensor {n!r} is not in the IR" for n in self._entries if n not in set(ir_names)]
        irmap = model.tensor_map()
        table = []
        for name, entry in self._entries.items():
            t = irmap.get(name)
            if t is None:
                continue
            expected = nbytes(t.encoding.format, t.shape, t.encoding.params)
            if entry["size"] != expected:
                problems.append(f"tensor {name!r} has {entry['size']} bytes; {t.encoding.format} "
                                f"{list(t.shape)} takes {expected}")
            if entry["align"] < t.align:
                problems.append(f"tensor {name!r} was written with align {entry['align']}, the IR asks {t.align}")
            table.append({"name": name, "role": t.role, "layer": t.layer, "expert": t.expert,
                          "format": t.encoding.format, "params": [list(p) for p in t.encoding.params],
                          "shape": list(t.shape), **entry})
        if problems:
            raise ArtifactWriteError("the written tensors disagree with the IR: " + "; ".join(problems))
        return {"ir": to_plain(model), "tensors": table, "sections": stored_sections}


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; some platforms cannot open a directory, which is fine to skip."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
