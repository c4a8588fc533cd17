"""A GPU memory budget (`thin-exec --vram SIZE`): what a model will take, checked before loading,
and a cap on what the runtime may allocate, so a budget can be proven on a bigger card.

The check adds the weights as the artifact stores them (quantized weights stay packed on the
device), the KV cache for the context asked for, and the workspace (rotary tables, prefill
activations, scratch). The cap is torch's per-process fraction of the card: an allocation beyond
it raises torch.OutOfMemoryError instead of using memory the budget does not have.
"""

from __future__ import annotations

import torch

from thin.ir import formats, parse_size  # noqa: F401 (parse_size: thin-exec --vram)

from .errors import RunError

# Allocator slack, CUDA graph pools, Triton and cuBLAS scratch.
_OVERHEAD = 256 * 2**20
# The --vram cap set on each device (check), in bytes.
_CAPS: dict[int, int] = {}


class VramBudgetError(RunError, RuntimeError):
    """The model does not fit in the --vram budget, or the budget does not fit on the card."""


def human(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def estimate(artifact, context: int) -> dict[str, int]:
    """Device bytes a model takes: weights, KV cache for `context` tokens, workspace."""
    model = artifact.model
    records = model.tensor_map()
    stored = formats.get(records[model.embedding.weight].source_dtype)
    element = torch.tensor([], dtype=getattr(torch, stored.torch_dtype)).element_size() if stored.dense else 4
    from .expert_cache import device_weight_bytes

    # With experts in host memory (--stream-experts), the device holds the rest and the expert cache's slots.
    weights = device_weight_bytes(artifact)
    if weights is None:
        weights = sum(artifact.tensor_entry(t.name)["size"] for t in model.tensors)
    kv = sum(2 * layer.attention.num_kv_heads * layer.attention.head_dim * element for layer in model.layers)
    ropes = {layer.attention.rope for layer in model.layers if layer.attention.rope is not None}
    tables = sum(2 * model.max_position_embeddings * rope.rotary_dim * element for rope in ropes)
    widest = max(_width(layer, records) for layer in model.layers)
    activations = context * (6 * model.hidden_size + 3 * widest) * element + 8 * model.vocab_size
    return {"weights": weights, "kv": kv * context, "workspace": tables + activations + _OVERHEAD}


def _width(layer, records) -> int:
    """The widest projection output of a layer: q/k/v together, or gate/up together."""
    a = layer.attention
    mlps = getattr(layer.ffn, "experts", None) or (layer.ffn,)
    return max([(a.num_heads + 2 * a.num_kv_heads) * a.head_dim]
               + [2 * records[mlp.down.weight].shape[1] for mlp in mlps])


def check(artifact, context: int, budget: int, device: torch.device) -> None:
    """Raise VramBudgetError unless the model fits in `budget` bytes on `device`; then cap the
    runtime's allocations at `budget`."""
    total = torch.cuda.get_device_properties(device).total_memory
    if budget > total:
        raise VramBudgetError(f"--vram {human(budget)} is more than this GPU has ({human(total)})")
    need = estimate(artifact, context)
    if sum(need.values()) > budget:
        raise VramBudgetError(
            f"the model needs {human(sum(need.values()))} on the GPU (weights {human(need['weights'])} + KV cache "
            f"{human(need['kv'])} for {context} tokens + workspace {human(need['workspace'])}), more than "
            f"--vram {human(budget)}")
    index = device_index(device)
    torch.cuda.set_per_process_memory_fraction(budget / total, index)
    _CAPS[index] = budget


def device_index(device) -> int:
    """The CUDA device number of `device` ("cuda" alone: the current device), as torch's memory
    functions want it."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def allocatable(device) -> int:
    """Bytes a new allocation on `device` may take now: the card's free memory, and under a --vram cap
    (check) no more than the cap leaves over what the runtime has allocated."""
    index = device_index(device)
    free = torch.cuda.mem_get_info(index)[0]
    cap = _CAPS.get(index)
    return free if cap is None else max(0, min(free, cap - torch.cuda.memory_allocated(index)))
