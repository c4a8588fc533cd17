"""Helpers shared by the artifact tests: build a small artifact, and re-seal edited bytes."""

from __future__ import annotations

import hashlib

import numpy as np

from thin.artifacts import ArtifactWriter
from thin.artifacts.spec import PREAMBLE_SIZE, Preamble, pack, unpack, unpack_preamble

from ir_fixtures import tiny_model

TOKENIZER = {"tokenizer.json": b'{"model": {"vocab": {"a": 0, "b": 1}}}' * 20, "tokenizer_config.json": b"{}"}
SECTIONS = {
    "tokenizer": TOKENIZER,
    "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "generation_config": {"temperature": 0.7, "top_p": 0.9, "eos_token_id": [1, 2]},
    "compile_config": {"schema": 1, "vram": "8G", "formats": ["int4", "fp8_e4m3"]},
    "provenance": {"source_config_sha256": "ab" * 32},
    "key": "cd" * 32,
}


def tensor_bytes(model, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in model.tensors}


def write_artifact(path, model=None, *, seed: int = 0, sections=None, align: int = 64):
    """Write `model` (default: tiny_model()) with random f32 weights; return (model, {name: array})."""
    model = model or tiny_model()
    data = tensor_bytes(model, seed)
    with ArtifactWriter(path) as w:
        for name, arr in data.items():
            w.add_tensor(name, arr, align=align)
        w.commit(model, SECTIONS if sections is None else sections)
    return model, data


def split(blob: bytes):
    """(preamble, header dict, data region bytes) of an artifact's bytes."""
    pre = unpack_preamble(blob[:PREAMBLE_SIZE])[0]
    header = unpack(blob[pre.header_offset:pre.header_offset + pre.header_length])
    return pre, header, blob[PREAMBLE_SIZE:pre.header_offset]


def reseal(blob: bytes, header=None, **preamble_fields) -> bytes:
    """The artifact with a replaced header and/or preamble fields, every checksum made valid again."""
    pre, old_header, data = split(blob)
    head = pack(old_header if header is None else header)
    fields = dict(major=pre.major, minor=pre.minor, min_thin_version=pre.min_thin_version, flags=pre.flags,
                  file_size=PREAMBLE_SIZE + len(data) + len(head), header_offset=PREAMBLE_SIZE + len(data),
                  header_length=len(head), header_sha256=hashlib.sha256(head).digest())
    fields.update(preamble_fields)
    return Preamble(**fields).pack() + data + head
