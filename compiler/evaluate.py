"""The evaluator the compiler hands to passes (`PassContext.evaluator`): runs a compile-time
`Program` through the runtime's `Executor`, on token ids, on the compile's device.

Passes never import the runtime; they call what is here (see `passes.runner.Evaluator`):

- `session(program)` loads a program once and runs it (`forward`, `greedy`; `layer_inputs` and
  `forward_from` to re-run only the layers after a change), with a tap on every projection:
  `observe` sees each linear's input (calibration), `override` swaps a weight for a dense one
  (sensitivity probes) without rebuilding the model;
- `compare(reference, candidate, prompts)` scores two sessions teacher-forced, with the runtime's
  own metrics (`runtime.quality`), so a certificate and `bench_quality.py` measure the same way;
- `encode(text)` tokenizes with the checkpoint's tokenizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from thin.ir import Program
from thin.runtime.executor import Executor
from thin.runtime.generate import generate
from thin.runtime.linear import DenseLinear
from thin.runtime.quality import compare_prompts
from thin.runtime.sampling import GenerationOptions

from .errors import CompileError


class EvaluatorError(CompileError, RuntimeError):
    """The model cannot be evaluated as asked (no tokenizer for text, a device that isn't there)."""


def default_device() -> str:
    """cuda when a CUDA GPU is present, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class _Tap:
    """Stands in for one LinearOp: reports its input to the session's observer and, while an
    override is set for its weight, multiplies by the override instead. The op runs its kernel's
    default launch configuration (LinearOp.tune): a compile decodes a few tokens in each of the
    formats its plan chose (the certificate's greedy agreement), not worth compiling and timing
    every launch candidate of every format and shape for."""

    def __init__(self, name: str, op, session: Session):
        self.name, self.op, self.session = name, op, session
        op.tune = False
        self.format, self.implementation = op.format, op.implementation
        self.in_features, self.out_features = op.in_features, op.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.session.observer is not None:
            self.session.observer(self.name, x.reshape(-1, x.shape[-1]))
        weight = self.session.overrides.get(self.name)
        if weight is None:
            return self.op(x)
        return F.linear(x, weight.to(x.dtype), getattr(self.op, "bias", None))

    def prefix(self, x: torch.Tensor, *, rows=None, cols=None, halves=1) -> torch.Tensor:
        """The op's weight prefix (LinearOp.prefix), or the override's. The observer sees full inputs only."""
        weight = self.session.overrides.get(self.name)
        if weight is None:
            return self.op.prefix(x, rows=rows, cols=cols, halves=halves)
        return DenseLinear(weight.to(x.dtype), getattr(self.op, "bias", None), self.format).prefix(
            x, rows=rows, cols=cols, halves=halves)

    def dense_weight(self) -> torch.Tensor:
        return self.op.dense_weight()


class _OverridableEmbedding:
    """The executor's embedding lookup, with the same override as the (tied) head."""

    def __init__(self, name: str, embed, session: Session):
        self.name, self.embed, self.session = name, embed, session

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.session.overrides.get(self.name)
        if weight is None:
            return self.embed(ids)
        return F.embedding(ids, weight).to(self.embed.dtype)


class Session:
    """One program in the runtime's executor on `device`, with every projection tapped."""

    def __init__(self, program: Program, device: str):
        self.observer: Callable[[str, torch.Tensor], None] | None = None
        self.overrides: dict[str, torch.Tensor] = {}
        self.executor = Executor(program.model, program.load, device=device,
                                 wrap_linear=lambda name, op: _Tap(name, op, self))
        self.executor.embed = _OverridableEmbedding(program.model.embedding.weight, self.executor.embed, self)
        self.device = self.executor.device
        self.model = program.model

    def forward(self, ids) -> torch.Tensor:
        """float32 logits [T, vocab] (on the session's device) for token ids [T]."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(self.device)
        with torch.inference_mode():
            return self.executor.forward(ids)

    def layer_inputs(self, ids) -> list[torch.Tensor]:
        """The hidden states entering each layer for token ids [T], then the last layer's output
        (Executor.layer_inputs), with the weights as they are now (overrides included)."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(self.device)
        return self.executor.layer_inputs(ids)

    def forward_from(self, first: int, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, vocab] continuing from `hidden`, the state entering layer `first` (one
        of `layer_inputs`): `forward` when nothing before layer `first` has changed since."""
        return self.executor.forward_from(first, hidden)

    @contextlib.contextmanager
    def observing(self, observer: Callable[[str, torch.Tensor], None]):
        """Within the block, `observer(weight name, x [tokens, in_features])` sees every linear input."""
        self.observer = observer
        try:
            yield self
        finally:
            self.observer = None

    @contextlib.contextmanager
    def overriding(self, weights: dict[str, torch.Tensor]):
        """Within the block, the named weights are replaced by these dense ones (any float dtype)."""
        self.overrides = {k: v.to(self.device) for k, v in weights.items()}
        try:
            yield self
        finally:
            self.overrides = {}

    @contextlib.contextmanager
    def ffn_prefix(self, widths: list[int | None], scales=None, shifts=None):
        """Within the block, layer i's FFN runs only its first widths[i] channels, scaled by scales[i]
        and shifted by shifts[i] (see Executor.set_ffn_prefix)."""
        self.executor.set_ffn_prefix(widths, scales, shifts)
        try:
            yield self
        finally:
            self.executor.set_ffn_level(None)

    @contextlib.contextmanager
    def ffn_level(self, index: int):
        """Within the block, the model runs its elastic FFN level `index` (model.ffn_levels[index])."""
        self.executor.set_ffn_level(index)
        try:
            yield self
        finally:
            self.executor.set_ffn_level(None)

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        """`n` greedily chosen tokens after `prompt` (no stop token ends it early)."""
        options = GenerationOptions(max_new_tokens=n, temperature=0.0, stop_token_ids=())
        with torch.inference_mode():
            return list(generate(self.executor, list(prompt), options))


class ExecutorEvaluator:
    """What passes may run, on `device`, with the checkpoint's `tokenizer` (None: ids only)."""

    def __init__(self, device: str, tokenizer=None):
        self.device = device
        self.tokenizer = tokenizer

    def session(self, program: Program) -> Session:
        return Session(program, self.device)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise EvaluatorError("calibration and certification read text, and this checkpoint has no "
                                 "tokenizer.json to encode it")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def compare(self, reference: Session, candidate: Session, prompts: Sequence[Sequence[int]]) -> dict:
        """Teacher-forced agreement of `candidate` with `reference` over every position of every
        prompt (see runtime.quality.compare_prompts), as plain data."""
        return compare_prompts(reference, candidate, prompts).to_plain()


def make_evaluator(device: str, tokenizer_files: dict[str, bytes]) -> ExecutorEvaluator:
    """The evaluator for a checkpoint: on `device` (checked here), with its tokenizer when
    `tokenizer_files` hold a tokenizer.json."""
    from thin.runtime.loader import DeviceUnavailableError, resolve_device
    from thin.runtime.tokenizer import Tokenizer

    from .config import CompileOptionError

    try:
        resolve_device(device)
    except DeviceUnavailableError as e:
        raise CompileOptionError(f"--device {device}: {e}") from None
    tokenizer = Tokenizer.from_files(tokenizer_files) if "tokenizer.json" in tokenizer_files else None
    return ExecutorEvaluator(device, tokenizer)
