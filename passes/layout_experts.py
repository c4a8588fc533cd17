"""layout_experts: every expert of a mixture of experts in one page-aligned, contiguous range of the file."""

from __future__ import annotations

import dataclasses

from thin.ir import MLP, Model, MoE, Program

from .runner import PassContext

PAGE = 4096  # bytes: the unit a host maps, pins and copies


def expert_tensors(expert: MLP) -> list[str]:
    """An expert's tensors in the order a forward pass reads them: gate/up (or gate_up), down, each
    weight followed by its bias."""
    linears = (expert.gate, expert.up, expert.gate_up, expert.down)
    return [name for lin in linears if lin is not None for name in (lin.weight, lin.bias) if name is not None]


def routed_experts(model: Model) -> list[MLP]:
    """Every routed expert, layer by layer (shared experts run on every token and are not paged)."""
    return [expert for layer in model.layers if isinstance(layer.ffn, MoE) for expert in layer.ffn.experts]


def layout_experts(program: Program, ctx: PassContext) -> Program:
    """Afterwards each routed expert's tensors are adjacent in the tensor table (expert e of a layer,
    then e + 1, each at the place of its first tensor) and its weights start on a 4 KiB page, so
    reading, mapping or moving one expert is one aligned contiguous byte range of the artifact
    (`thin.artifacts.pages.expert_page`). Other tensors keep their order and alignment."""
    model = program.model
    records = model.tensor_map()
    experts = routed_experts(model)
    pages = [expert_tensors(expert) for expert in experts]
    page_of = {name: i for i, page in enumerate(pages) for name in page}
    order: list[str] = []
    placed: set[int] = set()
    for t in model.tensors:
        page = page_of.get(t.name)
        if page is None:
            order.append(t.name)
        elif page not in placed:
            placed.add(page)
            order.extend(pages[page])
    # A page starts with a weight; biases (a few hundred bytes) just follow their weight.
    aligned = {lin.weight for e in experts for lin in (e.gate, e.up, e.gate_up, e.down) if lin is not None}
    tensors = tuple(dataclasses.replace(records[n], align=max(records[n].align, PAGE)) if n in aligned
                    else records[n] for n in order)
    return program.replace(model=dataclasses.replace(model, tensors=tensors))
