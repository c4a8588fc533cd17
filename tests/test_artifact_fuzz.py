"""Thousands of damaged artifacts: each is refused with an ArtifactError subclass or opens cleanly,
quickly, without allocating much more than the file; data damage is then caught by the checksums."""

from __future__ import annotations

import copy
import os
import random
import time
import tracemalloc

import pytest
import zstandard

import thin.artifacts as art
from thin.artifacts.spec import PREAMBLE_SIZE

from ir_fixtures import tiny_model
from test_artifact_common import reseal, split, write_artifact

N_CASES = 2400
ABSURD = [-1, 0, 1, 3, 17, 127, 128, 4096, 2**31, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 1.5, True, None, "x",
          "a" * 3000, [], {}, [2**62, 2**62], [0], b"\x00" * 8, {"_type": "Model"}]
PREAMBLE_VALUES = [0, 1, 127, 128, 129, 2**31, 2**63, 2**64 - 1]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "base.thin"
    write_artifact(path, tiny_model(num_layers=1), align=128)
    blob = path.read_bytes()
    pre, header, _ = split(blob)
    data_spans = [(e["offset"], e["offset"] + e["size"]) for e in header["tensors"]]
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(8 << 20))
    return blob, pre, header, data_spans, bomb


def _flip(blob: bytes, rng: random.Random, lo: int, hi: int, n: int) -> bytes:
    out = bytearray(blob)
    for _ in range(n):
        out[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
    return bytes(out)


def _walk(value, rng: random.Random, depth: int = 0):
    """A random (container, key) inside plain data, or None at a leaf."""
    choices = list(value.keys()) if isinstance(value, dict) else list(range(len(value))) if isinstance(value, list) else []
    if not choices:
        return None
    k = rng.choice(choices)
    child = value[k]
    if isinstance(child, (dict, list)) and child and rng.random() < 0.75 and depth < 12:
        deeper = _walk(child, rng, depth + 1)
        if deeper is not None:
            return deeper
    return value, k


def _mutate_header(header: dict, rng: random.Random, bomb: bytes) -> dict:
    h = copy.deepcopy(header)
    kind = rng.randrange(8)
    if kind == 0:  # one field of one tensor entry
        entry = rng.choice(h["tensors"])
        entry[rng.choice(list(entry))] = rng.choice(ABSURD)
    elif kind == 1:  # anywhere in the header tree
        spot = _walk(h, rng)
        if spot:
            container, k = spot
            container[k] = rng.choice(ABSURD)
    elif kind == 2:  # delete anything
        spot = _walk(h, rng)
        if spot:
            container, k = spot
            container.pop(k)
    elif kind == 3:  # reorder or duplicate tensor entries
        t = h["tensors"]
        i, j = rng.randrange(len(t)), rng.randrange(len(t))
        if rng.random() < 0.5:
            t[i], t[j] = t[j], t[i]
        else:
            t.insert(i, copy.deepcopy(t[j]))
    elif kind == 4:  # tokenizer decompression bounds
        f = h["sections"]["tokenizer"]["files"]["tokenizer.json"]
        f.update(rng.choice([{"zstd": bomb}, {"zstd": bomb, "size": 8 << 20}, {"size": 2**40},
                             {"zstd": bytes(rng.randrange(256) for _ in range(40))},
                             {"zstd": f["zstd"][:-3]}, {"size": f["size"] + 1}]))
    elif kind == 5:  # an unknown key somewhere
        spot = _walk(h, rng)
        target = spot[0] if spot and isinstance(spot[0], dict) else h
        target["unexpected"] = 1
    elif kind == 6:  # shift one tensor by a few bytes, keeping its size
        entry = rng.choice(h["tensors"])
        entry["offset"] += rng.choice([-128, -16, -1, 1, 16, 128, 4096])
    else:
        h = rng.choice(ABSURD)
    return h


def _mutate(rng: random.Random, case: int, base) -> tuple[str, bytes]:
    blob, pre, header, spans, bomb = base
    kind = case % 9
    if kind == 0:
        return "truncate", blob[:rng.randrange(len(blob))]
    if kind == 1:
        return "preamble flips", _flip(blob, rng, 0, PREAMBLE_SIZE, rng.randint(1, 4))
    if kind == 2:
        return "header flips", _flip(blob, rng, pre.header_offset, len(blob), rng.randint(1, 4))
    if kind == 3:
        lo, hi = rng.choice(spans)
        return "data flips", _flip(blob, rng, lo, hi, rng.randint(1, 3))
    if kind == 4:
        return "anywhere flips", _flip(blob, rng, 0, len(blob), rng.randint(1, 8))
    if kind == 5:
        field = rng.choice(["file_size", "header_offset", "header_length"])
        value = rng.choice(PREAMBLE_VALUES + [len(blob) + rng.randint(-300, 300), rng.getrandbits(64)])
        return "preamble fields", reseal(blob, **{field: max(0, value) % 2**64})
    if kind == 6:
        choice = rng.randrange(4)
        if choice == 0:
            return "magic", bytes([blob[0] ^ 0x20]) + blob[1:]
        if choice == 1:
            return "major", reseal(blob, major=rng.choice([0, 2, 3, 65535]), min_thin_version=rng.choice(["0.4.0", "\x00"]))
        if choice == 2:
            return "minor", reseal(blob, minor=rng.randint(1, 65535))
        return "garbage", bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 400)))
    if kind == 7:
        return "header fields", reseal(blob, _mutate_header(header, rng, bomb))
    cut = rng.randrange(len(blob))
    return "splice", blob[:cut] + bytes(rng.randrange(1, 300)) + blob[cut + rng.randrange(0, 300):]


