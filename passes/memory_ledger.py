"""The memory ledger: every byte the runtime holds on the device for a model, line by line.

`--vram SIZE` is a promise about the whole process on the GPU, not about the file, so the ledger
counts, besides the weights (as stored: the GPU engine's kernels read packed formats directly):

- kv_cache: keys and values of every layer for `ctx` tokens (capped at the model's positions) in
  the compute dtype, 2 x kv_heads x head_dim x tokens x dtype bytes per layer; a sliding-window
  layer keeps only its window (the engine's ring);
- activations: the largest step, a prefill of the whole context in one batch: ctx x (6 x hidden +
  3 x the widest projection) activations plus the last position's float32 logits;
- workspace: rotary tables for every position, and the allocator's slack, CUDA graph pools and
  Triton/cuBLAS scratch;
- cuda_context: what the process holds before any tensor (the CUDA context and loaded kernels).

The first three follow the GPU engine's own check (runtime/memory.py `estimate`, which
`thin-exec --vram` applies; a test keeps the two in step); the context is on top, since
`--vram` here is everything on the device. CUDA_CONTEXT is measured with the real runtime by
examples/benchmarks/measure_overhead.py (see the constant).
"""

from __future__ import annotations

from thin.ir import Model, formats, parse_size  # noqa: F401 (parse_size: the passes' API)
from thin.ir.formats.base import DTYPE_BYTES

# Measured 2026-11-30 on one H200 (torch 2.11, Triton 3.6) by examples/benchmarks/measure_overhead.py
# examples/models/tiny-coder: the process held 518 MiB after CUDA's initialisation alone (the
# context), and 770.8 MiB more than torch's peak allocation after load + a 512-token prompt + 32
# decoded tokens (context, loaded Triton/cuBLAS kernels, the allocator's unused reserve). The context
# line is the first figure rounded up to 32 MiB; with ENGINE_SCRATCH below the two lines hold 800 MiB,
# above the 770.8 measured.
CUDA_CONTEXT = 544 * 2**20
# The engine's allocator slack, CUDA graph pools, Triton and cuBLAS scratch (runtime/memory.py).
ENGINE_SCRATCH = 256 * 2**20
DEFAULT_CTX = 4096

def compute_dtype_bytes(model: Model) -> int:
    """Bytes per activation and KV element on the GPU: the runtime computes in the embedding's stored
    dtype there (bf16/f16: 2, f32: 4)."""
    fmt = formats.get(model.tensor(model.embedding.weight).source_dtype)
    return DTYPE_BYTES[fmt.torch_dtype] if fmt.dense else 4


def context_tokens(model: Model, ctx: int) -> int:
    """The tokens the runtime keeps: `ctx`, at most the model's positions."""
    return min(ctx, model.max_position_embeddings)


def kv_cache_bytes(model: Model, ctx: int) -> int:
    """Keys and values of every layer for `ctx` tokens (a sliding-window layer keeps its window)."""
    size, ctx = compute_dtype_bytes(model), context_tokens(model, ctx)
    total = 0
    for layer in model.layers:
        a = layer.attention
        tokens = min(ctx, a.sliding_window) if a.sliding_window else ctx
        total += 2 * a.num_kv_heads * a.head_dim * tokens * size
    return total


def activation_bytes(model: Model, ctx: int) -> int:
    """A prefill of the whole context in one batch, and the float32 logits of its last position."""
    widest = 0
    for layer in model.layers:
        a = layer.attention
        mlps = getattr(layer.ffn, "experts", None) or (layer.ffn,)
        widest = max([widest, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim]
                     + [2 * model.tensor(m.down.weight).shape[1] for m in mlps])
    tokens = context_tokens(model, ctx)
    return tokens * (6 * model.hidden_size + 3 * widest) * compute_dtype_bytes(model) + 8 * model.vocab_size


def workspace_bytes(model: Model) -> int:
    """Rotary cos/sin tables for every position, and the engine's scratch."""
    ropes = {layer.attention.rope for layer in model.layers if layer.attention.rope is not None}
    tables = sum(2 * model.max_position_embeddings * rope.rotary_dim * compute_dtype_bytes(model) for rope in ropes)
    return tables + ENGINE_SCRATCH


def ledger(model: Model, weight_bytes: int, *, ctx: int, overhead: int = CUDA_CONTEXT) -> dict:
    """Every line item in bytes, and their total."""
    lines = {
        "weights": int(weight_bytes),
        "kv_cache": kv_cache_bytes(model, ctx),
        "activations": activation_bytes(model, ctx),
        "workspace": workspace_bytes(model),
        "cuda_context": overhead,
    }
    return {"lines": lines, "total": sum(lines.values()), "ctx": context_tokens(model, ctx),
            "compute_dtype_bytes": compute_dtype_bytes(model), "overhead_source": OVERHEAD_SOURCE}


OVERHEAD_SOURCE = ("cuda_context: 544 MiB, measured on an H200 with thin's runtime (518 MiB context; 771 MiB "
                   "beyond torch's peak allocation with ENGINE_SCRATCH's share; "
                   "examples/benchmarks/measure_overhead.py)")
