"""Read a checkpoint's safetensors headers and hand out lazy, bounded tensor loaders.

Tensor data is never read here: `TensorStore` parses every shard's safetensors header to
learn names, shapes, dtypes and byte ranges, and hands out loaders that read one tensor, or
one expert's block of it, when called. Loaders use plain reads rather than a memory map: a
mapped checkpoint's touched pages count against the compiler's resident memory, a read
buffer is freed as soon as the tensor has been written. A header is checked as the
safetensors library checks it (the tensors tile the data area exactly: no overlap, no gap),
and a loader refuses a shard that changed since its header was read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from math import prod
from pathlib import Path

from thin.ir import formats

from .errors import CheckpointError, InputChangedError
from .files import ModelFolder, identity, parse_json_object


@dataclass(frozen=True)
class SourceTensor:
    """One tensor in a safetensors shard, known from the header only."""

    name: str
    file: Path  # the shard as named in the model folder (for messages)
    shape: tuple[int, ...]
    # thin's dense format name for the safetensors dtype ("bf16"), or RAW_BYTES for U8 tensors: the
    # packed bytes of a pre-quantized checkpoint, which no format describes alone (GPT-OSS's mxfp4
    # blocks and scales); an adapter that reads them says what they are.
    dtype: str
    offset: int = 0  # absolute byte offset of the data in `file`
    nbytes: int = 0


RAW_BYTES = "u8"
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
_MAX_RANK = 16
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class TensorStore:
    """All tensors of a checkpoint's safetensors files, by name, with lazy loaders."""

    def __init__(self, folder: ModelFolder, shards, weight_map: dict[str, str] | None = None):
        """Read the headers of `shards` (names inside `folder`); `weight_map` is the index's tensor -> shard."""
        self.folder = folder
        self.tensors: dict[str, SourceTensor] = {}
        self._shards: dict[Path, tuple[Path, tuple[int, ...]]] = {}  # shown path -> (real path, identity)
        for shard in shards:
            self._read_header(shard)
        expected = weight_map or {}
        missing = sorted(n for n in expected if n not in self.tensors)
        if missing:
            raise CheckpointError(f"{len(missing)} tensor(s) listed in the index are absent from their "
                                  f"shards: {', '.join(map(repr, missing[:8]))}")
        misplaced = sorted(n for n, f in expected.items() if self.tensors[n].file != folder.path / f)
        if misplaced:
            n = misplaced[0]
            raise CheckpointError(f"the index puts tensor {n!r} in {expected[n]}, but it is in "
                                  f"{self.tensors[n].file.name}")

    def _read_header(self, shard: str) -> None:
        shown = self.folder.path / shard
        fd, st = self.folder.open(shard)
        try:
            header, data_start = _parse_safetensors_header(fd, st.st_size, shown)
            self.folder.note(shard, st, os.fstat(fd))
        finally:
            os.close(fd)
        self._shards[shown] = (self.folder.real_path(shard), identity(st))
        spans = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in self.tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {self.tensors[name].file.name} "
                                      f"and {shown.name}")
            tensor = _source_tensor(shown, name, info, data_start, st.st_size)
            self.tensors[name] = tensor
            spans.append((tensor.offset, tensor.offset + tensor.nbytes, name))
        _check_tiling(shown, spans, data_start, st.st_size)

    def loader(self, name: str, index: tuple | None = None):
        """A zero-argument callable returning the bytes of tensor `name` (or `tensor[index]`): a flat
        uint8 tensor, the encoding of its stored dense format (the weight contract of `Program`).

        When `index` starts with an integer (one expert of a fused 3-D expert tensor), only that
        block's bytes are read."""
        src = self.tensors[name]
        shape, offset, nbytes = src.shape, src.offset, src.nbytes
        if index and isinstance(index[0], int):
            if not 0 <= index[0] < shape[0]:
                raise CheckpointError(f"{src.file.name}: tensor {name!r} has {shape[0]} entries along its first "
                                      f"dimension; the config asks for entry {index[0]}")
            block = nbytes // shape[0]
            shape, offset, nbytes, index = shape[1:], offset + index[0] * block, block, index[1:]
        real, expected = self._shards[src.file]

        def load():
            import torch

            buf = bytearray(nbytes)
            try:
                fd = os.open(real, _READ_FLAGS)
                try:
                    if identity(os.fstat(fd)) != expected:
                        raise InputChangedError(f"{src.file} changed after its header was read; let the download "
                                                "or copy finish and compile again")
                    got = _pread_into(fd, buf, offset)
                finally:
                    os.close(fd)
            except OSError as e:
                raise CheckpointError(f"cannot read tensor {name!r} from {src.file.name}: {e}") from None
            if got != nbytes:
                raise CheckpointError(f"{src.file.name} is truncated inside tensor {name!r}")
            raw = torch.frombuffer(buf, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            dtype = torch.uint8 if src.dtype == RAW_BYTES else getattr(torch, formats.get(src.dtype).torch_dtype)
            _check_finite(raw, dtype, name, src.file)
            if not index:
                return raw
            return raw.view(dtype).reshape(shape)[index].contiguous().view(torch.uint8).reshape(-1)

        return load


def _check_finite(raw, dtype, name: str, file: Path) -> None:
    """CheckpointError when the floating-point bytes `raw` hold a NaN or an infinity: a damaged or
    diverged checkpoint, which would otherwise compile into a model that emits nothing. One min/max
    pass (milliseconds for a large weight); float8 values are widened a chunk at a time first."""
    import torch

    if not dtype.is_floating_point or not raw.numel():
        return
    values = raw.view(dtype)
    chunks = values.split(1 << 24) if dtype.itemsize == 1 else (values,)
    if all(bool(torch.isfinite(torch.stack(torch.aminmax(c.float() if dtype.itemsize == 1 else c))).all())
           for c in chunks):
        return
    bad = sum(int((~torch.isfinite(c.float())).sum()) for c in chunks)
    raise CheckpointError(f"{file.name}: tensor {name!r} holds {bad} NaN or infinite value(s) of {values.numel()}; "
                          "the checkpoint is damaged: export or download it again")


def _pread_into(fd: int, buf: bytearray, offset: int) -> int:
    """Fill `buf` from `offset` (one read returns at most ~2 GiB on Linux); the bytes read."""
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _parse_safetensors_header(fd: int, size: int, shard: Path) -> tuple[dict, int]:
    """(header dict, absolute offset of the data area) of an open safetensors file, checked."""
    try:
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise CheckpointError(f"{shard.name} is too short to be a safetensors file ({size} bytes)")
        n = int.from_bytes(prefix, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{shard.name} has a header length of {n} bytes in a {size}-byte "
                                  "file: it is truncated or not safetensors")
        raw = os.pread(fd, n, 8)
    except OSError as e:
        raise CheckpointError(f"cannot read {shard.name}: {e}") from None
    if len(raw) != n:
        raise CheckpointError(f"{shard.name} shrank while its header was read")
    header = parse_json_object(raw, f"{shard.name}'s safetensors header")
    return header, 8 + n


def _source_tensor(shard: Path, name: str, info, data_start: int, size: int) -> SourceTensor:
    try:
        st_dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        valid = (type(st_dtype) is str and len(shape) <= _MAX_RANK
                 and all(type(d) is int and d >= 0 for d in (*shape, begin, end)))
    except (TypeError, KeyError, ValueError):
        valid = False
    if not valid:
        raise CheckpointError(f"{shard.name}: tensor {name!r} has a malformed header entry")
    fmt = formats.from_safetensors_dtype(st_dtype)
    if st_dtype == "U8":
        dtype, itemsize = RAW_BYTES, 1
    elif fmt is None:
        known = ", ".join(f.safetensors_dtype for f in formats.dense_formats())
        raise CheckpointError(f"tensor {name!r} has dtype {st_dtype[:20]!r}; only {known} checkpoints "
                              "(and U8 for pre-quantized mxfp4 experts) are supported")
    else:
        dtype, itemsize = fmt.name, fmt.nbytes((1,))
    need = prod(shape) * itemsize  # a scalar's shape () holds one element
    if end - begin != need or begin > end:
        raise CheckpointError(f"{shard.name}: tensor {name!r} spans {end - begin} bytes, its shape {shape} "
                              f"needs {need}")
    if data_start + end > size:
        raise CheckpointError(f"{shard.name} is truncated: tensor {name!r} ends at byte {data_start + end} "
                              f"of a {size}-byte file")
    return SourceTensor(name, shard, shape, dtype, data_start + begin, end - begin)


def _check_tiling(shard: Path, spans: list[tuple[int, int, str]], data_start: int, size: int) -> None:
    """The tensors' byte ranges cover the data area exactly, as the safetensors library requires:
    overlapping ranges would make two tensors share bytes, gaps would hide unchecked data."""
    position, previous = data_start, "the header"
    for begin, end, name in sorted(spans):
        if begin != position:
            what = "overlaps" if begin < position else "leaves a gap after"
            raise CheckpointError(f"{shard.name}: tensor {name!r} at bytes {begin - data_start}..{end - data_start} "
                                  f"{what} {previous}; the safetensors header is corrupt")
        position, previous = end, f"tensor {name!r}"
    if position != size:
        raise CheckpointError(f"{shard.name} has {size - position} bytes after its last tensor; the file is "
                              "corrupt or not safetensors")
