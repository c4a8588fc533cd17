"""Elastic FFN arithmetic shared by the compiler and the runtime: channel counts and the bytes a
prefix of each FFN weight reads (see `FFNLevel`).

With a dense FFN's intermediate channels ordered by importance, running the first k of them reads:
gate and up (separate, or the two halves of a fused [gate; up]): rows [0, k) of each, one
contiguous byte range per part of the format (every part keeps the rows leading); down: columns
[0, k) of every row, a contiguous run at the start of each row (groups along the columns are 32, 64
or 128 wide, so a whole number of 128-channel superblocks never cuts one; row scales stay whole).
"""

from __future__ import annotations

from math import ceil

from . import formats
from .model import MLP, FFNLevel, Model, Tensor

SUPERBLOCK = 128  # FFN channels per superblock: what elastic levels keep or drop together


def ffn_widths(model: Model) -> list[int | None]:
    """Intermediate channels of each layer's dense FFN (None for a mixture of experts)."""
    tensors = model.tensor_map()
    return [tensors[layer.ffn.down.weight].shape[1] if isinstance(layer.ffn, MLP) else None
            for layer in model.layers]


def uniform_channels(model: Model, keep: float) -> tuple[int, ...]:
    """Per layer, the fewest whole superblocks holding at least `keep` of its channels (all of them
    when that is as many): the same share everywhere, what an uncertified level runs."""
    if not 0 < keep <= 1:
        raise ValueError(f"an FFN keep fraction must be in (0, 1], got {keep!r}")
    return tuple(min(width, SUPERBLOCK * ceil(round(keep * width, 6) / SUPERBLOCK)) for width in ffn_widths(model))


def prefix_bytes(record: Tensor, channels: int, width: int) -> int:
    """Bytes of FFN weight `record` read when its layer runs `channels` of `width` intermediate channels:
    rows of gate/up (halves of a fused gate_up), columns of down."""
    fmt, shape, params = formats.get(record.encoding.format), tuple(record.shape), record.encoding.params
    if channels == width:
        return fmt.nbytes(shape, params)
    if record.role.endswith("down"):
        return fmt.prefix_nbytes(shape, params, cols=channels)
    halves = shape[0] // width  # 2 for a fused [gate; up]
    return halves * fmt.prefix_nbytes((width, *shape[1:]), params, rows=channels)


def ffn_weights(model: Model) -> list[list[Tensor]]:
    """Each layer's FFN weights (gate/up or gate_up, down; biases are not counted: they are tiny)."""
    tensors = model.tensor_map()
    out = []
    for layer in model.layers:
        mlp = layer.ffn
        linears = (mlp.gate, mlp.up, mlp.gate_up, mlp.down) if isinstance(mlp, MLP) else ()
        out.append([tensors[lin.weight] for lin in linears if lin is not None])
    return out


def ffn_bytes(model: Model, channels: tuple[int, ...] | None = None) -> int:
    """Bytes of FFN weights read per token running `channels` per layer (None: every channel)."""
    widths = ffn_widths(model)
    channels = channels or tuple(widths)
    return sum(prefix_bytes(r, k, w) for records, k, w in zip(ffn_weights(model), channels, widths)
               for r in records)


def bytes_per_token(model: Model, level: FFNLevel | None = None) -> int:
    """Bytes of weights one decoded token reads at `level` (None: the whole model): every tensor once
    except the embedding (one row; a tied LM head reads the whole table once more), FFN weights as far
    as the level's prefix, and the shift and scale tensors of this level only."""
    extra = {n for lv in model.ffn_levels for n in (*lv.shift, *lv.scale) if n is not None}
    used = {n for n in ((*level.shift, *level.scale) if level is not None else ()) if n is not None}
    ffn = {r.name for records in ffn_weights(model) for r in records}
    total = 0
    for t in model.tensors:
        size = formats.nbytes(t.encoding.format, t.shape, t.encoding.params)
        if t.name == model.embedding.weight:
            total += size // t.shape[0] + (size if model.lm_head.tied else 0)
        elif (t.name in extra and t.name not in used) or t.name in ffn:
            continue
        else:
            total += size
    return total + ffn_bytes(model, level.channels if level is not None else None)
