"""The model folder as untrusted input: which files may be read, and reading them within bounds.

Policy. A file the frontend reads must, after following every symlink, lie inside the model
folder, or, when the folder is a Hugging Face hub cache snapshot (`.../snapshots/<revision>/`,
whose files are symlinks into the repository's `blobs/`), inside that repository's `blobs/`
folder. Names taken from a file (an index's `weight_map`) must be plain relative paths: no
absolute paths, no `..`, no backslashes, no NUL. Every input must be a regular file (a FIFO,
device or socket is refused, never opened for a blocking read), and every read is bounded.
Each file's identity (size, mtimes, inode, device) is recorded when it is read, so a file
that changes later in the compile is noticed instead of mixed into the artifact.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath

from .errors import CheckpointError, InputChangedError, OutsideModelFolderError

MAX_JSON_BYTES = 64 << 20  # config, index, tokenizer and generation configs
MAX_JSON_ITEMS = 4_000_000  # values in one JSON document (bounds the memory of parsing it)
_MAX_INT_DIGITS = 40  # JSON integers longer than this are not sizes or ids: refused before int()
_MAX_NAME_CHARS = 1024
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


def identity(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file's content may have changed: size, mtime, ctime, inode, device."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


class ModelFolder:
    """A checkpoint directory whose files are opened only through `open`/`read`, under the policy above."""

    def __init__(self, path):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise CheckpointError(f"{self.path} is a file, not a checkpoint folder; give the folder that holds "
                                  f"config.json and the *.safetensors ({self.path.parent})")
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self.root = Path(os.path.realpath(self.path))
        roots = [self.root]
        blobs = self.root.parent.parent / "blobs"
        if self.root.parent.name == "snapshots" and blobs.is_dir():
            roots.append(Path(os.path.realpath(blobs)))
        self.roots = tuple(roots)
        self.identities: dict[str, tuple[int, ...]] = {}  # name -> identity when it was read

    def check_name(self, name, where: str) -> str:
        """`name` if it is a plain relative path (as written in `where`), else CheckpointError."""
        if type(name) is not str or not 0 < len(name) <= _MAX_NAME_CHARS:
            raise CheckpointError(f"{where}: file name {_show(name)} must be a string of 1 to {_MAX_NAME_CHARS} "
                                  "characters")
        parts = PurePosixPath(name).parts
        if ("\0" in name or "\\" in name or PurePosixPath(name).is_absolute() or ".." in parts
                or not parts or not name.strip()):
            raise OutsideModelFolderError(f"{where}: file name {_show(name)} is not a plain path inside the model "
                                          "folder; absolute paths, '..' and backslashes are refused")
        return PurePosixPath(name).as_posix()  # one spelling per file: "./a" and "a" are the same shard

    def exists(self, name: str) -> bool:
        """Whether `name` exists in the folder (as anything; `open` decides whether it may be read)."""
        return os.path.lexists(self.path / name)

    def real_path(self, name: str) -> Path:
        """Where `name` leads after every symlink, checked to lie under the folder's roots."""
        real = Path(os.path.realpath(self.path / name))
        if not any(real == root or real.is_relative_to(root) for root in self.roots):
            raise OutsideModelFolderError(
                f"{self.path / name} resolves to {real}, outside the model folder; thin reads only files inside "
                "it (symlinks must point inside the folder, or into a hub cache's blobs/)")
        return real

    def open(self, name: str) -> tuple[int, os.stat_result]:
        """(file descriptor, its stat) of the regular file `name`; the caller closes the descriptor."""
        real = self.real_path(name)
        try:
            fd = os.open(real, _OPEN_FLAGS)
        except FileNotFoundError:
            raise CheckpointError(f"{name} not found in {self.path}") from None
        except OSError as e:
            raise CheckpointError(f"cannot open {self.path / name}: {e.strerror or e}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise CheckpointError(f"{self.path / name} is not a regular file ({_kind(st.st_mode)}); "
                                  "thin reads only regular files")
        return fd, st

    def read(self, name: str, limit: int = MAX_JSON_BYTES) -> bytes:
        """The whole content of `name`, refusing files over `limit` bytes; records its identity."""
        fd, st = self.open(name)
        try:
            if st.st_size > limit:
                raise CheckpointError(f"{self.path / name} is {st.st_size} bytes; the limit for this file is {limit}")
            chunks, total = [], 0
            while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
                chunks.append(chunk)
                total += len(chunk)
                if total > limit:
                    raise CheckpointError(f"{self.path / name} grew past {limit} bytes while being read")
            self.note(name, st, os.fstat(fd))
        finally:
            os.close(fd)
        return b"".join(chunks)

    def note(self, name: str, before: os.stat_result, after: os.stat_result) -> None:
        """Record `name`'s identity, refusing a file that changed between two stats taken around a read."""
        if identity(before) != identity(after):
            raise InputChangedError(f"{self.path / name} changed while it was read; let the download or copy "
                                    "finish and compile again")
        self.identities[name] = identity(before)

    def read_json(self, name: str, *, required: bool) -> dict:
        """`name` parsed as a JSON object; {} when absent and not required."""
        if not self.exists(name):
            if required:
                raise CheckpointError(f"{name} not found in {self.path}")
            return {}
        return parse_json_object(self.read(name), str(self.path / name))


def parse_json_object(raw: bytes, where: str, max_items: int = MAX_JSON_ITEMS) -> dict:
    """Untrusted JSON bytes as a dict. Refuses, as one-line CheckpointErrors: invalid UTF-8 or JSON,
    nesting too deep for the parser, integers of more than 40 digits, more than `max_items` values."""
    value = parse_json(raw, where, max_items)
    if not isinstance(value, dict):
        raise CheckpointError(f"{where} must hold a JSON object, found {type(value).__name__}")
    return value


def parse_json(raw: bytes, where: str, max_items: int = MAX_JSON_ITEMS):
    # Each value but the first sits after a comma or opens a container, so this counts every
    # value there can be (strings holding these characters only make the count larger).
    items = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if items > max_items:
        raise CheckpointError(f"{where} holds up to {items} JSON values; the limit is {max_items}")
    try:
        return json.loads(raw.decode("utf-8"), parse_int=_parse_int)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except RecursionError:
        raise CheckpointError(f"{where} is nested too deeply to be a JSON config") from None
    except ValueError as e:  # JSONDecodeError and the integer bound below
        raise CheckpointError(f"{where} is not valid JSON: {_first_line(e)}") from None


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits is out of range")
    return int(text)


def _first_line(error: Exception) -> str:
    return " ".join(str(error).split())[:300]


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"
