"""A small hand-built IR used by the IR, pass and artifact tests."""

from thin.ir import (
    MLP,
    Attention,
    DecoderLayer,
    Embedding,
    Encoding,
    Linear,
    LMHead,
    Model,
    Norm,
    RoPE,
    Tensor,
)


def tiny_model(num_layers: int = 2, hidden: int = 16, vocab: int = 32, heads: int = 4, kv_heads: int = 2,
               inter: int = 24, tied: bool = False, fmt: str = "f32") -> Model:
    """A Llama-shaped IR with separate q/k/v and gate/up, every tensor in `fmt`."""
    hd = hidden // heads
    tensors = []

    def t(name, role, layer, shape):
        tensors.append(Tensor(name, role, layer, tuple(shape), Encoding(fmt), fmt))
        return name

    emb = t("embed.weight", "embed", None, (vocab, hidden))
    layers = []
    for i in range(num_layers):
        p = f"layers.{i}."
        attn = Attention(
            num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, scale=hd ** -0.5,
            q=Linear(t(p + "attn.q.weight", "attn.q", i, (heads * hd, hidden))),
            k=Linear(t(p + "attn.k.weight", "attn.k", i, (kv_heads * hd, hidden))),
            v=Linear(t(p + "attn.v.weight", "attn.v", i, (kv_heads * hd, hidden))),
            o=Linear(t(p + "attn.o.weight", "attn.o", i, (hidden, heads * hd))),
            rope=RoPE("default", 10000.0, hd),
        )
        ffn = MLP("silu", down=Linear(t(p + "ffn.down.weight", "ffn.down", i, (hidden, inter))),
                  gate=Linear(t(p + "ffn.gate.weight", "ffn.gate", i, (inter, hidden))),
                  up=Linear(t(p + "ffn.up.weight", "ffn.up", i, (inter, hidden))))
        layers.append(DecoderLayer(
            index=i, attention=attn, ffn=ffn,
            attn_norm=Norm("rms", 1e-6, t(p + "attn_norm.weight", "norm.attn", i, (hidden,))),
            ffn_norm=Norm("rms", 1e-6, t(p + "ffn_norm.weight", "norm.ffn", i, (hidden,)))))
    final = Norm("rms", 1e-6, t("final_norm.weight", "norm.final", None, (hidden,)))
    head = LMHead(emb, tied=True) if tied else LMHead(t("lm_head.weight", "lm_head", None, (vocab, hidden)))
    return Model("LlamaForCausalLM", "llama", vocab, hidden, 128, Embedding(emb), tuple(layers), final,
                 head, tuple(tensors))
