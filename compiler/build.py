"""compile_model: checkpoint -> passes -> one .thin file, with caching by input key."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

from thin.ir import __version__
from thin.passes import PassContext, Scratch, run_passes

from .config import CompileConfig
from .inputs import evaluation_identity, evaluation_texts
from .pipeline import build_pipeline

# The certificate of a compile that keeps every tensor as stored: nothing to measure.
EXACT_CERTIFICATE = {"status": "EXACT"}

# progress(stage, done, total): total is 0 for stages without a count.
Progress = Callable[[str, int, int], None]


@dataclass
class CompileReport:
    output: Path
    key: str
    cache_hit: bool
    parameters: int = 0
    tensor_bytes: int = 0
    file_bytes: int = 0
    tensors: int = 0
    formats: dict[str, int] = field(default_factory=dict)  # format -> tensor count
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> wall seconds
    precision_plan: dict | None = None  # the artifact's sections, as written
    memory: dict | None = None
    certificate: dict | None = None


def compile_model(model_dir, output, *, cache_dir=None, dump_ir=None, progress: Progress | None = None,
                  calib=None, **options) -> Path:
    """Compile the Hugging Face checkpoint in `model_dir` into the artifact `output` and return its path.

    `options` are CompileConfig fields or their flat forms (e.g. fuse_projections=False, bpw=4.5,
    vram="8G", quant="int4"). `calib` is a calibration file (text or JSON lines with a "text"
    field) replacing the default sample of the standard library. With `cache_dir`, an artifact
    built earlier from identical inputs is reused and new builds are stored there. `dump_ir` names a
    folder that receives the IR text after each pass."""
    if calib is not None:
        options["calib_source"] = "file"
    config = CompileConfig.from_options(**options)
    return build(model_dir, output, config, cache_dir=cache_dir, dump_ir=dump_ir, progress=progress,
                 calib=calib).output


def build(model_dir, output, config: CompileConfig, *, cache_dir=None, dump_ir=None,
          progress: Progress | None = None, calib=None) -> CompileReport:
    """compile_model's worker: the same, returning a CompileReport for the CLI's summary."""
    from thin.artifacts import compute_key, open_artifact

    from .evaluate import make_evaluator
    from .hf import load_checkpoint

    progress = progress or (lambda stage, done, total: None)
    model_dir, output = Path(model_dir), Path(output)
    _check_output(output)
    clock = _Clock()
    # torch is imported on first use; time it here so the stage that happens to need it first
    # (writing tensors) is not charged for interpreter start-up.
    import torch  # noqa: F401

    clock.lap("import torch")

    # Reading the checkpoint is lazy (headers only), so a bad or unsupported model fails before hashing.
    progress("load checkpoint", 0, 0)
    source = load_checkpoint(model_dir)
    clock.lap("load checkpoint")
    calibration, heldout = evaluation_texts(config, calib)
    progress("hash inputs", 0, 0)
    key = compute_key(model_dir, config.to_plain(), calibration=evaluation_identity(calibration, heldout),
                      target=config.target)
    clock.lap("hash inputs")
    cached = Path(cache_dir) / f"{key}.thin" if cache_dir is not None else None
    if cached is not None and cached.is_file():
        progress("cache hit", 0, 0)
        _atomic_copy(cached, output)
        clock.lap("cache")
        with open_artifact(output) as art:
            return _report(art, output, key, True, clock)

    with tempfile.TemporaryDirectory(prefix="thin-scratch-") as scratch:
        evaluator = make_evaluator(config.device, source.tokenizer_files) if config.evaluated else None
        ctx = PassContext(config=config, evaluator=evaluator, source=source.program, calibration_text=calibration,
                          heldout_text=heldout, scratch=Scratch(scratch), device=config.device or "cpu",
                          progress=progress)

        def on_pass(name: str) -> None:
            clock.lap(clock.stage)  # each pass's time under its own name in the summary
            clock.stage = name
            progress(f"pass {name}", 0, 0)

        clock.stage = "setup"
        program = run_passes(source.program, build_pipeline(config), ctx, dump_dir=dump_ir, on_pass=on_pass)
        clock.lap(clock.stage)
        _write(program, source, config, key, output, progress, model_dir)
    clock.lap("write")
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        _atomic_copy(output, cached)
        clock.lap("cache")
    with open_artifact(output) as art:
        return _report(art, output, key, False, clock)


def _write(program, source, config: CompileConfig, key: str, output: Path, progress: Progress,
           model_dir: Path) -> None:
    from thin.artifacts import ArtifactWriter

    tensors = program.model.tensors
    with ArtifactWriter(output) as writer:
        for i, t in enumerate(tensors):
            progress("write tensors", i, len(tensors))
            raw = program.load(t.name)  # the weight contract: the encoded bytes of t's encoding
            writer.add_tensor(t.name, raw.contiguous().numpy(), align=t.align)
            del raw
        progress("write tensors", len(tensors), len(tensors))
        writer.commit(program.model, {
            "tokenizer": dict(source.tokenizer_files),
            "chat_template": source.chat_template,
            "generation_config": dict(source.generation_config),
            "compile_config": config.to_plain(),
            "precision_plan": _precision_plan(program),
            "memory": program.annotations.get("memory"),
            "certificate": program.annotations.get("certificate", None if config.quantized else EXACT_CERTIFICATE),
            "provenance": _provenance(source, model_dir),
            "key": key,
        })


def _precision_plan(program) -> dict | None:
    """What the precision passes decided, as they recorded it (None for an exact compile)."""
    notes = {"quantize": program.annotations.get("quantize"), "plan": program.annotations.get("precision_plan"),
             "calibration": _calibration_summary(program.annotations.get("calibration"))}
    notes = {k: v for k, v in notes.items() if v is not None}
    return notes or None


def _calibration_summary(note: dict | None) -> dict | None:
    """The calibration facts worth keeping in the artifact (not the per-weight input table)."""
    if note is None:
        return None
    summary = {k: note[k] for k in ("source", "text_sha256", "tokens", "windows")}
    if note.get("expert_tokens"):  # routing counts per expert, and how many experts fell short
        summary.update(expert_tokens=note["expert_tokens"], min_expert_tokens=note["min_expert_tokens"],
                       starved_experts=len(note["starved_experts"]))
    return summary


def _provenance(source, model_dir: Path) -> dict:
    config_bytes = (model_dir / "config.json").read_bytes()
    return {
        "thin_version": __version__,
        "architecture": source.program.model.architecture,
        "family": source.program.model.family,
        "source_config_sha256": hashlib.sha256(config_bytes).hexdigest(),
    }


def _report(art, output: Path, key: str, cache_hit: bool, clock: _Clock) -> CompileReport:
    report = CompileReport(output=output, key=key, cache_hit=cache_hit, seconds=clock.laps,
                           precision_plan=art.section("precision_plan"), memory=art.section("memory"),
                           certificate=art.section("certificate"))
    for t in art.model.tensors:
        report.tensors += 1
        report.formats[t.encoding.format] = report.formats.get(t.encoding.format, 0) + 1
        report.tensor_bytes += art.tensor_entry(t.name)["size"]
        # A tied head shares the embedding tensor, so each parameter is counted once.
        report.parameters += prod(t.shape)
    report.file_bytes = art.file_size
    return report


def _check_output(output: Path) -> None:
    if output.is_dir():
        raise IsADirectoryError(f"output {output} is a directory; give a file path such as {output}/model.thin")
    if not output.parent.is_dir():
        raise FileNotFoundError(f"output directory {output.parent} does not exist; create it first")


def _atomic_copy(src: Path, dst: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    try:
        with os.fdopen(fd, "wb") as f, open(src, "rb") as s:
            shutil.copyfileobj(s, f, 1 << 22)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class _Clock:
    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}
        self.stage = ""

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps[stage] = self.laps.get(stage, 0.0) + now - self.last
        self.last = now
