"""What the linear kernel families share: the LinearOp they serve and the launch configuration
each weight runs with, chosen once per (family, shape) and cached on disk.

A family (one file per format family) subclasses `KernelLinear` and supplies three launchers:
`_matvec` (one row of activations: the decode path), `_matmul` (many rows: prefill) and the
candidate configurations its matvec may run with. The op decides nothing at call time: the
configuration of each mode (plain or gate/up fused) is picked on first use, which the engine
triggers while it loads, by timing the candidates on the real weight (or read from the cache).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from thin.ir import Tensor, formats

from ..linear import LinearOp
from . import interpreting

# Activation codes shared by every kernel with a gate/up epilogue (see activation.py).
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


@dataclass(frozen=True)
class MatvecConfig:
    """How a matvec is tiled: `block_n` output rows per program, `chunk` columns per loop step
    (in the family's unit, see its `candidates`), `split` programs along the reduction (split-K,
    whose fp32 partial sums someone adds up), `num_warps` per program."""

    block_n: int
    chunk: int
    split: int = 1
    num_warps: int = 4


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
        self._configs: dict[str, MatvecConfig] = {}

    # ---- what families define ------------------------------------------------------------------

    def candidates(self, mode: str) -> list[MatvecConfig]:
        """Configurations worth timing for this weight in `mode` (first = the untimed default):
        "direct" (the output itself), "partial" (split-K partial sums, for a consumer that adds
        them) or "glu" (act(gate) * up of a [gate; up] weight)."""
        raise NotImplementedError

    def _matvec(self, x: torch.Tensor, out: torch.Tensor, config: MatvecConfig, act: int, partial: bool) -> None:
        """Launch the matvec: x [K] -> out, which is [n] in the compute dtype (`act` < 0: plain,
        bias added; else act(gate) * up over the two halves of the rows, n = N / 2) or, when
        `partial`, [split, N] float32 partial sums of x @ W.T without the bias."""
        raise NotImplementedError

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N] in the compute dtype, bias added."""
        raise NotImplementedError

    # ---- calling ---------------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self.matvec(x2[0]).unsqueeze(0) if x2.shape[0] == 1 else self._matmul(x2.contiguous())
        return y.reshape(*x.shape[:-1], self.out_features)

    def config(self, mode: str = "direct") -> MatvecConfig:
        """The matvec configuration of one mode (see `candidates`), chosen on first use (`choose`)."""
        if mode not in self._configs:
            self._configs[mode] = choose(self, mode)
        return self._configs[mode]

    @property
    def split(self) -> int:
        """Partial sums the matvec writes when asked for partials (split-K programs)."""
        return self.config("partial").split

    def matvec(self, x: torch.Tensor, *, out: torch.Tensor | None = None, partials: torch.Tensor | None = None,
               activation: str | None = None) -> torch.Tensor:
        """x [K] -> [N] (compute dtype, bias added), written into `out` when given.

        With `partials` ([>= split, N] float32), write the split-K partial sums there instead (no
        bias) and return the first `split` rows: whoever consumes them adds them up (the fused
        residual norm does). With `activation`, return act(gate) * up [N / 2] for a fused
        [gate; up] weight."""
        x = x.reshape(self.in_features)
        if activation is not None:
            out = out if out is not None else torch.empty(self.out_features // 2, dtype=self.dtype, device=x.device)
            self._matvec(x, out, self.config("glu"), ACTIVATION_CODES[activation], False)
            return out
        if partials is not None:
            config = self.config("partial")
            view = partials[:config.split]
            self._matvec(x, view, config, -1, True)
            return view
        out = out if out is not None else torch.empty(self.out_features, dtype=self.dtype, device=x.device)
        self._matvec(x, out, self.config("direct"), -1, False)
        return out

    def dense_weight(self) -> torch.Tensor:
        return self.fmt.decode(self.raw, self.shape, self.params, self.dtype)


# ---- choosing configurations ------------------------------------------------------------------------

def choose(op: KernelLinear, mode: str) -> MatvecConfig:
    """The configuration `op` runs with in `mode`: the first candidate under the interpreter
    (nothing to time), else the cached choice for this device and shape, else the fastest
    candidate timed on the real weight (then cached)."""
    candidates = op.candidates(mode)
    if interpreting() or len(candidates) == 1 or op.device.type != "cuda" or _small(op):
        return candidates[0]
    key = _cache_key(op, mode)
    cache = _TuneCache.get()
    hit = cache.lookup(key)
    if hit is not None and hit in candidates:
        return hit
    best = min(candidates, key=lambda c: _time(op, c, mode))
    cache.store(key, best)
    return best


def _small(op: KernelLinear) -> bool:
    """Weights under 4 MiB take microseconds whatever the tiles: not worth compiling candidates for."""
    return op.in_features * op.out_features < 4 * 2**20 // 2


def _time(op: KernelLinear, config: MatvecConfig, mode: str) -> float:
    """Median milliseconds of one launch with `config` (compile excluded)."""
    x = torch.randn(op.in_features, device=op.device).to(op.dtype)
    if mode == "glu":
        out = torch.empty(op.out_features // 2, dtype=op.dtype, device=x.device)
    elif mode == "partial":
        out = torch.empty(config.split, op.out_features, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(op.out_features, dtype=op.dtype, device=x.device)
    act = ACTIVATION_CODES["silu"] if mode == "glu" else -1

    def launch():
        op._matvec(x, out, config, act, mode == "partial")

    launch()  # compile
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            launch()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 5)
    return sorted(times)[len(times) // 2]


def _cache_key(op: KernelLinear, mode: str) -> str:
    import triton

    params = ",".join(f"{k}={v}" for k, v in sorted(op.p.items()))
    device = torch.cuda.get_device_name(op.device)
    return (f"{type(op).__name__}|{op.format}|{params}|{op.out_features}x{op.in_features}|"
            f"{str(op.dtype).removeprefix('torch.')}|{mode}|{device}|triton {triton.__version__}")


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

    def lookup(self, key: str) -> MatvecConfig | None:
        entry = self.entries.get(key)
        try:
            return MatvecConfig(**entry) if entry else None
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


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def interpreter_block(n: int, cap: int = 1024) -> int:
    """Under the interpreter every program is a Python call: cover the rows in as few as possible."""
    return min(next_power_of_2(n), cap)


# (rows per program, packed half-words per row and loop step) of the bit-plane matvecs, from wide
# tiles (few rows, long runs: each thread keeps several rows of one column run, so the activations
# it loads serve them all) to tall ones (many rows, short runs: more programs).
PLANE_TILES = ((2, 1024), (4, 512), (4, 1024), (8, 256), (8, 512), (16, 128), (16, 256), (32, 64), (64, 32))


def plane_candidates(n: int, groups: int, halves_per_group: int, mode: str, sms: int) -> list[MatvecConfig]:
    """Configurations of a bit-plane matvec over `n` output rows and `groups` groups of
    `halves_per_group` half-words a row: chunk = groups per loop step (a power of two dividing the
    groups), split-K only for partial sums."""
    from .tiles import split_candidates

    out: list[MatvecConfig] = []
    for block_n, halves in PLANE_TILES:
        gpi = groups_per_step(groups, max(1, halves // halves_per_group))
        splits = split_candidates(n, block_n, groups // gpi, sms) if mode == "partial" else [1]
        for split in splits[-2:]:
            config = MatvecConfig(block_n, gpi, split, 4)
            if config not in out:
                out.append(config)
    return out


def groups_per_step(groups: int, most: int) -> int:
    """The largest power of two <= `most` dividing `groups`: groups a matvec loop step covers."""
    gpi = 1
    while 2 * gpi <= most and groups % (2 * gpi) == 0:
        gpi *= 2
    return gpi


def sm_count() -> int:
    """Multiprocessors of the current CUDA device."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
