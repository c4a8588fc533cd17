"""Which files of a model folder the frontend reads: one list, shared by the compile and the cache key.

`take_inventory` decides it from the folder alone (reading only the shard index), so `thinc key`
and `thinc compile` hash exactly the files the frontend goes on to read, and nothing else: a
README or a stray `.bin` next to the weights never changes the key, a shard in a subfolder that
the index names always does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import CheckpointError, PickleCheckpointError
from .files import ModelFolder

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class Inventory:
    """The input files of one compile, by their names relative to the model folder."""

    folder: ModelFolder
    generation_config: bool  # generation_config.json is present
    index: bool  # the weights are listed by model.safetensors.index.json
    shards: tuple[str, ...]
    weight_map: dict[str, str] = field(default_factory=dict)  # tensor -> shard, from the index
    tokenizer_files: tuple[str, ...] = ()

    def names(self) -> list[str]:
        """Every input, in a fixed order: config, generation config, index, shards, tokenizer files."""
        return [CONFIG_FILE, *([GENERATION_FILE] if self.generation_config else []),
                *([INDEX_FILE] if self.index else []), *self.shards, *self.tokenizer_files]


def take_inventory(model_dir) -> Inventory:
    """The files a compile of `model_dir` reads; CheckpointError when the folder cannot be compiled."""
    folder = model_dir if isinstance(model_dir, ModelFolder) else ModelFolder(model_dir)
    if not folder.exists(CONFIG_FILE):
        raise CheckpointError(f"{CONFIG_FILE} not found in {folder.path}")
    index = folder.exists(INDEX_FILE)
    shards, weight_map = _index_shards(folder) if index else (_unindexed_shards(folder), {})
    return Inventory(folder, folder.exists(GENERATION_FILE), index, shards, weight_map,
                     tuple(name for name in TOKENIZER_FILES if folder.exists(name)))


def _index_shards(folder: ModelFolder) -> tuple[tuple[str, ...], dict[str, str]]:
    where = str(folder.path / INDEX_FILE)
    weight_map = folder.read_json(INDEX_FILE, required=True).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{where} has no weight_map")
    weight_map = {tensor: folder.check_name(shard, f"{where} weight_map[{tensor[:80]!r}]")
                  for tensor, shard in weight_map.items()}
    shards = tuple(sorted(set(weight_map.values())))
    absent = [s for s in shards if not folder.exists(s)]
    if absent:
        raise CheckpointError(f"shard(s) listed in {INDEX_FILE} are missing from {folder.path}: "
                              f"{', '.join(absent[:8])}")
    return shards, weight_map


def _unindexed_shards(folder: ModelFolder) -> tuple[str, ...]:
    if folder.exists(SINGLE_FILE):
        return (SINGLE_FILE,)
    names = sorted(p.name for p in folder.path.iterdir())
    shards = tuple(n for n in names if n.endswith(".safetensors"))
    if shards:
        return shards
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise PickleCheckpointError(
            f"{folder.path} holds only pickle weights ({', '.join(pickles)}); thin never unpickles "
            "files. Convert the checkpoint to safetensors first (e.g. load it in transformers and "
            "save_pretrained(..., safe_serialization=True)).")
    raise CheckpointError(f"no safetensors weights found in {folder.path}")
