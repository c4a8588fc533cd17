"""Building blocks shared by the Llama-shaped adapters (`model.layers.{i}.self_attn...`).

Each function maps one block from the transformers naming to the canonical IR naming:
`model.layers.{i}.self_attn.q_proj` -> `layers.{i}.attn.q`, `mlp.gate_proj` -> `ffn.gate`, ...
"""

from __future__ import annotations

from dataclasses import dataclass

from thin.ir import MLP, Attention, DecoderLayer, Embedding, Linear, LMHead, Model, Norm, RoPE

from ..builder import Builder
from ..config import Config


@dataclass(frozen=True)
class AttentionOptions:
    """How one family's attention block is laid out in the checkpoint."""

    qkv_bias: bool = False  # biases on q, k, v (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # bias on o (Llama's attention_bias)
    fused_qkv: bool = False  # one qkv_proj (Phi-3)
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3, Gemma-3); "full": whole projection (OLMo-2)
    norm_offset: float = 0.0  # Gemma: stored norm weights are applied as (1 + w)
    scale: float | None = None  # None: head_dim ** -0.5
    logit_softcap: float | None = None  # Gemma-2


def src_layer(i: int) -> str:
    return f"model.layers.{i}."


def attention(b: Builder, cfg: Config, i: int, rope: RoPE | None, sliding_window: int | None,
              opts: AttentionOptions) -> Attention:
    """The self-attention block of layer `i`."""
    src, dst = src_layer(i) + "self_attn.", f"layers.{i}.attn."
    head_dim = cfg.head_dim()
    eps = cfg.float("rms_norm_eps", 1e-6)
    if opts.fused_qkv:
        qkv = b.linear(src + "qkv_proj", dst + "qkv", "attn.qkv", i, bias=opts.qkv_bias)
        q = k = v = None
    else:
        qkv = None
        q, k, v = (b.linear(src + f"{p}_proj", dst + p, f"attn.{p}", i, bias=opts.qkv_bias) for p in "qkv")
    q_norm = k_norm = None
    if opts.qk_norm is not None:
        q_norm, k_norm = (b.rms_norm(src + f"{p}_norm", dst + f"{p}_norm", f"norm.{p}", i, eps,
                                     opts.norm_offset) for p in "qk")
    return Attention(
        num_heads=cfg.int("num_attention_heads"),
        num_kv_heads=cfg.int("num_key_value_heads", cfg.int("num_attention_heads")),
        head_dim=head_dim,
        scale=opts.scale if opts.scale is not None else head_dim ** -0.5,
        o=b.linear(src + "o_proj", dst + "o", "attn.o", i, bias=opts.o_bias),
        q=q, k=k, v=v, qkv=qkv, rope=rope,
        q_norm=q_norm, k_norm=k_norm, qk_norm_per_head=opts.qk_norm != "full",
        sliding_window=sliding_window, logit_softcap=opts.logit_softcap,
    )


def mlp(b: Builder, src: str, dst: str, layer: int, activation: str, *, fused: bool = False,
        bias: bool = False, role: str = "ffn", expert: int | None = None) -> MLP:
    """A gated MLP from `{src}.gate_proj/up_proj/down_proj` (or a fused `gate_up_proj`)."""
    def linear(s: str, d: str) -> Linear:
        weight = b.take(f"{src}{s}.weight", f"{dst}{d}.weight", f"{role}.{d}", layer, expert=expert)
        if not bias:
            return Linear(weight)
        bias_name = b.take(f"{src}{s}.bias", f"{dst}{d}.bias", f"{role}.{d}.bias", layer, expert=expert)
        return Linear(weight, bias_name)

    # Tensors are recorded in execution order: gate/up before down.
    if fused:
        gate_up = linear("gate_up_proj", "gate_up")
        return MLP(activation, gate_up=gate_up, down=linear("down_proj", "down"))
    gate, up = linear("gate_proj", "gate"), linear("up_proj", "up")
    return MLP(activation, gate=gate, up=up, down=linear("down_proj", "down"))


