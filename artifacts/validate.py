"""Checks of an untrusted header: the IR, and the tensor table against the IR and the file layout."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from thin.ir import IRSchemaError, IRVerificationError, Model, from_plain, verify
from thin.ir.formats import nbytes

from .errors import InvalidIRError, InvalidTensorTableError
from .spec import ENTRY_KEYS, MAX_ALIGN, MAX_NAME_CHARS, MIN_ALIGN, PREAMBLE_SIZE, valid_align

_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_RANK = 16
_DAMAGED = "the file is damaged: re-download or recompile"


@dataclass(frozen=True)
class TensorEntry:
    """One row of the tensor table: what a tensor is and where its bytes lie in the file."""

    name: str
    role: str
    layer: int | None
    expert: int | None
    format: str
    params: tuple[tuple[str, int | float | str], ...]
    shape: tuple[int, ...]
    offset: int  # absolute file offset, a multiple of `align`
    size: int  # bytes, == formats.nbytes(format, shape, params)
    sha256: str  # hex digest of the tensor's bytes
    align: int
    padding_start: int  # where the zero padding before this tensor begins (previous end)

    def __getitem__(self, key: str):
        """Read a field by its tensor-table key too, as in the header row: `entry["offset"]`."""
        if key not in ENTRY_KEYS:
            raise KeyError(key)
        return getattr(self, key)


def parse_ir(plain) -> Model:
    """The header's IR as a verified Model; InvalidIRError otherwise."""
    try:
        model = from_plain(plain)
    except IRSchemaError as e:
        raise InvalidIRError(f"the embedded IR is malformed ({e}); recompile with this thin") from None
    except Exception as e:  # noqa: BLE001 -- untrusted data must only ever raise an ArtifactError
        raise InvalidIRError(f"the embedded IR is malformed ({type(e).__name__}: {e})") from None
    try:
        verify(model)
    except IRVerificationError as e:
        first = e.violations[0] if e.violations else str(e)
        raise InvalidIRError(f"the embedded IR does not verify ({len(e.violations)} problem(s), first: "
                             f"{first}); recompile with this thin") from None
    except Exception as e:  # noqa: BLE001 -- as above
        raise InvalidIRError(f"the embedded IR could not be verified ({type(e).__name__}: {e})") from None
    return model


def _bad(i: int, name, what: str) -> InvalidTensorTableError:
    label = f"tensor table entry {i}" + (f" ({name!r})" if type(name) is str and len(name) < 200 else "")
    return InvalidTensorTableError(f"{label}: {what}; {_DAMAGED}")


def _is_int(x, lo: int, hi: int) -> bool:
    return type(x) is int and lo <= x <= hi


def _entry(raw, i: int, lenient: bool) -> TensorEntry:
    if type(raw) is not dict:
        raise _bad(i, None, "is not a mapping")
    name = raw.get("name")
    missing = [k for k in ENTRY_KEYS if k not in raw]
    if missing:
        raise _bad(i, name, f"lacks {missing}")
    extra = sorted(set(raw) - set(ENTRY_KEYS))
    if extra and not lenient:
        raise _bad(i, name, f"has unknown fields {extra}")
    if type(name) is not str or not 0 < len(name) <= MAX_NAME_CHARS:
        raise _bad(i, None, f"name must be a string of 1 to {MAX_NAME_CHARS} characters")
    if type(raw["role"]) is not str or type(raw["format"]) is not str:
        raise _bad(i, name, "role and format must be strings")
    for key in ("layer", "expert"):
        if raw[key] is not None and not _is_int(raw[key], 0, 1 << 31):
            raise _bad(i, name, f"{key} must be a small non-negative integer or null")
    params = raw["params"]
    if type(params) is not list or not all(
            type(p) is list and len(p) == 2 and type(p[0]) is str and type(p[1]) in (int, float, str)
            for p in params):
        raise _bad(i, name, "params must be a list of [name, number or string] pairs")
    shape = raw["shape"]
    if type(shape) is not list or len(shape) > _MAX_RANK or not all(_is_int(d, 1, 1 << 62) for d in shape):
        raise _bad(i, name, f"shape must be a list of at most {_MAX_RANK} positive integers")
    if not _is_int(raw["offset"], 0, 1 << 63) or not _is_int(raw["size"], 0, 1 << 63):
        raise _bad(i, name, "offset and size must be non-negative 64-bit integers")
    if type(raw["sha256"]) is not str or not _HEX64.fullmatch(raw["sha256"]):
        raise _bad(i, name, "sha256 must be 64 lowercase hex digits")
    if not valid_align(raw["align"]):
        raise _bad(i, name, f"align must be a power of two in [{MIN_ALIGN}, {MAX_ALIGN}]")
    return TensorEntry(name, raw["role"], raw["layer"], raw["expert"], raw["format"],
                       tuple(tuple(p) for p in params), tuple(shape), raw["offset"], raw["size"],
                       raw["sha256"], raw["align"], 0)


