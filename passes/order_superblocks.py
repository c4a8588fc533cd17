"""order_superblocks: every dense FFN's intermediate channels by decreasing importance, so that the
first k of them (whole 128-channel superblocks) are the best cheaper FFN of that width.

A dense FFN's intermediate channels can be permuted freely (rows of gate and up, columns of down, the
same permutation) without changing its function. Importance is what dropping a channel costs the
layer's output, from the calibration statistics of the down projection's input h (second moments
H = E[h h^T], mean mu) and the down weight W's columns w_j:

- "output" (default): backward elimination on the layer's output error. Dropping the set D of channels
  and adding back their mean output (the level's shift) leaves an output error of
  sum_{i,j in D} (w_i . w_j) C_ij with C the covariance of h (H itself without the shift); the channel
  whose removal adds the least goes first, so correlated channels are not both kept for the same job;
- "energy": the channel alone, ||w_j||^2 H_jj;
- "magnitude": mean |h_j| x ||w_j||, the plain magnitude score.

The permutation is applied before quantization (groups and scales are computed on the ordered
weights; groups along down's columns are 32, 64 or 128 wide, so no group straddles a superblock), and
the down input's statistics are permuted with it (GPTQ and the scores read them).

Layout ("page-major"): each FFN weight starts on a 4 KiB page. Superblock s of gate and of up (either
half of a fused [gate; up]) is rows [128 s, 128 s + 128): one contiguous byte range in every part of
the format (parts keep the rows leading). Superblock s of down is columns [128 s, 128 s + 128) of every
row: a prefix of k channels is, in each row, one contiguous run at the start of the row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from math import ceil

from thin.ir import MLP, Linear, MoE, Program, formats
from thin.ir.elastic import SUPERBLOCK, ffn_bytes, ffn_widths

from .calibrate_inputs import load_statistics, statistics_key
from .runner import PassContext

PAGE = 4096
IMPORTANCE = ("output", "energy", "magnitude")
CORRECTIONS = ("scale", "shift", "none")
ELIMINATION_STEPS = 2048  # backward elimination drops width / this many channels per step (1 for small FFNs)


class FFNLevelOptionError(ValueError):
    """An --ffn-levels option out of range."""


@dataclass(frozen=True)
class FFNLevelOptions:
    """Elastic FFN levels (`--ffn-levels`): the keep fractions the compiler certifies besides 1.0, and
    how each level is made (see certify_ffn_levels.py). No levels: the FFN stays in source order."""

    levels: tuple[float, ...] = ()  # keep fractions of the FFN weight bytes, each in (0, 1)
    importance: str = "output"  # the channel order: "output", "energy" or "magnitude" (see the module doc)
    # Each level's channels per layer chosen by a knapsack on measured sensitivity under its byte target;
    # false: the same share of every layer.
    per_layer: bool = True
    # What a level adds back for its dropped channels: "scale" (least-squares scale of the kept channels
    # and the mean output shift), "shift" (the dropped channels' mean output) or "none".
    correction: str = "scale"

    def __post_init__(self):
        levels = self.levels
        if not isinstance(levels, tuple) or any(isinstance(k, bool) or not isinstance(k, (int, float))
                                                or not 0 < k < 1 for k in levels):
            raise FFNLevelOptionError(f"--ffn-levels takes keep fractions in (0, 1) besides 1, got {levels!r}")
        if len(set(levels)) != len(levels):
            raise FFNLevelOptionError(f"--ffn-levels lists a keep fraction twice: {levels!r}")
        if self.importance not in IMPORTANCE:
            raise FFNLevelOptionError(f"FFN importance must be one of {', '.join(IMPORTANCE)}, got {self.importance!r}")
        if self.correction not in CORRECTIONS:
            raise FFNLevelOptionError(f"FFN correction must be one of {', '.join(CORRECTIONS)}, "
                                      f"got {self.correction!r}")
        if type(self.per_layer) is not bool:
            raise FFNLevelOptionError("per_layer must be true or false")

    @property
    def enabled(self) -> bool:
        return bool(self.levels)


def dense_mlps(program: Program) -> list[MLP]:
    """Each layer's MLP; ValueError naming the first layer that is a mixture of experts."""
    out = []
    for layer in program.model.layers:
        if isinstance(layer.ffn, MoE):
            raise ValueError(f"elastic FFN levels need dense MLPs; layer {layer.index} is a mixture of experts")
        out.append(layer.ffn)
    return out


