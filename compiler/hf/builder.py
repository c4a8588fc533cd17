"""The IR builder adapters write through: tensor records, lazy loaders, and the ledger.

Every source tensor an adapter maps is consumed here; the rest must be declared unused
with a reason. `finish()` raises `LedgerError` naming whatever is left, so a bias or a
norm the adapter forgot can never be silently dropped.
"""

from __future__ import annotations

from thin.ir import Encoding, Linear, Norm, Tensor

from .checkpoint import RAW_BYTES, TensorStore
from .errors import CheckpointError, LedgerError


def _sliced_shape(shape: tuple[int, ...], index: tuple) -> tuple[int, ...]:
    out = []
    for dim, item in enumerate(shape):
        if dim >= len(index):
            out.append(item)
        elif isinstance(index[dim], slice):
            out.append(len(range(*index[dim].indices(item))))
        # an integer index drops the dimension
    return tuple(out)


class Builder:
    """Collects IR tensors and their loaders while consuming source tensors from a store."""

    def __init__(self, store: TensorStore, architecture: str):
        self.store = store
        self.architecture = architecture
        self.tensors: list[Tensor] = []
        self.loaders: dict = {}
        self._consumed: set[str] = set()
        self._unused: dict[str, str] = {}

    def has(self, src: str) -> bool:
        return src in self.store.tensors

    def source_shape(self, src: str) -> tuple[int, ...]:
        return self._source(src).shape

    def _source(self, src: str):
        try:
            return self.store.tensors[src]
        except KeyError:
            raise CheckpointError(f"{self.architecture}: checkpoint has no tensor {src!r}") from None

    def take(self, src: str, name: str, role: str, layer: int | None, *, expert: int | None = None,
             index: tuple | None = None) -> str:
        """Map source tensor `src` (or `src[index]`, read lazily) to IR tensor `name`; return `name`."""
        info = self._source(src)
        if info.dtype == RAW_BYTES:
            raise CheckpointError(f"{self.architecture}: {src!r} holds packed bytes (U8) that only a "
                                  "pre-quantized layout explains; this adapter does not read it")
        shape = info.shape if index is None else _sliced_shape(info.shape, index)
        self.tensors.append(Tensor(name, role, layer, shape, Encoding(info.dtype), info.dtype, expert))
        self.loaders[name] = self.store.loader(src, index)
        self._consumed.add(src)
        return name

    def derive(self, sources: list[str], name: str, role: str, layer: int | None, shape: tuple[int, ...],
               encoding: Encoding, load, *, expert: int | None = None) -> str:
        """Record IR tensor `name` whose bytes `load()` computes from the source tensors `sources`
        (which count as consumed): for layouts `take` can't slice, e.g. a transposed expert tensor or
        mxfp4 blocks and scales re-packed into thin's mxfp4. `load` returns `encoding`'s bytes."""
        for src in sources:
            self._source(src)
        self.tensors.append(Tensor(name, role, layer, tuple(shape), encoding, encoding.format, expert))
        self.loaders[name] = load
        self._consumed.update(sources)
        return name

    def declare_unused(self, src: str, reason: str) -> None:
        """Record that `src` is deliberately not part of the IR (e.g. a tied duplicate)."""
        self._source(src)
        self._unused[src] = reason

    def linear(self, src: str, name: str, role: str, layer: int | None, *, bias: bool = False) -> Linear:
        """Linear from `{src}.weight` (+ `{src}.bias` when `bias`), named `{name}.weight/.bias`."""
        weight = self.take(f"{src}.weight", f"{name}.weight", role, layer)
        if not bias:
            return Linear(weight)
        return Linear(weight, self.take(f"{src}.bias", f"{name}.bias", f"{role}.bias", layer))

    def rms_norm(self, src: str, name: str, role: str, layer: int | None, eps: float,
                 weight_offset: float = 0.0) -> Norm:
        """RMSNorm with weight `{src}.weight`, named `{name}.weight`."""
        return Norm("rms", eps, self.take(f"{src}.weight", f"{name}.weight", role, layer),
                    weight_offset=weight_offset)

    def finish(self) -> None:
        """Raise LedgerError if any source tensor was neither consumed nor declared unused."""
        left = sorted(set(self.store.tensors) - self._consumed - set(self._unused))
        if left:
            shown = ", ".join(left[:12]) + (f", ... ({len(left) - 12} more)" if len(left) > 12 else "")
            raise LedgerError(f"{self.architecture}: {len(left)} checkpoint tensor(s) were not mapped to the "
                              f"IR nor declared unused: {shown}")
        both = sorted(self._consumed & set(self._unused))
        if both:
            raise LedgerError(f"{self.architecture}: tensor(s) both consumed and declared unused: {both}")
