"""compile_model: checkpoint -> passes -> one .thin file, with caching by input key."""

from __future__ import annotations

import os
import stat
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

from thin.ir import __version__
from thin.passes import PassContext, Scratch, run_passes

from .config import CompileConfig
from .errors import OutputPathError
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
    cache_note: str = ""  # why a cache entry present for the key was not used (and was replaced)
    parameters: int = 0
    tensor_bytes: int = 0
    file_bytes: int = 0
    tensors: int = 0
    formats: dict[str, int] = field(default_factory=dict)  # format -> tensor count
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> wall seconds
    precision_plan: dict | None = None  # the artifact's sections, as written
    memory: dict | None = None
    certificate: dict | None = None
    has_tokenizer: bool = True  # tokenizer.json is in the artifact: thin-exec takes text


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


def input_key(inputs, identities, config: CompileConfig, calibration: str | None, heldout: str | None) -> str:
    """The cache key of a compile of the files `inputs` (the frontend's inventory, by name) with
    `config`, running the model on `calibration` and `heldout` text: the one computation that
    `thinc compile` and `thinc key` share, so they cannot disagree."""
    from thin.artifacts import compute_key

    return compute_key(inputs, config.to_plain(), calibration=evaluation_identity(calibration, heldout),
                       target=config.target, identities=identities)


def build(model_dir, output, config: CompileConfig, *, cache_dir=None, dump_ir=None,
          progress: Progress | None = None, calib=None) -> CompileReport:
    """compile_model's worker: the same, returning a CompileReport for the CLI's summary."""
    from thin.artifacts import CompileCache, open_artifact

    from .evaluate import make_evaluator
    from .hf import load_checkpoint

    progress = progress or (lambda stage, done, total: None)
    model_dir, output = Path(model_dir), check_output(output)
    if dump_ir is not None:
        if os.path.realpath(dump_ir) == os.path.realpath(output):
            raise OutputPathError(f"--dump-ir {dump_ir} and the output are the same path; give each its own")
        dump_ir = check_dump_dir(dump_ir)
    if cache_dir is not None and os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        raise OutputPathError(f"--cache-dir {cache_dir} is a file, not a folder; give a folder for the cached "
                              "artifacts")
    clock = _Clock()
    # torch is imported on first use; time it here so the stage that happens to need it first
    # (writing tensors) is not charged for interpreter start-up.
    import torch  # noqa: F401

    clock.lap("import torch")

    # Reading the checkpoint is lazy (headers only), so a bad or unsupported model fails before hashing.
    progress("load checkpoint", 0, 0)
    source = load_checkpoint(model_dir)
    check_output(output, [*source.files, *([calib] if calib is not None else [])])
    clock.lap("load checkpoint")
    calibration, heldout = evaluation_texts(config, calib)
    progress("hash inputs", 0, 0)
    key = input_key(source.inputs, source.identities, config, calibration, heldout)
    clock.lap("hash inputs")
    cache = CompileCache(cache_dir) if cache_dir is not None else None
    with _writing(output):
        missed = cache.fetch(key, output) if cache is not None else "absent"
    if missed is None:
        progress("cache hit", 0, 0)
        clock.lap("cache")
        with open_artifact(output) as art:
            return _report(art, output, key, True, clock)
    note = "" if missed == "absent" else f"cache entry replaced: {missed}"
    if note:
        progress(note, 0, 0)

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
    if cache is not None:
        try:
            cache.store(key, output)
        except OSError as e:  # the artifact is written and sound; only the next compile loses the reuse
            note = f"cache not updated: {cache.entry(key)}: {e.strerror or e}"
            progress(note, 0, 0)
        clock.lap("cache")
    with open_artifact(output) as art:
        report = _report(art, output, key, False, clock)
    report.cache_note = note
    return report


