"""order_tensors: put the tensor table in the order a forward pass first reads each tensor."""

from __future__ import annotations

import dataclasses

from thin.ir import Program

from .runner import PassContext
from .tensor_order import execution_order


def order_tensors(program: Program, ctx: PassContext) -> Program:
    """Afterwards the tensor table (and so the artifact's data) is in execution order: streaming the
    file front to back pages weights in as decode reaches them."""
    tensors = program.model.tensor_map()
    model = dataclasses.replace(program.model, tensors=tuple(tensors[n] for n in execution_order(program.model)))
    return program.replace(model=model)
