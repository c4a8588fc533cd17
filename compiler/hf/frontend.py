"""`load_checkpoint`: a Hugging Face checkpoint directory in, a verified IR program out."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from thin.ir import Program, verify

from .adapters import get_adapter
from .builder import Builder
from .checkpoint import TensorStore, find_chat_template, read_json, read_tokenizer_files
from .config import Config
from .errors import CheckpointError, UnsupportedArchitectureError


@dataclass(frozen=True)
class Source:
    """Everything the compiler takes from a checkpoint directory."""

    program: Program  # the IR plus one lazy loader per tensor (stored dtype, no quantization)
    config: dict  # config.json as parsed
    generation_config: dict  # generation_config.json, {} if absent
    tokenizer_files: dict[str, bytes]  # tokenizer.json, tokenizer_config.json, ... those present
    chat_template: str | None
    files: tuple[Path, ...] = field(default=())  # every input file read, for the cache key


def load_checkpoint(model_dir) -> Source:
    """Read `model_dir` (config.json + safetensors, single or sharded) into a `Source`.

    Weights are not read: each IR tensor gets a loader that reads it from the memory-mapped
    shard when called. Raises a `FrontendError` subclass for anything unsupported or broken.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    config = read_json(model_dir / "config.json", required=True)
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise UnsupportedArchitectureError(
            f"config.json must name exactly one entry in `architectures`, found {architectures!r}")
    adapter = get_adapter(architectures[0])  # before touching weights: fail fast on the architecture
    generation_path = model_dir / "generation_config.json"
    generation_config = read_json(generation_path, required=False)

    store = TensorStore(model_dir)
    builder = Builder(store, adapter.architecture)
    model = adapter.build(Config(config, adapter.architecture, adapter.quant_methods), builder)
    builder.finish()
    verify(model)

    tokenizer_files = read_tokenizer_files(model_dir)
    files = [model_dir / "config.json", *store.files, *(model_dir / n for n in sorted(tokenizer_files))]
    if generation_path.is_file():
        files.insert(1, generation_path)
    return Source(
        program=Program(model=model, weights=dict(builder.loaders)),
        config=config,
        generation_config=generation_config,
        tokenizer_files=tokenizer_files,
        chat_template=find_chat_template(tokenizer_files),
        files=tuple(files),
    )