def _exercise(path):
    """Open and use every accessor: (ArtifactError class name or None, bad tensors, traced peak bytes).

    Allocations are traced while the file's own numbers are in play (open, decompress, verify);
    the summary afterwards works on already-validated data and runs untraced, for speed.
    """
    tracemalloc.start()
    try:
        a = art.open_artifact(path)
        a.tokenizer_files()
        bad = a.verify_checksums()
    except art.ArtifactError as e:
        assert "\n" not in str(e), f"multi-line message: {e}"
        return type(e).__name__, None, tracemalloc.get_traced_memory()[1]
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    with a:
        for name in a.tensor_names():
            a.numpy(name)
        art.render_description(art.describe(a))
    return None, bad, peak


def test_fuzzed_artifacts_fail_cleanly(base, tmp_path):
    blob, pre = base[0], base[1]
    rng = random.Random(20240611)
    path = tmp_path / "mutant.thin"
    path.write_bytes(b"")
    # Rewriting one file in place: truncating with O_TRUNC costs milliseconds on some filesystems.
    fd = os.open(path, os.O_RDWR)
    outcomes: dict[str, set] = {}
    slowest = 0.0
    try:
        for case in range(N_CASES):
            label, mutant = _mutate(rng, case, base)
            os.ftruncate(fd, len(mutant))
            os.pwrite(fd, mutant, 0)
            t0 = time.perf_counter()
            error, bad, peak = _exercise(path)  # anything but an ArtifactError propagates: the test fails
            slowest = max(slowest, time.perf_counter() - t0)
            assert peak < 2 * len(mutant) + (2 << 20), f"case {case} ({label}) allocated {peak} bytes"
            outcomes.setdefault(label, set()).add(error or "opened")
            data_changed = mutant[PREAMBLE_SIZE:pre.header_offset] != blob[PREAMBLE_SIZE:pre.header_offset]
            if error is None and len(mutant) == len(blob) and mutant[pre.header_offset:] == blob[pre.header_offset:]:
                assert bool(bad) == data_changed, f"case {case} ({label}): checksums said {bad}"
            if label == "data flips" and data_changed:
                assert error is None and bad, f"case {case}: data damage must open and fail verify"
    finally:
        os.close(fd)
    assert slowest < 1.0, f"an open took {slowest:.2f} s"
    errors = set().union(*outcomes.values()) - {"opened"}
    assert outcomes["truncate"] <= {"TruncatedError", "BadMagicError"}
    assert outcomes["data flips"] == {"opened"}
    assert outcomes["minor"] == {"opened"}
    assert "opened" not in outcomes["preamble flips"] | outcomes["header flips"] | outcomes["magic"]
    expected = {"TruncatedError", "BadMagicError", "UnsupportedVersionError", "CorruptHeaderError", "LayoutError",
                "ChecksumMismatchError", "InvalidTensorTableError", "InvalidIRError", "InvalidSectionError"}
    assert expected <= errors, f"never raised: {expected - errors}"
