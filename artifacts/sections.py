"""Header sections: the plain data beside the IR (tokenizer, templates, configs, provenance, plans).

One table of validators serves both sides: the writer refuses what the reader would refuse, so a
file this thin writes always opens.
"""

from __future__ import annotations

import re

import zstandard

from thin.ir import __version__ as THIN_VERSION

from .errors import ArtifactWriteError, InvalidSectionError
from .spec import (
    MAX_TOKENIZER_FILE,
    MAX_TOKENIZER_FILES,
    MAX_TOKENIZER_RATIO,
    MAX_TOKENIZER_TOTAL,
    SECTION_NAMES,
    SECTION_SINCE,
    ZSTD_LEVEL,
    plain_error,
)

_HEX64 = re.compile(r"[0-9a-f]{64}")
# Sections that may be absent (None): an exact compile has no plan and no ledger.
_OPTIONAL = ("precision_plan", "memory", "certificate")
CERTIFICATE_STATUSES = ("PASSED", "FAILED", "EXACT")


def _default(name: str):
    return {"tokenizer": {}, "generation_config": {}, "compile_config": {},
            "provenance": {"thin_version": THIN_VERSION}, "key": ""}.get(name)


def _file_name_error(name) -> str | None:
    if type(name) is not str or not 0 < len(name) <= 255:
        return "tokenizer file names must be strings of 1 to 255 characters"
    # The runtime may write these files into a directory: no paths, no traversal.
    if name in (".", "..") or any(c in name for c in "/\\\0"):
        return f"tokenizer file name {name!r} must be a plain file name"
    return None


def _value_error(name: str, value) -> str | None:
    """Problem with the logical value of a non-tokenizer section, or None."""
    if name == "chat_template":
        return None if value is None or type(value) is str else "chat_template must be a string or None"
    if name == "key":
        if type(value) is not str or not (value == "" or _HEX64.fullmatch(value)):
            return "key must be '' or 64 lowercase hex digits (a sha256 from compute_key)"
        return None
    if name in _OPTIONAL:
        if value is not None and type(value) is not dict:
            return f"{name} must be a mapping or None"
    elif type(value) is not dict:
        return f"{name} must be a mapping"
    if value is None:
        return None
    err = plain_error(value, name)
    if err:
        return err
    if name == "compile_config" and value and not any(type(value.get(k)) is int for k in ("schema", "version")):
        return "compile_config must carry an integer 'schema' (or 'version'): the config schema it follows"
    check = {"precision_plan": _plan_error, "memory": _memory_error, "certificate": _certificate_error}.get(name)
    return check(value) if check else None


# ---- schemas of the quality sections -----------------------------------------------------------
# Each returns the first problem or None; the writer and the reader share them.

def _number(v) -> bool:
    return type(v) in (int, float)


def _fields(value: dict, where: str, spec: dict) -> str | None:
    """Every key of `spec` present in `value` with a value its predicate accepts (None allowed
    where the predicate tuple says so)."""
    for key, (predicate, nullable) in spec.items():
        if key not in value:
            return f"{where} lacks {key!r}"
        v = value[key]
        if not ((nullable and v is None) or predicate(v)):
            return f"{where}.{key} has the wrong type"
    return None


