"""The cache identity of a compile: a sha256 over everything that decides the artifact's bytes.

Inputs: the content of the source files (weights, configs, tokenizer, chat template), the compile
options as canonical plain data, the calibration data, the thin version and the target. Hashing a
large checkpoint takes a while, so file hashes are cached on disk, keyed by the file's identity
(resolved path, size, mtime_ns, ctime_ns, inode, device): a second key of the same model is fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from pathlib import Path

from thin.ir import __version__ as THIN_VERSION

from .spec import pack

KEY_SCHEMA = 1  # bump when what goes into the key changes
SOURCE_FILES = ("model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
_CACHE_SCHEMA = 1
_CACHE_MAX_ENTRIES = 50_000
_CACHE_MAX_BYTES = 64 << 20
# A file modified within this window of its hashing is not cached: its mtime could repeat for a later
# write in the same timestamp tick (coarse filesystem clocks), which would make the cache lie.
_RACY_NS = 3_000_000_000
_CHUNK = 8 << 20


def default_hash_cache() -> Path:
    """$XDG_CACHE_HOME/thin/file-hashes.json, or ~/.cache/thin/file-hashes.json."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "thin" / "file-hashes.json"


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
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
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"schema": _CACHE_SCHEMA, "files": files}, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def hash_files(paths, *, hash_cache: Path | None = None) -> dict[str, str]:
    """{str(path): sha256 hex} for each file, reusing and updating the on-disk hash cache."""
    cache_path = Path(hash_cache) if hash_cache is not None else default_hash_cache()
    cache = _load_cache(cache_path)
    changed = False
    out = {}
    for p in paths:
        resolved = str(Path(p).resolve())
        ident = _identity(os.stat(resolved))
        hit = cache.get(resolved)
        if hit is not None and hit["id"] == ident:
            out[str(p)] = hit["sha256"]
            continue
        started = time.time_ns()
        digest = _hash_file(Path(resolved))
        after = _identity(os.stat(resolved))
        if after != ident:
            raise RuntimeError(f"{p} changed while it was being hashed; let the download or copy finish")
        out[str(p)] = digest
        if ident[1] < started - _RACY_NS:
            cache.pop(resolved, None)
            cache[resolved] = {"id": ident, "sha256": digest}
            changed = True
    if changed:
        _save_cache(cache_path, cache)
    return out


def source_files(model_dir: Path) -> list[Path]:
    """The files of a checkpoint directory that go into the key, in a fixed order."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir} is not a directory")
    found = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    found += [model_dir / name for name in SOURCE_FILES if (model_dir / name).is_file()]
    return found


def compute_key(model_dir, options: dict, *, calibration: bytes | None, target: str,
                hash_cache: Path | None = None) -> str:
    """Hex sha256 identifying a compile of `model_dir` with `options` for `target` by this thin.

    Same inputs give the same key; a changed byte in any source file, option, calibration data,
    target or thin version gives another. The key does not depend on where the model directory is.
    """
    if type(options) is not dict:
        raise TypeError(f"options must be a dict of plain data, got {type(options).__name__}")
    if type(target) is not str or not target:
        raise TypeError("target must be a non-empty string, e.g. 'cuda:sm90' or 'cpu'")
    if calibration is not None and not isinstance(calibration, (bytes, bytearray, memoryview)):
        raise TypeError("calibration must be bytes or None")
    model_dir = Path(model_dir)
    files = source_files(model_dir)
    digests = hash_files(files, hash_cache=hash_cache)
    identity = {
        "key_schema": KEY_SCHEMA,
        "thin_version": THIN_VERSION,
        "target": target,
        "options": options,  # pack() canonicalises it and refuses anything that is not plain data
        "calibration": None if calibration is None else hashlib.sha256(calibration).hexdigest(),
        "files": {p.name: digests[str(p)] for p in files},
    }
    return hashlib.sha256(pack(identity)).hexdigest()
