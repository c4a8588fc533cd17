"""quantize_weights: store each tensor in the format the precision plan (or `--quant`) gives it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from thin.ir import MLP, Encoding, Model, MoE, Program, formats

from .calibrate_inputs import load_statistics, statistics_key
from .gptq import gptq, gptq_many
from .runner import PassContext
from .scratch import Scratch

METHODS = ("gptq", "rtn")
# Device bytes one batched GPTQ sweep (gptq_many) may take: per weight [rows, cols] about five float32
# copies of it and three [cols, cols] matrices (H, its damped form, the inverse factor). At most
# half the free memory of a GPU: on an H200, llama-8b's q/k/v of every layer, gate/up of 13 or down of 9
# (a sweep's steps are launch-bound: the fewer sweeps, the faster; the format's pack adds a few copies).
GPTQ_SWEEP_BYTES = 32 << 30
CPU_SWEEP_BYTES = 4 << 30
# Weights per sweep in a format for routed experts only (trellis): its fits are Viterbi searches that
# dominate the sweep and gain little from more tiles per call past a few hundred (trellis.CHUNK), so
# sweeps of about a million weights (under a minute on one CPU core) cost little and report progress.
SEARCH_SWEEP_WEIGHTS = 1 << 20


def sweep_bytes(rows: int, cols: int) -> int:
    """What gptq_many holds on the device per weight of `rows` x `cols` (see GPTQ_SWEEP_BYTES)."""
    return 4 * (5 * rows * cols + 3 * cols * cols)


def _sweep_budget(device) -> int:
    import torch

    device = torch.device(device or "cpu")
    if device.type != "cuda":
        return CPU_SWEEP_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return min(GPTQ_SWEEP_BYTES, free // 2)


class QuantizeOptionError(ValueError):
    """A --quant option the chosen format does not take."""


@dataclass(frozen=True)
class QuantizeOptions:
    """How weights are quantized: one format for every linear weight (`--quant`; None keeps all as
    stored unless a budget plans formats), and the method that rounds them."""

    format: str | None = None
    group_size: int | None = None  # None: the format's default (only for formats with groups)
    asymmetric: bool = False  # grouped integer formats: a per-group offset as well as a scale
    keep_lm_head: bool = False  # leave an untied LM head as stored
    # "gptq": error-compensating rounding with the calibration statistics; "rtn": round to nearest.
    # None resolves in CompileConfig: gptq when a budget is planned, rtn for a plain --quant.
    method: str | None = None
    # GPTQ visits columns by decreasing input energy, on grids fitted before any update.
    act_order: bool = False

    def __post_init__(self):
        if self.method is not None and self.method not in METHODS:
            raise QuantizeOptionError(f"--method takes {' or '.join(METHODS)}, got {self.method!r}")
        if type(self.act_order) is not bool:
            raise QuantizeOptionError("act_order must be true or false")
        if self.format is None:
            if self.group_size is not None or self.asymmetric or self.keep_lm_head:
                raise QuantizeOptionError("--group-size, --asymmetric and --keep-lm-head need --quant FORMAT (with "
                                          "a budget the planner picks every tensor's format)")
            return
        fmt = formats.FORMATS.get(self.format)
        quantized = [f.name for f in formats.FORMATS.values() if not f.dense and not f.experts_only]
        if fmt is None or fmt.dense:
            raise QuantizeOptionError(f"--quant takes a quantized format ({', '.join(quantized)}), "
                                      f"got {self.format!r}")
        if fmt.experts_only:
            raise QuantizeOptionError(f"{fmt.name} is a format for routed experts only: give a budget and "
                                      f"--expert-formats {fmt.name}, not --quant")
        if self.group_size is not None and "group_size" not in fmt.params:
            raise QuantizeOptionError(f"format {self.format} has no groups; drop --group-size")
        if self.asymmetric and "asymmetric" not in fmt.params:
            raise QuantizeOptionError(f"format {self.format} has no asymmetric variant; drop --asymmetric")
        try:
            fmt.normalize(self.params())
        except ValueError as e:
            raise QuantizeOptionError(str(e)) from None

    def params(self) -> tuple:
        """The encoding parameters these options ask of the format (defaults filled in)."""
        given = {}
        if self.group_size is not None:
            given["group_size"] = self.group_size
        if self.asymmetric:
            given["asymmetric"] = 1
        return formats.get(self.format).normalize(given)


def check_lm_head(program: Program, ctx: PassContext) -> Program:
    """The first pass of a --keep-lm-head compile: QuantizeOptionError when the LM head is the embedding (tied),
    which --quant leaves as stored anyway, so the flag would do nothing. Changes nothing."""
    if program.model.lm_head.tied:
        raise QuantizeOptionError("--keep-lm-head keeps an untied LM head as stored, and this model's LM head is "
                                  "its embedding, which --quant leaves as stored anyway; leave the flag out")
    return program


def linear_weights(model: Model, *, lm_head: bool = True) -> list[str]:
    """Names of the weights the model multiplies activations by: attention and MLP projections,
    experts and shared experts, and (when `lm_head` and untied) the LM head. Routers and gates
    that decide rather than compute are not in the list; nor are embeddings, norms or biases."""
    names: list[str] = []

    def mlp(m: MLP) -> None:
        names.extend(lin.weight for lin in (m.gate, m.up, m.gate_up, m.down) if lin is not None)

    for layer in model.layers:
        a = layer.attention
        names.extend(lin.weight for lin in (a.q, a.k, a.v, a.qkv, a.o) if lin is not None)
        if isinstance(layer.ffn, MoE):
            for expert in layer.ffn.experts:
                mlp(expert)
            if layer.ffn.shared_expert is not None:
                mlp(layer.ffn.shared_expert)
        else:
            mlp(layer.ffn)
    if lm_head and not model.lm_head.tied:
        names.append(model.lm_head.weight)
    return names


def planned_encodings(program: Program, options: QuantizeOptions) -> dict[str, Encoding]:
    """{tensor name: encoding} this pass will apply: the precision plan's choices when one was made
    (annotations['precision_plan']), else --quant's format for every linear weight."""
    plan = program.annotations.get("precision_plan")
    records = program.model.tensor_map()
    if plan is not None:
        chosen = {name: Encoding(c["format"], tuple(tuple(p) for p in c["params"]))
                  for name, c in plan["choices"].items()}
        return {name: enc for name, enc in chosen.items() if enc != records[name].encoding}
    if options.format is None:
        return {}
    fmt, params = formats.get(options.format), options.params()
    chosen = linear_weights(program.model, lm_head=not options.keep_lm_head)
    problems = [f"{name} {records[name].shape}: {'; '.join(fmt.check(records[name].shape, params))}"
                for name in chosen if fmt.check(records[name].shape, params)]
    if problems:
        hint = " (try another --group-size)" if "group_size" in fmt.params else ""
        raise QuantizeOptionError(f"{len(problems)} weight(s) can't be stored as {options.format}{hint}: "
                                  f"{problems[0]}")
    return dict.fromkeys(chosen, Encoding(options.format, params))


