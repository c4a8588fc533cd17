"""What a storage format is: parameters, byte layout, and the hooks of its torch reference.

A format turns a weight of a given shape into one flat blob of bytes and back. Each format
lives in its own file in this package and is the single definition of:

- its parameters (`params`: name -> allowed values and default) and their check against a shape;
- its packed layout (`parts`): named byte ranges inside the blob (values, scales, offsets),
  each with a dtype and a shape, so a kernel author reads the layout off one place;
- its true size (`nbytes`, the end of the last part) and bits per weight, side data included;
- a torch reference `encode` / `decode` that defines what the bytes mean. Kernels are tested
  against `decode`; better quantizers (GPTQ) must produce bytes that `decode` reads.

Nothing here imports torch at module level: the IR stays plain data. The reference functions
import torch when they are called.

Quantized formats apply to 2-D weights [out_features, in_features] (rows x columns; the
reduction runs along the columns). Every part of such a layout has the rows as its leading
dimension, so stacking two weights along the rows (fusing q/k/v) is stacking each part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

PART_ALIGN = 16  # every part starts 16-byte aligned inside the blob: vector loads in kernels

# Element sizes of the dtypes parts may have (torch dtype names).
DTYPE_BYTES = {"uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class Part:
    """One byte range of a blob: `nbytes` bytes at `offset`, read as `dtype` of `shape`.

    Sub-byte values are stored in uint8 parts; the format's docstring says how they pack."""

    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Param:
    """A format parameter: the values it may take and the one used when absent."""

    choices: tuple[int, ...]
    default: int
    doc: str = ""


