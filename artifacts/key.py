"""The cache identity of a compile: a sha256 over everything that decides the artifact's bytes.

Inputs: the content of the source files (weights, configs, tokenizer, chat template), the compile
options as canonical plain data, the calibration data, the thin version and the target. Which
files those are is the compiler's frontend's decision (its inventory of the model folder), passed
in by name, so the key covers exactly what a compile reads. Hashing a large checkpoint takes a
while, so file hashes are cached on disk, keyed by the file's identity (resolved path, size,
mtime_ns, ctime_ns, inode, device): a second key of the same model is fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from thin.ir import __version__ as THIN_VERSION

from .errors import SourceChangedError
from .spec import pack
from .writer import replace_with_bytes

KEY_SCHEMA = 2  # bump when what goes into the key changes (2: the compiler names the input files)
_CACHE_SCHEMA = 1
_CACHE_MAX_ENTRIES = 50_000
_CACHE_MAX_BYTES = 64 << 20
# A file modified within this window of its hashing is not cached: its mtime could repeat for a later
# write in the same timestamp tick (coarse filesystem clocks), which would make the cache lie.
_RACY_NS = 3_000_000_000
_CHUNK = 8 << 20
# Files hashed at once (threads): a checkpoint's shards, bounded so a folder of many files doesn't
# open them all together.
_HASH_THREADS = min(8, os.cpu_count() or 1)


def default_hash_cache() -> Path:
    """$XDG_CACHE_HOME/thin/file-hashes.json, or ~/.cache/thin/file-hashes.json."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "thin" / "file-hashes.json"


def _hash_file(path: Path, ident: list[int]) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    # Non-blocking open: a FIFO put in a file's place must not hang the hash.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or _identity(st) != ident:
            raise SourceChangedError(f"{path} changed while it was being hashed; let the download or copy finish")
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _load_cache(path: Path) -> dict:
    try:
        if path.stat().st_size > _CACHE_MAX_BYTES:
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a missing or damaged cache only costs time
    if type(data) is not dict or data.get("schema") != _CACHE_SCHEMA or type(data.get("files")) is not dict:
        return {}
    return {k: v for k, v in data["files"].items()
            if type(v) is dict and type(v.get("id")) is list and type(v.get("sha256")) is str}


def _save_cache(path: Path, files: dict) -> None:
    if len(files) > _CACHE_MAX_ENTRIES:  # drop the oldest entries (dicts keep insertion order)
        files = dict(list(files.items())[-_CACHE_MAX_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_with_bytes(path, json.dumps({"schema": _CACHE_SCHEMA, "files": files}, sort_keys=True).encode())
    except OSError:
        pass  # a cache that cannot be saved only costs time


def hash_files(paths, *, hash_cache: Path | None = None,
                expected: Mapping[str, Sequence[int]] | None = None) -> dict[str, str]:
    """{str(path): sha256 hex} for each file, reusing and updating the on-disk hash cache.

    `expected` maps str(path) to the identity the caller saw when it read the file (see `_identity`);
    a file whose identity differs now raises SourceChangedError, so the key never describes bytes
    other than the ones the caller read. Files not in the cache are hashed in parallel threads (one
    sha256 is sequential, but a sharded checkpoint's shards are independent, and hashlib and file
    reads release the GIL): the digests are the same, the wall time that of the largest shard."""
    cache_path = Path(hash_cache) if hash_cache is not None else default_hash_cache()
    cache = _load_cache(cache_path)
    expected = expected or {}
    out: dict[str, str | None] = {}
    todo: list[tuple[str, str, list[int]]] = []  # (name, resolved path, identity) of files to hash
    for p in paths:
        resolved = str(Path(p).resolve())
        ident = _identity(os.stat(resolved))
        seen = expected.get(str(p))
        if seen is not None and list(seen) != ident:
            raise SourceChangedError(f"{p} changed after it was read; let the download or copy finish and "
                                     "compile again")
        hit = cache.get(resolved)
        if hit is not None and hit["id"] == ident:
            out[str(p)] = hit["sha256"]
            continue
        out[str(p)] = None  # keeps the order of `paths`
        todo.append((str(p), resolved, ident))

    def digest(name: str, resolved: str, ident: list[int]) -> tuple[str, int]:
        started = time.time_ns()
        value = _hash_file(Path(resolved), ident)
        if _identity(os.stat(resolved)) != ident:
            raise SourceChangedError(f"{name} changed while it was being hashed; let the download or copy finish")
        return value, started

    if len(todo) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(len(todo), _HASH_THREADS)) as pool:
            results = list(pool.map(lambda t: digest(*t), todo))
    else:
        results = [digest(*t) for t in todo]
    changed = False
    for (name, resolved, ident), (value, started) in zip(todo, results):
        out[name] = value
        if ident[1] < started - _RACY_NS:
            cache.pop(resolved, None)
            cache[resolved] = {"id": ident, "sha256": value}
            changed = True
    if changed:
        _save_cache(cache_path, cache)
    return out


def compute_key(inputs: Mapping[str, str | os.PathLike], options: dict, *, calibration: bytes | None,
                target: str, hash_cache: Path | None = None,
                identities: Mapping[str, Sequence[int]] | None = None) -> str:
    """Hex sha256 identifying a compile of the files `inputs` with `options` for `target` by this thin.

    `inputs` maps each source file's name as the model folder spells it ("config.json",
    "shards/model-00001-of-00002.safetensors") to its path; `identities`, by the same names, what the
    compiler saw when it read each file (SourceChangedError when a file has changed since).
    Same inputs give the same key; a changed byte in any source file, a renamed file, an option,
    calibration data, target or thin version gives another. The key does not depend on where the
    model folder is.
    """
    if not isinstance(inputs, Mapping) or not all(type(name) is str for name in inputs):
        raise TypeError("inputs must map file names (str) to paths")
    if type(options) is not dict:
        raise TypeError(f"options must be a dict of plain data, got {type(options).__name__}")
    if type(target) is not str or not target:
        raise TypeError("target must be a non-empty string, e.g. 'cuda:sm90' or 'cpu'")
    if calibration is not None and not isinstance(calibration, (bytes, bytearray, memoryview)):
        raise TypeError("calibration must be bytes or None")
    paths = {name: str(path) for name, path in inputs.items()}
    expected = {paths[name]: ident for name, ident in (identities or {}).items() if name in paths}
    digests = hash_files(list(paths.values()), hash_cache=hash_cache, expected=expected)
    identity = {
        "key_schema": KEY_SCHEMA,
        "thin_version": THIN_VERSION,
        "target": target,
        "options": options,  # pack() canonicalises it and refuses anything that is not plain data
        "calibration": None if calibration is None else hashlib.sha256(calibration).hexdigest(),
        "files": {name: digests[path] for name, path in paths.items()},
    }
    return hashlib.sha256(pack(identity)).hexdigest()
