"""Calibration statistics for experts the calibration text rarely or never routes to.

A token reaches only its top-k experts, so an expert can end calibration with a handful of tokens
or none; GPTQ and the format scores would then quantize it blind. For every routed expert with
fewer than MIN_EXPERT_TOKENS tokens (a starved expert) this estimates what its inputs look like:

- its gate/up input (the MoE input): pooled with the tokens routed to its nearest neighbours, the
  experts whose router rows point the most the same way (cosine), until MIN_EXPERT_TOKENS tokens;
- its down input (its own hidden activation, which no other expert shares): its own tokens plus
  synthetic ones, inputs drawn from the pooled mean and covariance and run through its own
  gate/up and activation, up to MIN_EXPERT_TOKENS.

The estimate keeps the shape of the second moment (what GPTQ and the scores use) and weighs it by
the expert's own routing count (at least one token), so a rarely routed expert still counts for
less in the budget but is never quantized without statistics.

`RoutingWeights` gives calibration each routed token's weight in its expert's share of the layer
output (the router's top-k probability, renormalised as the model does), so within an expert a
token counts with g^2 (calibrate_inputs then keeps the mass of the expert's token count: the
planner's bits per expert follow routing frequency, GPTQ's objective each token's weight).
"""

from __future__ import annotations

import re

from thin.ir import MLP, Model, MoE, Program

MIN_EXPERT_TOKENS = 128
_EXPERT_INPUT = re.compile(r"layers\.(\d+)\.expert\.(\d+)\.(down\.)?in")


class RoutingWeights:
    """routing(input key, x) -> each row's routing weight when `x` is a routed expert's input, else
    None. The rows of an expert's gate/up input are the tokens routed to it, so their weights are the
    router's (softmax over the experts, top-k, renormalised when the model does: the runtime's
    arithmetic, in float32); its down input follows for the same tokens (run_mlp runs gate/up, then
    down) and reuses them."""

    def __init__(self, program: Program):
        self.program = program
        self.routers: dict[int, tuple] = {}
        self.last: dict[tuple[int, int], object] = {}

    def __call__(self, key: str, x):
        import torch
        import torch.nn.functional as F

        match = _EXPERT_INPUT.fullmatch(key)
        if match is None:
            return None
        layer, expert = int(match.group(1)), int(match.group(2))
        if match.group(3):
            g = self.last.pop((layer, expert), None)
            return g if g is not None and g.shape[0] == x.shape[0] else None
        moe = self.program.model.layers[layer].ffn
        if layer not in self.routers:  # decoded once, kept on the device (not copied there per expert)
            bias = _decode(self.program, moe.router.bias)
            self.routers[layer] = (_decode(self.program, moe.router.weight).to(x.device),
                                   None if bias is None else bias.to(x.device))
        weight, bias = self.routers[layer]
        probs = torch.softmax(F.linear(x, weight, bias), dim=-1)
        top, chosen = torch.topk(probs, moe.top_k, dim=-1)
        if moe.normalize_top_k:
            top = top / top.sum(dim=-1, keepdim=True)
        g = (top * (chosen == expert)).sum(-1)
        self.last[(layer, expert)] = g
        return g


def routing_weights(model: Model, sums: dict) -> dict[str, list[float]]:
    """{"layers.L": [mean squared routing weight of the tokens routed to expert e, ...]} (0 for none)."""
    out = {}
    for layer in model.layers:
        if isinstance(layer.ffn, MoE):
            slots = [sums.get(f"layers.{layer.index}.expert.{e}.in", {}) for e in range(layer.ffn.num_experts)]
            out[f"layers.{layer.index}"] = [round(s["weight2"] / s["count"], 4) if s.get("count") else 0.0
                                            for s in slots]
    return out


def routed_counts(model: Model, sums: dict) -> dict[str, list[int]]:
    """{"layers.L": [tokens routed to expert e, ...]} for every MoE layer, from the calibration sums."""
    return {f"layers.{layer.index}": [sums.get(f"layers.{layer.index}.expert.{e}.in", {}).get("count", 0)
                                      for e in range(layer.ffn.num_experts)]
            for layer in model.layers if isinstance(layer.ffn, MoE)}