def _plan_error(value: dict) -> str | None:
    unknown = set(value) - {"quantize", "plan", "calibration"}
    if unknown:
        return f"precision_plan has unknown part(s) {sorted(unknown)}"
    if "quantize" in value:
        err = _fields(value["quantize"], "precision_plan.quantize",
                      {"method": (lambda v: type(v) is str, False), "tensors": (lambda v: type(v) is int, False)})
        if err:
            return err
    if "calibration" in value:
        err = _fields(value["calibration"], "precision_plan.calibration",
                      {"tokens": (lambda v: type(v) is int, False),
                       "text_sha256": (lambda v: type(v) is str and bool(_HEX64.fullmatch(v)), False)})
        if err:
            return err
    plan = value.get("plan")
    if plan is None:
        return None
    if type(plan) is not dict:
        return "precision_plan.plan must be a mapping"
    err = _fields(plan, "precision_plan.plan",
                  {"choices": (lambda v: type(v) is dict, False), "weight_bytes": (lambda v: type(v) is int, False),
                   "bits_per_weight": (_number, False), "predicted_kld": (_number, False),
                   "budget": (lambda v: type(v) is dict, False)})
    if err:
        return err
    for tensor, choice in plan["choices"].items():
        if type(choice) is not dict:
            return f"precision_plan.plan.choices[{tensor!r}] must be a mapping"
        err = _fields(choice, f"precision_plan.plan.choices[{tensor!r}]",
                      {"format": (lambda v: type(v) is str, False), "params": (lambda v: type(v) is list, False),
                       "bytes": (lambda v: type(v) is int and v >= 0, False),
                       "predicted_kld": (_number, False), "layer": (lambda v: type(v) is int, True)})
        if err:
            return err
    return None


def _memory_error(value: dict) -> str | None:
    err = _fields(value, "memory", {"lines": (lambda v: type(v) is dict, False),
                                    "total": (lambda v: type(v) is int and v >= 0, False),
                                    "ctx": (lambda v: type(v) is int and v > 0, False),
                                    "budget": (lambda v: type(v) is int and v > 0, True)})
    if err:
        return err
    if any(type(k) is not str or type(v) is not int or v < 0 for k, v in value["lines"].items()):
        return "memory.lines must map item names to byte counts"
    if sum(value["lines"].values()) != value["total"]:
        return "memory.total is not the sum of its lines"
    return _residency_error(value.get("residency"))


def _residency_error(value) -> str | None:
    """The residency plan (thinc compile --stream-experts): routed experts kept in host memory, as
    [layer, expert] pairs, and the GPU slots that cache them."""
    if value is None:
        return None
    if type(value) is not dict:
        return "memory.residency must be a mapping"
    def count(v) -> bool:
        return type(v) is int and v >= 0

    err = _fields(value, "memory.residency", {
        "host": (lambda v: type(v) is list and all(type(p) is list and len(p) == 2 and all(map(count, p))
                                                   for p in v), False),
        "slots": (count, False), "slot_bytes": (count, False), "host_bytes": (count, False),
        "resident_experts": (count, False), "policy": (lambda v: type(v) is str, False),
        "ranked_by": (lambda v: type(v) is str, False)})
    if err:
        return err
    if value["host"] and (value["slots"] < 1 or value["slot_bytes"] < 1):
        return "memory.residency keeps experts in host memory but gives no GPU slots for them"
    if value["slots"] > len(value["host"]):  # a slot per host-resident expert is all a cache can use
        return "memory.residency has more GPU slots than experts in host memory"
    return None


def _certificate_error(value: dict) -> str | None:
    if value.get("status") not in CERTIFICATE_STATUSES:
        return f"certificate.status must be one of {', '.join(CERTIFICATE_STATUSES)}"
    err = _levels_error(value.get("ffn_levels"))
    if err or value["status"] == "EXACT":
        return err
    err = _fields(value, "certificate", {"gate": (lambda v: type(v) is dict, False),
                                         "measured": (lambda v: type(v) is dict, False),
                                         "prompts": (lambda v: type(v) is dict, False)})
    if err:
        return err
    err = _fields(value["gate"], "certificate.gate", {"max_kld": (_number, False)})
    if err:
        return err
    err = _fields(value["measured"], "certificate.measured", dict.fromkeys(
        ("mean_kld", "top1_agreement", "mean_cosine", "min_cosine", "perplexity_source", "perplexity_compiled",
         "greedy_agreement"), (_number, False)))
    if err:
        return err
    return _fields(value["prompts"], "certificate.prompts",
                   {"count": (lambda v: type(v) is int and v > 0, False),
                    "positions": (lambda v: type(v) is int and v > 0, False),
                    "sha256": (lambda v: type(v) is str and bool(_HEX64.fullmatch(v)), False)})