def pre_norm_layer(b: Builder, cfg: Config, i: int, attn: Attention, ffn, norm_offset: float = 0.0,
                   sandwich: bool = False) -> DecoderLayer:
    """A layer with input/post-attention norms; `sandwich` adds Gemma's four-norm layout."""
    src, dst = src_layer(i), f"layers.{i}."
    eps = cfg.float("rms_norm_eps", 1e-6)

    def norm(s: str, d: str, role: str) -> Norm:
        return b.rms_norm(src + s, dst + d, role, i, eps, norm_offset)

    if not sandwich:
        return DecoderLayer(i, attn, ffn, attn_norm=norm("input_layernorm", "attn_norm", "norm.attn"),
                            ffn_norm=norm("post_attention_layernorm", "ffn_norm", "norm.ffn"))
    return DecoderLayer(
        i, attn, ffn,
        attn_norm=norm("input_layernorm", "attn_norm", "norm.attn"),
        attn_post_norm=norm("post_attention_layernorm", "attn_post_norm", "norm.attn_post"),
        ffn_norm=norm("pre_feedforward_layernorm", "ffn_norm", "norm.ffn"),
        ffn_post_norm=norm("post_feedforward_layernorm", "ffn_post_norm", "norm.ffn_post"),
    )


def sliding_windows(cfg: Config, layer_types: list[str], default: int | None = None) -> list[int | None]:
    """Per layer: config sliding_window (`default` when absent) on "sliding_attention" layers."""
    window = cfg.optional_int("sliding_window", default)
    return [window if t == "sliding_attention" and window is not None else None for t in layer_types]


def assemble(b: Builder, cfg: Config, family: str, layers: list[DecoderLayer], *, tied_default: bool,
             norm_offset: float = 0.0, embed_scale: float | None = None,
             final_softcap: float | None = None) -> Model:
    """Embedding, final norm and LM head around `layers`; declares rotary buffers unused."""
    embed = b.take("model.embed_tokens.weight", "embed.weight", "embed", None)
    final_norm = b.rms_norm("model.norm", "final_norm", "norm.final", None,
                            cfg.float("rms_norm_eps", 1e-6), norm_offset)
    tied = cfg.bool("tie_word_embeddings", tied_default)
    if tied:
        if b.has("lm_head.weight"):
            b.declare_unused("lm_head.weight", "tie_word_embeddings: a copy of the embedding")
        head = LMHead(embed, tied=True, final_softcap=final_softcap)
    else:
        weight = b.take("lm_head.weight", "lm_head.weight", "lm_head", None)
        head = LMHead(weight, final_softcap=final_softcap)
    for name in b.store.tensors:
        if name.endswith(("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")):
            b.declare_unused(name, "RoPE frequencies are recomputed from the config")
    return Model(
        architecture=b.architecture, family=family,
        vocab_size=cfg.int("vocab_size"), hidden_size=cfg.int("hidden_size"),
        max_position_embeddings=cfg.int("max_position_embeddings"),
        embedding=Embedding(embed, scale=embed_scale), layers=tuple(layers),
        final_norm=final_norm, lm_head=head, tensors=tuple(b.tensors),
    )


def dense_layers(b: Builder, cfg: Config, *, ropes: list[RoPE | None], windows: list[int | None],
                 opts: AttentionOptions, activation: str, mlp_bias: bool = False, fused_mlp: bool = False,
                 sandwich: bool = False) -> list[DecoderLayer]:
    """Every layer of a pre-norm (or Gemma sandwich-norm) decoder with a dense gated MLP."""
    layers = []
    for i in range(cfg.int("num_hidden_layers")):
        attn = attention(b, cfg, i, ropes[i], windows[i], opts)
        ffn = mlp(b, src_layer(i) + "mlp.", f"layers.{i}.ffn.", i, activation, fused=fused_mlp, bias=mlp_bias)
        layers.append(pre_norm_layer(b, cfg, i, attn, ffn, opts.norm_offset, sandwich))
    return layers