def fill_starved_experts(program: Program, sums: dict, min_tokens: int = MIN_EXPERT_TOKENS) -> list[str]:
    """Give every starved expert estimated statistics in `sums` (calibrate_inputs' per-input sums of
    x x^T, x and |x|max, and the real token count, which stays as it was); return their input keys
    ("layers.L.expert.E"), in layer and expert order."""
    import torch

    starved = []
    for layer in program.model.layers:
        if not isinstance(layer.ffn, MoE):
            continue
        prefix = f"layers.{layer.index}.expert."
        counts = [sums.get(f"{prefix}{e}.in", {}).get("count", 0) for e in range(layer.ffn.num_experts)]
        if not any(c < min_tokens for c in counts) or not any(counts):
            continue
        router = _decode(program, layer.ffn.router.weight)
        similarity = torch.nn.functional.normalize(router, dim=1) @ torch.nn.functional.normalize(router, dim=1).T
        for e, count in enumerate(counts):
            if count >= min_tokens:
                continue
            neighbours = [j for j in torch.argsort(similarity[e], descending=True).tolist() if j != e and counts[j]]
            pool, pooled = ([e] if count else []), count
            for j in neighbours:
                if pooled >= min_tokens:
                    break
                pool.append(j)
                pooled += counts[j]
            _estimate(program, layer.ffn.experts[e], sums, prefix, e, pool, min_tokens, seed=layer.index * 65536 + e)
            starved.append(f"{prefix}{e}")
    return starved


def _estimate(program, expert: MLP, sums: dict, prefix: str, e: int, pool: list[int], min_tokens: int,
              seed: int) -> None:
    import torch

    parts = [sums[f"{prefix}{j}.in"] for j in pool]
    n = sum(p["count"] for p in parts)
    weighted = sum(p["hessian"] for p in parts)  # sum g^2 x x^T over the pooled tokens
    g2 = sum(p.get("weight2", p["count"]) for p in parts) / n  # their mean squared routing weight
    mean = sum(p["sum"] for p in parts) / n
    own = sums.get(f"{prefix}{e}.in", {}).get("count", 0)
    weight = max(own, 1)  # scaled to the expert's own routing count, never to nothing
    sums[f"{prefix}{e}.in"] = {"hessian": weighted / n * weight, "sum": mean * weight, "count": own,
                               "weight2": g2 * weight, "absmax": torch.stack([p["absmax"] for p in parts]).amax(0)}
    # Synthetic inputs with the pooled mean and covariance (E[x x^T] without the routing weights,
    # taken as independent of x), through the expert's own gate/up.
    covariance = weighted / (g2 * n) - torch.outer(mean, mean)
    eigenvalues, basis = torch.linalg.eigh(covariance.double())
    root = (basis * eigenvalues.clamp(min=0).sqrt()).float()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    synthetic = min_tokens - own
    noise = torch.randn(synthetic, mean.numel(), generator=generator).to(mean.device)
    h = _hidden(program, expert, mean + noise @ root.T)
    down = sums.get(f"{prefix}{e}.down.in")
    real_hh = down["hessian"] if down else 0
    real_sum = down["sum"] if down else 0
    per_token = (real_hh + g2 * (h.T @ h)) / min_tokens
    sums[f"{prefix}{e}.down.in"] = {
        "hessian": per_token * weight, "sum": (real_sum + h.sum(0)) / min_tokens * weight, "count": own,
        "weight2": g2 * weight,
        "absmax": torch.maximum(down["absmax"], h.abs().amax(0)) if down else h.abs().amax(0)}


def _decode(program: Program, name: str | None):
    return None if name is None else program.decoded(name)


def _hidden(program: Program, expert: MLP, x):
    """The expert's input to its down projection for inputs x [n, hidden]. The same arithmetic as the
    runtime's run_mlp (passes do not import the runtime): act(gate) * (up + up_offset), gate and up
    clamped first when the MLP has a limit, silu with a gain when alpha is not 1."""
    import torch
    import torch.nn.functional as F

    def linear(lin):
        w, b = _decode(program, lin.weight), _decode(program, lin.bias)
        return F.linear(x, w.to(x.device), None if b is None else b.to(x.device))

    activations = {"silu": lambda g: g * torch.sigmoid(expert.alpha * g), "gelu": F.gelu, "relu": F.relu,
                   "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}
    if not expert.gated:
        return activations[expert.activation](linear(expert.up))
    if expert.gate_up is not None:
        gate, up = linear(expert.gate_up).chunk(2, dim=-1)
    else:
        gate, up = linear(expert.gate), linear(expert.up)
    if expert.limit is not None:
        gate, up = gate.clamp(max=expert.limit), up.clamp(-expert.limit, expert.limit)
    return activations[expert.activation](gate) * (up + expert.up_offset)
