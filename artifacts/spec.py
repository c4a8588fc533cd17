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
# Decoded msgpack costs up to ~70 bytes of memory per object (an empty map or array is one byte
# of input), so the count of objects is bounded, not only the bytes: ~70 objects per tensor.
MAX_HEADER_OBJECTS = 8_000_000
MAX_NESTING = 64  # plain-data depth allowed in the header
MAX_NAME_CHARS = 1024  # tensor names
MAX_TOKENIZER_FILE = 64 << 20  # decompressed bytes of one tokenizer file (the largest in use: ~35 MB)
MAX_TOKENIZER_TOTAL = 96 << 20  # decompressed bytes of all of them together
MAX_TOKENIZER_FILES = 16
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
    """Decode untrusted msgpack with every length bounded by the input and at most MAX_HEADER_OBJECTS
    objects; CorruptHeaderError on failure."""
    if len(data) > MAX_HEADER_OBJECTS:  # smaller inputs cannot hold more objects than bytes
        count_objects(data, MAX_HEADER_OBJECTS, what)
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


def _type_tables() -> tuple[list[int], list[int]]:
    """Per msgpack type byte, (kind, argument): 0 skips a fixed payload of `argument` bytes; 1 adds
    `argument` children (a map's count doubled); 2 skips a payload whose length is in the next
    `argument` bytes (3: plus an ext type byte); 4 adds as many children as the next `argument`
    bytes say (5: twice that, a map); 6 is the unused byte 0xC1."""
    kinds, args = [0] * 256, [0] * 256
    for b in range(0x80, 0x90):
        kinds[b], args[b] = 1, 2 * (b & 15)
    for b in range(0x90, 0xA0):
        kinds[b], args[b] = 1, b & 15
    for b in range(0xA0, 0xC0):
        args[b] = b & 31
    for b, n in ((0xCA, 4), (0xCB, 8), (0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8), (0xD0, 1), (0xD1, 2),
                 (0xD2, 4), (0xD3, 8), (0xD4, 2), (0xD5, 3), (0xD6, 5), (0xD7, 9), (0xD8, 17)):
        args[b] = n
    for b, w in ((0xC4, 1), (0xC5, 2), (0xC6, 4), (0xD9, 1), (0xDA, 2), (0xDB, 4)):
        kinds[b], args[b] = 2, w
    for b, w in ((0xC7, 1), (0xC8, 2), (0xC9, 4)):
        kinds[b], args[b] = 3, w
    for b, w in ((0xDC, 2), (0xDD, 4)):
        kinds[b], args[b] = 4, w
    for b, w in ((0xDE, 2), (0xDF, 4)):
        kinds[b], args[b] = 5, w
    kinds[0xC1] = 6
    return kinds, args


_KINDS, _ARGS = _type_tables()


def count_objects(data: bytes, limit: int, what: str = "header") -> int:
    """The number of msgpack objects in `data`, found without decoding them; CorruptHeaderError past `limit`.

    Malformed input simply stops the count: the decoder that runs next reports it."""
    kinds, args, from_bytes = _KINDS, _ARGS, int.from_bytes
    pos = count = 0
    pending = 1
    try:
        while pending and count < limit:
            b = data[pos]
            kind = kinds[b]
            pos += 1
            pending -= 1
            count += 1
            if kind == 0:
                pos += args[b]
            elif kind == 1:
                pending += args[b]
            elif kind < 4:
                width = args[b]
                pos += width + from_bytes(data[pos:pos + width], "big") + (kind == 3)
            elif kind < 6:
                width = args[b]
                pending += from_bytes(data[pos:pos + width], "big") * (kind - 3)
                pos += width
            else:
                break
    except IndexError:
        pass
    if pending and count >= limit:
        raise CorruptHeaderError(f"the {what} holds more than {limit} msgpack objects, beyond what this thin "
                                 "reads; the file is damaged or hand-made: re-download or recompile")
    return count
