"""The launch tuner: which of its candidate configurations (KernelLinear.candidates) each weight's matvec
runs with, chosen once per kind of weight by timing the candidates on the device, in turn over the weights
the decode step reads one after another, and kept in a cache of choices on disk (`TuneCache`); with the
host threads that compile the candidates first (`precompile`) and the GPU timer every tuner of the runtime
uses (`median_ms`: the prefill tilings, the finishing norms, the attention, the batch schemes).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from thin.artifacts import replace_with_bytes

from ..errors import InputError
from . import interpreting
from .common import ACTIVATION_CODES, KernelLinear, MatvecConfig, config_key, proper_prefix

# torch.cuda._sleep spins for a number of GPU clock cycles; 2e9 a second is a current data-centre GPU's
# boost clock (H200: 1.98 GHz). A slower clock only makes the hold longer, which is harmless.
SLEEP_CYCLES_PER_SECOND = 2e9


def _tuned_mode(mode: str, rows: int | None, cols: int | None, in_turn: bool = False) -> str:
    """The mode as the cache of choices names it: a prefix's rows and columns added, and " in turn" for a
    choice timed over several weights in turn (`choose`'s peers: from memory, not L2)."""
    return (mode + (f" rows {rows}" if rows is not None else "") + (f" cols {cols}" if cols is not None else "")
            + (IN_TURN if in_turn else ""))


IN_TURN = " in turn"


def choose(op: KernelLinear, mode: str, rows: int | None = None, cols: int | None = None,
           peers: Sequence[KernelLinear] = ()) -> MatvecConfig:
    """The configuration `op` runs with in `mode` (over the prefix `rows`, `cols` when given, see
    KernelLinear.matvec): the first candidate under the interpreter (nothing to time) or for an op
    not to be tuned (`LinearOp.tune`), else the cached choice for this device, shape and prefix,
    else the fastest candidate timed on the real weight (then cached). A candidate that does not
    compile on this GPU is skipped (`median_ms_or_inf`). `peers`: other weights of op's kind (format,
    shape) that the decode step also runs: each timed launch goes to the next of op and its peers in
    turn, so that the weights come from memory as in the step. One weight launched again and again
    stays in the 50 MB L2 when it is smaller (llama-8b's o, qkv and down, and every elastic FFN
    prefix of down), and its timing then favours the tiles that are fastest out of L2."""
    candidates = op.candidates(mode, rows, cols)
    if untuned(op, candidates):
        return candidates[0]
    key = cache_key(op, _tuned_mode(mode, rows, cols, bool(peers)), candidates)
    cache = TuneCache.get()
    hit = cache.lookup(key)
    if hit is not None and hit in candidates:
        return hit
    ops = [op, *peers] if peers else None
    times = {config: _time(op, config, mode, rows, cols, **({"ops": ops} if ops else {})) for config in candidates}
    best = min(candidates, key=times.get)
    if times[best] < float("inf"):  # none compiling: the first runs (and fails) as untuned, nothing cached
        cache.store(key, best)
        logging.getLogger("thin.runtime").info(
            f"{op.format} {op.out_features}x{op.in_features} {_tuned_mode(mode, rows, cols)}: {best} "
            f"{1e3 * times[best]:.1f} us, the fastest of {len(candidates)} candidates timed "
            + (f"over {len(peers) + 1} weights in turn" if peers else "on the one weight"))
    return best


def weight_kinds(uses) -> dict[tuple, tuple[str, int | None, int | None, list[KernelLinear]]]:
    """The (op, mode) or (op, mode, rows, cols) `uses` whose configuration is not chosen yet, by kind of
    weight: {kind: (mode, rows, cols, ops)}, one kind per type, format and parameters, shape, dtype,
    device, mode and prefix (weights of one kind take the same configuration)."""
    kinds: dict[tuple, tuple] = {}
    for op, mode, *prefix in uses:
        rows, cols = proper_prefix(op, mode, *(prefix or (None, None)))
        if config_key(mode, rows, cols) in op._configs:
            continue
        kind = (type(op), getattr(op, "format", None), repr(sorted(getattr(op, "p", {}).items())), op.out_features,
                op.in_features, getattr(op, "dtype", None), str(op.device), mode, rows, cols)
        ops = kinds.setdefault(kind, (mode, rows, cols, []))[3]
        if all(o is not op for o in ops):
            ops.append(op)
    return kinds


def choose_together(uses) -> None:
    """Choose the configuration of every use (as precompile takes them) not chosen yet: each kind of
    weight (`weight_kinds`) once, timed over all its weights in turn (`choose`'s peers), and every weight
    of the kind given that choice, as the decode step runs them one after another."""
    for mode, rows, cols, ops in weight_kinds(uses).values():
        config = choose(ops[0], mode, rows, cols, peers=ops[1:])
        for op in ops:
            op._configs[config_key(mode, rows, cols)] = config


def small_weight(op: KernelLinear) -> bool:
    """Weights under 4 MiB take microseconds whatever the tiles: not worth compiling candidates for."""
    return op.in_features * op.out_features < 4 * 2**20 // 2


def untuned(op: KernelLinear, candidates: Sequence) -> bool:
    """Whether `op` takes its first candidate untimed (this tuner's `choose`, the prefill tuner's
    prefill.choose_matmul): under the interpreter, off a CUDA device, for an op not to be tuned
    (`LinearOp.tune`), a small weight, or a single candidate."""
    return interpreting() or not op.tune or len(candidates) == 1 or op.device.type != "cuda" or small_weight(op)


def _launcher(op: KernelLinear, config: MatvecConfig, mode: str, rows: int | None = None, cols: int | None = None,
              ops: Sequence[KernelLinear] = ()):
    """One matvec of `op` with `config` in `mode` (over the prefix `rows`, `cols`), on random input,
    as a callable; with `ops` (op's kind), each call launches on the next of them in turn."""
    n, k = op.matvec_shape(mode, rows, cols)
    x = torch.randn(k, device=op.device).to(op.dtype)
    if mode == "partial":
        out = torch.empty(config.split, op.out_features if rows is None else rows, dtype=torch.float32,
                          device=x.device)
    else:
        out = torch.empty(n, dtype=op.dtype, device=x.device)
    act = ACTIVATION_CODES["silu"] if mode == "glu" else -1
    return in_turn(list(ops) or [op], lambda o: o._matvec(x, out, config, act, mode == "partial", rows, cols))


def in_turn(items, run):
    """A launch to time: each call runs `run` on the next of `items`, cycling, so that consecutive launches
    read different weights (or caches) from memory, as the decode step does, not the one weight from L2."""
    cycle = itertools.cycle(items)
    return lambda: run(next(cycle))


def _time(op: KernelLinear, config: MatvecConfig, mode: str, rows: int | None = None,
          cols: int | None = None, ops: Sequence[KernelLinear] = ()) -> float:
    """Median milliseconds of one launch with `config` (compile excluded; infinity where it does not
    compile, `median_ms_or_inf`); over `ops` in turn when given (`_launcher`)."""
    launch = _launcher(op, config, mode, rows, cols, **({"ops": ops} if ops else {}))
    return median_ms_or_inf(launch, what=f"{op.format} {mode} {config}")


def compile_threads() -> int:
    """Host threads `precompile` uses: THIN_COMPILE_THREADS, else the cores up to 16 (1: the
    loading thread compiles each candidate itself, as choosing would)."""
    value = os.environ.get("THIN_COMPILE_THREADS", "")
    if not value:
        return min(16, os.cpu_count() or 1)
    if not value.isdigit() or int(value) < 1:
        raise InputError(f"THIN_COMPILE_THREADS must be a positive whole number, got {value!r}: unset it "
                         "or give the host threads that compile kernels on a model's first load")
    return int(value)


def precompile(uses, workers: int | None = None) -> int:
    """Compile, on `workers` host threads (default `compile_threads()`), every launch candidate
    `choose` would time for these (op, mode) or (op, mode, rows, cols) uses (the last two: an elastic
    prefix, see KernelLinear.matvec), so that choosing then only times them. One op per distinct
    weight shape, format, mode and prefix (the kernels they compile are the same), and none whose
    choice is cached or that `choose` would not time. Returns the candidates launched.

    Compiling dominates the first load of a model on a GPU: about a second a candidate (the 9 of
    int6 g64 at 4096x4096 took 10.2 s compiled for sm_90 on this project's 2-core CPU machine),
    several candidates per format, shape and mode, and a planned artifact mixes formats (the
    llama-8b --vram 8G plan has nine). Triton's compiler spends much of it outside the interpreter
    lock (ptxas runs as a subprocess), so threads overlap it: the same 9 took 6.6 s on two threads.
    Each candidate is launched once on random input, which is what compiles it; a candidate that
    fails here is left to `choose`, which times it as before (and skips it when it cannot compile)."""
    if interpreting():
        return 0
    cache, jobs, seen = TuneCache.get(), [], set()
    for mode, rows, cols, ops in weight_kinds(uses).values():
        op = ops[0]
        if not op.tune or op.device.type != "cuda" or small_weight(op):
            continue
        candidates = op.candidates(mode, rows, cols)
        key = cache_key(op, _tuned_mode(mode, rows, cols, len(ops) > 1), candidates)  # as choose looks it up
        if len(candidates) == 1 or key in seen or cache.lookup(key) in candidates:
            continue
        seen.add(key)
        jobs += [(op.device, _launcher(op, config, mode, rows, cols)) for config in candidates]
    compile_launches(jobs, workers)
    return len(jobs)


def compile_launches(jobs, workers: int | None = None, *, report: bool = True) -> None:
    """Run each (device, launch) of `jobs` once, on `workers` host threads (default
    `compile_threads()`), for what the first call of a Triton launch does: compile it (see
    `precompile`). A launch that fails is skipped: the caller's own timing of it meets the
    same failure and handles it. `report`: say so on the "thin.runtime" log (thin-exec prints it)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(job):
        device, launch = job
        try:
            with torch.cuda.device(device):
                launch()
        except Exception:  # noqa: BLE001  (the timing that follows meets the same failure and handles it)
            pass

    if not jobs:
        return
    workers = workers or compile_threads()
    note = logging.getLogger("thin.runtime").info if report else lambda message: None
    note(f"compiling {len(jobs)} kernel launch candidates for this GPU on {workers} thread(s) (the first "
         "load of these formats and shapes; Triton caches them)")
    started = time.perf_counter()
    if workers == 1:
        for job in jobs:
            run(job)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, jobs))
    for device in {device for device, _ in jobs}:
        torch.cuda.synchronize(device)
    note(f"compiled in {time.perf_counter() - started:.1f} s; timing them")


def median_ms_or_inf(launch, what: str = "", **timing) -> float:
    """median_ms, or infinity for a launch that does not compile on this GPU (a tiling past its
    registers or shared memory, or one this Triton's passes reject): a tuner then takes another
    candidate, and the "thin.runtime" log (thin-exec prints it) says which (`what`) and why, in one
    line. Triton's own errors (CompilationError, OutOfResources, PTXASError) and the RuntimeErrors of
    its MLIR passes count as not compiling; a CUDA error (a fault of the device, not of the tiling) is
    raised, as is any other exception."""
    try:
        return median_ms(launch, **timing)
    except Exception as e:
        # Triton's errors by their module (their classes moved between versions); RuntimeError but CUDA's.
        if type(e).__module__.split(".")[0] != "triton" and not (isinstance(e, RuntimeError) and "CUDA" not in str(e)):
            raise
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        logging.getLogger("thin.runtime").info(
            f"skipped a kernel launch candidate that does not compile on this GPU{' (' + what + ')' if what else ''}: "
            f"{type(e).__name__}: {lines[-1][:200] if lines else ''}")
        return float("inf")


def median_ms(launch, repeats: int = 7, inner: int = 5, device=None) -> float:
    """Median milliseconds of one call of `launch` on the current CUDA stream: one call first (it
    compiles), then `repeats` timings of `inner` calls back to back.

    The GPU time, not the host's: a Triton launch costs the host tens of microseconds, more than
    many of these kernels take, so timed as they are issued every candidate would measure the same
    launch overhead (the H200 showed a ~50 us floor for the batch kernels: 8 MB matrices at 16 rows
    all timed 52-57 us, and candidates with a second launch twice that). The stream is first held
    by a device-side sleep longer than issuing the `inner` calls takes, so they queue up and run
    back to back, as they do inside the decode step's CUDA graph."""
    launch()
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    launch()
    issue = time.perf_counter() - started  # host seconds to issue one call (an upper bound)
    torch.cuda.synchronize(device)
    hold = int(min(2 * (inner + 1) * issue, 0.05) * SLEEP_CYCLES_PER_SECOND)
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(hold)
        start.record()
        for _ in range(inner):
            launch()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / inner)
    return sorted(times)[len(times) // 2]


def cache_key(op: KernelLinear, mode: str, candidates: Sequence = ()) -> str:
    """The cache of choices' key: the weight's kind, the mode, the device, Triton's version and a digest of
    the candidates timed, so that a choice made among other candidates (an older thin) is timed again."""
    import hashlib

    import triton

    params = ",".join(f"{k}={v}" for k, v in sorted(op.p.items()))
    device = torch.cuda.get_device_name(op.device)
    timed = hashlib.sha1(repr(list(candidates)).encode()).hexdigest()[:12]
    return (f"{type(op).__name__}|{op.format}|{params}|{op.out_features}x{op.in_features}|"
            f"{str(op.dtype).removeprefix('torch.')}|{mode}|{device}|triton {triton.__version__}|of {timed}")


class TuneCache:
    """Chosen configurations by key, in ~/.cache/thin/kernel-configs.json (THIN_CACHE_DIR overrides
    the folder). A missing or unreadable file is an empty cache; writes are atomic."""

    _instance: TuneCache | None = None

    def __init__(self, path: Path):
        self.path = path
        try:
            self.entries = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    @classmethod
    def get(cls) -> TuneCache:
        if cls._instance is None:
            folder = Path(os.environ.get("THIN_CACHE_DIR") or Path.home() / ".cache" / "thin")
            cls._instance = cls(folder / "kernel-configs.json")
        return cls._instance

    def lookup(self, key: str, kind: type = MatvecConfig):
        """The `kind` (a configuration dataclass) stored under `key`, or None."""
        entry = self.entries.get(key)
        try:
            return kind(**entry) if entry else None
        except TypeError:
            return None

    def store(self, key: str, config: MatvecConfig) -> None:
        self.entries[key] = asdict(config)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_with_bytes(self.path, json.dumps(self.entries, indent=1, sort_keys=True).encode())
        except OSError:
            pass  # a read-only home still runs, it only tunes again next time