def _levels_error(value) -> str | None:
    """The certificate of elastic FFN levels (thin.ir.FFNLevel): how they were made, and per level its
    channels, bytes read and measurements."""
    if value is None:
        return None
    if type(value) is not dict:
        return "certificate.ffn_levels must be a mapping"
    err = _fields(value, "certificate.ffn_levels", {"method": (lambda v: type(v) is dict, False),
                                                    "levels": (lambda v: type(v) is list and bool(v), False)})
    for i, level in enumerate(value["levels"] if not err else ()):
        where = f"certificate.ffn_levels.levels[{i}]"
        if type(level) is not dict:
            return f"{where} must be a mapping"
        err = _fields(level, where, {
            "keep": (lambda v: _number(v) and 0 < v <= 1, False),
            "channels": (lambda v: type(v) is list and all(type(c) is int and c > 0 for c in v), False),
            "ffn_bytes": (lambda v: type(v) is int and v >= 0, False),
            "bytes_per_token": (lambda v: type(v) is int and v > 0, False),
            "measured": (lambda v: type(v) is dict, False)})
        err = err or _fields(level["measured"], f"{where}.measured", dict.fromkeys(
            ("mean_kld", "top1_agreement", "mean_cosine"), (_number, False)))
        if err:
            return err
    return err


def encode_sections(sections: dict | None) -> dict:
    """The stored form of the writer's `sections` argument; ArtifactWriteError on anything invalid."""
    sections = dict(sections or {})
    unknown = sorted(map(str, set(sections) - set(SECTION_NAMES)))
    if unknown:
        raise ArtifactWriteError(f"unknown section(s) {unknown}; known: {', '.join(SECTION_NAMES)}")
    stored = {}
    for name in SECTION_NAMES:
        value = sections.get(name, _default(name))
        if name == "provenance":
            value = dict(value) if type(value) is dict else value
            if type(value) is dict:
                value.setdefault("thin_version", THIN_VERSION)
                if value["thin_version"] != THIN_VERSION:
                    raise ArtifactWriteError(f"provenance.thin_version is {value['thin_version']!r} but this "
                                             f"is thin {THIN_VERSION}; leave it out, the writer fills it")
        if name == "tokenizer":
            stored[name] = _compress_tokenizer(value)
            continue
        err = _value_error(name, _plainish(value))
        if err:
            raise ArtifactWriteError(f"section {err}")
        stored[name] = value
    return stored


def _plainish(value):
    """Tuples as lists, so that the writer accepts what canonical() will store."""
    if isinstance(value, tuple):
        return [_plainish(v) for v in value]
    if isinstance(value, list):
        return [_plainish(v) for v in value]
    if isinstance(value, dict):
        return {k: _plainish(v) for k, v in value.items()}
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    return value


