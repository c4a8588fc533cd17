"""certify_ffn_levels: the elastic FFN levels of a compiled model, each a cheaper model within a byte
target, with its measured quality.

The FFN channels are in importance order (order_superblocks.py), so a level is a channel count per
layer (whole 128-channel superblocks). For a keep fraction f, the level reads at most f of the FFN
weight bytes:

- per-layer counts (`per_layer`): a multiple-choice knapsack (plan_precision.solve) over the layers, each
  option a channel count with its bytes and its cost: the KLD against the compiled model when only that
  layer is cut (with its correction), measured on calibration windows. Sensitive layers keep more.
- the correction of a cut layer, from the down input's calibration statistics (second moments H, mean
  mu, covariance C = H - mu mu^T) and the down weight as compiled, with K the kept channels and D the
  dropped ones: "shift" adds the dropped channels' mean output W_D mu_D; "scale" also multiplies the
  kept channels by 1 + d, d minimising the expected output error, the solution of
  ((W_K^T W_K) o C_KK) d = rowsum((W_K^T W_D) o C_KD), with shift W_D mu_D - W_K (d o mu_K). Both are
  tiny tensors per level and layer ([hidden] and [k]); no weight is copied.

Each level is then measured like the certificate (certify_model.py): teacher-forced KLD, top-1, cosine,
perplexity and greedy agreement against the source on the same held-out prompts, with the bytes of
weights a decoded token reads at that level.
"""

from __future__ import annotations

import dataclasses

from thin.ir import Encoding, FFNLevel, Program, Tensor, formats
from thin.ir.elastic import SUPERBLOCK, bytes_per_token, ffn_bytes, ffn_weights, ffn_widths, prefix_bytes

from .calibrate_inputs import load_statistics
from .certify_model import heldout_prompts
from .order_superblocks import FFNLevelOptions, dense_mlps
from .plan_precision import BudgetError, solve
from .runner import PassContext

MAX_OPTIONS = 16  # channel counts probed per layer (evenly spread superblock counts beyond that)
PROBE_WINDOWS = 4


def certify_ffn_levels(program: Program, ctx: PassContext) -> Program:
    """Afterwards model.ffn_levels holds the full model and one level per keep fraction asked, by
    decreasing keep: per layer the channels it runs, within the level's share of the FFN weight bytes,
    and the shift and scale tensors that stand in for the dropped channels; the certificate
    (annotations['certificate']) holds `ffn_levels`: how they were made and, per level, its channels,
    bytes read and measurements on the held-out prompts."""
    options: FFNLevelOptions = ctx.config.ffn
    if ctx.evaluator is None or "ffn_order" not in program.annotations:
        raise ValueError("certify_ffn_levels needs an evaluator and importance-ordered FFNs (order_superblocks)")
    dense_mlps(program)
    widths = ffn_widths(program.model)
    corrections = _Corrections(program, ctx, options.correction)
    costs = _layer_costs(ctx, ctx.evaluator.session(program), widths, corrections) if options.per_layer else None
    model, weights = program.model, dict(program.weights)
    records = ffn_weights(model)
    full = ffn_bytes(model)
    none = (None,) * len(widths)
    plans = [(keep, _channels(keep, widths, records, full, costs)) for keep in sorted(options.levels, reverse=True)]
    for i, width in enumerate(widths):  # layer by layer: each layer's statistics are read once for every level
        for _, channels in plans:
            if channels[i] < width:
                corrections.get(i, channels[i])
    levels, tensors = [FFNLevel(1.0, tuple(widths), none, none)], []
    for j, (keep, channels) in enumerate(plans, start=1):
        shift, scale = [], []
        for i, k in enumerate(channels):
            s, b = corrections.get(i, k) if k < widths[i] else (None, None)
            for value, label, out in ((b, "shift", shift), (s, "scale", scale)):
                name = None if value is None else f"layers.{i}.ffn.levels.{j}.{label}"
                if name is not None:
                    tensors.append(Tensor(name, f"ffn.level.{label}", i, tuple(value.shape), Encoding("f32"), "f32"))
                    weights[name] = _loader(value)
                out.append(name)
        levels.append(FFNLevel(float(keep), channels, tuple(shift), tuple(scale)))
    model = dataclasses.replace(model, tensors=model.tensors + tuple(tensors), ffn_levels=tuple(levels))
    program = program.replace(model=model, weights=weights)
    measured = _measure_levels(ctx, program)
    block = {"method": {"importance": options.importance, "per_layer": options.per_layer,
                        "correction": options.correction, "superblock": SUPERBLOCK},
             "levels": [{"keep": level.keep, "channels": list(level.channels),
                         "ffn_bytes": ffn_bytes(model, level.channels), "ffn_bytes_full": full,
                         "bytes_per_token": bytes_per_token(model, level), "measured": m}
                        for level, m in zip(levels, measured)]}
    certificate = dict(program.annotations.get("certificate") or {"status": "EXACT"})
    return program.replace(annotations={**program.annotations, "certificate": {**certificate, "ffn_levels": block}})


