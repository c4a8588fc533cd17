"""Programmatic dependent launch (sm_90): a decode kernel launched as a dependent of the one before it in
the stream may start while that one is still running, so its programs are resident and past their first
loads of what the kernel before does not write (weights; the decode attention's cached keys and values)
when that kernel's results land.

A launcher asks `kernel_args()` what to add to its launch: the kernel takes the level as its `PDL`
constexpr and calls `wait_previous(PDL)` before its first read of anything the kernel before it writes
(activations, residual, partial sums, counters, the qkv row) and before its first store, then
`release_next(PDL)`, which lets the next kernel's programs be placed once every program of this one has
said so or exited. Before the wait a dependent may read only what no kernel of the step writes (weights,
norm weights) or what was written two kernels or more before it (the position, the cache's past keys and
values): the kernel before it released its dependents only after its own wait, so the one before that had
finished. Levels:

    0  a plain launch, the plain code;
    1  a dependent's code without the grid-dependency instructions (Triton's interpreter has none), so
       the CPU tests run every reordered load of level 2;
    2  a programmatic dependent (CUDA, launched with `launch_pdl`): loads ahead of the wait, waits, releases;
    3  a plain launch that releases its dependents at once (the kernel before a level-2 one), the plain code.

Launches of kernels that do not take part (torch's, the sampler's, other families') keep full stream
order. The engine turns it on around its decode step (`launching`: every taking-part launch a dependent, or
only those in some of the step's sections, `section`). Its default on sm_90 is the attention's alone
(ATTENTION): the split kernel loads its first tile of cached keys and values while the qkv matvec runs,
which gained llama-8b's fp8 and int4 steps 1.1% and 1.0% on the H200 in fresh processes; every launch a
dependent measured no better than that in one process, and timing the ways at warm-up cost the step it
chose about as much as it gained (BENCHMARKS.md, Round 11).
"""

from __future__ import annotations

import contextlib
import contextvars

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import interpreting

_ON = contextvars.ContextVar("thin_dependent_launch", default=False)
_SECTION = contextvars.ContextVar("thin_dependent_section", default=None)

# The decode step's sections (the engine's profiler names) of its attention kernels.
ATTENTION = frozenset({"attention + qk norm + rope + append", "attention"})


@contextlib.contextmanager
def launching(on):
    """Launch the taking-part kernels inside the block as programmatic dependents (`on` True), plainly
    (False), or only those inside the named sections (`on` a frozenset of `section` names; the others
    release their dependents at once, level 3)."""
    token = _ON.set(on if isinstance(on, frozenset) else bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


@contextlib.contextmanager
def section(name: str):
    """Name the launches inside the block (for `launching` with a set of names)."""
    token = _SECTION.set(name)
    try:
        yield
    finally:
        _SECTION.reset(token)


def level() -> int:
    """The PDL constexpr for a launch made now (see the module docstring)."""
    on = _ON.get()
    if not on:
        return 0
    if interpreting():
        return 1
    return 2 if on is True or _SECTION.get() in on else 3


def kernel_args() -> dict:
    """The keywords a taking-part kernel's launch adds now: none plainly, else its PDL constexpr and,
    for a dependent on the GPU, the launch attribute."""
    pdl = level()
    return {} if not pdl else {"PDL": 2, "launch_pdl": True} if pdl == 2 else {"PDL": pdl}


def preloads(args: dict) -> bool:
    """Whether a launch with `kernel_args()` runs a dependent's code (loads ahead of its wait)."""
    return args.get("PDL", 0) in (1, 2)


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished and its writes are visible."""
    if PDL == 2:
        gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel's programs start (once every program of this launch has said so or exited)."""
    if PDL >= 2:
        gdc_launch_dependents()


__all__ = ["ATTENTION", "kernel_args", "launching", "level", "preloads", "release_next", "section", "triton",
           "wait_previous"]