def quantize_weights(program: Program, ctx: PassContext) -> Program:
    """Afterwards every tensor in `planned_encodings` is stored in its encoding: quantized formats by
    GPTQ against the calibration statistics of the tensor's input (method gptq; round-to-nearest
    for a weight no calibration token reached) or by round-to-nearest (rtn); dense targets by a
    cast. Weights that read the same input in the same format are rounded together. Everything
    else (embeddings unless planned, norms, biases, routers) stays as stored."""
    options: QuantizeOptions = ctx.config.quantize
    method = options.method or "rtn"
    targets = planned_encodings(program, options)
    records = program.model.tensor_map()
    scratch = ctx.scratch if ctx.scratch is not None else Scratch()
    batches = _batches(program, targets, method)
    fallback: list[str] = []
    weights = dict(program.weights)

    def key_of(names):
        encoding = targets[names[0]]
        return f"quantized/{method}/{options.act_order}/{encoding.format}/{encoding.params}/" + ",".join(names)

    todo = [names for names in batches if not scratch.has(f"{key_of(names)}#{names[-1]}")]
    done = 0
    for sweep in _sweeps(program, ctx, todo, targets, method, options):
        ctx.report(f"quantize ({method})", done, len(todo))
        encoding = targets[sweep[0][0]]
        if len(sweep) > 1:
            blobs, rounded = _quantize_many(program, ctx, sweep, encoding), True
        else:
            blobs, rounded = _quantize(program, ctx, [records[n] for n in sweep[0]], encoding, method, options)
        for names in sweep:
            fallback += [] if rounded else names
            for name in names:
                scratch.save(f"{key_of(names)}#{name}", {"blob": blobs[name]})
        done += len(sweep)
    ctx.report(f"quantize ({method})", len(todo), len(todo))
    for names in batches:
        for name in names:
            weights[name] = _stored(scratch, f"{key_of(names)}#{name}")
            records[name] = dataclasses.replace(records[name], encoding=targets[name])
    model = dataclasses.replace(program.model, tensors=tuple(records[t.name] for t in program.model.tensors))
    by_format: dict[str, int] = {}
    for enc in targets.values():
        by_format[enc.format] = by_format.get(enc.format, 0) + 1
    note = {"method": {"gptq": "gptq", "rtn": "round-to-nearest"}[method], "act_order": options.act_order,
            "tensors": len(targets), "formats": dict(sorted(by_format.items())),
            "round_to_nearest_fallback": sorted(fallback)}
    if options.format is not None and "precision_plan" not in program.annotations:
        note.update(format=options.format, params=[list(p) for p in options.params()])
    return program.replace(model=model, weights=weights, annotations={**program.annotations, "quantize": note})


