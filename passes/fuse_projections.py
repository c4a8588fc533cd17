"""fuse_projections: stack projections that read the same input into one weight."""

from __future__ import annotations

import dataclasses

from thin.ir import MLP, Attention, Linear, MoE, Program, Tensor, formats

from .runner import PassContext


def fuse_projections(program: Program, ctx: PassContext) -> Program:
    """Afterwards every attention whose q/k/v share one encoding has a single `qkv` projection and
    every gated MLP whose gate/up share one has a single `gate_up` (weights stacked along the rows,
    part by part for packed formats); projections in different encodings stay separate."""
    fuser = _Fuser(program)
    model = program.model
    layers = []
    for layer in model.layers:
        ffn = fuser.moe(layer.ffn) if isinstance(layer.ffn, MoE) else fuser.mlp(layer.ffn)
        layers.append(dataclasses.replace(layer, attention=fuser.attention(layer.attention), ffn=ffn))
    used = fuser.used()
    tensors = tuple(t for t in fuser.tensors.values() if t.name in used)
    model = dataclasses.replace(model, layers=tuple(layers), tensors=tensors)
    return program.replace(model=model, weights={t.name: fuser.weights[t.name] for t in tensors})


class _Fuser:
    """Builds fused tensors whose loaders stack the originals' bytes, lazily."""

    def __init__(self, program: Program):
        self.tensors = program.model.tensor_map()
        self.weights = dict(program.weights)
        self.replaced: set[str] = set()

    def _fusable(self, names: list[str]) -> bool:
        records = [self.tensors[n] for n in names]
        return len({r.encoding for r in records}) == 1 and len({r.shape[1:] for r in records}) == 1

    def _stack(self, names: list[str], name: str, role: str) -> str:
        records = [self.tensors[n] for n in names]
        first = records[0]
        shape = (sum(r.shape[0] for r in records), *first.shape[1:])
        self.tensors[name] = Tensor(name, role, first.layer, shape, first.encoding, first.source_dtype,
                                    first.expert, align=max(r.align for r in records))
        fmt, params = formats.get(first.encoding.format), first.encoding.params
        loaders, shapes = [self.weights[n] for n in names], [r.shape for r in records]

        def load():
            return fmt.stack_rows([f() for f in loaders], shapes, params)

        self.weights[name] = load
        self.replaced.update(names)
        return name

    def _fuse(self, linears: list[Linear], prefix: str, role: str) -> Linear | None:
        weights = [lin.weight for lin in linears]
        biases = [lin.bias for lin in linears]
        if not self._fusable(weights):
            return None
        if any(b is not None for b in biases) and not (all(b is not None for b in biases)
                                                       and self._fusable(biases)):
            return None
        weight = self._stack(weights, f"{prefix}.weight", role)
        bias = self._stack(biases, f"{prefix}.bias", role + ".bias") if biases[0] is not None else None
        return Linear(weight, bias)

    @staticmethod
    def _prefix(name: str) -> str:
        # "layers.3.attn.q.weight" -> "layers.3.attn"
        return name.rsplit(".", 2)[0]

    def attention(self, a: Attention) -> Attention:
        if a.qkv is not None:
            return a
        prefix = self._prefix(a.q.weight) + ".qkv"
        fused = self._fuse([a.q, a.k, a.v], prefix, self.tensors[a.q.weight].role[:-1] + "qkv")
        return a if fused is None else dataclasses.replace(a, q=None, k=None, v=None, qkv=fused)

    def mlp(self, mlp: MLP) -> MLP:
        if not mlp.gated or mlp.gate_up is not None:
            return mlp
        role = self.tensors[mlp.gate.weight].role.rsplit(".", 1)[0] + ".gate_up"
        fused = self._fuse([mlp.gate, mlp.up], self._prefix(mlp.gate.weight) + ".gate_up", role)
        return mlp if fused is None else dataclasses.replace(mlp, gate=None, up=None, gate_up=fused)

    def moe(self, moe: MoE) -> MoE:
        experts = tuple(self.mlp(e) for e in moe.experts)
        shared = self.mlp(moe.shared_expert) if moe.shared_expert is not None else None
        return dataclasses.replace(moe, experts=experts, shared_expert=shared)

    def used(self) -> set[str]:
        return set(self.tensors) - self.replaced
