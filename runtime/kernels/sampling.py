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
    _finish(_argmax(logits_ptr, V, BLOCK), token_ptr, out_ptr, seen_ptr, pos_ptr, step_ptr, ADVANCE, SEEN)


@triton.jit
def uniform_kernel(seed_ptr, step_ptr, out_ptr):
    """The uniform number the draw of this step uses (for tests: same seed and step, same number)."""
    tl.store(out_ptr, tl.rand(tl.load(seed_ptr), tl.load(step_ptr)))


@triton.jit
def _sample_kernel(vals_ptr, idx_ptr, n, inv_temperature, top_p, min_p, seed_ptr, token_ptr, out_ptr, seen_ptr,
                   pos_ptr, step_ptr, BLOCK: tl.constexpr, SORTED: tl.constexpr, ADVANCE: tl.constexpr,
                   SEEN: tl.constexpr):
    """Draw from softmax(vals / T) over the candidates that survive top-p and min-p (_draw).

    vals: n candidate logits, sorted descending when SORTED (then idx maps them to token ids)."""
    token = _draw(vals_ptr, n, inv_temperature, top_p, min_p, tl.rand(tl.load(seed_ptr), tl.load(step_ptr)), SORTED,
                  BLOCK)
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
            # One program walks the logits: blocks of up to 8192 (16 a thread), so a 32000 vocabulary is 4
            # dependent L2 round trips, not 32 (the first largest index whatever the block).
            _greedy_kernel[(1,)](logits, self.vocab, token, out, seen, pos, step,
                                 BLOCK=min(next_power_of_2(self.vocab), 8192), ADVANCE=advance, SEEN=track,
                                 num_warps=16)
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
                             seen, pos, step, BLOCK=min(1024, next_power_of_2(n)), SORTED=sort, ADVANCE=advance,
                             SEEN=track, num_warps=8)


# ---- a batch of sequences, each with its own options (the serving engine's step) ----------------

@triton.jit
def _rows_penalty_kernel(logits_ptr, out_ptr, seen_ptr, counts_ptr, rep_ptr, freq_ptr, pres_ptr, V,
                         BLOCK: tl.constexpr):
    """Row r: the repetition penalty of the tokens seen (as _penalty_kernel), then OpenAI's
    frequency and presence penalties over the tokens generated (counts), float32 out."""
    r = tl.program_id(0)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = v < V
    x = tl.load(logits_ptr + r * V + v, mask=mask, other=0.0).to(tl.float32)
    penalty = tl.load(rep_ptr + r)
    seen = tl.load(seen_ptr + r * V + v, mask=mask, other=0) != 0
    x = tl.where(seen & (penalty != 1.0), tl.where(x < 0, x * penalty, x / penalty), x)
    count = tl.load(counts_ptr + r * V + v, mask=mask, other=0).to(tl.float32)
    x = x - tl.load(freq_ptr + r) * count - tl.where(count > 0, tl.load(pres_ptr + r), 0.0)
    tl.store(out_ptr + r * V + v, x, mask=mask)


@triton.jit
def _argmax(x_ptr, V, BLOCK: tl.constexpr):
    """The lowest index of the largest of V float32 values (as torch.argmax)."""
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    where = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    for v0 in range(0, V, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + v, mask=v < V, other=float("-inf")).to(tl.float32)
        better = x > best
        where = tl.where(better, v, where)
        best = tl.where(better, x, best)
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, where, 2147483647), axis=0)


