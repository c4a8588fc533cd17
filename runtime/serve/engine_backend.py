"""The CUDA decode engine as the scheduler's BatchBackend: every sequence in the batch decodes in
one step (runtime/batch_engine.py), over one paged KV pool the batch shares.

The pool is sized when the server starts: room for `max_batch` sequences of min(context, 4096)
tokens each, cut to what fits in 80% of the device memory left after the weights. A sequence takes
its blocks (prompt plus max_tokens) when it joins; when too few are free it waits in the queue
(NoRoom) until another leaves, and one that would not fit even in an empty pool fails at once.
"""

from __future__ import annotations

import logging

import torch

from thin.runtime.batch_engine import BatchEngine, NoCapacity

from .scheduler import NoRoom, SequenceSpec, TooLarge

log = logging.getLogger("thin.serve")

DEFAULT_TOKENS_PER_SEQUENCE = 4096
MEMORY_SHARE = 0.8


def pool_tokens(engine, max_batch: int) -> int:
    """Positions of the shared KV pool for `max_batch` sequences on `engine`'s device."""
    want = max_batch * min(engine.max_positions, DEFAULT_TOKENS_PER_SEQUENCE)
    if engine.device.type != "cuda":
        return want
    free, _ = torch.cuda.mem_get_info(engine.device)
    return max(1, min(want, int(MEMORY_SHARE * free) // engine.cache_bytes(1)))


class EngineBackend:
    """BatchBackend over a BatchEngine: sequence ids <-> the engine's slots."""

    def __init__(self, engine, max_batch: int, kv_tokens: int | None = None):
        tokens = kv_tokens if kv_tokens is not None else pool_tokens(engine, max_batch)
        self.batch = BatchEngine(engine, max_batch, tokens)
        self._ids: list[int] = []  # sequence id of each slot
        log.info("batched decode on %s: %d sequences at most, a KV pool of %d tokens (%d per sequence at most)",
                 engine.device, max_batch, tokens, self.batch.max_seq_len)

    def add(self, spec: SequenceSpec) -> int:
        need = len(spec.prompt) + spec.options.max_new_tokens
        if not self.batch.fits(need):
            raise TooLarge(f"this request needs {need} tokens of KV cache (prompt and max_tokens); the server holds "
                           f"{self.batch.max_seq_len} per request: lower max_tokens")
        try:
            _, token = self.batch.add(spec.prompt, spec.options, frequency=spec.frequency_penalty,
                                      presence=spec.presence_penalty)
        except NoCapacity as e:
            raise NoRoom(str(e)) from None
        self._ids.append(spec.id)
        return token

    def step(self) -> dict[int, int]:
        return dict(zip(self._ids, self.batch.step(), strict=True))

    def remove(self, seq_id: int) -> None:
        if seq_id not in self._ids:
            return
        slot = self._ids.index(seq_id)
        moved = self.batch.remove(slot)
        last = self._ids.pop()
        if moved is not None:
            self._ids[slot] = last


def default_backend(model, max_batch: int):
    """The batch backend `thin-exec serve` runs `model` with: the CUDA engine's when it took the
    model, else the torch executor's."""
    from thin.runtime.engine_plans import EngineUnsupported

    from .scheduler import TorchBackend

    if model.engine is not None:
        try:
            return EngineBackend(model.engine, max_batch)
        except EngineUnsupported as e:
            log.warning("%s; decoding through the torch executor, one sequence after another", e)
    return TorchBackend(model.executor)
