"""canonicalize: fuse projections the kernels read together and order tensors by execution."""

from __future__ import annotations

import dataclasses

from thin.ir import MLP, Attention, Linear, Model, MoE, Program, Tensor

from .runner import PassContext
from .tensor_order import execution_order


def canonicalize(program: Program, ctx: PassContext) -> Program:
    """Afterwards, when `fuse_projections` is on (the default), every attention whose q/k/v share a
    format has one fused `qkv` projection and every gated MLP one `gate_up`; the tensor table is in
    execution order either way."""
    fuse = ctx.options.get("fuse_projections", True)
    fuser = _Fuser(program)
    model = program.model
    if fuse:
        layers = []
        for layer in model.layers:
            attention = fuser.attention(layer.attention)
            ffn = fuser.moe(layer.ffn) if isinstance(layer.ffn, MoE) else fuser.mlp(layer.ffn)
            layers.append(dataclasses.replace(layer, attention=attention, ffn=ffn))
        model = dataclasses.replace(model, layers=tuple(layers))
    model = fuser.finish(model)
    weights = {t.name: fuser.weights[t.name] for t in model.tensors}
    return program.replace(model=model, weights=weights)


class _Fuser:
    """Builds fused tensors whose loaders concatenate the originals row-wise, lazily."""

    def __init__(self, program: Program):
        self.tensors = program.model.tensor_map()
        self.weights = dict(program.weights)

    def _fusable(self, names: list[str]) -> bool:
        encs = {self.tensors[n].encoding for n in names}
        # Only dense formats concatenate byte-for-byte; packed formats are fused by layout later.
        return len(encs) == 1 and next(iter(encs)).format in ("f32", "f16", "bf16")

    def _concat(self, names: list[str], name: str, role: str) -> str:
        first = self.tensors[names[0]]
        rows = sum(self.tensors[n].shape[0] for n in names)
        shape = (rows, *first.shape[1:])
        self.tensors[name] = Tensor(name, role, first.layer, shape, first.encoding, first.source_dtype,
                                    first.expert)
        loaders = [self.weights[n] for n in names]

        def load():
            import torch

            return torch.cat([f() for f in loaders], dim=0)

        self.weights[name] = load
        return name

    def _fuse_linears(self, linears: list[Linear], prefix: str, role: str) -> Linear | None:
        weights = [lin.weight for lin in linears]
        biases = [lin.bias for lin in linears]
        if not self._fusable(weights):
            return None
        if any(b is not None for b in biases) and not (all(b is not None for b in biases)
                                                       and self._fusable(biases)):
            return None
        weight = self._concat(weights, f"{prefix}.weight", role)
        bias = self._concat(biases, f"{prefix}.bias", role + ".bias") if biases[0] is not None else None
        return Linear(weight, bias)

    @staticmethod
    def _prefix(name: str) -> str:
        # "layers.3.attn.q.weight" -> "layers.3.attn"
        return name.rsplit(".", 2)[0]

    def attention(self, a: Attention) -> Attention:
        if a.qkv is not None:
            return a
        prefix = self._prefix(a.q.weight) + ".qkv"
        fused = self._fuse_linears([a.q, a.k, a.v], prefix, self.tensors[a.q.weight].role[:-1] + "qkv")
        return a if fused is None else dataclasses.replace(a, q=None, k=None, v=None, qkv=fused)

    def mlp(self, mlp: MLP) -> MLP:
        if not mlp.gated or mlp.gate_up is not None:
            return mlp
        role = self.tensors[mlp.gate.weight].role.rsplit(".", 1)[0] + ".gate_up"
        fused = self._fuse_linears([mlp.gate, mlp.up], self._prefix(mlp.gate.weight) + ".gate_up", role)
        return mlp if fused is None else dataclasses.replace(mlp, gate=None, up=None, gate_up=fused)

    def moe(self, moe: MoE) -> MoE:
        experts = tuple(self.mlp(e) for e in moe.experts)
        shared = self.mlp(moe.shared_expert) if moe.shared_expert is not None else None
        return dataclasses.replace(moe, experts=experts, shared_expert=shared)

    def finish(self, model: Model) -> Model:
        order = execution_order(model)
        return dataclasses.replace(model, tensors=tuple(self.tensors[n] for n in order))
