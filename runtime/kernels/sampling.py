"""Choosing the next token on the device: greedy argmax, or a seeded draw after temperature,
top-k, top-p and min-p, each with the semantics of runtime/sampling.py (transformers' processors).

One program finishes a step: it picks the token, writes it where the next step reads it and into
the step's slot of the output buffer, marks it seen (for the repetition penalty), advances the
step counter and, in a decode step, the position, so a captured step needs nothing from the host.
The draw is inverse-CDF sampling with one uniform number from Philox (`tl.rand`) keyed by the
seed and the step, both on the device: the same seed gives the same tokens, replayed or not.
Top-k and the sort top-p needs are torch's (`topk`, `sort`), which a CUDA graph captures too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_power_of_2


@triton.jit
def _finish(token, token_ptr, out_ptr, seen_ptr, pos_ptr, step_ptr, ADVANCE: tl.constexpr, SEEN: tl.constexpr):
    """Publish the token: next input, out[step], seen; step += 1 (and pos += 1 with ADVANCE)."""
    step = tl.load(step_ptr)
    tl.store(token_ptr, token.to(tl.int64))
    tl.store(out_ptr + step, token.to(tl.int64))
    if SEEN:
        tl.store(seen_ptr + token, 1)
    if ADVANCE:
        tl.store(pos_ptr, tl.load(pos_ptr) + 1)
    tl.store(step_ptr, step + 1)


@triton.jit
def _greedy_kernel(logits_ptr, V, token_ptr, out_ptr, seen_ptr, pos_ptr, step_ptr, BLOCK: tl.constexpr,
                   ADVANCE: tl.constexpr, SEEN: tl.constexpr):
    """argmax over V logits, the lowest index among equal maxima (as torch.argmax)."""
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    where = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    for v0 in range(0, V, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + v, mask=v < V, other=float("-inf")).to(tl.float32)
        better = x > best
        where = tl.where(better, v, where)
        best = tl.where(better, x, best)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, where, 2147483647), axis=0)
    _finish(token, token_ptr, out_ptr, seen_ptr, pos_ptr, step_ptr, ADVANCE, SEEN)


@triton.jit
def uniform_kernel(seed_ptr, step_ptr, out_ptr):
    """The uniform number the draw of this step uses (for tests: same seed and step, same number)."""
    tl.store(out_ptr, tl.rand(tl.load(seed_ptr), tl.load(step_ptr)))


@triton.jit
def _sample_kernel(vals_ptr, idx_ptr, n, inv_temperature, top_p, min_p, seed_ptr, token_ptr, out_ptr, seen_ptr,
                   pos_ptr, step_ptr, BLOCK: tl.constexpr, SORTED: tl.constexpr, TOP_P: tl.constexpr,
                   MIN_P: tl.constexpr, ADVANCE: tl.constexpr, SEEN: tl.constexpr):
    """Draw from softmax(vals / T) over the candidates that survive top-p and min-p.

    vals: n candidate logits, sorted descending when SORTED (then idx maps them to token ids)."""
    # Pass 1: the largest scaled logit and the softmax's normaliser.
    top = tl.load(vals_ptr).to(tl.float32) * inv_temperature  # the largest, when SORTED
    if not SORTED:
        for v0 in range(0, n, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            x = tl.load(vals_ptr + v, mask=v < n, other=float("-inf")).to(tl.float32) * inv_temperature
            top = tl.maximum(top, tl.max(x, axis=0))
    total = 0.0
    for v0 in range(0, n, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = tl.load(vals_ptr + v, mask=v < n, other=float("-inf")).to(tl.float32) * inv_temperature
        total += tl.sum(tl.exp(x - top), axis=0)
    # Pass 2: the kept mass. top-p keeps a candidate while the mass strictly before it is < p
    # (sorted descending, that is runtime/sampling.apply_top_p); min-p keeps p >= min_p * p_max.
    kept = 0.0
    before = 0.0
    for v0 in range(0, n, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        e = tl.exp(tl.load(vals_ptr + v, mask=v < n, other=float("-inf")).to(tl.float32) * inv_temperature - top)
        keep = v < n
        if TOP_P:
            keep &= (before + tl.cumsum(e, axis=0) - e) < top_p * total
        if MIN_P:
            keep &= e >= min_p
        before += tl.sum(e, axis=0)
        kept += tl.sum(tl.where(keep, e, 0.0), axis=0)
    # Pass 3: the first kept candidate whose cumulative kept mass exceeds u * kept.
    target = tl.rand(tl.load(seed_ptr), tl.load(step_ptr)) * kept
    chosen = tl.full([], -1, dtype=tl.int32)
    last = tl.full([], -1, dtype=tl.int32)
    running = 0.0
    before = 0.0
    for v0 in range(0, n, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        e = tl.exp(tl.load(vals_ptr + v, mask=v < n, other=float("-inf")).to(tl.float32) * inv_temperature - top)
        keep = v < n
        if TOP_P:
            keep &= (before + tl.cumsum(e, axis=0) - e) < top_p * total
        if MIN_P:
            keep &= e >= min_p
        before += tl.sum(e, axis=0)
        ek = tl.where(keep, e, 0.0)
        cum = running + tl.cumsum(ek, axis=0)
        hit = keep & (cum > target)
        first = tl.min(tl.where(hit, v, 2147483647), axis=0)
        chosen = tl.where((chosen < 0) & (first < 2147483647), first, chosen)
        last = tl.maximum(last, tl.max(tl.where(keep, v, -1), axis=0))
        running += tl.sum(ek, axis=0)
    # Rounding can leave u * kept just above the sum: then the last kept candidate.
    token = tl.where(chosen < 0, last, chosen)
    if SORTED:
        token = tl.load(idx_ptr + token).to(tl.int32)
    _finish(token, token_ptr, out_ptr, seen_ptr, pos_ptr, step_ptr, ADVANCE, SEEN)


@triton.jit
def _penalty_kernel(logits_ptr, seen_ptr, out_ptr, V, penalty, BLOCK: tl.constexpr):
    """Repetition penalty on every token seen so far: positive logits / penalty, negative * penalty."""
    v = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + v, mask=v < V, other=0.0).to(tl.float32)
    seen = tl.load(seen_ptr + v, mask=v < V, other=0) != 0
    x = tl.where(seen, tl.where(x < 0, x * penalty, x / penalty), x)
    tl.store(out_ptr + v, x, mask=v < V)


class Sampler:
    """Picks the next token of a step from logits [V] (any float dtype) on the device.

    State lives in device tensors the caller owns: `token` [1] int64 (the next step's input),
    `out` (token of step i at out[i]), `seen` [V] int8, `pos` and `step` [1] int32, `seed` [1]
    int64. The step moves on by one; with `advance_pos` the position too (a decode step). `key`
    names the sampler for whoever caches captured steps by it."""

    def __init__(self, options, vocab_size: int, softcap: float | None, key=None):
        self.options, self.vocab, self.softcap, self.key = options, vocab_size, softcap, key

    def __call__(self, logits, token, out, seen, pos, step, seed, *, advance_pos: bool) -> None:
        advance = advance_pos
        o = self.options
        track = o.repetition_penalty != 1.0
        if self.softcap is not None:
            logits = torch.tanh(logits.float() / self.softcap) * self.softcap
        if track:
            penalised = torch.empty(self.vocab, dtype=torch.float32, device=logits.device)
            block = 1024
            _penalty_kernel[(-(-self.vocab // block),)](logits, seen, penalised, self.vocab,
                                                        float(o.repetition_penalty), BLOCK=block)
            logits = penalised
        if o.greedy:
            _greedy_kernel[(1,)](logits, self.vocab, token, out, seen, pos, step, BLOCK=1024, ADVANCE=advance,
                                 SEEN=track, num_warps=8)
            return
        sort = (o.top_k > 0 and o.top_k < self.vocab) or o.top_p < 1.0 or o.min_p > 0.0
        if 0 < o.top_k < self.vocab:
            vals, idx = torch.topk(logits.float(), o.top_k)
        elif sort:
            vals, idx = torch.sort(logits.float(), descending=True)
        else:
            vals, idx = logits, logits
        n = vals.shape[0]
        _sample_kernel[(1,)](vals, idx, n, 1.0 / o.temperature, float(o.top_p), float(o.min_p), seed, token, out,
                             seen, pos, step, BLOCK=min(1024, next_power_of_2(n)), SORTED=sort, TOP_P=o.top_p < 1.0,
                             MIN_P=o.min_p > 0.0, ADVANCE=advance, SEEN=track, num_warps=8)


def reference_draw(logits: torch.Tensor, options, u: float, seen: torch.Tensor | None = None) -> int:
    """The token Sampler picks for uniform number `u`, by runtime/sampling.process_logits and the
    inverse CDF over token ids in the candidate order (sorted descending when a filter needs it)."""
    from ..sampling import process_logits

    seen_ids = None if seen is None else torch.nonzero(seen).reshape(-1)
    processed = process_logits(logits.float(), options, seen_ids)
    if options.greedy:
        return int(processed.argmax())
    probs = torch.softmax(processed.double(), dim=-1)
    sort = (0 < options.top_k < logits.shape[-1]) or options.top_p < 1.0 or options.min_p > 0.0
    order = torch.argsort(processed, descending=True, stable=True) if sort else torch.arange(logits.shape[-1])
    cum = torch.cumsum(probs[order], 0)
    pick = int(torch.searchsorted(cum, torch.tensor([u], dtype=torch.float64), right=True)[0])
    return int(order[min(pick, len(order) - 1)])