def candidate_counts(width: int) -> list[int]:
    """The channel counts a layer may run below `width`: whole superblocks, at most MAX_OPTIONS of them."""
    blocks = list(range(SUPERBLOCK, width, SUPERBLOCK))
    if len(blocks) > MAX_OPTIONS:
        blocks = [blocks[round(i * (len(blocks) - 1) / (MAX_OPTIONS - 1))] for i in range(MAX_OPTIONS)]
    return blocks


def _channels(keep: float, widths: list[int], records, full: int, costs) -> tuple[int, ...]:
    """Per layer, the channels level `keep` runs: at most keep x the FFN bytes in all."""
    budget = int(keep * full)
    if costs is None:  # the same share everywhere, whole superblocks, at least one
        return tuple(min(w, max(SUPERBLOCK, SUPERBLOCK * int(keep * w // SUPERBLOCK))) for w in widths)
    items = {i: [(sum(prefix_bytes(r, k, w) for r in records[i]), cost) for k, cost in costs[i]]
             for i, w in enumerate(widths)}
    try:
        choice = solve(items, budget)
    except BudgetError:
        raise BudgetError(f"FFN level {keep:g} asks for {budget} bytes of FFN weights; one superblock per layer "
                          "needs more") from None
    return tuple(costs[i][choice[i]][0] for i in range(len(widths)))


def _layer_costs(ctx: PassContext, session, widths: list[int], corrections) -> list[list[tuple[int, float]]]:
    """Per layer, (channels, KLD against the compiled model when only this layer runs that many, with
    its correction) for every candidate count, the full width (KLD 0) last. A probe of layer i runs
    only layers i on, from each window's hidden state entering layer i (cached once: the layers
    before it are the compiled model's), so the logits are those of the whole forward pass."""
    import torch

    from .score_formats import probe_windows, reference_logprobs

    windows = probe_windows(ctx, PROBE_WINDOWS)
    hidden = [session.layer_inputs(w) for w in windows]
    reference = reference_logprobs(session, windows, hidden)
    out = []
    for i, width in enumerate(widths):
        ctx.report("FFN levels: layer sensitivity", i, len(widths))
        options = []
        for k in candidate_counts(width):
            scale, shift = corrections.get(i, k)
            prefix = [None] * len(widths)
            prefix[i] = k
            scales, shifts = [None] * len(widths), [None] * len(widths)
            scales[i], shifts[i] = scale, shift
            kld = 0.0
            with session.ffn_prefix(prefix, scales, shifts):
                for h, ref in zip(hidden, reference):
                    logprobs = torch.log_softmax(session.forward_from(i, h[i]).float(), -1)
                    kld += float((ref.exp() * (ref - logprobs)).sum(-1).mean())
            options.append((k, kld / len(windows)))
        out.append([*options, (width, 0.0)])
    ctx.report("FFN levels: layer sensitivity", len(widths), len(widths))
    return out


class _Corrections:
    """(scale [k] or None, shift [hidden] or None) of layer i cut to k channels, computed on first use
    from the down input's (permuted) statistics and the down weight as compiled (module docstring)."""

    def __init__(self, program: Program, ctx: PassContext, kind: str):
        self.program, self.ctx, self.kind = program, ctx, kind
        self.mlps = dense_mlps(program)
        self.layer: tuple[int, dict] | None = None
        self.cache: dict[tuple[int, int], tuple] = {}

    def _layer(self, i: int) -> dict:
        import torch

        if self.layer is None or self.layer[0] != i:
            name = self.mlps[i].down.weight
            device = self.ctx.device
            dtype = torch.float64 if torch.device(device).type == "cpu" else torch.float32
            # Decoded on the compile's device (llama-8b's int4 down: 59M weights a layer; the same values).
            w = self.program.decoded(name, device).to(dtype=dtype)
            stats = load_statistics(self.ctx, self.program, name)
            mean = stats["mean"].to(device=device, dtype=dtype)
            covariance = stats["hessian"].to(device=device, dtype=dtype) - torch.outer(mean, mean)
            self.layer = (i, {"w": w, "mean": mean, "gram": (w.T @ w) * covariance})
        return self.layer[1]

    def get(self, i: int, k: int) -> tuple:
        if self.kind == "none":
            return None, None
        if (i, k) not in self.cache:
            self.cache[(i, k)] = tuple(None if t is None else t.float().cpu() for t in self._solve(self._layer(i), k))
        return self.cache[(i, k)]

    def _solve(self, layer: dict, k: int) -> tuple:
        import torch

        w, mean, gram = layer["w"], layer["mean"], layer["gram"]
        shift = w[:, k:] @ mean[k:]
        if self.kind == "shift":
            return None, shift
        a = gram[:k, :k]
        b = gram[:k, k:].sum(1)
        ridge = 1e-6 * float(a.diagonal().mean().clamp_min(1e-30))
        eye = torch.eye(k, dtype=a.dtype, device=a.device)
        for _ in range(4):
            factor, info = torch.linalg.cholesky_ex(a + ridge * eye)
            if int(info) == 0:
                break
            ridge *= 100
        d = torch.cholesky_solve(b[:, None], factor)[:, 0]
        if not bool(torch.isfinite(d).all()):
            return None, shift
        return 1 + d, shift - w[:, :k] @ (d * mean[:k])


def _loader(value):
    def load():
        return formats.encode("f32", value)

    return load


def _measure_levels(ctx: PassContext, program: Program) -> list[dict]:
    """Each level's measurements against the source on the certificate's held-out prompts (the full
    level's are the certificate's own when certify_model ran)."""
    options = ctx.config.certify
    ids = ctx.evaluator.encode(ctx.heldout_text)
    positions = min(options.positions, program.model.max_position_embeddings - 1)
    prompts = heldout_prompts(ids, options.prompts, positions)
    reference = ctx.evaluator.session(ctx.source)
    candidate = ctx.evaluator.session(program)
    heads = [p[:min(len(p) // 2, program.model.max_position_embeddings - options.generate)] for p in prompts]
    expected = [reference.greedy(h, options.generate) for h in heads]
    certificate = program.annotations.get("certificate")
    out = []
    for j in range(len(program.model.ffn_levels)):
        ctx.report("FFN levels: certify", j, len(program.model.ffn_levels))
        if j == 0 and certificate is not None and "measured" in certificate:
            out.append(dict(certificate["measured"]))
            continue
        with candidate.ffn_level(j):
            stats = ctx.evaluator.compare(reference, candidate, prompts)
            agreement = []
            for head, want in zip(heads, expected):
                got = candidate.greedy(head, options.generate)
                same = next((t for t, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
                agreement.append(same / options.generate)
        out.append({"mean_kld": stats["mean_kld"], "max_kld": stats["max_kld"], "kld_p99": stats["kld_p99"],
                    "top1_agreement": stats["top1_agreement"], "mean_cosine": stats["mean_cosine"],
                    "min_cosine": stats["min_cosine"], "perplexity_source": stats["perplexity_reference"],
                    "perplexity_compiled": stats["perplexity_candidate"],
                    "greedy_agreement": sum(agreement) / len(agreement), "positions": stats["positions"]})
    ctx.report("FFN levels: certify", len(out), len(out))
    return out


__all__ = ["FFNLevelOptions", "candidate_counts", "certify_ffn_levels"]
