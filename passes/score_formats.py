"""score_formats: predict, per tensor and candidate format, how much it would raise the output error.

Two factors per (tensor t, format f), both measured on calibration data:

- E_t(f), the layer-output error the rounding leaves, E||(W - W_f) x||^2 summed over outputs, from
  the input second-moment matrix H = E[x x^T] that calibrate_inputs kept. For round-to-nearest it
  is exact: trace(dW H dW^T). For GPTQ it is estimated without running GPTQ on the tensor: GPTQ
  rounds column j with the columns after it left to absorb the error, so each squared rounding
  error costs 1 / [H_F^-1]_jj = 1 / U_jj^2 (U the upper Cholesky factor of H^-1, F the columns from
  j on) instead of about H_jj; E_t(f) = c_f sum_j sum_rows err_rj^2 / U_jj^2, with err the format's
  round-to-nearest error and c_f a per-encoding correction (GPTQ's updated weights round a little
  differently, most for 1- and 2-bit grids), measured once per compile by running GPTQ on up to
  REFERENCE_ROWS rows (and REFERENCE_COLUMNS columns) of two reference tensors. The embedding of
  an untied model is a lookup, not a product: its E is the token-frequency-weighted squared row
  error.
- a_t, the sensitivity of the model's output to that layer error: tensor (or, for MoE experts,
  all experts of one role in one layer) is rounded alone to a probe format, the model runs on
  calibration windows with the rest exact, and a_t = measured mean KLD / E_t(probe).

The predicted KLD of a plan is sum_t a_t E_t(f_t): additive, as errors of different tensors are
independent to first order. plan_precision minimises it under the byte budget; certify_model
measures the truth, and BENCHMARKS.md reports the two side by side.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from thin.ir import Encoding, Model, Program, formats

from .calibrate_inputs import load_statistics
from .gptq import inverse_cholesky
from .quantize_weights import linear_weights
from .runner import PassContext

# Probe encodings, first that fits: coarse enough that one tensor's rounding moves the output
# measurably above float noise, fine enough to stay where KLD grows linearly with the layer error.
PROBES = (Encoding("int3", (("asymmetric", 0), ("group_size", 64))),
          Encoding("int3", (("asymmetric", 0), ("group_size", 32))),
          Encoding("q2", (("group_size", 32),)), Encoding("int8"))
PROBE_WINDOWS = 4
PROBE_TOKENS = 256
REFERENCE_ROWS = 128  # rows of each reference tensor GPTQ runs on to correct the estimate
REFERENCE_COLUMNS = 2048  # and its leading columns (with their block of H): a cheaper problem of the same kind


@dataclass(frozen=True)
class ScoreOptions:
    """Which encodings the planner may choose among, and how sensitivity is probed."""

    # Formats the planner may pick (every parameter variant of each); None: every registered one.
    formats: tuple[str, ...] | None = None
    # `--expert-formats`: the only formats routed experts may take (every parameter variant of each,
    # never their stored format unless listed), so "q2 experts" is a plan; None: as `formats`.
    expert_formats: tuple[str, ...] | None = None
    probe_windows: int = PROBE_WINDOWS  # calibration windows of PROBE_TOKENS each per probe

    def __post_init__(self):
        for name in ("formats", "expert_formats"):
            value = getattr(self, name)
            if value is None:
                continue
            unknown = [f for f in value if f not in formats.FORMATS]
            if unknown or not value:
                raise ValueError(f"unknown format(s) {', '.join(map(str, unknown)) or '(none given)'}; "
                                 f"known: {', '.join(formats.FORMATS)}")
        if self.expert_formats is not None and any(formats.get(f).dense for f in self.expert_formats):
            quantized = [f.name for f in formats.FORMATS.values() if not f.dense]
            raise ValueError(f"--expert-formats takes quantized formats ({', '.join(quantized)}), "
                             f"got {','.join(self.expert_formats)}")

        if self.formats is not None:
            only = [f for f in self.formats if formats.get(f).experts_only]
            if only:
                raise ValueError(f"{', '.join(only)} is a format for routed experts only: name it in "
                                 "--expert-formats, not --formats")
        if type(self.probe_windows) is not int or self.probe_windows < 1:
            raise ValueError(f"probe_windows must be a positive integer, got {self.probe_windows!r}")

    def allowed(self, record) -> tuple[tuple[str, ...] | None, bool]:
        """(formats `record` may take, strict): a routed expert under `expert_formats` may take only
        those (strict); any other tensor `formats` and its stored format."""
        if record.expert is not None and self.expert_formats is not None:
            return self.expert_formats, True
        return self.formats, False


def plannable(model: Model) -> list[str]:
    """The tensors the planner chooses a format for: every linear weight (LM head included) and the
    embedding. Norms, biases, routers and gates stay as stored."""
    names = [model.embedding.weight]
    names += [n for n in linear_weights(model, lm_head=True) if n != model.embedding.weight]
    return names


def candidates(record, allowed: tuple[str, ...] | None = None, strict: bool = False) -> list[Encoding]:
    """Every encoding `record` can be stored in: each quantized format with each combination of its
    parameters that fits the shape, plus the stored dense format and any narrower dense one. With
    `allowed`, only those formats and the stored one; `strict`: only those. A format for routed
    experts only (trellis) is a candidate only where `strict` names it for a routed expert (what
    `ScoreOptions.allowed` gives under `--expert-formats`), never by default."""
    stored = formats.get(record.encoding.format)
    keep_stored = not strict or allowed is None or stored.name in allowed
    out = [record.encoding] if stored.dense and keep_stored else []
    for fmt in formats.FORMATS.values():
        if allowed is not None and fmt.name not in allowed and (strict or fmt.name != record.encoding.format):
            continue
        if fmt.experts_only and not (strict and record.expert is not None and fmt.name in allowed):
            continue
        if fmt.dense:
            # bf16 is the one narrower dense choice for an f32 or f16 source.
            if fmt.name == "bf16" and stored.dense and stored.name in ("f32", "f16"):
                out.append(Encoding(fmt.name))
            continue
        keys = sorted(fmt.params)
        for values in itertools.product(*(fmt.params[k].choices for k in keys)):
            params = tuple(zip(keys, values))
            if not fmt.check(record.shape, params):
                out.append(Encoding(fmt.name, params))
    return out


def probe_groups(model: Model, names: list[str]) -> list[list[str]]:
    """Tensors probed together: every tensor alone, except MoE experts, probed per (layer, role)
    so a model with hundreds of experts needs a few probes per layer, not hundreds."""
    records = model.tensor_map()
    expert_groups: dict[tuple, list[str]] = {}
    out = []
    for name in names:
        r = records[name]
        if r.expert is not None:
            expert_groups.setdefault((r.layer, r.role), []).append(name)
        else:
            out.append([name])
    return out + list(expert_groups.values())


def score_formats(program: Program, ctx: PassContext) -> Program:
    """Afterwards annotations['scores'] holds, for every plannable tensor, its sensitivity a_t and
    for every candidate encoding its bytes, predicted layer error E_t and predicted KLD a_t E_t
    (see the module docstring); the stored encoding scores 0."""

    options: ScoreOptions = ctx.config.score
    model = program.model
    records = model.tensor_map()
    names = plannable(model)
    method = ctx.config.quantize.method or "gptq"
    tensors: dict[str, dict] = {}
    probe_errors: dict[str, float] = {}
    encodings = {enc for name in names for enc in candidates(records[name], *options.allowed(records[name]))}
    correction = _gptq_corrections(program, ctx, encodings) if method == "gptq" else {}
    inputs = program.annotations["calibration"]["inputs"]
    shared = {}  # the last input's (H, GPTQ gain): q/k/v and gate/up read one input, in a row
    for i, name in enumerate(names):
        ctx.report("score formats", i, len(names))
        r = records[name]
        w = program.decoded(name, ctx.device)
        error = _error_model(program, ctx, name, w, method, correction, shared, inputs.get(name))
        rows = []
        for enc in candidates(r, *options.allowed(r)):
            e = 0.0 if enc == r.encoding else error(enc)
            rows.append([enc.format, [list(p) for p in enc.params], formats.nbytes(enc.format, r.shape, enc.params),
                         e])
        probe = probe_encoding(r)
        tensors[name] = {"candidates": rows, "probe": None if probe is None else [probe.format, [
            list(p) for p in probe.params]]}
        probe_errors[name] = error(probe, exact=True) if probe is not None else 0.0
        del w
    ctx.report("score formats", len(names), len(names))
    probes = _probe(program, ctx, names, probe_errors, options)
    for name, row in tensors.items():
        a = probes["sensitivity"][name]
        row["sensitivity"] = a
        for c in row["candidates"]:
            c.append(a * c[3])
    note = {"method": method, "probe": probes["summary"],
            "gptq_correction": {f"{e.format}{list(map(list, e.params))}": round(c, 4) for e, c in correction.items()},
            "columns": ["format", "params", "bytes", "layer_error", "predicted_kld"], "tensors": tensors}
    return program.replace(annotations={**program.annotations, "scores": note})


def probe_encoding(record) -> Encoding | None:
    """The first of PROBES that can store `record`, or None."""
    for enc in PROBES:
        if not formats.check(enc.format, record.shape, enc.params):
            return enc
    return None


def _error_model(program: Program, ctx: PassContext, name: str, w, method: str, correction: dict,
                 shared: dict | None = None, input_key: str | None = None):
    """error(encoding, exact=False) -> predicted layer error E of storing `w` (tensor `name`) so.

    exact=True (and method rtn) is round-to-nearest as `Format.encode` does it, scored exactly;
    otherwise the GPTQ estimate of the module docstring. `shared` keeps the (H, gain) of
    `input_key`, the calibration input of `name`, for the next weight reading the same input."""
    import torch

    model = program.model
    untied_embedding = name == model.embedding.weight and not model.lm_head.tied
    if untied_embedding:
        frequency = ctx.scratch.load("calibration/token_frequency")["frequency"].to(w.device)
        hessian, gain = None, None
    elif shared is not None and input_key is not None and shared.get("key") == input_key:
        hessian, gain = shared["hessian"], shared["gain"]
    else:
        hessian = _hessian(ctx, program, name, w.shape[1], w.device)
        gain = gptq_gain(hessian)
        if shared is not None:
            shared.update(key=input_key, hessian=hessian, gain=gain)

    def layer_error(delta, rows: slice) -> float:
        if untied_embedding:
            return float(frequency[rows].double() @ (delta.double() ** 2).sum(1))
        return float(((delta @ hessian) * delta).sum())

    def measure(delta, rows, estimate: bool) -> float:
        return float(gain @ (delta.double() ** 2).sum(0)) if estimate else layer_error(delta, rows)

    def error(enc: Encoding, exact: bool = False) -> float:
        # Row by row block: every format rounds each row on its own, and each estimate below is a sum
        # over rows, so a large embedding or LM head never has more than a block's float32 copies.
        fmt = formats.get(enc.format)
        estimate = not (fmt.dense or exact or method == "rtn" or untied_embedding)
        if fmt.experts_only:
            total = sampled_error(w, fmt, enc.params, lambda delta, rows: measure(delta, rows, estimate))
            return correction.get(enc, 1.0) * total if estimate else total
        total = 0.0
        for rows in row_blocks(w):
            part = w[rows]
            if fmt.dense:
                delta = part - fmt.decode(fmt.encode(part, enc.params), tuple(part.shape), enc.params, torch.float32)
            else:
                delta = part - rounded(fmt, part, enc.params)
            total += float(gain @ (delta.double() ** 2).sum(0)) if estimate else layer_error(delta, rows)
        return correction.get(enc, 1.0) * total if estimate else total

    return error


# Formats for routed experts only (trellis) round by a search over 16-row tiles: Viterbi over 2^12
# states, about 4 x 2^12 float operations a weight a pass, thousands of times a grid's rounding. Their
# error is measured on evenly spaced bands of SAMPLE_BAND whole rows, about SAMPLE_WEIGHTS weights of
# each tensor (a quarter of tiny-coder-moe's experts, one band of moe-a3b's), and scaled up.
SAMPLE_BAND = 16  # a trellis tile's rows; every other format rounds each row on its own
SAMPLE_WEIGHTS = 8192


def sample_rows(shape) -> list[int] | None:
    """Rows of a [rows, cols] weight that sampled_error encodes: the bands of SAMPLE_BAND rows whose
    index is nearest the middle of each of `count` equal spans (count bands of about SAMPLE_WEIGHTS
    weights in all, at least one), or None when that is every band (the whole weight is measured)."""
    rows, cols = shape
    bands = rows // SAMPLE_BAND
    count = max(1, -(-SAMPLE_WEIGHTS // (SAMPLE_BAND * cols)))
    if count >= bands or rows % SAMPLE_BAND:
        return None
    picked = [(2 * i + 1) * bands // (2 * count) for i in range(count)]
    return [b * SAMPLE_BAND + r for b in picked for r in range(SAMPLE_BAND)]


def sampled_error(w, fmt, params, measure) -> float:
    """measure(W - W_f, rows) over all of `w` (a sum over rows: E_t of the module docstring) for a
    format whose rounding is a search, from the rows `sample_rows` picks: the sample's error relative
    to the same measure of its weights, times that measure of the whole weight (a ratio estimate:
    the format's error scales with each row's own scale, so it is exact when the sample's relative
    error is the weight's). Every row is encoded when the weight is no larger than the sample."""
    import torch

    picked = sample_rows(tuple(w.shape))
    if picked is None:
        return sum(measure(w[rows] - rounded(fmt, w[rows], params), rows) for rows in row_blocks(w))
    index = torch.tensor(picked, device=w.device)
    part = w[index]
    energy = measure(part, index)
    if energy <= 0:
        return 0.0
    whole = sum(measure(w[rows], rows) for rows in row_blocks(w))
    return measure(part - rounded(fmt, part, params), index) / energy * whole


# Elements of a weight rounded at once: bounds the float32 copies of a large embedding or LM head
# (gpt-oss-20b's 201088 x 2880, 2.3 GB in float32) to a few blocks of 256 MB.
BLOCK_ELEMENTS = 1 << 26


def row_blocks(w) -> list[slice]:
    """Slices of `w`'s rows, each at most BLOCK_ELEMENTS elements (at least one row)."""
    step = max(1, BLOCK_ELEMENTS // max(1, w.shape[1]))
    return [slice(i, min(i + step, w.shape[0])) for i in range(0, w.shape[0], step)]


def rounded(fmt, w, params):
    """`w` rounded to nearest on the format's plain grids (what `encode` stores), as float32; a
    block of rows at a time (every format rounds each row on its own)."""
    blocks = row_blocks(w)
    if len(blocks) == 1:
        q = fmt.quantizer(tuple(w.shape), params)
        q.start(w)
        return q.project(w, q.fit(w))
    out = w.new_empty(w.shape)
    for rows in blocks:
        out[rows] = rounded(fmt, w[rows], params)
    return out


def gptq_gain(hessian, factor=None):
    """1 / U_jj^2 per column: what a squared rounding error of column j costs after GPTQ's updates
    (`factor`: inverse_cholesky(hessian), when the caller has it)."""
    import torch

    upper, _ = factor if factor is not None else inverse_cholesky(hessian)
    return 1.0 / torch.diagonal(upper).double() ** 2


def _hessian(ctx: PassContext, program: Program, name: str, columns: int, device):
    import torch

    stats = load_statistics(ctx, program, name)
    if stats is None:  # nothing reached it: as if one token of unit activations had
        return torch.eye(columns, device=device) / max(program.annotations["calibration"]["tokens"], 1)
    return stats["hessian"].to(device).float()


def _gptq_corrections(program: Program, ctx: PassContext, encodings) -> dict:
    """{encoding: GPTQ's measured error / the estimate}, the geometric mean over the first attention
    projection and the down projection of the middle layer (up to REFERENCE_ROWS rows each: GPTQ
    treats rows independently, so a slice of rows is an exact sample; and up to REFERENCE_COLUMNS
    leading columns, a smaller problem of the same kind)."""
    import math

    from .gptq import gptq, gptq_many, output_error

    model = program.model
    layer = model.layers[len(model.layers) // 2]
    a = layer.attention
    first = (a.qkv or a.q).weight
    mlps = getattr(layer.ffn, "experts", None) or (layer.ffn,)
    names = [first, mlps[0].down.weight]
    experts_only = any(formats.get(e.format).experts_only for e in encodings)
    if experts_only and getattr(layer.ffn, "experts", None):
        # formats for routed experts only are corrected on the expert's two projections alone
        names.append((mlps[0].gate or mlps[0].gate_up).weight)
    references = {}  # name: (rows x columns of the weight, their block of H, its factor), made once
    for name in names:
        r = model.tensor(name)
        w = program.decoded(name, ctx.device)
        columns = min(w.shape[1], REFERENCE_COLUMNS)
        w = w[:REFERENCE_ROWS, :columns].contiguous()
        hessian = _hessian(ctx, program, name, r.shape[1], w.device)[:columns, :columns]
        references[name] = (r, w, hessian, inverse_cholesky(hessian))
    out = {}
    quantized = [e for e in encodings if not formats.get(e.format).dense]
    for k, enc in enumerate(sorted(quantized, key=lambda e: (e.format, e.params))):
        ctx.report("score formats: GPTQ estimate", k, len(quantized))
        logs = []
        fmt = formats.get(enc.format)
        usable = [ref for name, ref in references.items() if not fmt.check(ref[0].shape, enc.params)
                  and ((ref[0].expert is not None) if fmt.experts_only else name in names[:2])]
        if len(usable) > 1 and len({tuple(ref[1].shape) for ref in usable}) == 1:
            # one batched sweep for both (the same numbers as one gptq() each, in half the column steps)
            _, stacked = gptq_many([ref[1] for ref in usable], [ref[2] for ref in usable], fmt, enc.params,
                                   factors=[ref[3] for ref in usable])
            solved = stacked.split(usable[0][1].shape[0])
        else:
            solved = [gptq(w, hessian, fmt, enc.params, factor=factor)[1] for _, w, hessian, factor in usable]
        for (_, w, hessian, factor), w_hat in zip(usable, solved):
            estimate = float(gptq_gain(hessian, factor) @ ((w - rounded(fmt, w, enc.params)).double() ** 2).sum(0))
            measured = output_error(w, w_hat, hessian)
            if estimate > 0 and measured > 0:
                logs.append(math.log(measured / estimate))
        out[enc] = math.exp(sum(logs) / len(logs)) if logs else 1.0
    ctx.report("score formats: GPTQ estimate", len(quantized), len(quantized))
    return out


def probe_windows(ctx: PassContext, count: int) -> list[list[int]]:
    """`count` windows of PROBE_TOKENS calibration tokens, spread over the calibration ids."""
    ids = ctx.scratch.load("calibration/ids")["ids"].tolist()
    span = max(len(ids) // count, PROBE_TOKENS)
    return [ids[i:i + PROBE_TOKENS] for i in range(0, len(ids) - PROBE_TOKENS + 1, span)][:count]


def reference_logprobs(session, windows, hidden: list | None = None) -> list:
    """The exact model's log-probabilities on each window (from its `layer_inputs` `hidden`, when
    given: the same logits without running the layers again)."""
    import torch

    if hidden is not None:
        return [torch.log_softmax(session.forward_from(len(h) - 1, h[-1]).float(), -1) for h in hidden]
    return [torch.log_softmax(session.forward(w).float(), -1) for w in windows]


def first_changed_layer(model: Model, names) -> int | None:
    """The first decoder layer whose output overriding `names` changes (len(layers) for the LM head
    alone), or None when the embedding is among them (everything changes)."""
    records = model.tensor_map()
    if model.embedding.weight in names:
        return None
    return min(len(model.layers) if records[n].layer is None else records[n].layer for n in names)


def override_kld(session, windows, reference, dense: dict, hidden: list | None = None) -> float:
    """Mean KLD(exact || the session with `dense` weights in place of its own) over the windows.
    With `hidden` (the exact session's `layer_inputs` per window), only the layers from the first
    one `dense` changes are run: the layers before it see exact weights, so their outputs are the
    cached ones and the logits are those of the whole forward pass."""
    import torch

    first = None if hidden is None or not dense else first_changed_layer(session.model, dense)
    kld = 0.0
    with session.overriding(dense):
        for k, (w, ref) in enumerate(zip(windows, reference)):
            logits = session.forward(w) if first is None else session.forward_from(first, hidden[k][first])
            out = torch.log_softmax(logits.float(), -1)
            kld += float((ref.exp() * (ref - out)).sum(-1).mean())
    return kld / len(windows)


def _probe(program: Program, ctx: PassContext, names: list[str], probe_errors: dict[str, float],
           options: ScoreOptions) -> dict:
    """Sensitivities a_t: each probe group rounded alone to its probe encoding, mean KLD against the
    exact model on calibration windows, divided by the group's predicted layer error."""

    records = program.model.tensor_map()
    windows = probe_windows(ctx, options.probe_windows)
    session = ctx.evaluator.session(program)
    # Each window's hidden state entering every layer, once: a probe runs only the layers from the
    # first one it changes (on average half the model).
    hidden = [session.layer_inputs(w) for w in windows]
    reference = reference_logprobs(session, windows, hidden)
    groups = probe_groups(program.model, names)
    sensitivity: dict[str, float] = {}
    measured = []
    for i, group in enumerate(groups):
        ctx.report("probe sensitivity", i, len(groups))
        dense = {}
        for name in group:
            r = records[name]
            probe = probe_encoding(r)
            if probe is None:
                continue
            w = program.decoded(name, ctx.device)
            dense[name] = rounded(formats.get(probe.format), w, probe.params)
        error = sum(probe_errors[n] for n in dense)
        if not dense or error <= 0:
            continue
        kld = override_kld(session, windows, reference, dense, hidden)
        measured.append({"tensors": group, "kld": kld, "layer_error": error})
        for name in group:
            sensitivity[name] = kld / error
    ctx.report("probe sensitivity", len(groups), len(groups))
    if measured:  # tensors no probe could take borrow the mean sensitivity
        mean = sum(m["kld"] for m in measured) / sum(m["layer_error"] for m in measured)
        for name in names:
            sensitivity.setdefault(name, mean)
    summary = {"windows": len(windows), "tokens": PROBE_TOKENS, "groups": len(groups),
               "total_probe_kld": sum(m["kld"] for m in measured)}
    return {"sensitivity": {n: sensitivity.get(n, 0.0) for n in names}, "summary": summary}