@triton.jit
def _draw(vals_ptr, n, inv_temperature, top_p, min_p, u, SORTED: tl.constexpr, BLOCK: tl.constexpr):
    """The index of the candidate drawn for uniform number u from softmax(vals / T), in three passes:
    the largest scaled logit and the normaliser; the kept mass, where top-p keeps a candidate while
    the mass strictly before it is < p (sorted descending, that is runtime/sampling.apply_top_p) and
    min-p keeps p >= min_p * p_max; then the first kept candidate whose cumulative kept mass exceeds
    u * kept (rounding can leave that just above the sum: then the last kept one). top_p 1 keeps
    every candidate (the mass before one is finite), min_p 0 too (e >= 0)."""
    top = tl.load(vals_ptr).to(tl.float32) * inv_temperature
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
    limit = tl.where(top_p >= 1.0, float("inf"), top_p * total)
    kept = 0.0
    before = 0.0
    for v0 in range(0, n, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        e = tl.exp(tl.load(vals_ptr + v, mask=v < n, other=float("-inf")).to(tl.float32) * inv_temperature - top)
        keep = (v < n) & ((before + tl.cumsum(e, axis=0) - e) < limit) & (e >= min_p)
        before += tl.sum(e, axis=0)
        kept += tl.sum(tl.where(keep, e, 0.0), axis=0)
    target = u * kept
    chosen = tl.full([], -1, dtype=tl.int32)
    last = tl.full([], -1, dtype=tl.int32)
    running = 0.0
    before = 0.0
    for v0 in range(0, n, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        e = tl.exp(tl.load(vals_ptr + v, mask=v < n, other=float("-inf")).to(tl.float32) * inv_temperature - top)
        keep = (v < n) & ((before + tl.cumsum(e, axis=0) - e) < limit) & (e >= min_p)
        before += tl.sum(e, axis=0)
        ek = tl.where(keep, e, 0.0)
        cum = running + tl.cumsum(ek, axis=0)
        hit = keep & (cum > target)
        first = tl.min(tl.where(hit, v, 2147483647), axis=0)
        chosen = tl.where((chosen < 0) & (first < 2147483647), first, chosen)
        last = tl.maximum(last, tl.max(tl.where(keep, v, -1), axis=0))
        running += tl.sum(ek, axis=0)
    return tl.where(chosen < 0, last, chosen)


@triton.jit
def _rows_pick_kernel(x_ptr, vals_ptr, idx_ptr, V, inv_t_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, step_ptr,
                      token_ptr, pos_ptr, active_ptr, seen_ptr, counts_ptr, BLOCK: tl.constexpr,
                      SORT: tl.constexpr, TRACK: tl.constexpr):
    """Row r: argmax (inv_t[r] == 0, greedy) or a draw with row r's temperature and filters, from
    x [rows, V] (or, for a row with a filter, from its candidates sorted descending, vals/idx: only
    when SORT). Then the row's state moves on: token, step, and for an active row its position;
    TRACK: seen and generated counts too."""
    r = tl.program_id(0)
    inv_t = tl.load(inv_t_ptr + r)
    top_k = tl.load(top_k_ptr + r)
    top_p = tl.load(top_p_ptr + r)
    min_p = tl.load(min_p_ptr + r)
    step = tl.load(step_ptr + r)
    if inv_t == 0.0:
        token = _argmax(x_ptr + r * V, V, BLOCK)
    else:
        u = tl.rand(tl.load(seed_ptr + r), step)
        # A row without filters draws over token ids in order, as Sampler does (SORTED=False).
        top_k_on = (top_k > 0) & (top_k < V)
        filters = top_k_on.to(tl.int32) + (top_p < 1.0).to(tl.int32) + (min_p > 0.0).to(tl.int32)
        if SORT:
            if filters > 0:
                n = tl.where(top_k_on, top_k, V)
                token = tl.load(idx_ptr + r * V + _draw(vals_ptr + r * V, n, inv_t, top_p, min_p, u, True, BLOCK))
                token = token.to(tl.int32)
            else:
                token = _draw(x_ptr + r * V, V, inv_t, top_p, min_p, u, False, BLOCK)
        else:
            token = _draw(x_ptr + r * V, V, inv_t, top_p, min_p, u, False, BLOCK)
    tl.store(token_ptr + r, token.to(tl.int64))
    tl.store(step_ptr + r, step + 1)
    if tl.load(active_ptr + r) != 0:
        tl.store(pos_ptr + r, tl.load(pos_ptr + r) + 1)
    if TRACK:
        tl.store(seen_ptr + r * V + token, 1)
        tl.store(counts_ptr + r * V + token, tl.load(counts_ptr + r * V + token) + 1)


class RowOptions:
    """Each sequence's sampling options as device columns (row r: the sequence in batch slot r),
    the inputs of `pick_rows`."""

    def __init__(self, rows: int, device):
        def new(dtype, fill=0):
            return torch.full((rows,), fill, dtype=dtype, device=device)

        self.inv_temperature = new(torch.float32)
        self.top_k, self.top_p, self.min_p = new(torch.int32), new(torch.float32, 1.0), new(torch.float32)
        self.repetition, self.frequency, self.presence = new(torch.float32, 1.0), new(torch.float32), new(torch.float32)

    def set(self, row: int, options, frequency: float = 0.0, presence: float = 0.0) -> None:
        """Row `row` takes `options` (GenerationOptions) and OpenAI's two penalties."""
        # Written through one host tensor per column: the same float32 roundings Sampler's arguments get.
        values = {"inv_temperature": 0.0 if options.greedy else 1.0 / options.temperature,
                  "top_k": min(options.top_k, 2**31 - 1), "top_p": options.top_p, "min_p": options.min_p,
                  "repetition": options.repetition_penalty, "frequency": frequency, "presence": presence}
        for name, value in values.items():
            column = getattr(self, name)
            column[row:row + 1].copy_(torch.tensor([value], dtype=column.dtype))

    def move(self, src: int, dst: int) -> None:
        for column in vars(self).values():
            column[dst] = column[src]


def pick_rows(logits, options: RowOptions, rows: int, *, token, step, pos, active, seed, seen, counts,
              softcap: float | None, sort: bool, track: bool) -> None:
    """Pick the next token of each of the first `rows` sequences from logits [rows, V] on the device:
    greedy or drawn with that row's options (as Sampler picks for one sequence: the same
    processing, the same uniform number from the row's seed and step). `sort`: some row has a
    top-k, top-p or min-p filter (their candidates are sorted; without it no row may have one).
    `track`: some row has a penalty (seen [rows, V] int8 marks prompt and generated tokens for the
    repetition penalty; counts [rows, V] int32 counts generated ones for OpenAI's two)."""
    V = logits.shape[-1]
    x = logits.float() if softcap is None else torch.tanh(logits.float() / softcap) * softcap
    if track:
        penalised = torch.empty(rows, V, dtype=torch.float32, device=logits.device)
        block = 1024
        _rows_penalty_kernel[(rows, -(-V // block))](x, penalised, seen, counts, options.repetition,
                                                     options.frequency, options.presence, V, BLOCK=block)
        x = penalised
    x = x.contiguous()
    vals, idx = torch.sort(x, dim=-1, descending=True) if sort else (x, x)
    _rows_pick_kernel[(rows,)](x, vals, idx, V, options.inv_temperature, options.top_k, options.top_p, options.min_p,
                               seed, step, token, pos, active, seen, counts, BLOCK=min(1024, next_power_of_2(V)),
                               SORT=sort, TRACK=track, num_warps=8)


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
