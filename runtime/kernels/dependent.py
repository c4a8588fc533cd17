"""Programmatic dependent launch (sm_90): a decode kernel launched as a dependent of the one before it
in the stream may start while that one is still draining, so its programs are resident and their
weight loads in flight when the previous kernel's results land.

A launcher asks `level()` what to compile and `launch_args()` what to add to the launch; the kernel
takes the level as its `PDL` constexpr and calls `wait_previous(PDL)` before its first read of
anything the previous kernel writes (activations, residual, partial sums, counters) and before its
first store, and `release_next(PDL)` once its own programs no longer need the room (the next kernel's
programs are placed only after every program of this one has released or exited). Loads of weights,
which nothing in the step writes, may come before the wait. Levels: 0 a plain launch; 1 the dependent
kernel's code without the grid-dependency instructions (under Triton's interpreter, which has none:
the tests run the reordered loads); 2 the real thing (CUDA, launched with `launch_pdl`).

The decode engine turns it on around its step (`DecodeEngine(pdl=True)`, `launching`); tuning and
every other launch stay plain. Launches of kernels that do not take part (torch's, other formats')
keep full stream order, so a dependent kernel after them simply starts when they end.
"""

from __future__ import annotations

import contextlib
import contextvars

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import interpreting

_ON = contextvars.ContextVar("thin_dependent_launch", default=False)


@contextlib.contextmanager
def launching(on: bool):
    """Launch the taking-part kernels inside the block as programmatic dependents (`on`) or plainly."""
    token = _ON.set(on)
    try:
        yield
    finally:
        _ON.reset(token)


def level() -> int:
    """The PDL constexpr for a launch made now (see the module docstring)."""
    if not _ON.get():
        return 0
    return 1 if interpreting() else 2


def launch_args(pdl: int) -> dict:
    """Launch keywords for a kernel compiled at level `pdl`."""
    return {"launch_pdl": True} if pdl == 2 else {}


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished and its writes are visible."""
    if PDL == 2:
        gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel's programs start (once every program of this launch has said so or exited)."""
    if PDL == 2:
        gdc_launch_dependents()
