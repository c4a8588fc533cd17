"""Reference encode/decode in torch: the definition of what each format's bytes mean.

Kernels and quantizers are tested against these. This is the one module under ir/ that
uses torch, imported lazily so the rest of the IR stays plain data.
"""

from __future__ import annotations

from .spec import get


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def encode(format: str, tensor, params: tuple = ()):
    """Encode a torch tensor into this format's bytes: a flat uint8 tensor."""
    spec = get(format)
    if spec.torch_dtype is None:
        raise NotImplementedError(f"no reference encoder for {format}")
    dense = tensor.detach().to(_dtype(spec.torch_dtype)).contiguous().reshape(-1)
    return dense.view(__import__("torch").uint8)


def decode(format: str, raw, shape: tuple[int, ...], params: tuple = ()):
    """Decode a flat uint8 tensor of this format into a tensor of `shape` (the stored dtype)."""
    spec = get(format)
    if spec.torch_dtype is None:
        raise NotImplementedError(f"no reference decoder for {format}")
    expected = spec.nbytes(tuple(shape), params)
    if raw.numel() != expected:
        raise ValueError(f"{format} tensor of shape {tuple(shape)} needs {expected} bytes, got {raw.numel()}")
    return raw.view(_dtype(spec.torch_dtype)).reshape(shape)
