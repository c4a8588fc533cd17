"""Launch tiles of the mixture-of-experts decode kernels (experts.py): the configurations, the
candidates the load-time timing chooses from (the first of each list is the default off a GPU), and
the routings that timing runs them over."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import interpreting
from .chunks import CHUNK_ROWS
from .common import next_power_of_2
from .expert_rows import GINT, MXFP4, TRELLIS, ExpertGroup


@dataclass(frozen=True)
class ExpertConfig:
    """Tiles of one expert kernel: `block_n` rows a program, `groups` format groups a loop step
    (columns per step for one-byte and dense formats; with `words`, chunks of 32 columns; trellis: blocks of
    16 columns), `num_warps`."""

    block_n: int
    groups: int
    num_warps: int = 4
    prefetch: bool = False  # load the next step's weights before this step's math
    words: bool = False  # grouped ints, mxfp4: rows read as whole words (expert_words.py), one chunk a lane
    packed: bool = False  # with words: symmetric int4 or mxfp4 under bf16 activations, summed as bf16 pairs

    def label(self) -> str:
        """The tiles in a benchmark table's words: rows x groups (or chunks) / warps, and the options."""
        options = "+pf" * self.prefetch + "+words" * self.words + "+pairs" * self.packed
        return f"{self.block_n}x{self.groups}/{self.num_warps}w{options}"


@dataclass(frozen=True)
class RouterConfig:
    """Tiles of the router: `block_e` experts a program, `block_h` columns a loop step, `num_warps`."""

    block_e: int
    block_h: int
    num_warps: int = 4

    def label(self) -> str:
        """experts x columns / warps."""
        return f"{self.block_e}x{self.block_h}/{self.num_warps}w"


def expert_candidates(group: ExpertGroup, K: int, n: int, dtype: torch.dtype, glu: bool) -> list[ExpertConfig]:
    """Tiles worth timing for a kernel reading `group`'s rows of K columns into n outputs (glu: gate/up,
    fused or not, two weight rows an output); the byte-wise tilings first (the first is the default)."""
    if interpreting():  # the whole row in one step, and with the prefetch's masked extra step
        cols = next_power_of_2(K)
        ng = cols // group.group if group.group else cols
        return [ExpertConfig(min(next_power_of_2(n), 64), ng), ExpertConfig(16, max(1, ng // 2), 4, True)] \
            + word_candidates(group, K, n, dtype, glu)
    if group.fmt == TRELLIS:
        return trellis_candidates(K, glu)
    if group.group:  # groups a step: 256 or 512 columns, at most the row's
        steps = [min(max(1, c // group.group), next_power_of_2(K // group.group)) for c in (256, 512)]
        tiles = [(bn, step, w) for step in steps for bn, w in ((16, 4), (8, 4), (32, 8))]
    else:
        tiles = [(bn, min(bk, next_power_of_2(K)), w) for bk in (256, 512) for bn, w in ((8, 4), (16, 4), (4, 2))]
    out = []
    for prefetch in (False, True):
        for bn, step, w in tiles[:4] if prefetch else tiles:
            config = ExpertConfig(bn, step, w, prefetch)
            if config not in out:
                out.append(config)
    return out + word_candidates(group, K, n, dtype, glu)


def trellis_candidates(K: int, glu: bool) -> list[ExpertConfig]:
    """Tiles of a trellis group (trellis.rows_dot: a lane a block of 16 columns of each of its rows, 32
    blocks a warp): 1, 2 or 4 warps (2 and 4 only where the row has that many blocks, 32 a warp), 8, 16
    or 4 weight rows a program (half as many output rows with glu); one warp of 8 or 4 rows also with the
    next step's codes loaded before this step's math (16 rows and the next step's codes spill at sm_90). One
    warp first: the default untimed."""
    blocks = K // 16
    tiles = [(rows // 2 if glu else rows, 32 * warps, warps) for warps in (1, 2, 4)
             if warps == 1 or 32 * warps <= blocks for rows in (8, 16, 4)]
    return [ExpertConfig(bn, ng, w) for bn, ng, w in tiles] \
        + [ExpertConfig(bn, ng, w, True) for bn, ng, w in tiles[:3] if bn * (2 if glu else 1) <= 8]


def word_candidates(group: ExpertGroup, K: int, n: int, dtype: torch.dtype, glu: bool) -> list[ExpertConfig]:
    """The whole-word tilings of a grouped-int or mxfp4 group (none for other formats): a lane a chunk of 32
    columns, 32 chunks a warp (for rows shorter than that, also 8 chunks a step), tiles of 4-16 weight
    rows (half as many output rows with glu), and each also with bf16 pairs where those apply. They
    follow the byte-wise candidates: never the default untimed."""
    if group.fmt not in (GINT, MXFP4) or group.group % 32 or K % 32:
        return []
    total = K // 32
    words = group.dt if group.fmt == GINT else 4  # a lane's words per row and chunk: b for b-bit codes
    pairs = dtype == torch.bfloat16 and (group.fmt == MXFP4 or (group.dt == 4 and not group.asym))
    if interpreting():  # steps of 2 chunks (a loop, and a masked tail where the chunks are odd)
        tiles = [(min(next_power_of_2(n), 64), min(2, total), 4)]
    else:
        tiles = []
        for warps in (1, 2, 4):
            if 32 * warps > total and warps > 1:
                continue
            # A row shorter than a warp's 32 chunks (down's 768 columns are 24) leaves lanes idle: also
            # one warp of 8 chunks a step, several steps.
            chunks = [32 * warps] + ([8] if warps == 1 and total < 32 and total % 8 == 0 else [])
            for c in chunks:
                for rows in CHUNK_ROWS[words]:
                    tiles.append((rows // 2 if glu else rows, c, warps))
    out = []
    for bn, c, w in tiles:
        out.append(ExpertConfig(bn, c, w, words=True))
        if pairs:
            out.append(ExpertConfig(bn, c, w, words=True, packed=True))
    return out


def router_candidates(num_experts: int, hidden: int) -> list[RouterConfig]:
    """Router tilings worth timing, the first the default: a few experts a program over steps of 512
    columns, then whole rows a step (every program's loads in flight at once: one memory latency)."""
    if interpreting():
        return [RouterConfig(next_power_of_2(num_experts), min(next_power_of_2(hidden), 1024))]
    out = [RouterConfig(max(1, min(16, num_experts // 64)), min(next_power_of_2(hidden), 512), 4)]
    for block_e, warps in ((1, 4), (2, 4), (1, 8), (2, 8), (4, 8)):
        config = RouterConfig(block_e, next_power_of_2(hidden), warps)
        if config not in out:
            out.append(config)
    return out


def routings(group: ExpertGroup, num_experts: int, top_k: int, normalize: bool, device) -> tuple:
    """(logits [R, E], chosen [R, top_k], weights [R, top_k]) of R routings that pick the group's
    experts in turn, routing r the k members from r * k on: R = members / k (at most 64), so a timed
    launch after another reads other experts (moe-a3b: 16 routings, 200 MB of int4 gate/up, past the
    L2), as a model's step does."""
    members = group.members
    k = min(top_k, len(members))
    rounds = min(64, -(-len(members) // k))
    logits = torch.zeros(rounds, num_experts)
    for r in range(rounds):
        for j in range(k):
            logits[r, members[(r * k + j) % len(members)]] = 30.0 + k - j
    top = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True) if normalize else top.values
    return logits.to(device), top.indices.to(torch.int32).to(device), weights.float().to(device)
