"""Reading config.json values that define the math, refusing the ones we cannot honour.

Handles both spellings transformers has written over time: top-level `rope_theta` +
`rope_scaling` (v4) and `rope_parameters` (v5, optionally nested per layer type).
"""

from __future__ import annotations

from thin.ir import RoPE

from .errors import CheckpointError, UnsupportedConfigError

# config.json activation names -> IR activation names.
ACTIVATIONS = {
    "silu": "silu", "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
    "relu": "relu",
}
# rope_type -> keys allowed in its parameter dict (besides rope_type/type/rope_theta/partial_rotary_factor).
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate",
             "attention_factor", "mscale", "mscale_all_dim"},
}
LAYER_TYPES = ("full_attention", "sliding_attention")


class Config:
    """A config.json dict with typed accessors whose errors name the key."""

    def __init__(self, raw: dict, architecture: str, quant_methods: tuple[str, ...] = ()):
        """`quant_methods`: the quantization_config methods the adapter reads natively (GPT-OSS: mxfp4)."""
        self.raw = raw
        self.architecture = architecture
        quant = raw.get("quantization_config")
        if quant and not (isinstance(quant, dict) and quant.get("quant_method") in quant_methods):
            raise UnsupportedConfigError(
                f"{architecture}: pre-quantized checkpoints (config.json quantization_config, method "
                f"{raw['quantization_config'].get('quant_method', '?')!r}) are not supported; "
                "use the unquantized checkpoint")

    def get(self, key: str, default=None):
        value = self.raw.get(key, default)
        return default if value is None else value

    def optional(self, key: str, default=None):
        """config[key] where an explicit null means "off" (None) and absence means the family default."""
        return self.raw.get(key, default)

    def optional_float(self, key: str, default: float | None = None) -> float | None:
        value = self.optional(key, default)
        return None if value is None else self.float(key, value)

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise CheckpointError(f"config.json: {key} must be an integer, got {value!r}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise CheckpointError(f"config.json: {key} must be a number, got {value!r}")
        return float(value)

    def refuse(self, key: str, *allowed) -> None:
        """Error unless config[key] is absent or one of `allowed` (values this adapter implements)."""
        value = self.raw.get(key)
        if value is not None and value not in allowed:
            raise UnsupportedConfigError(f"{self.architecture}: config.json {key}={value!r} is not supported "
                                         f"(supported: {', '.join(map(repr, allowed)) or 'absent'})")

    def head_dim(self) -> int:
        return self.int("head_dim", self.int("hidden_size") // self.int("num_attention_heads"))

    def activation(self, key: str = "hidden_act", default: str = "silu") -> str:
        name = self.get(key, default)
        if name not in ACTIVATIONS:
            raise UnsupportedConfigError(f"{self.architecture}: config.json {key}={name!r} is not supported "
                                         f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        return ACTIVATIONS[name]

    def layer_types(self, default: list[str]) -> list[str]:
        """Per-layer "full_attention"/"sliding_attention", from config or the family's rule."""
        types = self.get("layer_types", default)
        n = self.int("num_hidden_layers")
        if len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise UnsupportedConfigError(f"{self.architecture}: config.json layer_types {types!r} must list "
                                         f"{n} entries from {', '.join(LAYER_TYPES)}")
        return list(types)

    def rope_parameters(self, layer_type: str | None = None, default_theta: float = 10000.0) -> dict:
        """The RoPE parameter dict for all layers, or for `layer_type` when nested (Gemma-3)."""
        params = self.raw.get("rope_parameters") or self.raw.get("rope_scaling") or {}
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        elif any(isinstance(v, dict) for v in params.values()):
            raise UnsupportedConfigError(f"{self.architecture}: nested rope_parameters without a layer type "
                                         f"{layer_type!r} entry: {params!r}")
        params = dict(params)
        params.setdefault("rope_theta", self.get("rope_theta", default_theta))
        if "partial_rotary_factor" in self.raw:
            params.setdefault("partial_rotary_factor", self.raw["partial_rotary_factor"])
        return params

    def rope(self, params: dict) -> RoPE:
        """An IR RoPE from a parameter dict; unknown rope types and keys are errors."""
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in _ROPE_KEYS:
            raise UnsupportedConfigError(f"{self.architecture}: rope_type {kind!r} is not supported "
                                         f"(supported: {', '.join(_ROPE_KEYS)})")
        extra = set(params) - _ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
        if extra:
            raise UnsupportedConfigError(f"{self.architecture}: rope_type {kind!r} with unsupported "
                                         f"parameter(s) {', '.join(sorted(extra))}")
        head_dim = self.head_dim()
        rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        theta = float(params["rope_theta"])
        if kind == "default":
            return RoPE("default", theta, rotary_dim)
        if kind == "linear":
            return RoPE("linear", theta, rotary_dim, factor=float(params["factor"]))
        # transformers lets a top-level original_max_position_embeddings override the rope dict's.
        original = self.raw.get("original_max_position_embeddings",
                                params.get("original_max_position_embeddings", self.int("max_position_embeddings")))
        if kind == "yarn":
            return _yarn(params, theta, rotary_dim, int(original), self.int("max_position_embeddings"))
        return RoPE("llama3", theta, rotary_dim, factor=float(params["factor"]),
                    low_freq_factor=float(params["low_freq_factor"]),
                    high_freq_factor=float(params["high_freq_factor"]),
                    original_max_position_embeddings=int(original))


def _yarn(params: dict, theta: float, rotary_dim: int, original: int, max_positions: int) -> RoPE:
    """YaRN as transformers' _compute_yarn_parameters reads it: factor defaults to the context ratio,
    beta_fast/beta_slow to 32/1 (a 0 also means the default there), truncate to true, and the
    attention factor (scale on cos/sin) to 0.1 ln(factor) + 1, or the ratio of two such terms when
    mscale and mscale_all_dim are both given."""
    import math

    factor = params.get("factor")
    factor = float(max_positions / original if factor is None else factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise CheckpointError(f"rope_parameters truncate must be true or false, got {truncate!r}")
    return RoPE("yarn", theta, rotary_dim, factor=factor, original_max_position_embeddings=original,
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                truncate=truncate, attention_factor=float(attention))
