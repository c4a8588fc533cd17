"""`load(path)`: open a .thin artifact and wrap everything needed to run it in a `ThinModel`.

Weights are not copied here: the executor receives uint8 views of the artifact's mapped bytes
and its LinearOps decide what lives where (runtime/linear.py). So a running model keeps reading
the file: replace an artifact in use by rename (as `thinc compile` does), never by truncating it
in place (`cp` over it), which makes the mapped pages past the new end fault with SIGBUS.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .chat_template import ChatTemplate
from .errors import RunError
from .generate import ContextTooLongError, ConversationCache, GenerationStats, engine_generate, generate
from .inputs import InputError, check_prompt_text, token_list, token_tensor
from .perplexity import PerplexityResult, evaluate_perplexity
from .sampling import GenerationOptions
from .tokenizer import Tokenizer, TokenizerError


class DeviceUnavailableError(RunError, RuntimeError):
    """The requested device does not exist on this machine."""


class NoChatTemplateError(RunError, ValueError):
    """The artifact carries no chat template, so messages cannot be rendered."""


class FFNLevelError(RunError, ValueError):
    """An elastic FFN level the artifact did not certify (or an artifact without levels)."""


def resolve_device(device: str | torch.device) -> torch.device:
    """Check that `device` ("cpu", "cuda", "cuda:1") is usable here; raise DeviceUnavailableError if not."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceUnavailableError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(f"device {str(device)!r} needs a CUDA GPU and none is available here; "
                                         "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"device {device} requested but only {torch.cuda.device_count()} CUDA GPU(s) are present")
    elif device.type != "cpu":
        raise DeviceUnavailableError(f"device {device.type!r} is not supported (use cpu or cuda)")
    return device


def _raw_getter(artifact):
    """get_raw(name): the tensor's encoded bytes as a uint8 torch view of the mapped file (no copy)."""

    def get_raw(name: str) -> torch.Tensor:
        # open_artifact maps the file copy-on-write, so its views are writable: torch.frombuffer
        # takes them without a copy and without the read-only-buffer warning.
        view = artifact.buffer(name)
        return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)

    return get_raw


