"""Continuous batching: requests join the decoding batch and leave it between steps.

One thread owns the model. Each turn of its loop it admits waiting requests while the batch has
room (prefilling each), drops the ones whose clients went away, and runs one decode step for
every sequence still active; each new token goes through the request's TextStream and out to its
client as an event. A request leaves the batch at its stop token, stop string or max_tokens, or
when cancelled, and its place is free for the next step.

The model is reached only through a BatchBackend (add / step / remove), so the CUDA engine can
take the place of the torch one below without the scheduler changing.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from thin.runtime.generate import decode_one_token, prefill
from thin.runtime.sampling import GenerationOptions, apply_repetition_penalty, make_generator, sample_next

from .errors import ApiError
from .text import TextStream

log = logging.getLogger("thin.serve")


@dataclass(frozen=True)
class SequenceSpec:
    """What a backend needs to run one sequence."""

    id: int
    prompt: list[int]
    options: GenerationOptions  # sampling, seed, max_new_tokens (the KV cache it needs)
    frequency_penalty: float = 0.0  # OpenAI's: logit -= penalty * times generated so far
    presence_penalty: float = 0.0  # OpenAI's: logit -= penalty once a token has been generated


class BatchBackend(Protocol):
    """A model that decodes several sequences together.

    add(spec) -> int          prefill spec.prompt into a KV cache of its own (room for the prompt
                              plus spec.options.max_new_tokens) and return the first new token,
                              chosen with spec.options and a generator seeded from spec.options.seed
    step() -> {id: token}     one decode step for every added sequence: feed each its last token,
                              return the next one; all sequences in one batched step where the
                              backend can, with the same tokens as each would get alone
    remove(id)                forget the sequence and free its cache; also mid-generation

    The scheduler calls these from one thread, never at once, and decides every stop itself.
    A backend must give each sequence exactly the tokens its own single-sequence generate gives
    it alone (greedy: the same argmax; sampled: the same draws from the same seed), whatever else
    is in the batch. `add` raises NoRoom when the sequence does not fit now (a paged KV pool
    shared by the batch is full): the request then waits until another sequence has left; and
    TooLarge when it would not fit even alone: the request fails with its message.
    """

    def add(self, spec: SequenceSpec) -> int: ...

    def step(self) -> dict[int, int]: ...

    def remove(self, seq_id: int) -> None: ...


class NoRoom(Exception):
    """BatchBackend.add: no room for this sequence until another one leaves (KV blocks, say)."""


class TooLarge(Exception):
    """BatchBackend.add: this sequence never fits, even alone; the message says why (to the client)."""


class _Sampler:
    """One sequence's token choice, as generate() makes it, plus OpenAI's additive penalties."""

    def __init__(self, spec: SequenceSpec, device: torch.device):
        o = spec.options
        self.options, self.generator = o, make_generator(o.seed, device)
        self.frequency, self.presence = spec.frequency_penalty, spec.presence_penalty
        # Every token so far, for the repetition penalty (transformers counts the prompt too).
        self.history = torch.empty(len(spec.prompt) + o.max_new_tokens, dtype=torch.long, device=device)
        self.history[:len(spec.prompt)] = torch.tensor(spec.prompt, dtype=torch.long)
        self.length = len(spec.prompt)
        self.counts = None  # generated tokens by id, for the frequency and presence penalties

    def pick(self, logits: torch.Tensor) -> int:
        o = self.options
        penalised = self.history[:self.length] if o.repetition_penalty != 1.0 else None
        if self.frequency or self.presence:
            # vLLM's order: repetition first, then frequency and presence, then the filters.
            logits = logits.float()
            if penalised is not None:
                logits = apply_repetition_penalty(logits, penalised, o.repetition_penalty)
            if self.counts is None:
                self.counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
            logits = logits - self.frequency * self.counts - self.presence * (self.counts > 0).float()
            penalised = None
        token = sample_next(logits, o, penalised, self.generator)
        self.history[self.length] = token
        self.length += 1
        if self.frequency or self.presence:
            self.counts[token] += 1
        return token


@dataclass
class _TorchSequence:
    cache: object
    sampler: _Sampler
    last: int


class TorchBackend:
    """The torch executor as a batch: each sequence keeps its own KV cache and is stepped with
    decode_one_token in turn. The calls per sequence are exactly generate()'s, so every sequence
    gets the tokens it would get alone; a batch of one costs what `thin-exec` costs."""

    def __init__(self, executor):
        self.executor = executor
        self.device = torch.device(getattr(executor, "device", "cpu"))
        self._sequences: dict[int, _TorchSequence] = {}

    @torch.inference_mode()
    def add(self, spec: SequenceSpec) -> int:
        sampler = _Sampler(spec, self.device)
        cache = self.executor.new_cache(len(spec.prompt) + spec.options.max_new_tokens)
        token = sampler.pick(prefill(self.executor, cache, sampler.history[:len(spec.prompt)].clone()))
        self._sequences[spec.id] = _TorchSequence(cache, sampler, token)
        return token

    @torch.inference_mode()
    def step(self) -> dict[int, int]:
        tokens = {}
        for seq_id, seq in self._sequences.items():
            last = torch.tensor([seq.last], dtype=torch.long, device=self.device)
            seq.last = tokens[seq_id] = seq.sampler.pick(decode_one_token(self.executor, seq.cache, last))
        return tokens

    def remove(self, seq_id: int) -> None:
        self._sequences.pop(seq_id, None)


# Events a request's sink receives, in order: Delta*, then one Done or Failed.
@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" (stop token or string) or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str


_ids = itertools.count(1)


@dataclass(eq=False)
class Job:
    """One request in the scheduler. `sink(event)` is called from the scheduler thread."""

    prompt: list[int]
    options: GenerationOptions
    tokenizer: object
    sink: Callable[[object], None]
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    name: str = ""  # for the log: the response id
    id: int = field(default_factory=lambda: next(_ids))
    completion_tokens: int = 0
    cancelled: bool = False

    def __post_init__(self):
        self.text = TextStream(self.tokenizer, self.stop)
        self.stop_ids = frozenset(self.options.stop_token_ids)
        self.name = self.name or f"request {self.id}"

    @property
    def spec(self) -> SequenceSpec:
        return SequenceSpec(self.id, self.prompt, self.options, self.frequency_penalty, self.presence_penalty)

    def emit(self, event) -> None:
        try:
            self.sink(event)
        except Exception:  # noqa: BLE001 -- a closed event loop at shutdown; the client is gone
            log.debug("%s: event not delivered", self.name, exc_info=True)


class Scheduler:
    """Runs a BatchBackend on a thread of its own: at most `max_batch` sequences decode together,
    at most `max_queue` more wait; `submit` refuses beyond that (ApiError 429)."""

    def __init__(self, backend: BatchBackend, max_batch: int, max_queue: int):
        self.backend, self.max_batch, self.max_queue = backend, max_batch, max_queue
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: dict[int, Job] = {}  # touched by the scheduler thread only
        # Jobs taken off the queue whose prefill is under way: in neither list, yet they hold a place
        # (submit counts them, so a request can't slip into the room they seem to leave).
        self._admitting = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="thin-serve-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop after the current step; every unfinished request gets Failed."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def load(self) -> dict:
        return {"active": len(self._active), "waiting": len(self._waiting)}

    def submit(self, job: Job) -> None:
        with self._cv:
            if not self.running:
                raise ApiError(503, "the server is shutting down", code="unavailable")
            if len(self._waiting) + self._admitting + len(self._active) >= self.max_batch + self.max_queue:
                raise ApiError(429, f"the server is busy: {self.max_batch} requests decoding and "
                                    f"{len(self._waiting)} waiting; retry later", code="server_busy")
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the request now if it waits, else before the next step."""
        job.cancelled = True
        with self._cv:
            if job in self._waiting:
                self._waiting.remove(job)
                log.info("%s: cancelled while waiting (client gone)", job.name)
            self._cv.notify()

    def _run(self) -> None:
        while self._turn():
            pass
        self._fail_all("the server is shutting down")

    def _turn(self) -> bool:
        """Admit, drop the cancelled, step once; False when closed. The thread never dies of an error:
        the requests it was serving fail instead."""
        with self._cv:
            while not self._closed and not self._waiting and not self._active:
                self._cv.wait()
            if self._closed:
                return False
            admitted = []
            while self._waiting and len(self._active) + len(admitted) < self.max_batch:
                admitted.append(self._waiting.popleft())
            self._admitting = len(admitted)
        try:
            for i, job in enumerate(admitted):
                if not self._admit(job):  # else in the batch, or finished (refused, failed, cancelled)
                    with self._cv:  # back to the head of the queue, in order, until a sequence leaves
                        self._waiting.extendleft(reversed(admitted[i:]))
                        self._admitting = 0
                    break
            for job in [j for j in self._active.values() if j.cancelled]:
                self._leave(job)
                log.info("%s: cancelled after %d tokens (client gone)", job.name, job.completion_tokens)
            if self._active:
                self._step()
        except Exception:
            with self._cv:
                self._admitting = 0
            log.exception("scheduler error; failing the %d requests in the batch", len(self._active))
            for job in admitted:  # any not yet in the batch (one that already finished ignores this)
                if job.id not in self._active:
                    job.emit(Failed("the server failed on this request; see its log"))
            self._fail_all("the server failed on this request; see its log", waiting=False)
        return True

    def _admit(self, job: Job) -> bool:
        """Prefill `job` into the batch; False when the backend has no room for it yet. The job's
        place moves from `_admitting` to the batch (or is given up) before any event reaches its
        client, who may send the next request as soon as it has the answer."""
        if job.cancelled:
            self._placed()
            return True
        try:
            token = self.backend.add(job.spec)
        except TooLarge as e:
            log.info("%s: refused: %s", job.name, e)
            self._placed()
            job.emit(Failed(str(e)))
            return True
        except NoRoom:
            if self._active:
                return False
            log.warning("%s: does not fit in the backend even alone", job.name)
            self._placed()
            job.emit(Failed("this request needs more KV cache than the server has; lower max_tokens"))
            return True
        except Exception:
            log.exception("%s: prefill failed", job.name)
            self.backend.remove(job.id)
            self._placed()
            job.emit(Failed("the model failed on this request; see the server log"))
            return True
        self._placed(job)
        self._deliver(job, token)
        return True

    def _placed(self, job: Job | None = None) -> None:
        """An admitted job leaves `_admitting`: into the batch when given, else it is finished."""
        with self._cv:
            self._admitting -= 1
            if job is not None:
                self._active[job.id] = job

    def _step(self) -> None:
        try:
            tokens = self.backend.step()
        except Exception:
            log.exception("decode step failed; failing the %d requests in the batch", len(self._active))
            self._fail_all("the model failed during decoding; see the server log", waiting=False)
            return
        for seq_id, token in tokens.items():
            self._deliver(self._active[seq_id], token)

    def _deliver(self, job: Job, token: int) -> None:
        job.completion_tokens += 1
        if token in job.stop_ids:
            return self._finish(job, job.text.finish(), "stop")
        text = job.text.put(token)
        if job.text.stopped:
            return self._finish(job, text, "stop")
        if job.completion_tokens >= job.options.max_new_tokens:
            return self._finish(job, text + job.text.finish(), "length")
        if text:
            job.emit(Delta(text))

    def _finish(self, job: Job, text: str, reason: str) -> None:
        self._leave(job)
        if text:
            job.emit(Delta(text))
        job.emit(Done(reason, len(job.prompt), job.completion_tokens))

    def _leave(self, job: Job) -> None:
        self._active.pop(job.id, None)
        self.backend.remove(job.id)

    def _fail_all(self, message: str, waiting: bool = True) -> None:
        with self._cv:
            jobs = list(self._active.values()) + (list(self._waiting) if waiting else [])
            if waiting:
                self._waiting.clear()
        for job in jobs:
            self._leave(job)
            job.emit(Failed(message))
