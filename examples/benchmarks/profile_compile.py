"""Where a compile's time goes, function by function, on the device it runs on.

    python examples/benchmarks/profile_compile.py /tmp/goss -o /tmp/goss.thin --vram 8G --calib-tokens 4096 \
        --device cuda

The arguments are `thinc compile`'s. The compile runs in this process with a timer around each of the
functions below (the passes' heavy steps, the evaluator's model runs, scratch traffic, the linear
algebra of GPTQ and of the starved-expert estimates); on CUDA each timer synchronises the device at
both ends, so a function's time is its own work, not that of the launches queued before it (the
compile runs a little slower for it; `--no-sync` times without). A function that calls itself (or
another timed function of the same name) is counted once, at its outermost call. Prints the compile's
own summary, then a table: calls, inclusive seconds, seconds per call, the share of the wall time.
"""

from __future__ import annotations

import functools
import importlib
import sys
import time

import torch

# module, qualified name: the functions timed.
TARGETS = [
    ("thin.artifacts.key", "hash_files"),
    ("thin.compiler.evaluate", "Session.__init__"),
    ("thin.compiler.evaluate", "Session.forward"),
    ("thin.compiler.evaluate", "Session.forward_from"),
    ("thin.compiler.evaluate", "Session.layer_inputs"),
    ("thin.compiler.evaluate", "Session.greedy"),
    ("thin.compiler.evaluate", "ExecutorEvaluator.compare"),
    ("thin.ir.program", "Program.load"),
    ("thin.ir.program", "Program.decoded"),
    ("thin.passes.scratch", "Scratch.save"),
    ("thin.passes.scratch", "Scratch.load"),
    ("thin.passes.expert_statistics", "RoutingWeights.__call__"),
    ("thin.passes.expert_statistics", "fill_starved_experts"),
    ("thin.passes.expert_statistics", "_estimate"),
    ("thin.passes.expert_statistics", "_hidden"),
    ("thin.passes.gptq", "inverse_cholesky"),
    ("thin.passes.gptq", "gptq"),
    ("thin.passes.gptq", "gptq_many"),
    ("thin.passes.gptq", "_sweep"),
    ("thin.passes.score_formats", "_gptq_corrections"),
    ("thin.passes.score_formats", "_hessian"),
    ("thin.passes.score_formats", "gptq_gain"),
    ("thin.passes.score_formats", "rounded"),
    ("thin.passes.score_formats", "_probe"),
    ("thin.passes.score_formats", "override_kld"),
    ("thin.passes.quantize_weights", "_quantize_many"),
    ("thin.passes.quantize_weights", "_quantize"),
    ("thin.passes.quantize_weights", "split_rows"),
    ("thin.ir.formats.quantized", "GroupQuantizer.refuse_nonfinite"),
    ("thin.ir.formats.quantized", "GroupQuantizer.fit"),
    ("thin.ir.formats.quantized", "GroupQuantizer.pack"),
    ("torch.linalg", "eigh"),
    ("torch.linalg", "cholesky_ex"),
    ("torch", "cholesky_inverse"),
]


class Timers:
    def __init__(self, sync: bool):
        self.sync = sync and torch.cuda.is_available()
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.active: set[str] = set()

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if label in self.active:
                return fn(*args, **kwargs)
            self.active.add(label)
            if self.sync:
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync:
                    torch.cuda.synchronize()
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1
                self.active.discard(label)

        return timed


def install(timers: Timers) -> None:
    """Replace every target by its timed wrapper, also where a module imported it by name."""
    for module_name, qualified in TARGETS:
        module = importlib.import_module(module_name)
        owner, attr = module, qualified
        if "." in qualified:
            cls, attr = qualified.split(".")
            owner = getattr(module, cls)
        original = getattr(owner, attr)
        wrapped = timers.wrap(f"{module_name.removeprefix('thin.')}.{qualified}", original)
        setattr(owner, attr, wrapped)
        if owner is module:  # `from .gptq import inverse_cholesky` elsewhere holds the original too
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith("thin.") and getattr(other, attr, None) is original:
                    setattr(other, attr, wrapped)


def main() -> None:
    sync = "--no-sync" not in sys.argv
    args = [a for a in sys.argv[1:] if a != "--no-sync"]
    import thin.compiler.build  # noqa: F401  (imports every pass before the wrappers go in)
    import thin.compiler.evaluate  # noqa: F401
    from thin.compiler.cli import main as thinc

    timers = Timers(sync)
    install(timers)
    sys.argv = ["thinc", "compile", *args]
    start = time.perf_counter()
    try:
        thinc()
    except SystemExit as e:
        if e.code:
            raise
    wall = time.perf_counter() - start
    print(f"\nprofile ({'synchronised' if timers.sync else 'unsynchronised'}), wall {wall:.1f}s")
    print(f"{'function':58} {'calls':>8} {'seconds':>9} {'s/call':>9} {'share':>6}")
    for label, seconds in sorted(timers.seconds.items(), key=lambda kv: -kv[1]):
        calls = timers.calls[label]
        print(f"{label:58} {calls:8d} {seconds:9.2f} {seconds / calls:9.4f} {100 * seconds / wall:5.1f}%")


if __name__ == "__main__":
    main()