class ThinModel:
    """A loaded artifact: forward, generate, tokenizer, chat template, perplexity."""

    def __init__(self, artifact, executor, tokenizer: Tokenizer | None, chat_template: ChatTemplate | None,
                 device: torch.device, engine=None):
        self.artifact = artifact
        self.executor = executor
        # The CUDA decode engine (runtime/engine.py) when it takes this model; else None and
        # generation runs through the executor.
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.device = device
        self.ir = artifact.model
        self.generation_config: dict = dict(artifact.generation_config or {})
        self.last_stats = GenerationStats()
        # The elastic FFN level running (see set_ffn_keep): None is the whole model.
        self.ffn_level = None
        self.ffn_keep, self.ffn_certified = 1.0, True

    def set_ffn_keep(self, keep: float, *, uncertified: bool = False) -> None:
        """Run the elastic FFN level `keep` (thin-exec --ffn-keep): each FFN reads only the prefix of its
        importance-ordered channels that the level certified (thin.ir.FFNLevel); 1.0 is the whole model.
        A keep the artifact did not certify raises FFNLevelError, unless `uncertified`: then every layer
        runs the same share of its channels (whole superblocks, so `ffn_share`, the share of the FFN bytes it
        reads, is `keep` rounded up), without a certificate or correction.
        Switching levels copies no weight; a conversation's cached keys and values stay in use. On CUDA
        the kernels read the prefix in place, and the decode engine captures its step once per level
        (a switch back replays the graph captured before)."""
        from thin.ir import FFNLevel
        from thin.ir.elastic import uniform_channels

        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
            raise FFNLevelError(f"an FFN keep fraction is a number in (0, 1], got {keep!r}")
        levels = self.ir.ffn_levels
        match = [i for i, level in enumerate(levels) if abs(level.keep - keep) < 5e-4]
        if not levels and keep != 1.0:
            raise FFNLevelError(f"--ffn-keep {keep:g}: this artifact has no FFN levels (its channels are not "
                                "importance-ordered); compile it with --ffn-levels")
        if match:
            self.executor.set_ffn_level(match[0])
            level, certified = levels[match[0]], True
        elif keep == 1.0:
            self.executor.set_ffn_level(None)
            level, certified = None, True
        elif not uncertified:
            known = ", ".join(f"{level.keep:g}" for level in levels)
            raise FFNLevelError(f"--ffn-keep {keep:g} is not a level this artifact certified ({known}); pass "
                                "--uncertified to run it anyway")
        else:
            channels = uniform_channels(self.ir, keep)
            self.executor.set_ffn_prefix(list(channels))
            none = (None,) * len(channels)
            level, certified = FFNLevel(keep, channels, none, none), False
        self.ffn_level, self.ffn_certified = level, certified
        self.ffn_keep = 1.0 if level is None else level.keep

    @property
    def ffn_share(self) -> float:
        """The share of the FFN weight bytes the running level reads: an uncertified keep runs whole
        superblocks, so this is its keep rounded up."""
        from thin.ir.elastic import ffn_bytes

        level = self.ffn_level
        return 1.0 if level is None else ffn_bytes(self.ir, level.channels) / ffn_bytes(self.ir)

    def describe_implementations(self) -> str:
        """One line: which implementation serves the model's linear weights, per format, here."""
        counts: dict[tuple[str, str], int] = {}
        for op in self.executor.linear_ops():
            counts[(op.format, op.implementation)] = counts.get((op.format, op.implementation), 0) + 1
        served = ", ".join(f"{fmt} x{n} -> {impl}" for (fmt, impl), n in sorted(counts.items()))
        cache = self.executor.expert_cache
        streamed = "" if cache is None else f"; {cache.describe()}" + (
            ", decoded by the torch executor" if self.device.type == "cuda" else "")
        return f"linear weights on {self.device.type}: {served}{streamed}"

    def forward(self, input_ids) -> torch.Tensor:
        """float32 logits [T, vocab] for one sequence of ids [T] (no cache); InputError for ids of another
        type, shape or range (floats, batches, ids past the vocabulary)."""
        ids = token_tensor(input_ids, self.ir.vocab_size, "forward").to(self.device)
        limit = self.ir.max_position_embeddings
        if limit and len(ids) > limit:  # as generate: positions past the model's are not its output
            raise ContextTooLongError(f"forward: {len(ids)} tokens exceed the model's max_position_embeddings "
                                      f"({limit}); score longer text in windows (perplexity does)")
        with torch.no_grad():
            return self.executor.forward(ids)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS ids from generation_config, plus the tokenizer's eos token."""
        ids = list(GenerationOptions.from_generation_config(self.generation_config).stop_token_ids)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is not None and eos not in ids:
            ids.append(eos)
        return tuple(ids)

    def generation_options(self, **overrides) -> GenerationOptions:
        """The artifact's generation defaults with `overrides` (None values ignored) on top."""
        if overrides.get("stop_token_ids") is None:
            overrides["stop_token_ids"] = self.stop_token_ids
        return GenerationOptions.from_generation_config(self.generation_config, **overrides)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (at most MAX_PROMPT_BYTES of UTF-8, checked before tokenizing)."""
        if self.tokenizer is None:
            raise TokenizerError("this artifact has no tokenizer (its source folder had no tokenizer.json): "
                                 "compile it again from a folder with one, or give token ids from Python "
                                 "(ThinModel.generate) instead of text")
        return self.tokenizer.encode(check_prompt_text(text), add_special_tokens=add_special_tokens)

    def generate(self, prompt: str | Sequence[int], *, stats: GenerationStats | None = None,
                 conversation: ConversationCache | None = None, **options) -> Iterator[int]:
        """Stream new token ids for `prompt` (text, encoded with special tokens, or ids).

        `options` are GenerationOptions fields (max_new_tokens, temperature, top_k, top_p, min_p,
        repetition_penalty, seed, stop_token_ids); the artifact's generation_config fills the rest.
        Timings land in `stats` (default: `self.last_stats`). With `conversation` (from
        `new_conversation()`), keys and values of a prompt prefix seen in an earlier call are reused.
        """
        ids = token_list(self.encode(prompt) if isinstance(prompt, str) else prompt, self.ir.vocab_size)
        if stats is None:
            stats = self.last_stats = GenerationStats()
        opts = self.generation_options(**options)
        if conversation is not None and conversation.executor is not (self.engine or self.executor):
            raise InputError("this conversation belongs to another model: make one with this model's "
                             "new_conversation()")
        return self._generate(ids, opts, stats, conversation)

    def new_conversation(self, min_tokens: int = 1024) -> ConversationCache:
        """A KV cache to pass to successive `generate` calls of one chat (first sized for `min_tokens`)."""
        return ConversationCache(self.engine or self.executor, self.ir.max_position_embeddings, min_tokens)

    def _generate(self, ids, opts, stats, conversation) -> Iterator[int]:
        # A generator function of its own so option errors above raise at the call, not on first next().
        cache = conversation.prepare(ids, opts.max_new_tokens) if conversation is not None else None
        generated: list[int] = []
        run = generate if self.engine is None else engine_generate
        try:
            with torch.no_grad():
                for token in run(self.engine or self.executor, ids, opts, stats=stats, cache=cache,
                                 max_position_embeddings=self.ir.max_position_embeddings):
                    generated.append(token)
                    yield token
        finally:
            if conversation is not None:
                conversation.record(ids, generated)

    def render_chat(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for chat `messages`, as transformers' apply_chat_template(tokenize=False) gives."""
        if self.chat_template is None:
            raise NoChatTemplateError("this artifact has no chat template; pass raw text instead")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def perplexity(self, text_or_ids: str | Sequence[int], *, context: int | None = None,
                   stride: int | None = None) -> PerplexityResult:
        """Perplexity and mean NLL of text (encoded with special tokens) or ids, teacher-forced."""
        ids = token_list(self.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids,
                         self.ir.vocab_size, "perplexity")
        return evaluate_perplexity(self, ids, context=context, stride=stride)


