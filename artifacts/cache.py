"""A compile cache, DIR/<key>.thin, that serves an entry only once it has proved to be what its key names.

A hit is copied to a temp file beside the output, and the copy is opened (every structure
checked) and must carry the requested key in its header; every tensor checksum must match too.
Hashing every tensor on every hit would make hits on a large model slow, so the entry's identity
(size, mtimes, inode, device) is remembered once it has been verified, in a small table beside
the file-hash cache: a later hit on the unchanged entry skips the checksums. An entry that fails
any check is removed and the compile runs as on a miss, storing a fresh entry.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from .errors import ArtifactError
from .key import _RACY_NS, _identity, _load_cache, _save_cache, default_hash_cache
from .reader import open_artifact
from .writer import _fsync_dir, create_temp_beside

_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
               | getattr(os, "O_NOFOLLOW", 0))
_COPY_CHUNK = 8 << 20


class BadCacheEntryError(ArtifactError):
    """A cache entry is not a complete, intact artifact for the key it is stored under."""


def verified_table(hash_cache: Path | None = None) -> Path:
    """Where verified entries are remembered: beside the file-hash cache."""
    return (Path(hash_cache) if hash_cache is not None else default_hash_cache()).with_name("verified-artifacts.json")


class CompileCache:
    """The artifacts of earlier compiles in `directory`, by key."""

    def __init__(self, directory, *, hash_cache: Path | None = None):
        self.directory = Path(directory)
        self.table = verified_table(hash_cache)

    def entry(self, key: str) -> Path:
        return self.directory / f"{key}.thin"

    def fetch(self, key: str, output: Path) -> str | None:
        """Copy the entry for `key` to `output` once verified. None on a hit; otherwise why it missed
        ("absent", or what was wrong with the entry, which is then removed). An OSError that is not the
        entry's fault (writing `output`: a full disk, a quota) propagates and leaves the entry in place."""
        entry = self.entry(key)
        if not os.path.lexists(entry):
            return "absent"
        try:
            self._copy_verified(entry, key, output)
        except ArtifactError as e:
            try:
                entry.unlink()
            except OSError:
                pass
            return " ".join(str(e).split())
        return None

    def store(self, key: str, artifact: Path) -> Path:
        """Copy the freshly written `artifact` into the cache as the entry for `key`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        entry = self.entry(key)
        with open(artifact, "rb") as source:
            copy_atomically(source.fileno(), entry)
        return entry

    def _copy_verified(self, entry: Path, key: str, output: Path) -> None:
        try:
            fd = os.open(entry, _OPEN_FLAGS)
        except OSError as e:  # ELOOP: a symlink where an entry should be
            raise BadCacheEntryError(f"cache entry {entry} cannot be opened as a file ({e.strerror})") from None
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                raise BadCacheEntryError(f"cache entry {entry} is not a regular file")
            copy_atomically(fd, output, check=lambda tmp: self._check_copy(tmp, entry, key, before))
        finally:
            os.close(fd)

    def _check_copy(self, copy: str, entry: Path, key: str, before: os.stat_result) -> None:
        """Raise unless `copy` (of `entry`, taken while it had stat `before`) is a sound artifact for `key`."""
        ident = _identity(before)
        try:
            now = _identity(os.stat(entry, follow_symlinks=False))
        except OSError:  # removed or replaced meanwhile (another compile): a miss, not a failure
            now = None
        if now != ident:
            raise BadCacheEntryError(f"cache entry {entry} changed while it was copied")
        try:
            art = open_artifact(copy, writable=False)
        except ArtifactError as e:  # named by the entry, not by the temp copy it was found in
            raise BadCacheEntryError(str(e).replace(copy, str(entry))) from None
        with art:
            if art.key != key:
                held = art.key[:16] or "(none)"
                raise BadCacheEntryError(f"cache entry {entry} holds an artifact for key {held}..., not {key[:16]}...")
            table = _load_cache(self.table)
            known = table.get(str(entry.resolve()))
            if known is not None and known["id"] == ident and known["sha256"] == key:
                return  # verified before, unchanged since: the copy holds the same bytes
            bad = art.verify_checksums()
        if bad:
            raise BadCacheEntryError(f"cache entry {entry}: {len(bad)} tensor(s) fail their checksum, first "
                                     f"{bad[0]!r}")
        # Remember only an entry old enough that a rewrite cannot repeat its mtime (see key.py).
        if ident[1] < time.time_ns() - _RACY_NS:
            table[str(entry.resolve())] = {"id": ident, "sha256": key}
            _save_cache(self.table, table)


def copy_atomically(source_fd: int, destination: Path, check=None) -> None:
    """Copy the open file `source_fd` to `destination` through a temp file and a rename.

    `check(temp_path)` runs on the complete copy before the rename; if it raises, nothing is
    published. The copy gets the permissions of a new file (0o666 minus the umask)."""
    fd, tmp = create_temp_beside(destination)
    try:
        with os.fdopen(fd, "wb") as out:
            offset = 0
            while chunk := os.pread(source_fd, _COPY_CHUNK, offset):
                out.write(chunk)
                offset += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        if check is not None:
            check(tmp)
        os.replace(tmp, destination)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(destination.parent)

