"""`load_checkpoint`: a Hugging Face checkpoint directory in, a verified IR program out."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from thin.ir import IRVerificationError, Program, verify

from .adapters import get_adapter
from .auxiliary import check_auxiliary, read_tokenizer_files
from .builder import Builder
from .checkpoint import TensorStore
from .config import Config
from .errors import ConfigMismatchError, UnsupportedArchitectureError
from .files import parse_json_object
from .inventory import CONFIG_FILE, GENERATION_FILE, take_inventory


@dataclass(frozen=True)
class Source:
    """Everything the compiler takes from a checkpoint directory."""

    program: Program  # the IR plus one lazy loader per tensor (stored dtype, no quantization)
    config: dict  # config.json as parsed
    generation_config: dict  # generation_config.json, {} if absent
    tokenizer_files: dict[str, bytes]  # tokenizer.json, tokenizer_config.json, ... those present
    chat_template: str | None
    # Every input file, by its name in the model folder: exactly what the cache key hashes.
    inputs: dict[str, Path] = field(default_factory=dict)
    # Each input's (size, mtime_ns, ctime_ns, inode, device) when it was read.
    identities: dict[str, tuple[int, ...]] = field(default_factory=dict)
    config_sha256: str = ""  # of the config.json bytes parsed above, for the artifact's provenance

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(self.inputs.values())


def load_checkpoint(model_dir) -> Source:
    """Read `model_dir` (config.json + safetensors, single or sharded) into a `Source`.

    Weights are not read: each IR tensor gets a loader that reads it from its shard when
    called. Raises a `FrontendError` subclass for anything unsupported, broken or hostile.
    """
    inventory = take_inventory(model_dir)
    folder = inventory.folder
    config_bytes = folder.read(CONFIG_FILE)
    config = parse_json_object(config_bytes, str(folder.path / CONFIG_FILE))
    architectures = config.get("architectures") or []
    if (not isinstance(architectures, list) or len(architectures) != 1
            or not isinstance(architectures[0], str)):
        raise UnsupportedArchitectureError(
            f"config.json must name exactly one entry in `architectures`, found {str(architectures)[:200]}")
    adapter = get_adapter(architectures[0])  # before touching weights: fail fast on the architecture
    generation_config = folder.read_json(GENERATION_FILE, required=inventory.generation_config)

    store = TensorStore(folder, inventory.shards, inventory.weight_map)
    builder = Builder(store, adapter.architecture)
    config_object = Config(config, adapter.architecture, adapter.quant_methods, tensor_count=len(store.tensors))
    model = adapter.build(config_object, builder)
    builder.finish()
    try:
        verify(model)
    except IRVerificationError as e:
        more = f" (and {len(e.violations) - 1} more)" if len(e.violations) > 1 else ""
        raise ConfigMismatchError(f"config.json does not fit the weights: {e.violations[0]}{more}") from None

    tokenizer_files = read_tokenizer_files(folder, inventory.tokenizer_files)
    chat_template = check_auxiliary(tokenizer_files, generation_config, model.vocab_size)
    names = inventory.names()
    # The cache key hashes exactly these files; each was read above, none besides them.
    assert set(folder.identities) == set(names), (sorted(folder.identities), names)
    return Source(
        program=Program(model=model, weights=dict(builder.loaders)),
        config=config,
        generation_config=generation_config,
        tokenizer_files=tokenizer_files,
        chat_template=chat_template,
        inputs={name: folder.path / name for name in names},
        identities=dict(folder.identities),
        config_sha256=hashlib.sha256(config_bytes).hexdigest(),
    )
