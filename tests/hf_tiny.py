"""Random tiny Hugging Face checkpoints, one per supported family, for parity tests.

`make_checkpoint(family, path)` builds a seeded random model with transformers at toy
sizes (hidden 64, 2-4 layers, 4 heads / 2 kv heads, vocab 256, sliding window 8) and
writes it with `save_pretrained` as safetensors. Norm weights are re-drawn around 1 (and
around 0 for Gemma's stored-as-offset norms) so +1 offsets and qk-norms matter.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2", "gemma2", "gemma3", "qwen3_moe", "mixtral",
            "gpt_oss"]

_COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

# family -> (config class name, model class name, config overrides)
_SPECS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
        rope_theta=500000.0, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5, tie_word_embeddings=False)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        sliding_window_pattern=2, rope_local_base_freq=10000.0, rope_theta=1000000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0}, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=False)),  # untied: a tied random Gemma-3 greedily repeats its input token
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=8)),
    # YaRN stretching a 64-position original context 4x, so interpolation and the cos/sin scale both
    # matter within 48 positions; swiglu_limit low enough that the clamps bite at these weight scales.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
        sliding_window=8, swiglu_limit=3.0, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64})),
}

# Families whose stored norm weight w is applied as (1 + w): re-draw those around 0.
_OFFSET_NORMS = {"gemma2", "gemma3"}


def build_model(family: str, *, seed: int = 0, **overrides):
    """The random transformers model for `family` (float32, eager attention, eval mode)."""
    import transformers

    cfg_name, model_name, spec = _SPECS[family]
    kwargs = {**_COMMON, **spec, **overrides}
    config = getattr(transformers, cfg_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    _config_clamps(model)
    _randomise(model, family, seed)
    return model


def _randomise(model, family: str, seed: int) -> None:
    """Make every parameter matter: norms not all ones, linears large enough that greedy decoding
    wanders instead of repeating one token, embeddings small so they do not dominate the residual."""
    gen = torch.Generator().manual_seed(seed + 1)
    center = 0.0 if family in _OFFSET_NORMS else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(center + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def make_checkpoint(family: str, path, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                    **overrides) -> Path:
    """Write a random tiny `family` checkpoint (safetensors) into `path`; return the path.

    `overrides` are config keyword arguments (e.g. `tie_word_embeddings=True`).
    """
    path = Path(path)
    model = build_model(family, seed=seed, **overrides).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_reference(path, dtype: torch.dtype = torch.float32):
    """Load a checkpoint written by `make_checkpoint` back into transformers (eager attention)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    _config_clamps(model)
    return model.eval()


def _config_clamps(model) -> None:
    """GPT-OSS: transformers before 5.18 fixed the experts' SwiGLU clamp at alpha 1.702 and limit 7.0
    (the published checkpoints' values) whatever the config said; later versions read swiglu_alpha /
    swiglu_limit from it, as thin does. Give an older reference the config's values, so the same
    test checkpoint (limit 3.0, low enough that the clamp bites) means the same model on both."""
    config = model.config
    if getattr(config, "model_type", None) != "gpt_oss":
        return
    for module in model.modules():
        if hasattr(module, "limit") and hasattr(module, "alpha"):
            module.limit = getattr(config, "swiglu_limit", module.limit)
            module.alpha = getattr(config, "swiglu_alpha", module.alpha)
