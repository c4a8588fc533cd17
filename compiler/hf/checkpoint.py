"""Read a Hugging Face checkpoint directory: JSON files, tokenizer files, safetensors headers.

Tensor data is never read here: `TensorStore` opens every shard once (memory-mapped by
safetensors) to learn names, shapes and dtypes, and hands out loaders that read one
tensor, or one slice of it, when called.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError
from thin.ir.formats import SAFETENSORS_DTYPES

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
    dtype: str  # thin's dense format name: "f32", "f16" or "bf16"


class TensorStore:
    """All tensors of a checkpoint's safetensors files, by name, with lazy loaders."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.files: list[Path] = []  # every file read: index and shards
        self._handles: dict[Path, object] = {}
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
        from safetensors import safe_open

        try:
            handle = safe_open(str(shard), framework="pt")
            entries = [(name, handle.get_slice(name)) for name in handle.keys()]  # noqa: SIM118 (not a dict)
            infos = [(name, tuple(s.get_shape()), s.get_dtype()) for name, s in entries]
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {shard.name}: {str(e).splitlines()[0]}") from None
        self.files.append(shard)
        self._handles[shard] = handle
        for name, shape, st_dtype in infos:
            if name in self.tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {self.tensors[name].file.name} "
                                      f"and {shard.name}")
            if st_dtype not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"tensor {name!r} has dtype {st_dtype}; only "
                                      f"{', '.join(SAFETENSORS_DTYPES)} checkpoints are supported")
            self.tensors[name] = SourceTensor(name, shard, shape, SAFETENSORS_DTYPES[st_dtype])

    def loader(self, name: str, index: tuple | None = None):
        """A zero-argument callable returning tensor `name` (or `tensor[index]`) in its stored dtype."""
        src = self.tensors[name]
        handle = self._handles[src.file]

        def load():
            try:
                if index is None:
                    return handle.get_tensor(name)
                return handle.get_slice(name)[index].contiguous()
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read tensor {name!r} from {src.file.name}: "
                                      f"{str(e).splitlines()[0]}") from None

        return load
