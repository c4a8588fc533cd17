"""GPT-OSS (GptOssForCausalLM): sinks, alternating sliding/full layers, YaRN, biased clamped-SwiGLU experts.

Experts come in two layouts, both one tensor per projection for all experts:
- dense (transformers' save_pretrained): `experts.gate_up_proj` [E, hidden, 2I] and `down_proj`
  [E, I, hidden], stored transposed (input features first);
- MXFP4, as OpenAI publishes the models (config.json quantization_config `quant_method: mxfp4`):
  `experts.gate_up_proj_blocks` uint8 [E, 2I, hidden / 32, 16] with `..._scales` uint8
  [E, 2I, hidden / 32], and the same for down_proj. That is OCP MXFP4 with thin's byte layout:
  each row's 16-byte blocks hold 32 E2M1 codes, element 2i in the low nibble of byte i, and a
  scale byte is an E8M0 exponent biased by 127 (transformers' integrations/mxfp4.py decodes them
  so). The bytes are kept as they are, as thin `mxfp4` tensors: nothing goes through bf16.

In both, gate and up are interleaved along the output rows (gate = rows 0, 2, 4, ..., up = rows
1, 3, 5, ...; transformers' `gate_up[..., ::2]`, `gate_up[..., 1::2]`), biases too. Each expert's
gate_up is read once and written as the IR's fused [gate; up] (rows regrouped, bytes unchanged).
"""

from __future__ import annotations

import dataclasses

from thin.ir import MLP, Encoding, Linear, MoE, formats

from ..checkpoint import RAW_BYTES
from ..errors import CheckpointError
from . import register
from .decoder import AttentionOptions, assemble, attention, pre_norm_layer, sliding_windows, src_layer

# GptOssConfig's RoPE when config.json has none.
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
MXFP4 = Encoding("mxfp4", formats.get("mxfp4").normalize())


