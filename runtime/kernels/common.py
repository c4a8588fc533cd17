"""What the linear kernel families share: the LinearOp they serve and the launch configuration
each weight runs with, chosen once per (family, shape) and cached on disk.

A family (one file per format family) subclasses `KernelLinear` and supplies three launchers:
`_matvec` (one row of activations: the decode path), `_matmul` (many rows: prefill) and the
candidate configurations its matvec may run with. The op decides nothing at call time: the
configuration of each mode (plain or gate/up fused) is picked on first use, which the engine
triggers while it loads, by timing the candidates on the real weight (or read from the cache).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from thin.ir import Tensor, formats

from ..errors import InputError
from ..linear import LinearOp
from . import interpreting

# Activation codes shared by every kernel with a gate/up epilogue (see activation.py).
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


# torch.cuda._sleep spins for a number of GPU clock cycles; 2e9 a second is a current data-centre GPU's
# boost clock (H200: 1.98 GHz). A slower clock only makes the hold longer, which is harmless.
SLEEP_CYCLES_PER_SECOND = 2e9


@dataclass(frozen=True)
class MatvecConfig:
    """How a matvec is tiled: `block_n` output rows per program, `chunk` columns per loop step
    (in the family's unit, see its `candidates`), `split` programs along the reduction (split-K,
    whose fp32 partial sums someone adds up), `num_warps` per program; `packed`: products summed
    as bfloat16 pairs within a chunk (grouped int4 under bf16 activations, pairs.py); `ahead` (grouped
    int): 1, each loop step loads the next step's group scales; 2, also the weight words of the step
    after next; (fp8_e4m3) 1 or 2: each loop step loads the weights and activations of the step 1 or
    2 after it, into registers; `stages` (fp8_e4m3, > 1): the loop software-pipelined by Triton
    instead, over that many buffers in shared memory (asynchronous copies, stages - 1 steps ahead)."""

    block_n: int
    chunk: int
    split: int = 1
    num_warps: int = 4
    packed: bool = False
    ahead: int = 0
    stages: int = 0


class KernelLinear(LinearOp):
    """y = x @ W.T (+ bias) by Triton kernels reading W's packed parts in place.

    `parts` are the format's parts as device views of the bytes (Format.split); `self.raw` keeps
    the blob alive and serves `dense_weight`."""

    implementation = "triton"

    def __init__(self, record: Tensor, raw: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(record.shape[1], record.shape[0], record.encoding.format)
        self.device = torch.device(device)
        self.fmt = formats.get(record.encoding.format)
        self.shape, self.params = tuple(record.shape), record.encoding.params
        self.p = dict(self.fmt.normalize(self.params))
        self.raw, self.bias, self.dtype = raw, bias, dtype
        self.parts = self.fmt.split(raw, self.shape, self.params) if not self.fmt.dense else {}
        # Chosen configurations: by mode for the whole weight, by (mode, rows, cols) for a prefix.
        self._configs: dict[str | tuple, MatvecConfig] = {}

    # Whether `_matvec` takes `scale` (an elastic FFN level's per-channel scale, applied in the gate/up
    # epilogue); otherwise `matvec` multiplies the product by it in a launch of its own.
    glu_scale = False

    # ---- what families define ------------------------------------------------------------------

    def candidates(self, mode: str, rows: int | None = None, cols: int | None = None) -> list[MatvecConfig]:
        """Configurations worth timing for this weight in `mode` (first = the untimed default):
        "direct" (the output itself), "partial" (split-K partial sums, for a consumer that adds
        them) or "glu" (act(gate) * up of a [gate; up] weight); for an elastic prefix (`rows`,
        `cols`, see `matvec`) those of a weight of the prefix's shape (`matvec_shape`)."""
        raise NotImplementedError

    def matvec_shape(self, mode: str, rows: int | None = None, cols: int | None = None) -> tuple[int, int]:
        """(output rows, columns) a matvec in `mode` computes: gate/up's output is half its rows; a
        prefix's are its `rows` and `cols`."""
        n = self.out_features // 2 if mode == "glu" else self.out_features
        return (n if rows is None else rows), (self.in_features if cols is None else cols)

    def _matvec(self, x: torch.Tensor, out: torch.Tensor, config: MatvecConfig, act: int, partial: bool,
                rows: int | None = None, cols: int | None = None) -> int | None:
        """Launch the matvec: x [K] -> out, which is [n] in the compute dtype (`act` < 0: plain,
        bias added; else act(gate) * up over the two halves of the rows, n = N / 2) or, when
        `partial`, [split, N] float32 partial sums of x @ W.T without the bias. An elastic FFN
        prefix (LinearOp.prefix): only the first `rows` rows (of each half with `act`; a multiple
        of 128) and the first `cols` columns (x is then [cols]; a multiple of 128), read in place
        (`prefix_rows`, `prefix_split`). Returns the partial sums written when that is fewer than
        the configuration's split (None: all of them)."""
        raise NotImplementedError

    def _matmul(self, x: torch.Tensor, rows: int | None = None, cols: int | None = None,
                halves: int = 1) -> torch.Tensor:
        """x [T, K] -> [T, N] in the compute dtype, bias added; with a prefix (LinearOp.prefix) the
        first `rows` rows of each of `halves` blocks, side by side, and the first `cols` columns."""
        raise NotImplementedError

    # ---- calling ---------------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self.matvec(x2[0]).unsqueeze(0) if x2.shape[0] == 1 else self._matmul(x2.contiguous())
        return y.reshape(*x.shape[:-1], self.out_features)

    def config(self, mode: str = "direct", rows: int | None = None, cols: int | None = None) -> MatvecConfig:
        """The matvec configuration of one mode (see `candidates`), chosen on first use (`choose`); an
        elastic prefix (`rows`, `cols`, see `matvec`) has its own, chosen for its shape, as a weight
        of that shape would be (the whole weight's tiles, splits and steps can fit a prefix badly)."""
        rows, cols = proper_prefix(self, mode, rows, cols)
        key = config_key(mode, rows, cols)
        if key not in self._configs:
            self._configs[key] = choose(self, mode, rows, cols)
        return self._configs[key]

    @property
    def split(self) -> int:
        """Partial sums the matvec writes when asked for partials (split-K programs)."""
        return self.config("partial").split

    # Families whose matvec kernels take a norm.Deferred (the residual norm left to the next projection).
    deferrable = False

    def matvec_deferred(self, x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor, slots: torch.Tensor,
                        norm: tuple, cols: int | None = None):
        """residual += x @ W.T (+ bias) over the first `cols` columns when given, its RMSNorm `norm` ((float32
        weight, eps)) left to the next projection: out = residual * weight, each program's sum of squares
        in `slots`. Runs the "direct" configuration (one split); returns the norm.Deferred the next
        projection's matvec takes as `rstd`."""
        from .norm import Deferred

        if not self.deferrable:
            raise ValueError(f"{self.format} matvecs do not defer the residual norm")
        x = x.reshape(self.in_features if cols is None else cols)
        config = self.config("direct", None, cols)
        defer = Deferred(residual, out, slots, norm, prefix_rows(self, config, -1, None)[1])
        self._matvec(x, out, config, -1, False, cols=cols, defer=defer)
        return defer

    def matvec(self, x: torch.Tensor, *, out: torch.Tensor | None = None, partials: torch.Tensor | None = None,
               activation: str | None = None, rows: int | None = None, cols: int | None = None,
               scale: torch.Tensor | None = None, rstd=None) -> torch.Tensor:
        """x [K] -> [N] (compute dtype, bias added), written into `out` when given.

        With `partials` ([>= split, N] float32), write the split-K partial sums there instead (no
        bias) and return the rows written: whoever consumes them adds them up (the fused residual
        norm does). With `activation`, return act(gate) * up [N / 2] for a fused [gate; up] weight,
        times `scale` (one per output, in the compute dtype) when given. `rows` / `cols` run a prefix
        of the weight in place (an elastic FFN level, see `prefix`) with its own configuration
        (`config`): the first `rows` outputs (of each half with `activation`), the first `cols`
        columns (x is [cols]). A prefix whose split-K exceeds the rows of `partials` runs with
        fewer splits (a buffer sized before that prefix's configuration was chosen). `rstd` (a norm.Deferred,
        deferrable families): x is a row whose norm was deferred; the sums are multiplied by its 1 / rms."""
        x = x.reshape(self.in_features if cols is None else cols)
        extra = {}
        if rstd is not None:
            if not self.deferrable:
                raise ValueError(f"{self.format} matvecs do not take a deferred norm")
            extra = {"rstd": rstd}
        if activation is not None:
            width = self.out_features // 2 if rows is None else rows
            out = out if out is not None else torch.empty(width, dtype=self.dtype, device=x.device)
            code, config = ACTIVATION_CODES[activation], self.config("glu", rows, cols)
            if scale is not None and self.glu_scale:
                self._matvec(x, out, config, code, False, rows, cols, scale=scale, **extra)
                return out
            self._matvec(x, out, config, code, False, rows, cols, **extra)
            return out if scale is None else out.mul_(scale)
        if partials is not None:
            config = self.config("partial", rows, cols)
            if config.split > partials.shape[0]:
                config = replace(config, split=partials.shape[0])
            view = partials[:config.split]
            used = self._matvec(x, view, config, -1, True, rows, cols, **extra)
            return view if used is None else view[:used]
        out = out if out is not None else torch.empty(self.out_features if rows is None else rows, dtype=self.dtype,
                                                      device=x.device)
        self._matvec(x, out, self.config("direct", rows, cols), -1, False, rows, cols, **extra)
        return out

    def prefix(self, x, *, rows=None, cols=None, halves=1):
        # One row of activations and one block of rows: the decode matvec; else the prefill matmul.
        from ..linear import row_blocks

        row_blocks(self.out_features, rows, halves)  # checks the prefix fits
        if cols is not None and not 0 < cols <= self.in_features:
            raise ValueError(f"a prefix of {cols} columns does not fit {self.in_features}")
        x2 = x.reshape(-1, self.in_features if cols is None else cols)
        if x2.shape[0] == 1 and halves == 1:
            y = self.matvec(x2[0], rows=rows, cols=cols).unsqueeze(0)
        else:
            y = self._matmul(x2.contiguous(), rows, cols, halves)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def dense_weight(self) -> torch.Tensor:
        return self.fmt.decode(self.raw, self.shape, self.params, self.dtype)