def _batches(program: Program, targets: dict[str, Encoding], method: str) -> list[list[str]]:
    """Targets grouped for rounding: with GPTQ, weights that read one input (q/k/v, gate/up) in one
    encoding go through one column sweep (GPTQ treats rows independently, so this changes nothing
    but the time); everything else alone. In the model's tensor order."""
    inputs = program.annotations.get("calibration", {}).get("inputs", {}) if method == "gptq" else {}
    batches: dict[tuple, list[str]] = {}
    for t in program.model.tensors:
        if t.name not in targets:
            continue
        dense = formats.get(targets[t.name].format).dense
        key = (inputs.get(t.name), targets[t.name]) if inputs.get(t.name) and not dense else (t.name,)
        batches.setdefault(key, []).append(t.name)
    return list(batches.values())


def _sweeps(program, ctx, batches: list[list[str]], targets: dict[str, Encoding], method: str,
            options: QuantizeOptions) -> list[list[list[str]]]:
    """`batches` in runs that one GPTQ column sweep can take (gptq_many): batches of one encoding and
    one stacked shape, each with its own calibration statistics, up to the sweep's byte budget per
    run (a layer's q/k/v next to other layers'; SEARCH_SWEEP_WEIGHTS at most for trellis). act_order,
    round-to-nearest, dense targets and weights without statistics go one batch at a time, as before."""
    records = program.model.tensor_map()
    inputs = program.annotations.get("calibration", {}).get("inputs", {})
    runs: dict[tuple, list[list[list[str]]]] = {}
    out = []
    budget = _sweep_budget(ctx.device)
    for names in batches:
        encoding = targets[names[0]]
        key = inputs.get(names[0])
        alone = method != "gptq" or options.act_order or formats.get(encoding.format).dense or key is None \
            or ctx.scratch is None or not ctx.scratch.has(statistics_key(key))
        if alone:
            out.append([names])
            continue
        shape = (sum(records[n].shape[0] for n in names), records[names[0]].shape[1])
        size = sweep_bytes(*shape)
        current = runs.setdefault((encoding, shape), [[]])
        full = formats.get(encoding.format).experts_only and (len(current[-1]) + 1) * shape[0] * shape[1] \
            > SEARCH_SWEEP_WEIGHTS
        if current[-1] and ((len(current[-1]) + 1) * size > budget or full):
            current.append([])
        current[-1].append(names)
    for group in runs.values():
        out += group
    return out


def _quantize_many(program, ctx, batches: list[list[str]], encoding: Encoding) -> dict:
    """{name: blob} of every weight in `batches` (each a list of weights reading one input, all
    batches of one stacked shape) by one gptq_many sweep, each batch under its own statistics."""
    import torch

    records = program.model.tensor_map()
    fmt = formats.get(encoding.format)
    stacked, hessians, shapes = [], [], []
    for names in batches:
        stacked.append(torch.cat([program.decoded(n, ctx.device) for n in names]))
        hessians.append(load_statistics(ctx, program, names[0])["hessian"])
        shapes += [records[n].shape for n in names]
    blob, _ = gptq_many(stacked, hessians, fmt, encoding.params)
    rows = sum(s[0] for s in shapes)
    del stacked, hessians
    names = [n for batch in batches for n in batch]
    return dict(zip(names, split_rows(fmt, blob.cpu(), (rows, shapes[0][1]), encoding.params, shapes)))


def _quantize(program, ctx, records, encoding: Encoding, method: str, options: QuantizeOptions):
    """({name: blob}, rounded by GPTQ?) for weights `records` sharing one input, in `encoding`."""
    import torch

    fmt = formats.get(encoding.format)
    dense = [program.decoded(r.name) for r in records]
    stats = load_statistics(ctx, program, records[0].name) if method == "gptq" and not fmt.dense else None
    if stats is None:
        return {r.name: fmt.encode(w, encoding.params) for r, w in zip(records, dense)}, False
    stacked = torch.cat(dense).to(ctx.device)
    blob, _ = gptq(stacked, stats["hessian"], fmt, encoding.params, act_order=options.act_order)
    blob = blob.cpu()
    if len(records) == 1:
        return {records[0].name: blob}, True
    return dict(zip((r.name for r in records), split_rows(fmt, blob, tuple(stacked.shape), encoding.params,
                                                          [r.shape for r in records]))), True


def split_rows(fmt, blob, shape, params, shapes) -> list:
    """The blobs of weights `shapes` whose rows were stacked into one blob of `shape` (the inverse of
    Format.stack_rows: every part keeps the rows as its leading dimension)."""
    parts = fmt.split(blob, shape, params)
    out, start = [], 0
    for s in shapes:
        rows = slice(start, start + s[0])
        out.append(fmt.join({name: t[rows] for name, t in parts.items()}, tuple(s), params))
        start += s[0]
    return out


def _stored(scratch: Scratch, key: str):
    def load():
        return scratch.load(key)["blob"]

    return load


__all__ = ["QuantizeOptions", "QuantizeOptionError", "linear_weights", "planned_encodings", "quantize_weights",
           "split_rows"]
