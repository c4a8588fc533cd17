"""quantize_weights: store every linear weight in one quantized format (`thinc compile --quant`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from thin.ir import MLP, Encoding, Model, MoE, Program, formats

from .runner import PassContext


class QuantizeOptionError(ValueError):
    """A --quant option the chosen format does not take."""


@dataclass(frozen=True)
class QuantizeOptions:
    """Round-to-nearest quantization of every linear weight to one format; None keeps all as stored."""

    format: str | None = None
    group_size: int | None = None  # None: the format's default (only for formats with groups)
    asymmetric: bool = False  # grouped integer formats: a per-group offset as well as a scale
    keep_lm_head: bool = False  # leave an untied LM head as stored

    def __post_init__(self):
        if self.format is None:
            if self.group_size is not None or self.asymmetric:
                raise QuantizeOptionError("--group-size and --asymmetric need --quant FORMAT")
            return
        fmt = formats.FORMATS.get(self.format)
        quantized = [f.name for f in formats.FORMATS.values() if not f.dense]
        if fmt is None or fmt.dense:
            raise QuantizeOptionError(f"--quant takes a quantized format ({', '.join(quantized)}), "
                                      f"got {self.format!r}")
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


def quantize_weights(program: Program, ctx: PassContext) -> Program:
    """Afterwards every linear weight (see `linear_weights`; the LM head too unless keep_lm_head) is
    stored in the chosen format, quantized round-to-nearest from its source values; embeddings
    (a tied head with them), norms, biases and routers stay as stored."""
    options: QuantizeOptions = ctx.config.quantize
    fmt = formats.get(options.format)
    params = options.params()
    records = program.model.tensor_map()
    chosen = linear_weights(program.model, lm_head=not options.keep_lm_head)
    problems = [f"{name} {records[name].shape}: {'; '.join(fmt.check(records[name].shape, params))}"
                for name in chosen if fmt.check(records[name].shape, params)]
    if problems:
        hint = " (try another --group-size)" if "group_size" in fmt.params else ""
        raise QuantizeOptionError(f"{len(problems)} weight(s) can't be stored as {options.format}{hint}: "
                                  f"{problems[0]}")
    weights = dict(program.weights)
    for name in chosen:
        weights[name] = _quantizing_loader(records[name], program.weights[name], options.format, params)
        records[name] = dataclasses.replace(records[name], encoding=Encoding(options.format, params))
    model = dataclasses.replace(program.model, tensors=tuple(records[t.name] for t in program.model.tensors))
    note = {"method": "round-to-nearest", "format": options.format, "params": [list(p) for p in params],
            "tensors": len(chosen)}
    return program.replace(model=model, weights=weights,
                           annotations={**program.annotations, "quantize": note})


def _quantizing_loader(record, load, format: str, params):
    source = formats.get(record.encoding.format)

    def quantized():
        import torch

        dense = source.decode(load(), record.shape, record.encoding.params, torch.float32)
        return formats.get(format).encode(dense, params)

    return quantized


__all__ = ["QuantizeOptions", "QuantizeOptionError", "linear_weights", "quantize_weights"]