# ---- choosing configurations ------------------------------------------------------------------------

def proper_prefix(op: KernelLinear, mode: str, rows: int | None, cols: int | None) -> tuple[int | None, int | None]:
    """(rows, cols) of a matvec prefix in `mode` with a whole dimension as None (the weight itself)."""
    n = op.out_features // 2 if mode == "glu" else op.out_features
    return (None if rows == n else rows), (None if cols == op.in_features else cols)


def config_key(mode: str, rows: int | None, cols: int | None) -> str | tuple:
    """Where KernelLinear.config keeps a choice: the mode for the whole weight, else (mode, rows, cols)."""
    return mode if rows is None and cols is None else (mode, rows, cols)


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
    if interpreting() or not op.tune or len(candidates) == 1 or op.device.type != "cuda" or _small(op):
        return candidates[0]
    key = _cache_key(op, _tuned_mode(mode, rows, cols, bool(peers)), candidates)
    cache = _TuneCache.get()
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


def _small(op: KernelLinear) -> bool:
    """Weights under 4 MiB take microseconds whatever the tiles: not worth compiling candidates for."""
    return op.in_features * op.out_features < 4 * 2**20 // 2


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
    cache, jobs, seen = _TuneCache.get(), [], set()
    for mode, rows, cols, ops in weight_kinds(uses).values():
        op = ops[0]
        if not op.tune or op.device.type != "cuda" or _small(op):
            continue
        candidates = op.candidates(mode, rows, cols)
        key = _cache_key(op, _tuned_mode(mode, rows, cols, len(ops) > 1), candidates)  # as choose looks it up
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


