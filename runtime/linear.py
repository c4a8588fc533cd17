"""The runtime's kernel seam: every weight the model multiplies by is behind a `LinearOp`.

`make_linear(record, raw, bias, device, dtype)` turns a tensor record and its encoded bytes into
an op; a registry maps (format, device type) to the implementations that can serve it, best
first. The executor holds ops, never raw weights, so adding a kernel for a format is one
registration here and nothing in the executor.

Implementations:
- `dense` (torch): dense formats, decoded once to the compute dtype; `F.linear`.
- `dequant` (torch): any quantized format. The packed bytes stay as they are (on the CPU a view
  into the mapped artifact, on CUDA one copy on the device); each call dequantizes the weight in
  row blocks and multiplies, so at most one block of one weight is ever dense. Slow, exact to
  the format's reference `decode`: it is what every kernel is tested against.
- `triton` (runtime/kernels/): every format on CUDA, reading the packed bytes in place: a matvec
  for one row of activations (decode), a dequantize-a-tile-then-tl.dot matmul for many (prefill;
  dense weights use cuBLAS there). Registered below by "module:factory" name, so importing the
  runtime never imports triton; a factory returns None for a shape its tiles can't take, and the
  torch path serves that weight.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from thin.ir import Tensor, formats

# Rows dequantized at once by the torch path on the CPU: bounds the dense scratch to
# _ROW_BLOCK x in_features floats whatever the weight's size.
_ROW_BLOCK = 1024


class LinearOp:
    """y = x @ W.T (+ bias) for x [..., in_features]; W is stored in `format`."""

    implementation = "?"
    # A kernel op (runtime/kernels/tuning.py) times its launch candidates on first use of each mode;
    # False takes the untimed default instead: the same results, without compiling and timing every
    # candidate (the compiler's evaluation sessions, which decode a few tokens per format and shape).
    tune = True

    def __init__(self, in_features: int, out_features: int, format: str):
        self.in_features = in_features
        self.out_features = out_features
        self.format = format

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def prefix(self, x: torch.Tensor, *, rows: int | None = None, cols: int | None = None,
               halves: int = 1) -> torch.Tensor:
        """x @ P.T for a prefix P of the weight, read in place (no copy of any weight): the first `rows`
        rows of each of `halves` equal blocks of rows, side by side in the output [..., halves * rows]
        with their bias (a fused [gate; up] weight has two blocks), and the first `cols` columns (x then
        has `cols` features). None: all of them. This is what an elastic FFN level runs (thin.ir.FFNLevel)."""
        raise NotImplementedError(f"{type(self).__name__} ({self.implementation}) runs no weight prefix")

    def dense_weight(self) -> torch.Tensor:
        """The whole weight decoded (for tests and tools; never used on the decode path)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.format}, {self.out_features}x{self.in_features}, "
                f"{self.implementation})")