def _compress_tokenizer(files) -> dict:
    if type(files) is not dict:
        raise ArtifactWriteError("section tokenizer must be a mapping of file name -> bytes")
    # Single-threaded, fixed level, content size in the frame: deterministic and bounded to decode.
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True, write_checksum=True)
    out = {}
    for name in sorted(files):
        err = _file_name_error(name)
        if err:
            raise ArtifactWriteError(err)
        data = files[name]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ArtifactWriteError(f"tokenizer file {name!r} must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_TOKENIZER_FILE:
            raise ArtifactWriteError(f"tokenizer file {name!r} is {len(data)} bytes; the limit is "
                                     f"{MAX_TOKENIZER_FILE}")
        out[name] = {"size": len(data), "zstd": compressor.compress(data)}
    err = _tokenizer_totals_error(out)
    if err:
        raise ArtifactWriteError(err)
    return {"files": out}


def _tokenizer_totals_error(files: dict) -> str | None:
    # Each file is bounded on its own; so are their number and the memory they take all decompressed.
    if len(files) > MAX_TOKENIZER_FILES:
        return f"the tokenizer has {len(files)} files; the limit is {MAX_TOKENIZER_FILES}"
    total = sum(entry["size"] for entry in files.values())
    if total > MAX_TOKENIZER_TOTAL:
        return f"the tokenizer files decompress to {total} bytes in all; the limit is {MAX_TOKENIZER_TOTAL}"
    return None


def validate_sections(stored, file_minor: int, reader_minor: int) -> dict:
    """Check the stored sections of an untrusted header; return them (unknown newer ones dropped)."""
    if type(stored) is not dict:
        raise InvalidSectionError("header 'sections' must be a mapping; the file is damaged: recompile")
    unknown = sorted(set(stored) - set(SECTION_NAMES))
    if unknown and file_minor <= reader_minor:
        raise InvalidSectionError(f"unknown section(s) {unknown} in a format 1.{file_minor} file; "
                                  "the file is damaged or hand-made: recompile")
    out = {}
    for name in SECTION_NAMES:
        if name not in stored:
            if file_minor >= SECTION_SINCE[name]:
                raise InvalidSectionError(f"section {name!r} is missing; the file is damaged: recompile")
            out[name] = _default(name)
            continue
        value = stored[name]
        err = _tokenizer_error(value) if name == "tokenizer" else _value_error(name, value)
        if err:
            raise InvalidSectionError(f"section {err}; the file is damaged: recompile")
        out[name] = value
    return out


def _tokenizer_error(value) -> str | None:
    if type(value) is not dict or set(value) != {"files"} or type(value["files"]) is not dict:
        return "tokenizer must be a mapping {'files': {name: {'size', 'zstd'}}}"
    if len(value["files"]) > MAX_TOKENIZER_FILES:
        return f"tokenizer has {len(value['files'])} files; the limit is {MAX_TOKENIZER_FILES}"
    for name, entry in value["files"].items():
        err = _file_name_error(name)
        if err:
            return err
        if type(entry) is not dict or set(entry) != {"size", "zstd"}:
            return f"tokenizer file {name!r} must be stored as {{'size', 'zstd'}}"
        size, blob = entry["size"], entry["zstd"]
        if type(size) is not int or type(blob) is not bytes:
            return f"tokenizer file {name!r} has a bad size or data type"
        if not 0 <= size <= min(MAX_TOKENIZER_FILE, (1 << 20) + MAX_TOKENIZER_RATIO * len(blob)):
            return f"tokenizer file {name!r} claims {size} bytes, beyond the decompression bound"
        try:
            content = zstandard.get_frame_parameters(blob).content_size
        except zstandard.ZstdError:
            content = None
        # The frame's own content size decides the allocation when decompressing: it must agree.
        if content != size:
            return f"tokenizer file {name!r} has a zstd frame that does not declare its {size} bytes"
    return _tokenizer_totals_error(value["files"])


def decompress_tokenizer(stored: dict) -> dict[str, bytes]:
    """The tokenizer files of a validated section, each decompressed within its declared size."""
    out = {}
    decompressor = zstandard.ZstdDecompressor()
    for name in sorted(stored["files"]):
        entry = stored["files"][name]
        try:
            data = decompressor.decompress(entry["zstd"], max_output_size=entry["size"])
        except zstandard.ZstdError as e:
            raise InvalidSectionError(f"tokenizer file {name!r} does not decompress ({e}); "
                                      "the file is damaged: recompile") from None
        if len(data) != entry["size"]:
            raise InvalidSectionError(f"tokenizer file {name!r} decompressed to {len(data)} bytes, "
                                      f"expected {entry['size']}; the file is damaged: recompile")
        out[name] = data
    return out
