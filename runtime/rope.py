"""Rotary position embeddings (rotate-half convention) for the IR's RoPE kinds.

Frequencies are computed in float32 exactly as transformers does (default, linear,
llama3, yarn), and cos/sin tables are cached per RoPE and grown on demand.
"""

from __future__ import annotations

import math

import torch

from thin.ir import RoPE


def inverse_frequencies(rope: RoPE) -> torch.Tensor:
    """float32 [rotary_dim // 2] inverse frequencies, scaled per `rope.kind`."""
    dim = rope.rotary_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    if rope.kind == "default":
        return inv_freq
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3(inv_freq, rope)
    if rope.kind == "yarn":
        return _yarn(rope)
    raise NotImplementedError(f"RoPE kind {rope.kind!r} is not implemented")


def _llama3(inv_freq: torch.Tensor, rope: RoPE) -> torch.Tensor:
    # Llama-3.1: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_context = rope.original_max_position_embeddings
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RoPE) -> torch.Tensor:
    # YaRN (transformers' _compute_yarn_parameters): dims that turn fewer than beta_slow times over the
    # original context are interpolated (/ factor), those turning more than beta_fast times kept, a
    # linear ramp between. Same float32 operations in the same order, so the tables agree to the bit.
    dim, base = rope.rotary_dim, rope.theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryTables:
    """cos/sin tables [positions, rotary_dim] for one RoPE, in the compute dtype, grown as needed."""

    def __init__(self, rope: RoPE, device: torch.device, dtype: torch.dtype):
        self.rope = rope
        self.dtype = dtype
        self.inv_freq = inverse_frequencies(rope).to(device)
        self.cos = self.sin = torch.empty(0, rope.rotary_dim, device=device, dtype=dtype)

    def get(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions start .. start + length - 1."""
        end = start + length
        if end > self.cos.shape[0]:
            self._grow(max(end, 2 * self.cos.shape[0], 256))
        return self.cos[start:end], self.sin[start:end]

    def _grow(self, size: int) -> None:
        positions = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.rope.attention_factor != 1.0:  # YaRN's mscale, applied in float32 as transformers does
            cos, sin = cos * self.rope.attention_factor, sin * self.rope.attention_factor
        self.cos, self.sin = cos.to(self.dtype), sin.to(self.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim features of x [T, heads, head_dim]; cos/sin are [T, rotary_dim]."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, keep = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, keep), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
