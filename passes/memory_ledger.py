"""The memory ledger: every byte the runtime holds on the device for a model, line by line.

`--vram SIZE` is a promise about the whole process on the GPU, not about the file, so the ledger
counts, besides the weights:

- kv_cache: keys and values of every layer for `ctx` tokens in the compute dtype:
  2 x kv_heads x head_dim x tokens x dtype bytes per layer, a sliding-window layer holding at
  most its window;
- activations: the live tensors of the largest single step, a prefill chunk of `prefill_chunk`
  tokens (the GPU engine prefills in chunks; the largest phase of attention, FFN or LM head,
  with the residual stream, attention scores against the whole context, and the float32 logits);
- dequant_workspace: the torch path dequantizes one weight at a time on the device (float32,
  then the compute dtype), so the largest quantizable weight decoded once is reserved;
- runtime_overhead: what the process holds before any tensor: the CUDA context, cuBLAS
  workspace and the caching allocator's slack. RUNTIME_OVERHEAD is a documented constant until
  examples/benchmarks/measure_overhead.py is run on the GPU with the real runtime.
"""

from __future__ import annotations

import re

from thin.ir import Model, MoE, formats
from thin.ir.formats.base import DTYPE_BYTES

# CUDA context (~300-550 MiB with lazy module loading on Hopper, CUDA 12; PyTorch's CUDA notes),
# plus cuBLAS workspaces and the caching allocator's rounding/fragmentation slack. Not yet
# measured with thin's runtime: examples/benchmarks/measure_overhead.py prints the figure.
RUNTIME_OVERHEAD = 768 * 2**20
PREFILL_CHUNK = 512
DEFAULT_CTX = 4096

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
          "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str) -> int:
    """Bytes in `8G`, `7.5GiB`, `12000M`, `512MiB`, `6GB`: K/M/G/T and KiB/MiB/GiB/TiB are powers of
    1024 (as nvidia-smi counts), KB/MB/GB/TB powers of 1000; a bare number is bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write it like 8G, 7.5GiB, 12000M or 6GB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def compute_dtype_bytes(model: Model) -> int:
    """Bytes per activation and KV element on the GPU: the runtime computes in the embedding's stored
    dtype there (bf16/f16: 2, f32: 4)."""
    fmt = formats.get(model.tensor(model.embedding.weight).source_dtype)
    return DTYPE_BYTES[fmt.torch_dtype] if fmt.dense else 2


def kv_cache_bytes(model: Model, ctx: int) -> int:
    """Keys and values of every layer for `ctx` tokens (a sliding-window layer keeps its window)."""
    size = compute_dtype_bytes(model)
    total = 0
    for layer in model.layers:
        a = layer.attention
        tokens = min(ctx, a.sliding_window) if a.sliding_window else ctx
        total += 2 * a.num_kv_heads * a.head_dim * tokens * size
    return total


def activation_bytes(model: Model, ctx: int, chunk: int = PREFILL_CHUNK) -> int:
    """The live activations of the largest step: one prefill chunk through its largest phase."""
    a_size = compute_dtype_bytes(model)
    t = min(chunk, ctx)
    hidden = model.hidden_size
    residual = t * hidden * (2 * a_size + 4)  # x, the normed copy, a float32 norm temporary
    phases = []
    for layer in model.layers:
        a = layer.attention
        qkv = t * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim * a_size
        keys = min(ctx, a.sliding_window) if a.sliding_window else ctx
        scores = a.num_heads * t * keys * 4  # float32 scores when attention is not fused
        phases.append(2 * qkv + scores + t * a.num_heads * a.head_dim * a_size)
        ffn = layer.ffn
        if isinstance(ffn, MoE):
            width = max(_mlp_width(model, e) for e in ffn.experts) * ffn.top_k
            if ffn.shared_expert is not None:
                width += _mlp_width(model, ffn.shared_expert)
            phases.append(t * width * 3 * a_size + t * ffn.num_experts * 4 * 2)
        else:
            phases.append(t * _mlp_width(model, ffn) * 3 * a_size)
    phases.append(t * model.vocab_size * (a_size + 4))  # logits, then their float32 copy
    return residual + max(phases)


def _mlp_width(model: Model, mlp) -> int:
    lin = mlp.down
    return model.tensor(lin.weight).shape[1]


def dequant_workspace_bytes(model: Model, names: list[str]) -> int:
    """The largest of `names` decoded once: float32, then the compute dtype."""
    records = model.tensor_map()
    largest = max((_numel(records[n].shape) for n in names), default=0)
    return largest * (4 + compute_dtype_bytes(model))


def ledger(model: Model, weight_bytes: int, *, ctx: int, prefill_chunk: int, quantizable: list[str],
           overhead: int = RUNTIME_OVERHEAD) -> dict:
    """Every line item in bytes, and their total."""
    lines = {
        "weights": int(weight_bytes),
        "kv_cache": kv_cache_bytes(model, ctx),
        "activations": activation_bytes(model, ctx, prefill_chunk),
        "dequant_workspace": dequant_workspace_bytes(model, quantizable),
        "runtime_overhead": overhead,
    }
    return {"lines": lines, "total": sum(lines.values()), "ctx": ctx, "prefill_chunk": prefill_chunk,
            "compute_dtype_bytes": compute_dtype_bytes(model), "overhead_source": OVERHEAD_SOURCE}


OVERHEAD_SOURCE = ("constant: CUDA context + cuBLAS workspace + allocator slack, not yet measured with thin's "
                   "runtime (examples/benchmarks/measure_overhead.py)")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
