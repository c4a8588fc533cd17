"""The semantic IR: what a decoder-only language model is, independent of any checkpoint.

A model is a small tree of frozen dataclasses. Weights are referenced by name; each
name has one `Tensor` record in `Model.tensors` carrying its role, layer, shape and
encoding. Nothing here imports torch: the IR is plain data, serialisable and verifiable
on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Activation names accepted by MLP.activation.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
# RoPE kinds accepted by RoPE.kind.
ROPE_KINDS = ("default", "linear", "llama3", "yarn")
NORM_KINDS = ("rms", "layer")
ROUTER_SCORINGS = ("softmax",)


@dataclass(frozen=True)
class Encoding:
    """How a tensor's bytes are stored: a format name from `thin.ir.formats` plus parameters."""

    format: str
    # Format parameters as sorted (key, value) pairs, e.g. (("group_size", 128),).
    params: tuple[tuple[str, int | float | str], ...] = ()

    def param(self, key: str, default=None):
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class Tensor:
    """One weight: where it sits in the model and how its bytes are encoded."""

    name: str  # canonical, e.g. "layers.3.attn.qkv.weight"
    role: str  # e.g. "attn.qkv", "ffn.down", "moe.expert.up", "norm.attn"
    layer: int | None  # decoder layer index; None for embedding, final norm, lm head
    shape: tuple[int, ...]
    encoding: Encoding
    # Format in the source checkpoint: "f32", "f16" or "bf16"; a quantized format for a checkpoint that
    # stores it pre-quantized (GPT-OSS: "mxfp4" experts).
    source_dtype: str
    expert: int | None = None  # MoE expert index for per-expert weights
    # Byte alignment of the data in the artifact (a power of two): 4096 for page-major expert pages.
    align: int = 64


@dataclass(frozen=True)
class Linear:
    """y = x @ weight.T (+ bias). weight is [out_features, in_features]."""

    weight: str
    bias: str | None = None


@dataclass(frozen=True)
class Norm:
    kind: str  # "rms" or "layer"
    eps: float
    weight: str | None
    bias: str | None = None
    # Gemma: the stored weight w is applied as (1 + w).
    weight_offset: float = 0.0


@dataclass(frozen=True)
class RoPE:
    """Rotary position embedding (rotate-half convention) and its frequency scaling."""

    kind: str  # "default", "linear" or "llama3"
    theta: float
    rotary_dim: int  # dims of each head that rotate (== head_dim unless partial)
    factor: float = 1.0  # linear and llama3 scaling factor
    # Llama-3 frequency-band scaling.
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    # YaRN (GPT-OSS): frequencies ramp from extrapolated to interpolated (/ factor) between the dims
    # where beta_fast and beta_slow rotations fit the original context; floor/ceil of that range when
    # truncate; cos and sin are multiplied by attention_factor (the resolved mscale).
    beta_fast: float | None = None
    beta_slow: float | None = None
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(frozen=True)
class Attention:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # softmax scale on q.k (1/sqrt(head_dim); Gemma: query_pre_attn_scalar**-0.5)
    o: Linear
    # Either separate projections or one fused [q; k; v] projection (Phi-3, or after canonicalize).
    q: Linear | None = None
    k: Linear | None = None
    v: Linear | None = None
    qkv: Linear | None = None
    rope: RoPE | None = None
    # Qwen3 / Gemma-3: RMSNorm over each head (weight [head_dim]);
    # OLMo-2: over the whole projection (weight [num_heads * head_dim]) before the head split.
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    qk_norm_per_head: bool = True
    sliding_window: int | None = None  # tokens a query sees, itself included (Mistral, Gemma)
    logit_softcap: float | None = None  # Gemma-2: tanh softcap on attention logits
    sinks: str | None = None  # GPT-OSS: per-head sink logits [num_heads]


@dataclass(frozen=True)
class MLP:
    """down(act(gate(x)) * up(x)) when gated, else down(act(up(x)))."""

    activation: str
    down: Linear
    gated: bool = True
    gate: Linear | None = None
    up: Linear | None = None
    gate_up: Linear | None = None  # fused [gate; up] (Phi-3, or after canonicalize)
    # GPT-OSS's clamped SwiGLU: gate = min(gate, limit), up = clamp(up, -limit, limit), then
    # act(gate) * (up + up_offset) with silu's gain act(x) = x * sigmoid(alpha * x).
    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0


@dataclass(frozen=True)
class MoE:
    """Token-choice mixture of experts: router scores, top-k experts, weighted sum."""

    num_experts: int
    top_k: int
    router: Linear  # [num_experts, hidden]
    experts: tuple[MLP, ...]
    scoring: str = "softmax"  # softmax over all experts, then top-k
    normalize_top_k: bool = True  # Qwen3-MoE norm_topk_prob: renormalise the k weights to sum 1
    shared_expert: MLP | None = None
    shared_expert_gate: Linear | None = None  # Qwen2-MoE: sigmoid gate [1, hidden] on the shared expert


@dataclass(frozen=True)
class DecoderLayer:
    """x += post(attn(pre(x))); x += post(ffn(pre(x))); any norm may be absent."""

    index: int
    attention: Attention
    ffn: MLP | MoE
    attn_norm: Norm | None = None  # before attention (absent in OLMo-2)
    attn_post_norm: Norm | None = None  # on the attention output (Gemma-2/3 sandwich, OLMo-2)
    ffn_norm: Norm | None = None  # before the FFN (absent in OLMo-2)
    ffn_post_norm: Norm | None = None  # on the FFN output (Gemma-2/3, OLMo-2)


@dataclass(frozen=True)
class Embedding:
    weight: str  # [vocab_size, hidden_size]
    # Gemma: embeddings are multiplied by sqrt(hidden_size), rounded to the embedding's stored dtype.
    scale: float | None = None


@dataclass(frozen=True)
class LMHead:
    weight: str  # [vocab_size, hidden_size]; the embedding's name when tied
    tied: bool = False
    final_softcap: float | None = None  # Gemma-2: tanh softcap on the final logits


@dataclass(frozen=True)
class FFNLevel:
    """Elastic FFN: a cheaper model inside the artifact. Every dense FFN's intermediate channels are
    stored ordered by importance in 128-channel superblocks (passes/order_superblocks.py), so running
    only the first `channels[i]` of layer i is a contiguous prefix: rows [0, k) of gate and of up,
    columns [0, k) of down. The compiler certified this level (the certificate's `ffn_levels`)."""

    keep: float  # the level's name: at most this share of the FFN weight bytes is read (1.0: all)
    channels: tuple[int, ...]  # per layer: intermediate channels run (a multiple of 128, or all)
    # Per layer: a [hidden] tensor added to the FFN's output (the mean output of the dropped channels),
    # and a [channels] tensor multiplying the kept channels before down; None where all channels run.
    shift: tuple[str | None, ...] = ()
    scale: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class Model:
    architecture: str  # the checkpoint's `architectures[0]`, e.g. "Qwen3ForCausalLM"
    family: str  # the adapter that produced it, e.g. "qwen3"
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    embedding: Embedding
    layers: tuple[DecoderLayer, ...]
    final_norm: Norm
    lm_head: LMHead
    tensors: tuple[Tensor, ...] = field(default=())
    # Elastic FFN levels, by decreasing keep; the first keeps everything. Empty: channels as in the source.
    ffn_levels: tuple[FFNLevel, ...] = ()

    def tensor(self, name: str) -> Tensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no tensor named {name!r} in the IR")

    def tensor_map(self) -> dict[str, Tensor]:
        return {t.name: t for t in self.tensors}
