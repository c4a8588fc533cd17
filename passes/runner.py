"""Run an ordered list of passes, verifying the IR after each one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from thin.ir import IRVerificationError, Program, ThinError, format_ir, verify

from .scratch import Scratch

Pass = Callable[[Program, "PassContext"], Program]


# progress(stage, done, total): long passes report here (total 0 for stages without a count).
Progress = Callable[[str, int, int], None]


class Evaluator(Protocol):
    """What a pass may run (the compiler wires in the runtime's executor; see compiler/evaluate.py).

    `session(program)` loads a program once and returns an object with `forward(ids) -> float32
    logits [T, vocab]`, `layer_inputs(ids)` (the hidden state entering each layer, then the last
    layer's output) and `forward_from(layer, hidden)` (forward's logits, running only the layers from
    `layer` on), `observing(fn)` (a context in which fn(weight name, x [tokens, in]) sees
    every linear's input), `overriding({name: dense weight})` (a context in which those weights
    are replaced), `ffn_prefix(widths, scales, shifts)` and `ffn_level(index)` (contexts in which each
    FFN runs a prefix of its channels: elastic levels) and `greedy(prompt ids, n) -> ids`;
    `compare(reference, candidate, prompts)`
    returns runtime.quality's statistics as a dict; `encode(text)` gives token ids."""

    device: str

    def session(self, program: Program) -> Any: ...

    def compare(self, reference: Any, candidate: Any, prompts: Sequence[Sequence[int]]) -> dict: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class PassContext:
    """What a pass may read besides the program: the compile configuration and services the compiler
    wires in. `config` is the compiler's CompileConfig, composed of the passes' own typed option
    dataclasses (a pass reads `ctx.config.<its options>`, never a dict with repeated defaults)."""

    config: Any = None
    # Runs the model (the compiler passes the runtime in); used by calibrate, score and certify.
    evaluator: Evaluator | None = None
    # The program as the frontend produced it: certify measures against it and re-plans from it.
    source: Program | None = None
    # The calibration text (`--calib FILE`, or the default sample of the standard library).
    calibration_text: str | None = None
    # Held-out text the certificate's prompts come from (never calibration text).
    heldout_text: str | None = None
    # Large intermediate tensors (calibration statistics, quantized blobs) shared between passes.
    scratch: Scratch | None = None
    # Where passes do heavy tensor work (GPTQ, scoring): "cpu" or "cuda".
    device: str = "cpu"
    progress: Progress | None = None

    def report(self, stage: str, done: int = 0, total: int = 0) -> None:
        if self.progress is not None:
            self.progress(stage, done, total)


class PassError(ThinError, RuntimeError):
    """A pass raised, or left an IR that does not verify; names the pass and those run before it."""

    def __init__(self, name: str, done: list[str], cause: BaseException):
        before = ", ".join(done) if done else "none"
        super().__init__(f"pass {name!r} failed (passes already run: {before}): {cause}")
        self.pass_name = name
        self.passes_run = list(done)


def pass_name(p: Pass) -> str:
    return getattr(p, "__name__", type(p).__name__)


def run_passes(program: Program, passes: Sequence[Pass], ctx: PassContext, *,
               dump_dir: Path | None = None, on_pass: Callable[[str], None] | None = None) -> Program:
    """Apply `passes` in order; raise PassError naming the failing pass. Optionally dump the IR text
    after each pass into `dump_dir` as NN-name.txt (00-input.txt is the IR before any pass)."""
    verify(program.model)
    if dump_dir is not None:
        dump_dir = Path(dump_dir)
        dump_dir.mkdir(parents=True, exist_ok=True)
        (dump_dir / "00-input.txt").write_text(format_ir(program.model))
    done: list[str] = []
    for index, p in enumerate(passes, start=1):
        name = pass_name(p)
        if on_pass is not None:
            on_pass(name)
        try:
            program = p(program, ctx)
            verify(program.model)
        except (IRVerificationError, Exception) as e:
            raise PassError(name, done, e) from e
        missing = [t.name for t in program.model.tensors if t.name not in program.weights]
        if missing:
            raise PassError(name, done, ValueError(f"no weight loader for {missing[:5]}"))
        done.append(name)
        if dump_dir is not None:
            (dump_dir / f"{index:02d}-{name}.txt").write_text(format_ir(program.model))
    return program