def check_tensor_table(raw, model: Model, data_end: int, lenient: bool) -> list[TensorEntry]:
    """Validated entries in file order: layout, sizes and agreement with the IR's tensors."""
    if type(raw) is not list:
        raise InvalidTensorTableError(f"the tensor table is not a list; {_DAMAGED}")
    entries = [_entry(r, i, lenient) for i, r in enumerate(raw)]
    entries = _check_layout(entries, data_end)
    ir = model.tensor_map()
    seen = set()
    for i, e in enumerate(entries):
        if e.name in seen:
            raise _bad(i, e.name, "the name appears twice")
        seen.add(e.name)
        t = ir.get(e.name)
        if t is None:
            raise _bad(i, e.name, "is not a tensor of the IR")
        if (e.role, e.layer, e.expert, e.format, e.params, e.shape) != (
                t.role, t.layer, t.expert, t.encoding.format, tuple(t.encoding.params), tuple(t.shape)):
            raise _bad(i, e.name, "disagrees with the IR's record (role, layer, expert, format, params or shape)")
        if e.align < t.align:
            raise _bad(i, e.name, f"is aligned to {e.align} bytes, the IR asks at least {t.align}")
        try:
            expected = nbytes(e.format, e.shape, e.params)
        except Exception as exc:  # noqa: BLE001 -- a format this thin cannot size is as bad as a wrong size
            raise _bad(i, e.name, f"its size cannot be computed ({exc})") from None
        if e.size != expected:
            raise _bad(i, e.name, f"holds {e.size} bytes but {e.format} {list(e.shape)} takes {expected}")
    missing = [t.name for t in model.tensors if t.name not in seen]
    if missing:
        raise InvalidTensorTableError(f"the tensor table lacks {len(missing)} tensor(s) of the IR, first "
                                      f"{missing[0]!r}; {_DAMAGED}")
    return entries


def _check_layout(entries: list[TensorEntry], data_end: int) -> list[TensorEntry]:
    """Tensors lie in table order between the preamble and the header, each at the first aligned
    offset after the previous one: no overlap, no unexplained gap, nothing outside the file."""
    out = []
    prev_end, prev_name = PREAMBLE_SIZE, "the preamble"
    for i, e in enumerate(entries):
        if e.offset < prev_end:
            raise _bad(i, e.name, f"at offset {e.offset} overlaps {prev_name} (which ends at {prev_end})")
        if e.offset % e.align:
            raise _bad(i, e.name, f"offset {e.offset} is not a multiple of its alignment {e.align}")
        if e.offset - prev_end >= e.align:
            raise _bad(i, e.name, f"leaves {e.offset - prev_end} unexplained bytes after {prev_name}")
        end = e.offset + e.size
        if end > data_end:
            raise _bad(i, e.name, f"bytes {e.offset}..{end} run past the data region, which ends at {data_end}")
        out.append(dataclasses.replace(e, padding_start=prev_end))
        prev_end, prev_name = end, f"tensor {e.name!r}"
    if prev_end != data_end:
        raise InvalidTensorTableError(f"{data_end - prev_end} bytes between the last tensor and the header "
                                      f"are unexplained; {_DAMAGED}")
    return out
