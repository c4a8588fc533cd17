"""The fixed parts of the .thin byte layout: magic, versions, preamble, limits, canonical msgpack.

FORMAT.md is the prose version of this file; the two must agree.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import msgpack

from .errors import CorruptHeaderError

# PNG-style magic: the high byte and CR LF / ^Z catch text-mode and 7-bit transfer damage.
MAGIC = b"\x89THIN\r\n\x1a"
FORMAT_VERSION = (1, 0)  # (major, minor) this thin writes and reads
# The oldest thin release that reads each major version; written into the preamble so that an
# older reader can tell the user which thin to install.
MAJOR_INTRODUCED_IN = {1: "0.1.0"}

# Preamble, little-endian, 128 bytes. The first 28 bytes (magic, major, minor, min thin version)
# are frozen for every future version so any reader can refuse a newer file by name.
PREAMBLE = struct.Struct("<8sHH16sIQQQ32s36sI")
PREAMBLE_SIZE = PREAMBLE.size
FROZEN_PREFIX = 28
assert PREAMBLE_SIZE == 128 and struct.calcsize("<8sHH16s") == FROZEN_PREFIX

MIN_ALIGN = 16  # every tensor can be viewed as any dtype up to 16 bytes wide
MAX_ALIGN = 1 << 21  # 2 MiB: a huge page
MAX_HEADER_BYTES = 1 << 30  # the header is read into memory whole
MAX_NESTING = 64  # plain-data depth allowed in the header
MAX_NAME_CHARS = 1024  # tensor names
MAX_TOKENIZER_FILE = 256 << 20  # decompressed bytes of one tokenizer file
# A tokenizer file may decompress to at most this many times its stored size (plus 1 MiB), so a
# tiny forged section cannot ask for a large allocation.
MAX_TOKENIZER_RATIO = 1000
ZSTD_LEVEL = 9  # fixed: the same input must give the same bytes

SECTION_NAMES = ("tokenizer", "chat_template", "generation_config", "compile_config", "provenance", "key",
                 "precision_plan", "memory", "certificate")
# Minor format version that introduced each section: a file of an older minor may lack it.
SECTION_SINCE = dict.fromkeys(SECTION_NAMES, 0)
HEADER_KEYS = ("ir", "tensors", "sections")
ENTRY_KEYS = ("name", "role", "layer", "expert", "format", "params", "shape", "offset", "size", "sha256", "align")


@dataclass(frozen=True)
class Preamble:
    """The decoded fixed-size block at offset 0."""

    major: int
    minor: int
    min_thin_version: str
    flags: int
    file_size: int
    header_offset: int
    header_length: int
    header_sha256: bytes

    def pack(self) -> bytes:
        body = PREAMBLE.pack(MAGIC, self.major, self.minor, self.min_thin_version.encode("ascii"), self.flags,
                             self.file_size, self.header_offset, self.header_length, self.header_sha256,
                             bytes(36), 0)
        return body[:-4] + struct.pack("<I", zlib.crc32(body[:-4]))


def unpack_preamble(raw: bytes) -> tuple[Preamble, bytes, int, int]:
    """(preamble, reserved bytes, stored crc, computed crc) from exactly PREAMBLE_SIZE bytes."""
    _magic, major, minor, min_ver, flags, size, h_off, h_len, h_sha, reserved, crc = PREAMBLE.unpack(raw)
    text = min_ver.rstrip(b"\0")
    version = text.decode("ascii") if text.isascii() and text.replace(b".", b"").isalnum() else "?"
    pre = Preamble(major, minor, version, flags, size, h_off, h_len, h_sha)
    return pre, reserved, crc, zlib.crc32(raw[:-4])


def align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def valid_align(align) -> bool:
    return type(align) is int and MIN_ALIGN <= align <= MAX_ALIGN and align & (align - 1) == 0


def canonical(value, where: str = "value", depth: int = 0):
    """`value` as canonical plain data (dict keys sorted, tuples as lists); TypeError on anything else."""
    if depth > MAX_NESTING:
        raise TypeError(f"{where}: nested more than {MAX_NESTING} levels")
    if value is None or type(value) in (bool, str):
        return value
    if type(value) is int:
        if not -(1 << 63) <= value < (1 << 64):
            raise TypeError(f"{where}: integer {value} does not fit in 64 bits")
        return value
    if type(value) is float:
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple)):
        return [canonical(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if type(k) is not str]
        if bad:
            raise TypeError(f"{where}: mapping keys must be strings, got {bad[0]!r}")
        return {k: canonical(value[k], f"{where}.{k}", depth + 1) for k in sorted(value)}
    raise TypeError(f"{where}: {type(value).__name__} is not plain data (use dict, list, str, int, float, "
                    "bool, bytes or None)")


def pack(value) -> bytes:
    """Canonical msgpack: same plain data -> same bytes."""
    return msgpack.packb(canonical(value), use_bin_type=True)


def _refuse_ext(code, data):
    raise ValueError(f"msgpack extension type {code} is not allowed")


def unpack(data: bytes, what: str = "header"):
    """Decode untrusted msgpack with every length bounded by the input; CorruptHeaderError on failure."""
    n = max(len(data), 1)
    unpacker = msgpack.Unpacker(raw=False, use_list=True, strict_map_key=True, ext_hook=_refuse_ext,
                                max_buffer_size=n, max_str_len=n, max_bin_len=n, max_array_len=n,
                                max_map_len=n, max_ext_len=0)
    try:
        unpacker.feed(data)
        value = unpacker.unpack()
        end = unpacker.tell()
    except Exception as e:  # noqa: BLE001 -- msgpack raises several unrelated types on bad input
        raise CorruptHeaderError(f"the {what} is not valid msgpack ({type(e).__name__}: {e}); "
                                 "the file is damaged: re-download or recompile") from None
    if end != len(data):
        raise CorruptHeaderError(f"the {what} has {len(data) - end} stray bytes after its end; "
                                 "the file is damaged: re-download or recompile")
    return value


def plain_error(value, where: str, depth: int = 0) -> str | None:
    """None if `value` is plain data as `canonical` produces it, else a description of the first problem."""
    if depth > MAX_NESTING:
        return f"{where} is nested more than {MAX_NESTING} levels"
    if value is None or type(value) in (bool, int, float, str, bytes):
        return None
    if type(value) is list:
        for i, v in enumerate(value):
            err = plain_error(v, f"{where}[{i}]", depth + 1)
            if err:
                return err
        return None
    if type(value) is dict:
        for k, v in value.items():
            if type(k) is not str:
                return f"{where} has a non-string key"
            err = plain_error(v, f"{where}.{k}", depth + 1)
            if err:
                return err
        return None
    return f"{where} holds a {type(value).__name__}, which is not plain data"