def load(path, device: str | torch.device = "cpu", verify: bool = False, *, vram: int | None = None,
         context: int | None = None, graphs: bool = True, ffn_keep: float | None = None,
         uncertified: bool = False) -> ThinModel:
    """Open the artifact at `path` and make it runnable on `device`.

    With `verify`, every tensor's checksum is checked first and the artifacts' error names
    the first bad one. On CUDA, generation runs on the decode engine (fused kernels, paged KV
    cache, the decode step in a CUDA graph unless `graphs` is false; each matvec's launch
    configuration is chosen here) when it takes the model. `vram` (bytes, CUDA only) is a budget:
    the model, a KV cache of `context` tokens (default: the model's positions, at most 4096) and
    the workspace must fit, and allocations beyond it fail. Raises ArtifactError (from
    thin.artifacts) for a bad file, DeviceUnavailableError for a device this machine lacks,
    VramBudgetError (thin.runtime.memory) for a budget the model does not fit. `ffn_keep` runs an
    elastic FFN level (see ThinModel.set_ffn_keep; FFNLevelError for one the artifact did not certify,
    unless `uncertified`).
    """
    device = resolve_device(device)
    from thin.artifacts import ChecksumMismatchError, open_artifact

    from .executor import Executor

    artifact = open_artifact(path)
    if verify:
        bad = artifact.verify_checksums()
        if bad:
            raise ChecksumMismatchError(f"{path}: checksum mismatch in {len(bad)} tensor(s), first {bad[0]!r}; "
                                f"the file is damaged, re-download or recompile it")
    model_ir = artifact.model
    if vram is not None:
        from .memory import VramBudgetError, check

        if device.type != "cuda":
            raise VramBudgetError("--vram is a GPU memory budget: it needs --device cuda")
        check(artifact, context or min(model_ir.max_position_embeddings, 4096), vram, device)
    from .expert_cache import HostPages, Residency

    # Experts the compile left in host memory (--stream-experts) stream through a cache of device slots;
    # the decode engine runs all-resident models only, so the executor decodes those.
    residency = Residency.from_artifact(artifact)
    host = None if residency is None else HostPages(artifact, residency.host, device)
    executor = Executor(model_ir, _raw_getter(artifact), device=str(device), host_experts=host,
                        expert_slots=residency.slots if residency else 0)
    engine = _engine(executor, graphs) if device.type == "cuda" and host is None else None
    files = artifact.tokenizer_files()
    # A model compiled without tokenizer files still runs on token ids.
    tokenizer = Tokenizer.from_files(files) if "tokenizer.json" in files else None
    template = artifact.chat_template
    chat = ChatTemplate(template, tokenizer.special_tokens_map if tokenizer else {}) if template else None
    model = ThinModel(artifact, executor, tokenizer, chat, device, engine)
    if ffn_keep is not None:
        model.set_ffn_keep(ffn_keep, uncertified=uncertified)
    return model


def _engine(executor, graphs: bool):
    """The decode engine for `executor`, launch configurations chosen; None when Triton is missing
    or the engine does not take the model (the executor then generates)."""
    from .kernels import triton_available

    if not triton_available():
        return None
    from .engine import DecodeEngine
    from .engine_plans import EngineUnsupported

    try:
        engine = DecodeEngine(executor, graphs=graphs)
    except EngineUnsupported:
        return None
    engine.warm_up()
    return engine
