"""Versioned serialisation of the IR to plain data (dicts, lists, str, int, float, bool, None).

`from_plain` treats its input as untrusted: every field is type-checked against the
dataclass annotations and unknown fields are refused, unless they come from a newer
minor schema version (then they are ignored, by the compatibility rule).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache

from . import model as m
from .errors import IRError
from .version import IR_VERSION

_CLASSES = {
    c.__name__: c
    for c in (m.Encoding, m.Tensor, m.Linear, m.Norm, m.RoPE, m.Attention, m.MLP, m.MoE,
              m.DecoderLayer, m.Embedding, m.LMHead, m.FFNLevel, m.Model)
}
_MAX_DEPTH = 32


class IRSchemaError(IRError):
    """Plain data that does not describe a valid IR tree."""


def to_plain(model: m.Model) -> dict:
    """The model as plain data, tagged with the IR schema version."""
    return {"ir_version": list(IR_VERSION), "model": _to_plain(model)}


def _to_plain(value):
    if dataclasses.is_dataclass(value):
        out = {"_type": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = _to_plain(getattr(value, f.name))
        return out
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    return value


def from_plain(data) -> m.Model:
    """Rebuild a Model from `to_plain` output; raises IRSchemaError on anything malformed."""
    if not isinstance(data, dict) or "ir_version" not in data or "model" not in data:
        raise IRSchemaError("IR data must be a mapping with 'ir_version' and 'model'")
    version = data["ir_version"]
    if (not isinstance(version, (list, tuple)) or len(version) != 2
            or not all(type(v) is int for v in version)):
        raise IRSchemaError(f"bad IR version {version!r}")
    if version[0] != IR_VERSION[0]:
        raise IRSchemaError(
            f"IR schema {version[0]}.{version[1]} is not readable by this thin "
            f"(reads {IR_VERSION[0]}.x); install a thin that matches the file")
    lenient = tuple(version) > IR_VERSION
    model = _decode(data["model"], m.Model, "model", lenient, 0)
    return model


@cache
def _hints(cls):
    return typing.get_type_hints(cls, vars(m))


def _decode(value, hint, path: str, lenient: bool, depth: int):
    if depth > _MAX_DEPTH:
        raise IRSchemaError(f"{path}: nested too deeply")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise IRSchemaError(f"{path}: must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _decode(value, option, path, lenient, depth)
            except IRSchemaError as e:
                errors.append(str(e))
        raise IRSchemaError(errors[0] if len(errors) == 1 else f"{path}: matches none of {options}")
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise IRSchemaError(f"{path}: expected a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(v, args[0], f"{path}[{i}]", lenient, depth + 1) for i, v in enumerate(value))
        if len(value) != len(args):
            raise IRSchemaError(f"{path}: expected {len(args)} items, got {len(value)}")
        return tuple(_decode(v, a, f"{path}[{i}]", lenient, depth + 1) for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(hint):
        return _decode_dataclass(value, hint, path, lenient, depth)
    if hint is float:
        if type(value) in (int, float):
            return float(value)
        raise IRSchemaError(f"{path}: expected a number, got {type(value).__name__}")
    if hint in (int, str, bool):
        if type(value) is hint:
            return value
        raise IRSchemaError(f"{path}: expected {hint.__name__}, got {type(value).__name__}")
    raise IRSchemaError(f"{path}: unsupported type {hint!r}")


def _decode_dataclass(value, cls, path, lenient, depth):
    if not isinstance(value, dict):
        raise IRSchemaError(f"{path}: expected a {cls.__name__} mapping, got {type(value).__name__}")
    if value.get("_type") != cls.__name__:
        raise IRSchemaError(f"{path}: expected {cls.__name__}, got {value.get('_type')!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(value) - set(fields) - {"_type"}
    if unknown and not lenient:
        raise IRSchemaError(f"{path}: unknown fields {sorted(map(str, unknown))} in {cls.__name__}")
    kwargs = {}
    for name, f in fields.items():
        if name not in value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise IRSchemaError(f"{path}: {cls.__name__} lacks field {name!r}")
            continue
        kwargs[name] = _decode(value[name], hints[name], f"{path}.{name}", lenient, depth + 1)
    return cls(**kwargs)
