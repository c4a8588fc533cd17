"""The cache key changes exactly when an input changes, and file hashes are cached on disk.

Which files are inputs is the compiler's inventory (tests/test_hostile_folder.py checks that the key
covers exactly those); here the key is given them by name.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

import thin.artifacts.key as key_module
from thin.artifacts import SourceChangedError, compute_key, hash_files

OPTIONS = {"vram": "8G", "formats": ["int4", "fp8_e4m3"], "certify": {"min_cosine": 0.99, "prompts": 16}}
OLD_NS = 1_600_000_000 * 10**9  # files older than the racy window may be cached


def _make_checkpoint(d):
    d.mkdir()
    (d / "model-00001-of-00002.safetensors").write_bytes(bytes(range(256)) * 64)
    (d / "model-00002-of-00002.safetensors").write_bytes(b"\x01" * 5000)
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (d / "README.md").write_text("not an input")
    for p in d.iterdir():
        os.utime(p, ns=(OLD_NS, OLD_NS))
    return d


def _inputs(d):
    return {p.name: p for p in sorted(d.iterdir()) if p.name != "README.md"}


def _key(d, cache, **changes):
    args = dict(options=OPTIONS, calibration=b"calibration text", target="cuda:sm90", hash_cache=cache)
    args.update(changes)
    return compute_key(args.pop("inputs", None) or _inputs(d), args.pop("options"), **args)


@pytest.fixture
def ckpt(tmp_path):
    return _make_checkpoint(tmp_path / "ckpt"), tmp_path / "cache" / "hashes.json"


def test_key_is_stable_and_location_independent(ckpt, tmp_path):
    d, cache = ckpt
    k = _key(d, cache)
    assert len(k) == 64 and int(k, 16) >= 0
    assert _key(d, cache) == k
    reordered = {"certify": {"prompts": 16, "min_cosine": 0.99}, "formats": ["int4", "fp8_e4m3"], "vram": "8G"}
    assert _key(d, cache, options=reordered) == k
    moved = tmp_path / "elsewhere"
    shutil.copytree(d, moved)
    assert _key(moved, cache) == k
    # The names are part of the key: the same bytes under another name (a shard moved into a
    # subfolder the index points at) are another input.
    renamed = {("shards/" + n if n.endswith(".safetensors") else n): p for n, p in _inputs(d).items()}
    assert _key(d, cache, inputs=renamed) != k


def test_every_input_changes_the_key(ckpt, monkeypatch):
    d, cache = ckpt
    base = _key(d, cache)
    keys = {base}
    weights = d / "model-00001-of-00002.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[12345] ^= 0x01  # one flipped bit, same size
    weights.write_bytes(blob)
    keys.add(_key(d, cache))
    blob[12345] ^= 0x01
    weights.write_bytes(blob)
    assert _key(d, cache) == base, "restoring the byte restores the key"
    (d / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    keys.add(_key(d, cache))
    (d / "chat_template.jinja").write_text("{{ messages }}")
    keys.add(_key(d, cache))
    keys.add(_key(d, cache, options={**OPTIONS, "vram": "16G"}))
    keys.add(_key(d, cache, options={**OPTIONS, "certify": {"min_cosine": 0.98, "prompts": 16}}))
    keys.add(_key(d, cache, target="cpu"))
    keys.add(_key(d, cache, calibration=b"other text"))
    keys.add(_key(d, cache, calibration=None))
    monkeypatch.setattr(key_module, "THIN_VERSION", "9.9.9")
    keys.add(_key(d, cache))
    assert len(keys) == 10  # base + 9 changes, all distinct


def test_same_tick_rewrite_is_not_hidden_by_the_cache(ckpt):
    d, cache = ckpt
    weights = d / "model-00002-of-00002.safetensors"
    base = _key(d, cache)
    # Rewrite in place and put the old mtime back: size, mtime and inode match the cache entry, but
    # ctime moved, so the file is hashed again.
    weights.write_bytes(b"\x02" * 5000)
    os.utime(weights, ns=(OLD_NS, OLD_NS))
    assert _key(d, cache) != base


def test_hash_cache_is_used_on_the_second_call(ckpt, monkeypatch):
    d, cache = ckpt
    calls = []
    real = key_module._hash_file
    monkeypatch.setattr(key_module, "_hash_file", lambda p, ident: calls.append(p.name) or real(p, ident))
    first = _key(d, cache)
    assert sorted(calls) == ["config.json", "model-00001-of-00002.safetensors",
                             "model-00002-of-00002.safetensors", "tokenizer.json"]
    stored = json.loads(cache.read_text())["files"]
    assert str((d / "config.json").resolve()) in stored
    calls.clear()
    assert _key(d, cache) == first and calls == []
    (d / "config.json").write_text('{"architectures": ["MistralForCausalLM"]}')
    assert _key(d, cache) != first and calls == ["config.json"]
    # A just-written file is hashed again next time: its mtime may still repeat for another write.
    calls.clear()
    _key(d, cache)
    assert calls == ["config.json"]


def test_damaged_cache_is_ignored_and_rewritten(ckpt):
    d, cache = ckpt
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    k = _key(d, cache)
    assert json.loads(cache.read_text())["schema"] == 1
    cache.write_text(json.dumps({"schema": 1, "files": {str((d / "config.json").resolve()): "junk"}}))
    assert _key(d, cache) == k


def test_hash_files_and_refusals(ckpt):
    d, cache = ckpt
    digests = hash_files([d / "config.json"], hash_cache=cache)
    import hashlib
    assert digests == {str(d / "config.json"): hashlib.sha256((d / "config.json").read_bytes()).hexdigest()}
    with pytest.raises(TypeError):
        _key(d, cache, options={"bad": object()})
    with pytest.raises(TypeError):
        _key(d, cache, target="")
    with pytest.raises(FileNotFoundError):
        _key(d, cache, inputs={"missing.safetensors": d / "missing.safetensors"})
    with pytest.raises(TypeError):
        _key(d, cache, inputs=[d / "config.json"])


def test_several_files_hash_in_parallel_to_each_files_own_digest(tmp_path):
    """Uncached files are hashed in threads: each digest is its own file's, in the order given, and a
    failure in one thread (a file that is not a regular file) still refuses the whole key."""
    import hashlib
    files = [tmp_path / f"shard-{i}.bin" for i in range(5)]
    for i, f in enumerate(files):
        f.write_bytes(os.urandom(1000 + 7919 * i))
    digests = hash_files(list(reversed(files)), hash_cache=tmp_path / "cache.json")
    assert list(digests) == [str(f) for f in reversed(files)]
    assert digests == {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(SourceChangedError):
        hash_files([*files, fifo], hash_cache=tmp_path / "other.json")


def test_a_file_changed_since_it_was_read_is_refused(ckpt):
    """The compiler passes the identity it saw when reading each file: a later change is not hashed
    into a key for bytes the compile never read."""
    d, cache = ckpt
    config = d / "config.json"
    seen = list(key_module._identity(os.stat(config)))
    _key(d, cache, identities={"config.json": seen})
    config.write_text('{"architectures": ["MistralForCausalLM"]}')
    with pytest.raises(SourceChangedError, match="config.json changed"):
        _key(d, cache, identities={"config.json": seen})


def test_a_fifo_in_place_of_an_input_does_not_hang_the_hash(ckpt):
    d, cache = ckpt
    fifo = d / "tokenizer.json"
    fifo.unlink()
    os.mkfifo(fifo)
    with pytest.raises(SourceChangedError):
        hash_files([fifo], hash_cache=cache)
