"""The text a compile runs the model on: calibration text (`--calib FILE` or a sample of the local
standard library) and the held-out text certificates are measured on. Both are inputs like the
checkpoint, so their hashes are part of the cache key (`evaluation_identity`)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from .config import CompileConfig, CompileOptionError
from .corpus import SampleTooSmallError, calibration_text, heldout_text

# Characters drawn from the standard library per calibration token asked for: code tokenizes at
# 2-4 characters a token, so this leaves room for any tokenizer; the pass keeps the first N tokens.
CHARS_PER_TOKEN = 8
MAX_CALIBRATION_BYTES = 256 << 20


def read_calibration_file(path) -> str:
    """The text of `--calib FILE`: plain UTF-8 text, or JSON lines each with a string "text" field
    (joined by blank lines). Raises CompileOptionError naming the problem."""
    path = Path(path)
    try:
        raw = _read_regular(path, MAX_CALIBRATION_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise CompileOptionError(f"--calib {path}: no such file") from None
    except UnicodeDecodeError:
        raise CompileOptionError(f"--calib {path}: not UTF-8 text") from None
    lines = [line for line in raw.splitlines() if line.strip()]
    if path.suffix == ".jsonl" or (lines and all(line.lstrip().startswith("{") for line in lines)):
        texts = []
        for number, line in enumerate(lines, start=1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CompileOptionError(f"--calib {path}: line {number} is not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise CompileOptionError(f'--calib {path}: line {number} has no string "text" field')
            texts.append(record["text"])
        raw = "\n\n".join(texts)
    if not raw.strip():
        raise CompileOptionError(f"--calib {path}: the file holds no text")
    return raw


def _read_regular(path: Path, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them; opened without blocking, so a FIFO is refused, not waited on."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CompileOptionError(f"--calib {path}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CompileOptionError(f"--calib {path}: more than {limit} bytes, the limit on calibration text")
    return data


def evaluation_texts(config: CompileConfig, calib_file=None) -> tuple[str | None, str | None]:
    """(calibration text, held-out text) for a compile with `config`: None where it does not run
    the model that way."""
    if calib_file is not None and config.calibrate.source != "file":
        raise CompileOptionError("a calibration file was given but calibrate.source is not 'file'")
    if config.calibrate.source == "file" and config.calibrated and calib_file is None:
        raise CompileOptionError("calibrate.source is 'file': give the file (--calib FILE)")
    calibration = None
    if config.calibrated:
        try:
            calibration = read_calibration_file(calib_file) if calib_file is not None else \
                calibration_text(config.calibrate.tokens * CHARS_PER_TOKEN)
        except SampleTooSmallError as e:
            raise CompileOptionError(
                f"--calib-tokens {config.calibrate.tokens} is more than the built-in sample (this Python's standard "
                f"library) holds, about {e.available // CHARS_PER_TOKEN} tokens: ask for fewer, or give your own "
                "text with --calib FILE") from None
    heldout = heldout_text() if config.certified else None
    return calibration, heldout


def evaluation_identity(calibration: str | None, heldout: str | None) -> bytes | None:
    """What the cache key hashes for the text a compile runs the model on (None when it runs none)."""
    if calibration is None and heldout is None:
        return None
    parts = {"calibration_sha256": None if calibration is None else hashlib.sha256(calibration.encode()).hexdigest(),
             "heldout_sha256": None if heldout is None else hashlib.sha256(heldout.encode()).hexdigest()}
    return json.dumps(parts, sort_keys=True).encode()
