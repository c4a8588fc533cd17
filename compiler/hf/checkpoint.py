"""Read a Hugging Face checkpoint directory: JSON files, tokenizer files, safetensors headers.

Tensor data is never read here: `TensorStore` parses every shard's safetensors header to
learn names, shapes, dtypes and byte ranges, and hands out loaders that read one tensor, or
one expert's block of it, when called. Loaders use plain reads rather than a memory map: a
mapped checkpoint's touched pages count against the compiler's resident memory, a read
buffer is freed as soon as the tensor has been written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from math import prod
from pathlib import Path

from thin.ir import formats

from .errors import CheckpointError, PickleCheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")


def read_json(path: Path, *, required: bool) -> dict:
    """Parse a JSON object file; {} when absent and not required."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path.name} not found in {path.parent}")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(value).__name__}")
    return value


def read_tokenizer_files(model_dir: Path) -> dict[str, bytes]:
    """The tokenizer and chat-template files present in `model_dir`, as raw bytes."""
    return {name: (model_dir / name).read_bytes() for name in TOKENIZER_FILES if (model_dir / name).is_file()}


def find_chat_template(files: dict[str, bytes]) -> str | None:
    """The default chat template. transformers lets chat_template.jinja override tokenizer_config.json."""
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].decode("utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        if name not in files:
            continue
        try:
            template = json.loads(files[name]).get("chat_template")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise CheckpointError(f"{name} is not a valid JSON object: {e}") from None
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str):
            return template
    return None


@dataclass(frozen=True)
class SourceTensor:
    """One tensor in a safetensors shard, known from the header only."""

    name: str
    file: Path
    shape: tuple[int, ...]
    # thin's dense format name for the safetensors dtype ("bf16"), or RAW_BYTES for U8 tensors: the
    # packed bytes of a pre-quantized checkpoint, which no format describes alone (GPT-OSS's mxfp4
    # blocks and scales); an adapter that reads them says what they are.
    dtype: str
    offset: int = 0  # absolute byte offset of the data in `file`
    nbytes: int = 0


RAW_BYTES = "u8"
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class TensorStore:
    """All tensors of a checkpoint's safetensors files, by name, with lazy loaders."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.files: list[Path] = []  # every file read: index and shards
        self.tensors: dict[str, SourceTensor] = {}
        shards, expected = self._shard_list()
        for shard in shards:
            self._read_header(shard)
        missing = sorted(n for n, f in expected.items() if n not in self.tensors)
        if missing:
            raise CheckpointError(f"{len(missing)} tensor(s) listed in {INDEX_FILE} are absent from their "
                                  f"shards: {', '.join(missing[:8])}")

    def _shard_list(self) -> tuple[list[Path], dict[str, str]]:
        index_path = self.model_dir / INDEX_FILE
        if index_path.is_file():
            self.files.append(index_path)
            weight_map = read_json(index_path, required=True).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path} has no weight_map")
            shards = sorted({self.model_dir / f for f in weight_map.values()})
            absent = [s.name for s in shards if not s.is_file()]
            if absent:
                raise CheckpointError(f"shard(s) listed in {INDEX_FILE} are missing from {self.model_dir}: "
                                      f"{', '.join(absent)}")
            return shards, weight_map
        single = self.model_dir / SINGLE_FILE
        if single.is_file():
            return [single], {}
        shards = sorted(self.model_dir.glob("*.safetensors"))
        if shards:
            return shards, {}
        pickles = sorted(p.name for p in self.model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise PickleCheckpointError(
                f"{self.model_dir} holds only pickle weights ({', '.join(pickles)}); thin never unpickles "
                "files. Convert the checkpoint to safetensors first (e.g. load it in transformers and "
                "save_pretrained(..., safe_serialization=True)).")
        raise CheckpointError(f"no safetensors weights found in {self.model_dir}")

    def _read_header(self, shard: Path) -> None:
        header, data_start, size = _parse_safetensors_header(shard)
        self.files.append(shard)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in self.tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {self.tensors[name].file.name} "
                                      f"and {shard.name}")
            self.tensors[name] = _source_tensor(shard, name, info, data_start, size)

    def loader(self, name: str, index: tuple | None = None):
        """A zero-argument callable returning the bytes of tensor `name` (or `tensor[index]`): a flat
        uint8 tensor, the encoding of its stored dense format (the weight contract of `Program`).

        When `index` starts with an integer (one expert of a fused 3-D expert tensor), only that
        block's bytes are read."""
        src = self.tensors[name]
        shape, offset, nbytes = src.shape, src.offset, src.nbytes
        if index and isinstance(index[0], int):
            block = nbytes // shape[0]
            shape, offset, nbytes, index = shape[1:], offset + index[0] * block, block, index[1:]

        def load():
            import torch

            buf = bytearray(nbytes)
            try:
                with open(src.file, "rb") as f:
                    f.seek(offset)
                    got = f.readinto(buf)
            except OSError as e:
                raise CheckpointError(f"cannot read tensor {name!r} from {src.file.name}: {e}") from None
            if got != nbytes:
                raise CheckpointError(f"{src.file.name} is truncated inside tensor {name!r}")
            raw = torch.frombuffer(buf, dtype=torch.uint8)
            if not index:
                return raw
            dtype = torch.uint8 if src.dtype == RAW_BYTES else getattr(torch, formats.get(src.dtype).torch_dtype)
            return raw.view(dtype).reshape(shape)[index].contiguous().view(torch.uint8).reshape(-1)

        return load


def _parse_safetensors_header(shard: Path) -> tuple[dict, int, int]:
    """(header dict, absolute offset of the data area, file size) of a safetensors file, checked."""
    try:
        size = shard.stat().st_size
        with open(shard, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{shard.name} is too short to be a safetensors file ({size} bytes)")
            n = int.from_bytes(prefix, "little")
            if n > min(size - 8, _MAX_HEADER):
                raise CheckpointError(f"{shard.name} has a header length of {n} bytes in a {size}-byte "
                                      "file: it is truncated or not safetensors")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read {shard.name}: {e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{shard.name} has a corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{shard.name} has a corrupt safetensors header (not an object)")
    return header, 8 + n, size


def _source_tensor(shard: Path, name: str, info, data_start: int, size: int) -> SourceTensor:
    try:
        st_dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        valid = all(type(d) is int and d >= 0 for d in (*shape, begin, end))
    except (TypeError, KeyError, ValueError):
        valid = False
    if not valid:
        raise CheckpointError(f"{shard.name}: tensor {name!r} has a malformed header entry")
    fmt = formats.from_safetensors_dtype(st_dtype) if type(st_dtype) is str else None
    if st_dtype == "U8":
        dtype, itemsize = RAW_BYTES, 1
    elif fmt is None:
        known = ", ".join(f.safetensors_dtype for f in formats.dense_formats())
        raise CheckpointError(f"tensor {name!r} has dtype {st_dtype!r}; only {known} checkpoints "
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