def layout(shape_parts: list[tuple[str, str, tuple[int, ...], int]]) -> tuple[Part, ...]:
    """Parts placed one after another, each 16-byte aligned: [(name, dtype, shape, nbytes)] -> parts.

    `nbytes` is passed explicitly because sub-byte parts (packed nibbles, bits) hold more
    elements than their uint8 shape suggests only when a format says so."""
    parts, offset = [], 0
    for name, dtype, shape, size in shape_parts:
        offset = -(-offset // PART_ALIGN) * PART_ALIGN
        parts.append(Part(name, offset, size, dtype, tuple(shape)))
        offset += size
    return tuple(parts)


@dataclass(frozen=True)
class Format:
    """A storage format. Subclasses (one per file) override `_check`, `parts` and the reference.

    `params` on every method is the Encoding's tuple of (key, value) pairs; absent keys take
    their defaults (see `normalize`)."""

    name: str
    description: str
    params: dict[str, Param] = field(default_factory=dict)
    # Dense formats hold one plain element per weight: their torch dtype and safetensors name.
    torch_dtype: str | None = None
    safetensors_dtype: str | None = None
    # Quantized formats need 2-D weights; dense ones take any shape.
    matrix_only: bool = True
    # A format whose kernels exist for routed experts only, and whose reference rounding is a search
    # over whole tiles (trellis): the planner offers it to routed experts alone and only when
    # --expert-formats names it, and scores it on a sample of rows (passes/score_formats.py).
    experts_only: bool = False

    @property
    def dense(self) -> bool:
        return self.torch_dtype is not None

    # ---- parameters and checks ---------------------------------------------------------------

    def normalize(self, params=()) -> tuple[tuple[str, int], ...]:
        """All parameters, defaults filled in, sorted by key. Raises ValueError on a bad one."""
        given = dict(params)
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            known = ", ".join(sorted(self.params)) or "none"
            raise ValueError(f"format {self.name} has no parameter(s) {', '.join(unknown)} (known: {known})")
        out = []
        for key, spec in sorted(self.params.items()):
            value = given.get(key, spec.default)
            if type(value) is not int or value not in spec.choices:
                raise ValueError(f"format {self.name}: {key} must be one of "
                                 f"{', '.join(map(str, spec.choices))}, got {value!r}")
            out.append((key, value))
        return tuple(out)

    def check(self, shape: tuple[int, ...], params=()) -> list[str]:
        """Every reason `shape` with `params` cannot be stored in this format ([] when it can)."""
        try:
            p = dict(self.normalize(params))
        except ValueError as e:
            return [str(e)]
        shape = tuple(shape)
        if not shape or any(type(d) is not int or d <= 0 for d in shape):
            return [f"format {self.name}: bad shape {shape}"]
        if self.matrix_only and len(shape) != 2:
            return [f"format {self.name} stores 2-D weights [out, in], got shape {shape}"]
        return self._check(shape, p)

    def _check(self, shape: tuple[int, ...], p: dict) -> list[str]:
        return []

    def require(self, shape: tuple[int, ...], params=()) -> dict:
        """The normalized parameters as a dict; ValueError naming every problem otherwise."""
        problems = self.check(shape, params)
        if problems:
            raise ValueError("; ".join(problems))
        return dict(self.normalize(params))

    # ---- layout -------------------------------------------------------------------------------

    def parts(self, shape: tuple[int, ...], params=()) -> tuple[Part, ...]:
        """The blob's layout for a weight of `shape`."""
        if not self.dense:
            raise NotImplementedError(f"format {self.name} must define parts")
        self.require(shape, params)
        size = prod(shape) * DTYPE_BYTES[self.torch_dtype]
        return (Part("values", 0, size, self.torch_dtype, tuple(shape)),)

    def nbytes(self, shape: tuple[int, ...], params=()) -> int:
        """Bytes of the whole blob: the end of its last part."""
        last = self.parts(tuple(shape), params)[-1]
        return last.offset + last.nbytes

    def bits_per_weight(self, shape: tuple[int, ...], params=()) -> float:
        """Stored bits per element, side data (scales, offsets, alignment) included."""
        return 8 * self.nbytes(shape, params) / prod(shape)

    # ---- torch reference (imports torch when called) -------------------------------------------

    def encode(self, tensor, params=()):
        """The blob for a weight: a flat uint8 torch tensor of exactly `nbytes` bytes.

        For quantized formats this is round-to-nearest with the format's plain scale choice; it
        is the reference quantizer, and the definition of a valid blob is whatever `decode` reads."""
        import torch

        self.require(tuple(tensor.shape), params)
        dense = tensor.detach().to(getattr(torch, self.torch_dtype)).contiguous().reshape(-1)
        return dense.view(torch.uint8)

    def decode(self, raw, shape: tuple[int, ...], params=(), dtype=None):
        """The weight a blob stands for. Dense formats return a view in their stored dtype (or a
        copy in `dtype`); quantized formats return `dtype` (default float32)."""
        shape = tuple(shape)
        self.require(shape, params)
        return self.decode_parts(self.split(raw, shape, params), shape, params, dtype)

    def decode_parts(self, parts: dict, shape: tuple[int, ...], params=(), dtype=None):
        """`decode` from the split parts of a blob (or from a row slice of every part, which is
        how a subset of rows is decoded: see `decode_rows`)."""
        import torch

        out = parts["values"].reshape(shape)
        return out if dtype is None else out.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)

    def decode_rows(self, raw, shape: tuple[int, ...], params=(), rows=None, dtype=None):
        """Decode only the rows `rows` (a slice, or a 1-D index tensor) of a 2-D or larger weight.

        Every part keeps the rows as its leading dimension, so this reads only those rows' bytes:
        the runtime's torch path uses it to dequantize a large weight in row blocks, and to look up
        embedding rows without decoding the table."""
        shape = tuple(shape)
        parts = self.split(raw, shape, params)
        picked = {name: (t[rows] if isinstance(rows, slice) else t.index_select(0, rows))
                  for name, t in parts.items()}
        n = next(iter(picked.values())).shape[0]
        return self.decode_parts(picked, (n, *shape[1:]), params, dtype)

    def prefix_parts(self, parts: dict, shape: tuple[int, ...], cols: int) -> dict:
        """The parts of a 2-D weight's first `cols` columns, as views (no copy). Past the rows, a part
        either spans the columns in proportion (values, packed codes, group scales: sliced) or holds
        one entry per row (row scales: kept whole), so a column prefix that cuts no packed byte and no
        group decodes to the first `cols` columns of the weight. ValueError for one that would."""
        k = shape[1]
        if not 0 < cols <= k:
            raise ValueError(f"{self.name}: a column prefix of a {k}-column weight needs 1..{k} columns, got {cols}")
        out = {}
        for name, part in parts.items():
            if part.dim() == 1 or cols == k:
                out[name] = part
                continue
            if part.shape[1] * cols % k:
                raise ValueError(f"{self.name}: the first {cols} of {k} columns cut part {name!r} mid-element "
                                 "(a prefix must be a whole number of groups)")
            out[name] = part[:, :part.shape[1] * cols // k]
        return out

    def decode_prefix(self, raw, shape: tuple[int, ...], params=(), rows=None, cols: int | None = None, dtype=None):
        """Decode rows `rows` (a slice; None: all) and the first `cols` columns (None: all) of a 2-D
        weight, reading only their bytes (see `prefix_parts`)."""
        shape = tuple(shape)
        parts = self.split(raw, shape, params)
        if rows is not None:
            parts = {name: t[rows] for name, t in parts.items()}
        if cols is not None:
            parts = self.prefix_parts(parts, shape, cols)
        n = next(iter(parts.values())).shape[0]
        return self.decode_parts(parts, (n, shape[1] if cols is None else cols), params, dtype)

    def prefix_nbytes(self, shape: tuple[int, ...], params=(), rows: int | None = None,
                      cols: int | None = None) -> int:
        """Bytes a kernel reads for the first `rows` rows and `cols` columns of a 2-D weight (None: all):
        each part's share of them, alignment padding left out."""
        shape = tuple(shape)
        n, k = shape
        rows = n if rows is None else rows
        cols = k if cols is None else cols
        total = 0
        for part in self.parts(shape, params):
            per_row = part.nbytes // n
            if len(part.shape) > 1:
                if per_row * cols % k:
                    raise ValueError(f"{self.name}: the first {cols} of {k} columns cut part {part.name!r}")
                per_row = per_row * cols // k
            total += rows * per_row
        return total

    def stack_rows(self, blobs: list, shapes: list[tuple[int, ...]], params=()):
        """One blob for the weights `blobs` (of `shapes`) stacked along their rows, as fusing q/k/v
        or gate/up needs: each part is stacked separately."""
        import torch

        shapes = [tuple(s) for s in shapes]
        if any(s[1:] != shapes[0][1:] for s in shapes):
            raise ValueError(f"{self.name}: can only stack weights that agree past the rows, got {shapes}")
        if self.dense:
            return torch.cat([b.reshape(-1) for b in blobs])
        stacked = (sum(s[0] for s in shapes), *shapes[0][1:])
        split = [self.split(b, s, params) for b, s in zip(blobs, shapes)]
        return self.join({name: torch.cat([parts[name] for parts in split]) for name in split[0]},
                         stacked, params)

    def _check_blob(self, raw, shape, params) -> None:
        import torch

        expected = self.nbytes(shape, params)
        if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() != expected:
            raise ValueError(f"{self.name} blob of shape {shape} must be a flat uint8 tensor of {expected} "
                             f"bytes, got {raw.dtype} {tuple(raw.shape)}")

    def split(self, raw, shape: tuple[int, ...], params=()) -> dict:
        """The blob's parts as torch views {name: tensor of the part's dtype and shape} (no copy)."""
        import torch

        shape = tuple(shape)
        self._check_blob(raw, shape, params)
        out = {}
        for part in self.parts(shape, params):
            view = raw[part.offset:part.offset + part.nbytes]
            out[part.name] = view.view(getattr(torch, part.dtype)).reshape(part.shape)
        return out

    def join(self, arrays: dict, shape: tuple[int, ...], params=()):
        """The inverse of `split`: one blob from {part name: tensor}, zero bytes between parts."""
        import torch

        parts = self.parts(tuple(shape), params)
        # Uninitialised, then every byte written once: each part's, and zeros in the alignment gaps
        # (zeroing the whole blob first cost as much as copying the parts: a loaded expert's blob is MBs).
        blob = torch.empty(parts[-1].offset + parts[-1].nbytes, dtype=torch.uint8)
        end = 0
        for part in parts:
            data = arrays[part.name].contiguous()
            if tuple(data.shape) != part.shape or str(data.dtype) != f"torch.{part.dtype}":
                raise ValueError(f"{self.name} part {part.name}: expected {part.dtype} {part.shape}, "
                                 f"got {data.dtype} {tuple(data.shape)}")
            blob[end:part.offset] = 0
            blob[part.offset:part.offset + part.nbytes] = data.reshape(-1).view(torch.uint8)
            end = part.offset + part.nbytes
        return blob

    def quantizer(self, shape: tuple[int, ...], params=()):
        """A `GridQuantizer` for this format and shape; dense formats have none (ValueError)."""
        raise ValueError(f"format {self.name} stores values as they are: there is nothing to quantize")


class GridQuantizer:
    """Round-to-grid quantization shared by the reference `encode` and error-compensating methods.

    Every quantized format here maps each weight independently onto a grid of representable
    values, and the grid is fixed per block of `block` consecutive columns of a row (a group; the
    whole row for per-channel formats). A quantizer that updates weights column by column (GPTQ)
    uses it so:

        q = fmt.quantizer(shape, params)
        q.start(w)                                # whole-matrix choices (row super-scales)
        for each block of columns c0:c0+q.block:
            grid = q.fit(w[:, c0:c0 + q.block], importance)   # from the current weights
            for each column j in the block:
                w_hat[:, j] = q.project(w[:, j:j+1], grid, j - c0)   # nearest grid value
        blob = q.pack(w_hat, grids)               # codes are recovered exactly from w_hat

    `encode` is exactly this loop without any update, with `importance=None`.

    `fit` also takes several whole blocks at once ([rows, n * block]) and returns one grid for
    them all, the same as fitting them one at a time (a grid never looks across its block), and
    `pack` takes the grids in column order however many blocks each covers. `encode` fits the
    whole weight in one call, so no Python loop runs over rows or groups.
    """

    block: int

    def start(self, w) -> None:
        """See the whole float32 weight [rows, cols] once before any `fit`."""

    def fit(self, w_block, importance=None):
        """The grid for one block of columns [rows, block] (float32), or for several whole blocks
        [rows, n * block], optionally weighting each column's squared error by `importance`
        [block] or [n * block] (e.g. the diagonal of the input Hessian)."""
        raise NotImplementedError

    def project(self, w_cols, grid, offset: int = 0):
        """The nearest representable values for columns [rows, n] starting `offset` columns into
        the block `grid` was fitted on (float32)."""
        raise NotImplementedError

    def pack(self, w_hat, grids: list):
        """The blob for a weight whose every value lies on its block's grid (as `project` gives)."""
        raise NotImplementedError