@register("GptOssForCausalLM", "gpt_oss", quant_methods=("mxfp4",))
def build(cfg, b):
    """gpt-oss-20b / -120b, from the MXFP4 checkpoints as published or from dense experts."""
    n = cfg.int("num_hidden_layers")
    params = cfg.rope_parameters(default_theta=150_000.0)
    if not (cfg.raw.get("rope_parameters") or cfg.raw.get("rope_scaling")):
        params = {**DEFAULT_ROPE, **params}
    rope = cfg.rope(params)
    types = cfg.layer_types(["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
    windows = sliding_windows(cfg, types, default=128)
    bias = bool(cfg.get("attention_bias", True))
    opts = AttentionOptions(qkv_bias=bias, o_bias=bias)
    layers = []
    for i in range(n):
        attn = attention(b, cfg, i, rope, windows[i], opts)
        sinks = b.take(src_layer(i) + "self_attn.sinks", f"layers.{i}.attn.sinks", "attn.sinks", i)
        layers.append(pre_norm_layer(b, cfg, i, dataclasses.replace(attn, sinks=sinks), _moe(cfg, b, i)))
    return assemble(b, cfg, "gpt_oss", layers, tied_default=False)


def _moe(cfg, b, i: int) -> MoE:
    src, dst = src_layer(i) + "mlp.", f"layers.{i}.ffn."
    num_experts = cfg.int("num_local_experts", 128)
    router = b.linear(src + "router", dst + "router", "moe.router", i, bias=True)
    read = _Mxfp4Experts(b, src + "experts.") if b.has(src + "experts.gate_up_proj_blocks") \
        else _DenseExperts(b, src + "experts.")
    # GptOssExperts: glu = gate * sigmoid(alpha * gate) after clamping, times (up + 1).
    swiglu = dict(alpha=cfg.float("swiglu_alpha", 1.702), limit=cfg.float("swiglu_limit", 7.0), up_offset=1.0)
    experts = []
    for e in range(num_experts):
        name = f"{dst}experts.{e}."
        gate_up = Linear(read.gate_up(name + "gate_up.weight", i, e),
                         _bias(b, src + "experts.gate_up_proj_bias", name + "gate_up.bias", i, e, interleaved=True))
        down = Linear(read.down(name + "down.weight", i, e),
                      _bias(b, src + "experts.down_proj_bias", name + "down.bias", i, e, interleaved=False))
        experts.append(MLP("silu", gate_up=gate_up, down=down, **swiglu))
    # Top-k of the router logits, softmax over those k: the same as softmax then renormalised top-k.
    return MoE(num_experts=num_experts, top_k=cfg.int("num_experts_per_tok", 4), router=router,
               experts=tuple(experts), normalize_top_k=True)


def _regroup(rows):
    """Interleaved [g0, u0, g1, u1, ...] rows (dim 0) -> [g0, g1, ...; u0, u1, ...]."""
    import torch

    return torch.cat((rows[0::2], rows[1::2]))


def _bias(b, src: str, name: str, layer: int, e: int, *, interleaved: bool) -> str:
    info = b.store.tensors.get(src)
    if info is None:
        raise CheckpointError(f"{b.architecture}: checkpoint has no tensor {src!r}")
    load = b.store.loader(src, (e,))

    def read():
        raw = load()
        if not interleaved:
            return raw
        fmt = formats.get(info.dtype)
        return fmt.encode(_regroup(fmt.decode(raw, info.shape[1:])))

    return b.derive([src], name, "moe.expert.gate_up.bias" if interleaved else "moe.expert.down.bias", layer,
                    info.shape[1:], Encoding(info.dtype), read, expert=e)


class _DenseExperts:
    """Expert weights stored transposed ([E, in, out]), in a dense format."""

    def __init__(self, b, src: str):
        self.b, self.src = b, src

    def _read(self, src: str, name: str, role: str, layer: int, e: int, interleaved: bool) -> str:
        info = self.b.store.tensors.get(src)
        if info is None or len(info.shape) != 3:
            raise CheckpointError(f"{self.b.architecture}: expected a 3-D expert tensor {src!r}")
        load = self.b.store.loader(src, (e,))
        fmt = formats.get(info.dtype)

        def read():
            w = fmt.decode(load(), info.shape[1:]).t()  # [out, in]
            w = _regroup(w) if interleaved else w
            return fmt.encode(w)

        shape = (info.shape[2], info.shape[1])
        return self.b.derive([src], name, role, layer, shape, Encoding(info.dtype), read, expert=e)

    def gate_up(self, name: str, layer: int, e: int) -> str:
        return self._read(self.src + "gate_up_proj", name, "moe.expert.gate_up", layer, e, True)

    def down(self, name: str, layer: int, e: int) -> str:
        return self._read(self.src + "down_proj", name, "moe.expert.down", layer, e, False)


class _Mxfp4Experts:
    """Expert weights as MXFP4 blocks [E, out, in / 32, 16] and scales [E, out, in / 32] (uint8)."""

    def __init__(self, b, src: str):
        self.b, self.src = b, src

    def _read(self, proj: str, name: str, role: str, layer: int, e: int, interleaved: bool) -> str:
        blocks_src, scales_src = f"{self.src}{proj}_blocks", f"{self.src}{proj}_scales"
        blocks, scales = self.b.source_shape(blocks_src), self.b.source_shape(scales_src)
        for src in (blocks_src, scales_src):
            if self.b.store.tensors[src].dtype != RAW_BYTES:
                raise CheckpointError(f"{self.b.architecture}: {src!r} must be U8 (packed mxfp4)")
        if len(blocks) != 4 or blocks[3] != 16 or blocks[:3] != scales:
            raise CheckpointError(f"{self.b.architecture}: mxfp4 blocks {list(blocks)} and scales {list(scales)} "
                                  "must be [E, rows, groups, 16] and [E, rows, groups]")
        rows, cols = blocks[1], blocks[2] * 32
        load_blocks, load_scales = self.b.store.loader(blocks_src, (e,)), self.b.store.loader(scales_src, (e,))

        def read():
            values, exponents = load_blocks().reshape(rows, cols // 2), load_scales().reshape(rows, cols // 32)
            if interleaved:
                values, exponents = _regroup(values), _regroup(exponents)
            return formats.get("mxfp4").join({"values": values, "scales": exponents}, (rows, cols))

        return self.b.derive([blocks_src, scales_src], name, role, layer, (rows, cols), MXFP4, read, expert=e)

    def gate_up(self, name: str, layer: int, e: int) -> str:
        return self._read("gate_up_proj", name, "moe.expert.gate_up", layer, e, True)

    def down(self, name: str, layer: int, e: int) -> str:
        return self._read("down_proj", name, "moe.expert.down", layer, e, False)
