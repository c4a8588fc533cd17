"""Feed-forward blocks for the torch executor: gated/plain MLPs and token-choice mixtures of experts."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .linear import LinearOp


@dataclass
class MLPPlan:
    activation: str
    gated: bool
    up: list[LinearOp]  # [gate_up] fused, [gate, up] separate, or [up] when not gated
    down: LinearOp
    # GPT-OSS's clamped SwiGLU (see thin.ir.MLP): silu's gain, the clamp, the offset added to up.
    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0
    # Elastic FFN (thin.ir.FFNLevel): run only the first `width` intermediate channels (None: all), scale
    # them by `scale` [width] before down and add `shift` [hidden] to the output. Set by the executor.
    width: int | None = None
    scale: torch.Tensor | None = None
    shift: torch.Tensor | None = None


@dataclass
class MoEPlan:
    top_k: int
    normalize_top_k: bool
    scoring: str
    router_weight: torch.Tensor  # float32 on every device
    router_bias: torch.Tensor | None
    experts: list[MLPPlan | None]  # None: a host-resident expert, run from `cache`
    shared_expert: MLPPlan | None
    shared_expert_gate: torch.Tensor | None  # Qwen2-MoE: sigmoid gate [1, hidden]
    layer: int = 0
    # runtime/expert_cache.py's ExpertCache when some of this layer's experts stay in host memory.
    cache: object | None = None


ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


def activate(name: str, x: torch.Tensor) -> torch.Tensor:
    """The IR activation `name` applied to x."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    raise NotImplementedError(f"activation {name!r} is not implemented")


def run_mlp(x: torch.Tensor, p: MLPPlan) -> torch.Tensor:
    """down(act(gate(x)) * up(x)), or down(act(up(x))) when not gated; with a `width`, over the first
    `width` intermediate channels only (a contiguous prefix of every weight: no gather, no copy)."""
    k = p.width
    if not p.gated:
        h = activate(p.activation, _project(p.up[0], x, k, 1))
    else:
        if len(p.up) == 1:
            gate, up = _project(p.up[0], x, k, 2).chunk(2, dim=-1)
        else:
            gate, up = _project(p.up[0], x, k, 1), _project(p.up[1], x, k, 1)
        if p.limit is not None:
            gate, up = gate.clamp(max=p.limit), up.clamp(-p.limit, p.limit)
        if p.alpha != 1.0:  # silu with a gain: x * sigmoid(alpha * x)
            h = gate * torch.sigmoid(gate * p.alpha) * (up + p.up_offset)
        else:
            h = activate(p.activation, gate) * (up + p.up_offset if p.up_offset else up)
    if k is None:
        return p.down(h)
    if p.scale is not None:
        h = h * p.scale
    y = p.down.prefix(h, cols=k)
    return y if p.shift is None else y + p.shift


def _project(op: LinearOp, x: torch.Tensor, width: int | None, halves: int) -> torch.Tensor:
    """The op's output, or only its first `width` rows of each of `halves` blocks."""
    return op(x) if width is None else op.prefix(x, rows=width, halves=halves)


def run_moe(x: torch.Tensor, p: MoEPlan) -> torch.Tensor:
    """Softmax router over all experts, top-k (renormalised if asked), weighted sum of expert MLPs."""
    if p.scoring != "softmax":
        raise NotImplementedError(f"router scoring {p.scoring!r} is not implemented")
    probs = torch.softmax(F.linear(x.float(), p.router_weight, p.router_bias), dim=-1)
    weights, chosen = torch.topk(probs, p.top_k, dim=-1)  # [T, k]
    if p.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    if x.shape[0] == 1:  # decode: k experts, no bookkeeping
        for slot, (_, expert) in enumerate(_experts(p, chosen[0].tolist())):
            out += run_mlp(x, expert) * weights[0, slot]
    else:  # prefill: each expert once, on the tokens that chose it
        # One sort groups the (token, slot) pairs by expert, in token order within each, and one read of
        # the counts is the only wait on the device a layer (not a nonzero per expert).
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=p.router_weight.shape[0]).tolist()
        starts = [0, *itertools.accumulate(counts)]
        tokens, slots = order // p.top_k, order % p.top_k
        for e, expert in _experts(p, [e for e, c in enumerate(counts) if c]):
            token, slot = tokens[starts[e]:starts[e + 1]], slots[starts[e]:starts[e + 1]]
            out.index_add_(0, token, run_mlp(x[token], expert) * weights[token, slot, None])
    if p.shared_expert is not None:
        shared = run_mlp(x, p.shared_expert)
        if p.shared_expert_gate is not None:
            shared = shared * torch.sigmoid(F.linear(x, p.shared_expert_gate))
        out = out + shared
    return out


def _experts(p: MoEPlan, wanted: list[int]):
    """(expert, MLPPlan) for each of `wanted` in order; host-resident ones brought in by the cache."""
    if p.cache is None:
        return ((e, p.experts[e]) for e in wanted)
    return p.cache.experts(p.layer, wanted, p.experts)


def run_ffn(x: torch.Tensor, p: MLPPlan | MoEPlan) -> torch.Tensor:
    """Either feed-forward kind."""
    return run_moe(x, p) if isinstance(p, MoEPlan) else run_mlp(x, p)
