"""How the decode engine launches its step: plainly, or with the step's kernels as programmatic dependents
(kernels/dependent.py), chosen by timing the step both ways on this device at warm-up."""

from __future__ import annotations

import logging
import statistics

import torch

from .sampling import GenerationOptions


def choose_dependent(engine, *, positions: int = 512, replays: int = 16, rounds: int = 5) -> bool:
    """Whether `engine`'s decode step runs faster with its kernels launched as programmatic dependents: the
    step captured in a CUDA graph both ways, over a scratch cache of `positions` (every block reserved, the
    step attending to the first half), timed as the median of `rounds` timings of `replays` replays each,
    the two ways taking turns (the engine's own state - position, step, token - put back before each
    timing). Greedy, so the step draws nothing. Logs both times on "thin.runtime"."""
    cache = engine.new_cache(positions)
    cache.reserve(positions)
    sampler = engine.sampler(GenerationOptions(max_new_tokens=1, stop_token_ids=()))
    start = positions // 2
    saved = engine._dependent
    graphs = {}
    try:
        for on in (False, True):
            engine._dependent = on
            _reset(engine, start)
            engine.decode_one_token(cache, sampler)  # compiles what this way launches
            torch.cuda.synchronize(engine.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                engine.decode_one_token(cache, sampler)
            graphs[on] = graph
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for on, graph in graphs.items():
                _reset(engine, start)
                graph.replay()  # once untimed: the same start for both ways
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                end.synchronize()
                times[on].append(begin.elapsed_time(end) / replays)
    finally:
        engine._dependent = saved
        _reset(engine, 0)
        del graphs
    plain, dependent = statistics.median(times[False]), statistics.median(times[True])
    faster = dependent < plain
    logging.getLogger("thin.runtime").info(
        f"decode step {plain:.3f} ms with plain launches, {dependent:.3f} ms as programmatic dependents: "
        f"{'dependents' if faster else 'plain'} kept")
    return faster


def _reset(engine, position: int) -> None:
    """The step's device state at `position`, first step, token 0."""
    engine.pos.fill_(position)
    engine.step.zero_()
    engine.token.zero_()


__all__ = ["choose_dependent"]
