"""Triton kernels for the CUDA decode path, one family per file.

Weight formats (each reads its format's packed bytes directly, never a dequantized copy):
    dense.py        bf16 / f16 / f32                 matvec (+ fused gate/up activation, split-K)
    rowwise8.py     int8, fp8_e4m3 (one scale a row)  matvec, prefill matmul
    grouped_int.py  int3, int4, int5, int6            matvec (bits are constexpr); its prefill matmul
                                                      in grouped_int_prefill.py
    mxfp4.py        mxfp4                             matvec, prefill matmul
    q2.py, q1.py    q2, q1                            matvec, prefill matmul
    trellis.py      trellis (2-/3-bit trellis codes)  matvec, prefill matmul, the expert kernels' rows
Everything else a decode step runs:
    norm.py         residual add (+ split-K partial sums) + RMSNorm, with the optional post-norm
    deferred_norm.py  the residual norm left to the next projection (the matvecs' side of it)
    rope.py         q/k norm + RoPE (every kind, via the cos/sin tables) + paged KV append
    attention.py    split-KV decode attention over the paged cache (GQA, window, softcap, sinks),
                    prefill attention through scaled_dot_product_attention
    attention_append.py  the decode attention's split kernel with rope.py's work inside (the engine
                    times it against rope_append + attention at warm-up)
    int8_heads.py   the attention's merge rounding its output to int8 a head of 128, and o's symmetric int4
                    matvec on the int8 tensor cores from those codes (lanes.py: the mma's lane-level pieces)
    activation.py   the IR's activations, and act(gate) * up for prefill
    experts.py      mixture of experts: router top-k, the chosen experts' gate/up + activation and
                    weighted down, reading each expert's packed bytes (indices stay on the device)
    expert_rows.py  one expert's rows in any weight format, found through per-format offset tables
    expert_words.py grouped-int experts' rows read as whole words (the dense int4 matvec's chunk scheme)
    expert_tiles.py the expert kernels' launch tiles: candidates the load-time timing picks from
    norm_router.py  the router with the residual norm before its MoE layer inside (the engine times it
                    against add_rmsnorm + router at warm-up)
    grouped_int_batch.py  int4 weights times a few rows of activations (the batched decode step)
    sampling.py     greedy argmax and temperature / top-k / top-p / min-p draws on the device
    prefill.py      the prefill matmuls' tilings and their choice per prompt-length bucket (TiledPrefill)
The linear families share common.py (KernelLinear, the LinearOp they serve; MatvecConfig) and tuning.py
(which configuration each weight runs with, timed on the device and cached).

Nothing here is imported by `thin.runtime` itself: `runtime/linear.py` registers the linear
families by "module:factory" name and imports them on first use, and the engine imports the rest
when it is built. With TRITON_INTERPRET=1 every kernel also runs on CPU tensors (the tests do that).
"""

from __future__ import annotations

import importlib.util
import os


def triton_available() -> bool:
    """Triton can be imported here (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Kernels run through Triton's interpreter (on CPU tensors), as in the CPU test suite."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cuda_kernels_available() -> bool:
    """Triton is importable and a CUDA device is present: the registry may serve kernels on CUDA."""
    if not triton_available():
        return False
    import torch

    return torch.cuda.is_available()