def _cache_key(op: KernelLinear, mode: str, candidates: Sequence = ()) -> str:
    """The cache of choices' key: the weight's kind, the mode, the device, Triton's version and a digest of
    the candidates timed, so that a choice made among other candidates (an older thin) is timed again."""
    import hashlib

    import triton

    params = ",".join(f"{k}={v}" for k, v in sorted(op.p.items()))
    device = torch.cuda.get_device_name(op.device)
    timed = hashlib.sha1(repr(list(candidates)).encode()).hexdigest()[:12]
    return (f"{type(op).__name__}|{op.format}|{params}|{op.out_features}x{op.in_features}|"
            f"{str(op.dtype).removeprefix('torch.')}|{mode}|{device}|triton {triton.__version__}|of {timed}")


class _TuneCache:
    """Chosen configurations by key, in ~/.cache/thin/kernel-configs.json (THIN_CACHE_DIR overrides
    the folder). A missing or unreadable file is an empty cache; writes are atomic."""

    _instance: _TuneCache | None = None

    def __init__(self, path: Path):
        self.path = path
        try:
            self.entries = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    @classmethod
    def get(cls) -> _TuneCache:
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
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".kernel-configs.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self.entries, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only home still runs, it only tunes again next time


def prefix_rows(op: KernelLinear, config: MatvecConfig, act: int, rows: int | None) -> tuple[int, int, MatvecConfig]:
    """(the kernel's n, programs along the rows, configuration) of a matvec over the first `rows` rows
    (None: all). Plain: n is the rows. Gate/up (act >= 0): n stays the half, the up rows' offset,
    and only the programs whose tiles hold prefix rows run (the tile rows cut to divide `rows`)."""
    n = op.out_features // 2 if act >= 0 else op.out_features
    if rows is None:
        return n, -(-n // config.block_n), config
    if not 0 < rows <= n:
        raise ValueError(f"a prefix of {rows} rows does not fit {n}")
    if act < 0:
        return rows, -(-rows // config.block_n), config
    block_n = config.block_n
    while rows % block_n:
        block_n //= 2
    config = replace(config, block_n=block_n)
    return n, rows // block_n, config


def prefix_split(config: MatvecConfig, units: int, step: int = 1) -> MatvecConfig:
    """`config` over a reduction of `units` (an elastic prefix of the columns): the largest split-K, at
    most the configuration's, that divides them, so no program reads past the prefix; one down to half
    the configuration's that leaves each program whole loop steps of `step` units (no masks) first."""
    splits = [s for s in range(config.split, 0, -1) if units % s == 0]
    split = next((s for s in splits if 2 * s >= config.split and (units // s) % step == 0), splits[0])
    return config if split == config.split else replace(config, split=split)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def interpreter_block(n: int, cap: int = 1024) -> int:
    """Under the interpreter every program is a Python call: cover the rows in as few as possible."""
    return min(next_power_of_2(n), cap)


# The chunk-scheme matvecs use a little inline PTX on the GPU (tiles.shr16, tiles.opaque); False
# selects their plain-Triton path there too (the interpreter always takes it): the tests run both.
INLINE_ASM = True

MAGIC_BITS = 0x4B000000  # 2^23's float32 bits (tiles.MAGIC), passed as an argument: kept in a register, not
# re-materialised next to every mask


def sm_count() -> int:
    """Multiprocessors of the current CUDA device."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