def check_ffn_levels(program: Program, ctx: PassContext) -> Program:
    """The first pass of an --ffn-levels compile, before calibration runs the model: ValueError when a layer
    is a mixture of experts, FFNLevelOptionError when a level keeps fewer FFN bytes than one superblock a
    layer (the least a level runs). Changes nothing."""
    dense_mlps(program)
    smallest = min(ctx.config.ffn.levels, default=1.0)
    floor = smallest_level(program.model)
    if smallest < floor:
        raise FFNLevelOptionError(f"--ffn-levels {smallest:g} keeps fewer FFN bytes than one {SUPERBLOCK}-channel "
                                  f"superblock a layer, the least a level runs: {floor:.4g} of them on this model; "
                                  f"ask for {ceil(floor * 1000) / 1000:g} or more")
    return program


def smallest_level(model) -> float:
    """The share of the FFN weight bytes that one superblock a layer reads, at the weights' encodings now: no
    level can keep less (formats planned later keep the share about the same, every FFN weight scaling with
    its channels)."""
    widths = ffn_widths(model)
    return ffn_bytes(model, tuple(min(SUPERBLOCK, w) for w in widths)) / ffn_bytes(model)


def order_superblocks(program: Program, ctx: PassContext) -> Program:
    """Afterwards every dense FFN's intermediate channels are in decreasing importance (ties in source
    order): gate/up rows and down columns permuted together, so the model computes the same function;
    the down input's calibration statistics are permuted to match; every FFN weight starts on a 4 KiB
    page; annotations['ffn_order'] records the permutations (`apply_ffn_order` replays them)."""
    options: FFNLevelOptions = ctx.config.ffn
    if "calibration" not in program.annotations:
        raise ValueError("order_superblocks needs the calibration statistics (calibrate_inputs runs first)")
    centered = options.correction != "none"
    permutations = []
    for i, mlp in enumerate(dense_mlps(program)):
        ctx.report("order superblocks", i, len(program.model.layers))
        stats = load_statistics(ctx, program, mlp.down.weight)
        if stats is None:
            raise ValueError(f"no calibration statistics reached {mlp.down.weight}")
        down = program.decoded(mlp.down.weight, ctx.device)
        # On the compile's device: ordering and permuting a 14336-wide second-moment matrix is seconds there.
        stats = {k: (v.to(ctx.device) if hasattr(v, "to") else v) for k, v in stats.items()}
        order = importance_order(down, stats, options.importance, centered)
        permutations.append(order.cpu().tolist())
        key = statistics_key(program.annotations["calibration"]["inputs"][mlp.down.weight])
        ctx.scratch.save(key, permute_statistics(stats, order))
    ctx.report("order superblocks", len(permutations), len(permutations))
    note = {"importance": options.importance, "centered": centered, "permutations": permutations}
    return apply_ffn_order(program.replace(annotations={**program.annotations, "ffn_order": note}))


def importance_order(down, stats: dict, importance: str, centered: bool):
    """The channels of a down weight [hidden, channels], most important first (a LongTensor)."""
    import torch

    w = down.double() if down.device.type == "cpu" else down.float()
    norms = w.square().sum(0)
    if importance == "magnitude":
        score = stats["absmean"].to(w.dtype) * norms.sqrt()
    elif importance == "energy":
        score = stats["hessian"].diagonal().to(w.dtype) * norms
    else:
        second = stats["hessian"].to(w.dtype)
        if centered:
            mean = stats["mean"].to(w.dtype)
            second = second - torch.outer(mean, mean)
        return _eliminate((w.T @ w) * second)
    return torch.sort(score, descending=True, stable=True).indices


