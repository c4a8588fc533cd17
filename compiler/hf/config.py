"""Reading config.json values that define the math, refusing the ones we cannot honour.

Handles both spellings transformers has written over time: top-level `rope_theta` +
`rope_scaling` (v4) and `rope_parameters` (v5, optionally nested per layer type).
"""

from __future__ import annotations

import math

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
_INT32 = (1 << 31) - 1
# Integer keys that must be at least 1; other integers must be at least 0. Every integer is at
# most 2**31 - 1, and counts that each own checkpoint tensors (layers, experts) are at most the
# number of tensors: a config cannot make the frontend build lists longer than its weights explain.
_POSITIVE_INTS = {"num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                  "vocab_size", "max_position_embeddings", "sliding_window", "num_experts_per_tok",
                  "decoder_sparse_step", "sliding_window_pattern", "original_max_position_embeddings",
                  "intermediate_size", "moe_intermediate_size"}
_TENSOR_COUNTS = {"num_hidden_layers", "num_experts", "num_local_experts"}


class Config:
    """A config.json dict with typed accessors whose errors name the key and the value."""

    def __init__(self, raw: dict, architecture: str, quant_methods: tuple[str, ...] = (),
                 tensor_count: int = _INT32):
        """`quant_methods`: the quantization_config methods the adapter reads natively (GPT-OSS: mxfp4);
        `tensor_count`: how many tensors the checkpoint holds, which bounds the counts read here."""
        self.raw = raw
        self.architecture = architecture
        self.tensor_count = tensor_count
        quant = raw.get("quantization_config")
        if quant and not (isinstance(quant, dict) and quant.get("quant_method") in quant_methods):
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
            raise UnsupportedConfigError(
                f"{architecture}: pre-quantized checkpoints (config.json quantization_config, method "
                f"{_show(method)}) are not supported; use the unquantized checkpoint")

    def get(self, key: str, default=None):
        """The raw value (None counts as absent); typed accessors below are what adapters should use."""
        value = self.raw.get(key, default)
        return default if value is None else value

    def optional(self, key: str, default=None):
        """config[key] where an explicit null means "off" (None) and absence means the family default."""
        return self.raw.get(key, default)

    def int(self, key: str, default: int | None = None) -> int:
        return self._int(key, self.get(key, default))

    def optional_int(self, key: str, default: int | None = None) -> int | None:
        """An integer, or None when the config sets null ("off"); absence gives `default`."""
        value = self.optional(key, default)
        return None if value is None else self._int(key, value)

    def _int(self, key: str, value) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise CheckpointError(f"config.json: {key} must be an integer, got {_show(value)}")
        low = 1 if key in _POSITIVE_INTS else 0
        high = min(_INT32, self.tensor_count) if key in _TENSOR_COUNTS else _INT32
        if not low <= value <= high:
            why = f" (the checkpoint holds {self.tensor_count} tensors)" if high < _INT32 else ""
            raise CheckpointError(f"config.json: {key}={_show(value)} is outside {low}..{high}{why}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        """A finite number greater than 0 (every float the adapters read is a scale, epsilon or base)."""
        return self._float(key, self.get(key, default))

    def optional_float(self, key: str, default: float | None = None) -> float | None:
        value = self.optional(key, default)
        return None if value is None else self._float(key, value)

    def _float(self, key: str, value) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise CheckpointError(f"config.json: {key} must be a number, got {_show(value)}")
        if not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"config.json: {key} must be a finite number > 0, got {_show(value)}")
        return float(value)

    def bool(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise CheckpointError(f"config.json: {key} must be true or false, got {_show(value)}")
        return value

    def int_list(self, key: str) -> list[int]:
        """A list of layer indices, no longer than the checkpoint has tensors; [] when absent or null."""
        value = self.get(key, [])
        if not isinstance(value, list) or len(value) > self.tensor_count:
            raise CheckpointError(f"config.json: {key} must be a list of at most {self.tensor_count} layer "
                                  f"indices, got {_show(value)}")
        return [self._int(key, v) for v in value]

    def refuse(self, key: str, *allowed) -> None:
        """Error unless config[key] is absent or one of `allowed` (values this adapter implements)."""
        value = self.raw.get(key)
        if value is not None and (type(value) not in {type(a) for a in allowed} or value not in allowed):
            raise UnsupportedConfigError(f"{self.architecture}: config.json {key}={_show(value)} is not supported "
                                         f"(supported: {', '.join(map(repr, allowed)) or 'absent'})")

    def head_dim(self) -> int:
        if self.raw.get("head_dim") is not None:
            return self.int("head_dim")
        size = self.int("hidden_size") // self.int("num_attention_heads")
        if size < 1:
            raise CheckpointError(f"config.json: hidden_size {self.int('hidden_size')} / num_attention_heads "
                                  f"{self.int('num_attention_heads')} gives a head_dim of 0")
        return size

    def activation(self, key: str = "hidden_act", default: str = "silu") -> str:
        name = self.get(key, default)
        if not isinstance(name, str) or name not in ACTIVATIONS:
            raise UnsupportedConfigError(f"{self.architecture}: config.json {key}={_show(name)} is not supported "
                                         f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        return ACTIVATIONS[name]

    def layer_types(self, default: list[str]) -> list[str]:
        """Per-layer "full_attention"/"sliding_attention", from config or the family's rule."""
        types = self.get("layer_types", default)
        n = self.int("num_hidden_layers")
        if (not isinstance(types, list) or len(types) != n
                or any(not isinstance(t, str) or t not in LAYER_TYPES for t in types)):
            raise UnsupportedConfigError(f"{self.architecture}: config.json layer_types {_show(types)} must list "
                                         f"{n} entries from {', '.join(LAYER_TYPES)}")
        return list(types)

    def rope_parameters(self, layer_type: str | None = None, default_theta: float = 10000.0) -> dict:
        """The RoPE parameter dict for all layers, or for `layer_type` when nested (Gemma-3)."""
        key = "rope_parameters" if self.raw.get("rope_parameters") else "rope_scaling"
        params = self.raw.get(key) or {}
        if not isinstance(params, dict):
            raise CheckpointError(f"config.json: {key} must be an object, got {_show(params)}")
        if key == "rope_parameters":
            self._check_one_rope(params)
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        elif any(isinstance(v, dict) for v in params.values()):
            raise UnsupportedConfigError(f"{self.architecture}: nested rope_parameters without a layer type "
                                         f"{layer_type!r} entry: {_show(params)}")
        params = dict(params)
        params.setdefault("rope_theta", self.get("rope_theta", default_theta))
        if "partial_rotary_factor" in self.raw:
            params.setdefault("partial_rotary_factor", self.raw["partial_rotary_factor"])
        return params

    def _check_one_rope(self, params) -> None:
        """CheckpointError when the older rope_scaling says something rope_parameters does not: transformers
        5 then reads rope_scaling alone (its theta included), so a compile from either would be a guess."""
        legacy = self.raw.get("rope_scaling")
        if not legacy:
            return
        if not isinstance(legacy, dict):
            raise CheckpointError(f"config.json: rope_scaling must be an object, got {_show(legacy)}")

        def kind(d):
            return d.get("rope_type", d.get("type", "default"))

        differ = sorted({str(k) for k, v in legacy.items() if k not in ("type", "rope_type") and params.get(k) != v}
                        | ({"rope_type"} if kind(legacy) != kind(params) else set())
                        | ({"rope_theta"} if legacy.get("rope_theta", self.raw.get("rope_theta"))
                           != params.get("rope_theta", self.raw.get("rope_theta")) else set()))
        if differ:
            raise CheckpointError(f"config.json has both rope_parameters and the older rope_scaling, and they "
                                  f"differ in {', '.join(differ)[:200]}; keep the one the model was trained with "
                                  "and delete the other")

    def rope(self, params: dict) -> RoPE:
        """An IR RoPE from a parameter dict; unknown rope types and keys, and bad values, are errors."""
        kind = params.get("rope_type", params.get("type", "default"))
        if not isinstance(kind, str) or kind not in _ROPE_KEYS:
            raise UnsupportedConfigError(f"{self.architecture}: rope_type {_show(kind)} is not supported "
                                         f"(supported: {', '.join(_ROPE_KEYS)})")
        extra = set(params) - _ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
        if extra:
            raise UnsupportedConfigError(f"{self.architecture}: rope_type {kind!r} with unsupported "
                                         f"parameter(s) {', '.join(sorted(map(str, extra)))[:200]}")
        rope = Config(params, self.architecture)  # the same typed reads, naming the RoPE key
        head_dim = self.head_dim()
        partial = rope.float("partial_rotary_factor", 1.0)
        if partial > 1:
            raise CheckpointError(f"config.json: partial_rotary_factor must be in (0, 1], got {partial}")
        rotary_dim = int(head_dim * partial)
        theta = rope.float("rope_theta")
        if kind == "default":
            return RoPE("default", theta, rotary_dim)
        # transformers lets a top-level original_max_position_embeddings override the rope dict's.
        if self.raw.get("original_max_position_embeddings") is not None:
            original = self.int("original_max_position_embeddings")
        else:
            original = rope.int("original_max_position_embeddings", self.int("max_position_embeddings"))
        if kind == "yarn":
            return _yarn(rope, theta, rotary_dim, original, self.int("max_position_embeddings"))
        if "factor" not in params:
            raise CheckpointError(f"config.json: rope_type {kind!r} needs a factor")
        if kind == "linear":
            return RoPE("linear", theta, rotary_dim, factor=rope.float("factor"))
        return RoPE("llama3", theta, rotary_dim, factor=rope.float("factor"),
                    low_freq_factor=rope.float("low_freq_factor"), high_freq_factor=rope.float("high_freq_factor"),
                    original_max_position_embeddings=original)


def _yarn(rope: Config, theta: float, rotary_dim: int, original: int, max_positions: int) -> RoPE:
    """YaRN as transformers' _compute_yarn_parameters reads it: factor defaults to the context ratio,
    beta_fast/beta_slow to 32/1 (a 0 also means the default there), truncate to true, and the
    attention factor (scale on cos/sin) to 0.1 ln(factor) + 1, or the ratio of two such terms when
    mscale and mscale_all_dim are both given. Every value is read typed (finite, > 0) from `rope`."""
    import math

    factor = rope.optional_float("factor")
    factor = max_positions / original if factor is None else factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    def given(key: str) -> float | None:  # absent, null and 0 all mean "the default"
        return rope.float(key) if rope.raw.get(key) else None

    attention = rope.optional_float("attention_factor")
    if attention is None:
        m, m_all = given("mscale"), given("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RoPE("yarn", theta, rotary_dim, factor=factor, original_max_position_embeddings=original,
                beta_fast=given("beta_fast") or 32.0, beta_slow=given("beta_slow") or 1.0,
                truncate=rope.bool("truncate", True), attention_factor=float(attention))


def _show(value) -> str:
    """A config value as a short repr for messages: huge strings and lists are cut, not printed whole."""
    text = repr(value) if not isinstance(value, (list, dict)) or len(value) < 50 else f"<{type(value).__name__} " \
        f"of {len(value)} items>"
    return text if len(text) <= 80 else text[:77] + "..."