class DenseLinear(LinearOp):
    implementation = "torch"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, format: str):
        super().__init__(weight.shape[1], weight.shape[0], format)
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def prefix(self, x, *, rows=None, cols=None, halves=1):
        # A column prefix is a view with the full row stride, which the BLAS reads as is.
        weight = self.weight if cols is None else self.weight[:, :cols]
        outs = [F.linear(x, weight[r], None if self.bias is None else self.bias[r])
                for r in row_blocks(self.out_features, rows, halves)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def dense_weight(self) -> torch.Tensor:
        return self.weight


class DequantLinear(LinearOp):
    """Any quantized format through its reference decode, a block of rows at a time."""

    implementation = "torch-dequant"

    def __init__(self, record: Tensor, raw: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(record.shape[1], record.shape[0], record.encoding.format)
        self.fmt = formats.get(record.encoding.format)
        self.shape, self.params = tuple(record.shape), record.encoding.params
        self.raw, self.bias, self.dtype = raw, bias, dtype
        # On a GPU a whole-weight decode per call is allowed (the kernels replace this path there).
        self.row_block = self.out_features if raw.device.type == "cuda" else _ROW_BLOCK

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_block >= self.out_features:
            return F.linear(x, self.dense_weight(), self.bias)
        return self._rows(x, slice(0, self.out_features), None)

    def prefix(self, x, *, rows=None, cols=None, halves=1):
        outs = [self._rows(x, r, cols) for r in row_blocks(self.out_features, rows, halves)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _rows(self, x: torch.Tensor, rows: slice, cols: int | None) -> torch.Tensor:
        """x @ W[rows, :cols].T (+ bias[rows]), decoding a block of rows (and only those columns) at a time."""
        out = torch.empty(*x.shape[:-1], rows.stop - rows.start, dtype=x.dtype, device=x.device)
        for start in range(rows.start, rows.stop, self.row_block):
            stop = min(start + self.row_block, rows.stop)
            w = self.fmt.decode_prefix(self.raw, self.shape, self.params, slice(start, stop), cols, self.dtype)
            out[..., start - rows.start:stop - rows.start] = F.linear(x, w)
            del w
        if self.bias is not None:
            out += self.bias[rows]
        return out

    def dense_weight(self) -> torch.Tensor:
        return self.fmt.decode(self.raw, self.shape, self.params, self.dtype)


def row_blocks(out_features: int, rows: int | None, halves: int) -> list[slice]:
    """The row ranges `LinearOp.prefix` reads: the first `rows` rows of each of `halves` equal blocks."""
    if rows is None:
        return [slice(0, out_features)]
    if halves < 1 or out_features % halves or not 0 < rows <= out_features // halves:
        raise ValueError(f"a prefix of {rows} rows in each of {halves} blocks does not fit {out_features} rows")
    block = out_features // halves
    return [slice(h * block, h * block + rows) for h in range(halves)]


# ---- weights that are not multiplied: norms, biases, routers, embeddings ----------------------

def to_device(raw: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The bytes on `device`: a no-op on the CPU (views into the mapped artifact stay views)."""
    return raw if raw.device == device else raw.to(device)


def load_weight(record: Tensor, raw: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The one function that turns (tensor record, encoded bytes, device) into a dense runtime
    tensor of `dtype`: used for norms, biases and routers, whatever their format."""
    fmt = formats.get(record.encoding.format)
    return fmt.decode(to_device(raw, device), record.shape, record.encoding.params).to(dtype)


class Embedding:
    """Row lookup in a table stored in any format. Only the rows asked for are converted: a dense
    table stays as stored (on the CPU a view of the mapped artifact), a quantized one is decoded
    row by row."""

    def __init__(self, record: Tensor, raw: torch.Tensor, device: torch.device, dtype: torch.dtype):
        self.fmt = formats.get(record.encoding.format)
        self.shape, self.params, self.dtype = tuple(record.shape), record.encoding.params, dtype
        self.raw = to_device(raw, device)
        self.table = self.fmt.decode(self.raw, self.shape, self.params) if self.fmt.dense else None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return F.embedding(ids, self.table).to(self.dtype)
        unique, inverse = torch.unique(ids, return_inverse=True)
        rows = self.fmt.decode_rows(self.raw, self.shape, self.params, unique, self.dtype)
        return rows[inverse]

    def as_linear(self, record: Tensor) -> LinearOp:
        """The same table as a tied LM head (one dense copy in the compute dtype when dense)."""
        if self.table is not None:
            return DenseLinear(self.table.to(self.dtype), None, record.encoding.format)
        return make_linear(record, self.raw, None, self.raw.device, self.dtype)


# ---- the registry ------------------------------------------------------------------------------

Factory = Callable[[Tensor, torch.Tensor, "torch.Tensor | None", torch.device, torch.dtype], "LinearOp | None"]


@dataclass(frozen=True)
class Implementation:
    """One way to run linears of some formats on one device type.

    `target` is "module:function" for a factory loaded on first use, so that registering a
    Triton kernel costs no import. A factory may return None for a weight it can't take (a shape
    its tiles don't fit); the next implementation is tried."""

    name: str
    target: str
    # Loads only when this returns true (e.g. triton importable); checked once.
    available: Callable[[], bool] = lambda: True


_REGISTRY: dict[tuple[str, str], list[Implementation]] = {}
_FACTORIES: dict[Implementation, Factory | None] = {}  # None where the implementation isn't available


def register(format: str, device_type: str, impl: Implementation, *, first: bool = True) -> None:
    """Serve `format` on `device_type` with `impl` (tried before the others when `first`)."""
    impls = _REGISTRY.setdefault((format, device_type), [])
    if any(i.name == impl.name for i in impls):
        raise ValueError(f"implementation {impl.name!r} is registered twice for ({format}, {device_type})")
    impls.insert(0 if first else len(impls), impl)


def unregister(format: str, device_type: str, name: str) -> None:
    """Stop serving `format` on `device_type` with the implementation called `name` (KeyError if absent)."""
    impls = _REGISTRY.get((format, device_type), [])
    for i, impl in enumerate(impls):
        if impl.name == name:
            del impls[i]
            return
    raise KeyError(f"no implementation {name!r} registered for ({format}, {device_type})")


def _factory(impl: Implementation) -> Factory | None:
    if impl not in _FACTORIES:
        factory = None
        if impl.available():
            module, _, attr = impl.target.partition(":")
            factory = getattr(importlib.import_module(module), attr)
        _FACTORIES[impl] = factory
    return _FACTORIES[impl]


def implementations(format: str, device_type: str) -> list[Implementation]:
    """The implementations registered for `format` on `device_type`, best first, then the torch path."""
    fallback = _TORCH_DENSE if formats.get(format).dense else _TORCH_DEQUANT
    return [*_REGISTRY.get((format, device_type), []), fallback]


def make_linear(record: Tensor, raw: torch.Tensor, bias: torch.Tensor | None, device: torch.device,
                dtype: torch.dtype) -> LinearOp:
    """A LinearOp for weight `record` with encoded bytes `raw` (and a dense `bias`) on `device`,
    computing in `dtype`: the first registered implementation that takes it."""
    if len(record.shape) != 2:
        raise ValueError(f"linear weight {record.name!r} must be 2-D, got shape {record.shape}")
    for impl in implementations(record.encoding.format, device.type):
        factory = _factory(impl)
        if factory is None:
            continue
        op = factory(record, raw, bias, device, dtype)
        if op is not None:
            op.implementation = impl.name
            return op
    raise RuntimeError(f"no implementation takes {record.name!r} ({record.encoding.format}) on {device.type}")


def serving(format: str, device_type: str) -> str:
    """The name of the implementation that serves `format` on `device_type` here (first available)."""
    for impl in implementations(format, device_type):
        if _factory(impl) is not None:
            return impl.name
    return "none"


def _dense_factory(record, raw, bias, device, dtype):
    return DenseLinear(load_weight(record, raw, device, dtype), bias, record.encoding.format)


def _dequant_factory(record, raw, bias, device, dtype):
    return DequantLinear(record, to_device(raw, device), bias, dtype)


_TORCH_DENSE = Implementation("torch", f"{__name__}:_dense_factory")
_TORCH_DEQUANT = Implementation("torch-dequant", f"{__name__}:_dequant_factory")


def _register_kernels() -> None:
    from .kernels import cuda_kernels_available

    families = {"dense": ("f32", "f16", "bf16"), "rowwise8": ("int8", "fp8_e4m3"),
                "grouped_int": ("int3", "int4", "int5", "int6"), "mxfp4": ("mxfp4",), "q2": ("q2",), "q1": ("q1",),
                "trellis": ("trellis",)}
    for family, names in families.items():
        for name in names:
            register(name, "cuda", Implementation("triton", f"thin.runtime.kernels.{family}:make",
                                                  available=cuda_kernels_available))


_register_kernels()