def _eliminate(cost):
    """Backward elimination over the pairwise output-error matrix `cost` [n, n] (cost[i, j] = (w_i . w_j) C_ij):
    repeatedly drop the channels whose removal, given those already dropped, adds the least error; the
    channels dropped last are the most important. Returns the order, most important first."""
    import torch

    n = cost.shape[0]
    alone = cost.diagonal().clone()
    shared = torch.zeros_like(alone)  # sum over dropped i of cost[:, i]
    alive = torch.ones(n, dtype=torch.bool, device=cost.device)
    dropped, count = [], 0  # count: channels dropped so far (several a step in a wide FFN)
    step = max(1, n // ELIMINATION_STEPS)
    while count < n:
        added = torch.where(alive, alone + 2 * shared, torch.full_like(alone, float("inf")))
        take = torch.sort(added, stable=True).indices[:min(step, n - count)]
        alive[take] = False
        shared += cost[:, take].sum(1)
        dropped.append(take)
        count += take.numel()
    return torch.cat(dropped).flip(0)


def permute_statistics(stats: dict, order) -> dict:
    """A linear input's statistics with its channels in `order`."""
    out = dict(stats)
    out["hessian"] = stats["hessian"][order][:, order]
    for name in ("mean", "absmean", "absmax"):
        if name in stats:
            out[name] = stats[name][order]
    return out


def apply_ffn_order(program: Program) -> Program:
    """`program` with the permutations annotations['ffn_order'] records applied to its FFN weights
    (lazily: a loader permutes when called) and those weights page-aligned; unchanged without the note.
    certify_model re-plans from the source through this, so a re-planned program keeps the order."""
    note = program.annotations.get("ffn_order")
    if note is None:
        return program
    records = program.model.tensor_map()
    weights = dict(program.weights)
    for mlp, order in zip(dense_mlps(program), note["permutations"]):
        width = records[mlp.down.weight].shape[1]
        for lin, halves in ((mlp.gate, 1), (mlp.up, 1), (mlp.gate_up, 2)):
            for name in _names(lin):
                weights[name] = _permuted(weights[name], records[name], order, width, halves, rows=True)
        weights[mlp.down.weight] = _permuted(weights[mlp.down.weight], records[mlp.down.weight], order, width, 1,
                                             rows=False)
        for lin in (mlp.gate, mlp.up, mlp.gate_up, mlp.down):
            if lin is not None:
                records[lin.weight] = dataclasses.replace(records[lin.weight], align=max(records[lin.weight].align,
                                                                                          PAGE))
    model = dataclasses.replace(program.model, tensors=tuple(records[t.name] for t in program.model.tensors))
    return program.replace(model=model, weights=weights)


def _names(lin: Linear | None) -> list[str]:
    return [] if lin is None else [n for n in (lin.weight, lin.bias) if n is not None]


def _permuted(load, record, order: list[int], width: int, halves: int, rows: bool):
    """A loader of `record` with its channels in `order`: rows of each of `halves` blocks, or columns."""
    fmt = formats.get(record.encoding.format)
    if not fmt.dense:
        raise ValueError(f"order_superblocks permutes weights before quantization; {record.name} is already "
                         f"{record.encoding.format}")

    def permuted():
        import torch

        index = torch.tensor(order, dtype=torch.long)
        w = fmt.decode(load(), record.shape, record.encoding.params)
        if not rows:
            w = w[:, index]
        else:
            blocks = w.reshape(halves, width, *w.shape[1:])
            w = blocks[:, index].reshape(w.shape)
        return fmt.encode(w, record.encoding.params)

    return permuted
