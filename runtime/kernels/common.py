"""What the linear kernel families share: the LinearOp they serve and the launch configuration
each weight runs with (MatvecConfig; tuning.py chooses it once per kind of weight and caches it on disk).

A family (one file per format family) subclasses `KernelLinear` and supplies three launchers:
`_matvec` (one row of activations: the decode path), `_matmul` (many rows: prefill) and the
candidate configurations its matvec may run with. The op decides nothing at call time: the
configuration of each mode (plain or gate/up fused) is picked on first use, which the engine
triggers while it loads, by timing the candidates on the real weight (or read from the cache):
tuning.py does that.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from thin.ir import Tensor, formats

from ..linear import LinearOp
from . import interpreting  # noqa: F401  (chunks.py reads common.interpreting at call time; tests replace it)

# Activation codes shared by every kernel with a gate/up epilogue (see activation.py).
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


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
            from .tuning import choose  # the tuner builds on this module

            self._configs[key] = choose(self, mode, rows, cols)
        return self._configs[key]

    @property
    def split(self) -> int:
        """Partial sums the matvec writes when asked for partials (split-K programs)."""
        return self.config("partial").split

    # Families whose matvec kernels take a deferred_norm.Deferred (the residual norm left to the next projection).
    deferrable = False

    def matvec_deferred(self, x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor, slots: torch.Tensor,
                        norm: tuple, cols: int | None = None):
        """residual += x @ W.T (+ bias) over the first `cols` columns when given, its RMSNorm `norm` ((float32
        weight, eps)) left to the next projection: out = residual * weight, each program's sum of squares
        in `slots`. Runs the "direct" configuration (one split); returns the deferred_norm.Deferred the next
        projection's matvec takes as `rstd`."""
        from .deferred_norm import Deferred

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
        fewer splits (a buffer sized before that prefix's configuration was chosen). `rstd` (a deferred_norm.Deferred,
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


# ---- where a configuration is kept ------------------------------------------------------------------

def proper_prefix(op: KernelLinear, mode: str, rows: int | None, cols: int | None) -> tuple[int | None, int | None]:
    """(rows, cols) of a matvec prefix in `mode` with a whole dimension as None (the weight itself)."""
    n = op.out_features // 2 if mode == "glu" else op.out_features
    return (None if rows == n else rows), (None if cols == op.in_features else cols)


def config_key(mode: str, rows: int | None, cols: int | None) -> str | tuple:
    """Where KernelLinear.config keeps a choice: the mode for the whole weight, else (mode, rows, cols)."""
    return mode if rows is None and cols is None else (mode, rows, cols)


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
