"""Memory sizes as people write them (`--vram 8G`), read the same way by the compiler and the runtime."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
# 1024T: far above any device's memory, and within the 64-bit integers the artifact's header stores.
MAX_SIZE = 2**50


def parse_size(text: str) -> int:
    """Bytes in `8G`, `7.5GiB`, `12000M`, `512MiB`, `6GB`: K/M/G/T are powers of 1024 with or without
    "B" / "iB" (as nvidia-smi counts); a bare number is bytes. ValueError, saying how to write one,
    for anything else, for zero and for sizes above 1024T."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if match is None or (match.group(3) == "ib" and not match.group(2)):
        raise ValueError(f"cannot read {text!r} as a size; write it like 8G, 7.5GiB or 12000M")
    size = float(match.group(1)) * _UNITS[match.group(2)]
    if size > MAX_SIZE:
        raise ValueError(f"size {text!r} is larger than any device's memory; write it like 8G, 7.5GiB or 12000M")
    if int(size) <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return int(size)