def _write(program, source, config: CompileConfig, key: str, output: Path, progress: Progress,
           model_dir: Path) -> None:
    from thin.artifacts import ArtifactWriter

    tensors = program.model.tensors
    with _writing(output):
        writer = ArtifactWriter(output)
    with writer:
        for i, t in enumerate(tensors):
            progress("write tensors", i, len(tensors))
            raw = program.load(t.name)  # the weight contract: the encoded bytes of t's encoding
            with _writing(output):
                writer.add_tensor(t.name, raw.contiguous().numpy(), align=t.align)
            del raw
        progress("write tensors", len(tensors), len(tensors))
        sections = {
            "tokenizer": dict(source.tokenizer_files),
            "chat_template": source.chat_template,
            "generation_config": dict(source.generation_config),
            "compile_config": config.to_plain(),
            "precision_plan": _precision_plan(program),
            "memory": program.annotations.get("memory"),
            "certificate": program.annotations.get("certificate", None if config.quantized else EXACT_CERTIFICATE),
            "provenance": _provenance(source, model_dir),
            "key": key,
        }
        with _writing(output):
            writer.commit(program.model, sections)


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
    # The hash of the bytes the frontend parsed: reading the file again could see other bytes.
    return {
        "thin_version": __version__,
        "architecture": source.program.model.architecture,
        "family": source.program.model.family,
        "source_config_sha256": source.config_sha256,
    }


def _report(art, output: Path, key: str, cache_hit: bool, clock: _Clock) -> CompileReport:
    report = CompileReport(output=output, key=key, cache_hit=cache_hit, seconds=clock.laps,
                           precision_plan=art.section("precision_plan"), memory=art.section("memory"),
                           certificate=art.section("certificate"),
                           has_tokenizer="tokenizer.json" in (art.section("tokenizer") or {}))
    for t in art.model.tensors:
        report.tensors += 1
        report.formats[t.encoding.format] = report.formats.get(t.encoding.format, 0) + 1
        report.tensor_bytes += art.tensor_entry(t.name)["size"]
        # A tied head shares the embedding tensor, so each parameter is counted once.
        report.parameters += prod(t.shape)
    report.file_bytes = art.file_size
    return report


def check_output(output, inputs=()) -> Path:
    """`output` as a Path, if writing the artifact there destroys nothing; OutputPathError otherwise.

    Refused: a path ending in a separator (a folder was meant), an existing directory, device,
    FIFO or socket (the rename would replace it by a regular file), a missing parent folder, and
    any of `inputs`, compared by resolved path and by (device, inode) so links are caught too."""
    text = os.fspath(output)
    if not text or text.endswith(tuple(filter(None, ("/", os.sep, os.altsep)))):
        raise OutputPathError(f"output {text!r} names a folder, not a file; give a file path such as "
                              f"{os.path.join(text, 'model.thin')}")
    path = Path(text)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputPathError(f"output {path} is a directory; give a file path such as {path}/model.thin")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputPathError(f"output {path} exists and is not a regular file (a device, FIFO or socket); "
                              "thin replaces only regular files")
    if not path.parent.is_dir():
        raise OutputPathError(f"output directory {path.parent} does not exist; create it first")
    real = os.path.realpath(path)
    for source in inputs:
        same_file = st is not None and os.path.exists(source) and os.path.samestat(st, os.stat(source))
        if same_file or real == os.path.realpath(source):
            raise OutputPathError(f"output {path} is also an input ({source}); writing there would "
                                  "destroy it: choose another output path")
    probe_writable(path, "output")
    return path


def probe_writable(path: Path, what: str) -> None:
    """Create and remove the temp file a write of `path` starts with, so that a read-only, foreign or
    full folder is refused before the work, not after it."""
    from thin.artifacts import create_temp_beside

    try:
        fd, tmp = create_temp_beside(path)
    except OSError as e:
        raise OutputPathError(f"cannot write {what} {path}: {e.strerror or e}; choose a folder you can write to") \
            from None
    os.close(fd)
    os.unlink(tmp)


def check_dump_dir(path) -> Path:
    """The --dump-ir folder, created if missing and checked writable before the compile starts."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"--dump-ir {path} exists and is not a folder; give a folder for the IR text files")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputPathError(f"cannot create the --dump-ir folder {path}: {e.strerror or e}") from None
    probe_writable(path / "00-input.txt", "into the --dump-ir folder")
    return path


@contextmanager
def _writing(output: Path):
    """OSError while writing the artifact (a full disk, an I/O error) as one line naming the output; the
    writer has removed its temp file, and `output` is as it was."""
    try:
        yield
    except OSError as e:
        raise OutputPathError(f"writing {output} failed: {e.strerror or e}; nothing was written there") from None


class _Clock:
    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}
        self.stage = ""

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps[stage] = self.laps.get(stage, 0.0) + now - self.last
        self.last = now
