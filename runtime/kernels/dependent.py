"""Programmatic dependent launch (sm_90): a decode kernel launched as a dependent of the one before it in
the stream may start while that one is still running, so its programs are resident, past their prologue
and (fp8/int8 matvecs) asking L2 for their weights when the previous kernel's results land.

A launcher asks `level()` what to compile and `launch_args()` what to add to the launch; the kernel takes
the level as its `PDL` constexpr and calls `wait_previous(PDL)` before its first read of anything an
earlier kernel of the step writes (activations, residual, partial sums, counters, the KV cache, the
position) and before its first store, then `release_next(PDL)`, which lets the next kernel's programs be
placed once every program of this one has said so or exited. Only reads of what nothing in the step
writes (weights, norm weights) may come before the wait. Levels: 0 a plain launch; 1 the same code
without the grid-dependency instructions (Triton's interpreter has none); 2 the real thing (CUDA,
launched with `launch_pdl`).

Launches of kernels that do not take part (torch's, the sampler's, other families') keep full stream
order: a dependent launched after one of them starts when it ends, and one launched after a dependent
waits for all of it. So the engine can turn it on around its decode step (`launching`) and leave every
other launch plain. Whether it pays is the device's to say: the engine times its step both ways at
warm-up (engine_launch.choose_dependent) - on the H200 it gained bf16 and fp8 steps 1-2% and cost int4
steps 2-4% when it was last measured (BENCHMARKS.md, rounds 2 and 6), the waiting programs taking room
the next matvec wants.
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
    token = _ON.set(bool(on))
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


def kernel_args() -> dict:
    """The keywords a taking-part kernel's launch adds now: none plainly, else its PDL constexpr and
    the launch attribute."""
    pdl = level()
    return dict(PDL=pdl, **launch_args(pdl)) if pdl else {}


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


__all__ = ["kernel_args", "launch_args", "launching", "level", "release_next", "triton", "wait_previous"]
