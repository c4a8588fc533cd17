"""Check a whole IR tree and report every violation at once."""

from __future__ import annotations

import math

from . import formats
from . import model as m
from .elastic import SUPERBLOCK
from .errors import IRError

MAX_ALIGN = 1 << 21  # 2 MiB: a huge page


class IRVerificationError(IRError):
    """The IR breaks one or more invariants; `violations` lists each one."""

    def __init__(self, violations: list[str]):
        self.violations = list(violations)
        head = f"IR verification failed with {len(violations)} violation(s):"
        super().__init__("\n  - ".join([head, *violations]))


def verify(model: m.Model) -> None:
    """Raise IRVerificationError listing every broken invariant of `model`; return None if sound."""
    v = _Verifier(model)
    v.run()
    if v.errors:
        raise IRVerificationError(v.errors)


class _Verifier:
    def __init__(self, model: m.Model):
        self.model = model
        self.errors: list[str] = []
        self.tensors: dict[str, m.Tensor] = {}
        self.used: set[str] = set()

    def err(self, msg: str) -> None:
        self.errors.append(msg)

    def positive(self, value, where: str) -> None:
        """A number that scales the math must be finite and > 0: NaN or inf would poison every logit."""
        if not (_finite(value) and value > 0):
            self.err(f"{where} must be a finite number > 0, got {value!r}")

    def run(self) -> None:
        md = self.model
        self.check_tensor_table()
        for name in ("vocab_size", "hidden_size", "max_position_embeddings"):
            if getattr(md, name) <= 0:
                self.err(f"model.{name} must be positive, got {getattr(md, name)}")
        V, H = md.vocab_size, md.hidden_size
        self.ref(md.embedding.weight, (V, H), "embedding")
        if md.embedding.scale is not None:
            self.positive(md.embedding.scale, "embedding.scale")
        self.norm(md.final_norm, (H,), "final_norm")
        head = md.lm_head
        self.ref(head.weight, (V, H), "lm_head")
        if head.tied != (head.weight == md.embedding.weight):
            self.err("lm_head.tied must be true exactly when lm_head.weight is the embedding weight")
        if head.final_softcap is not None:
            self.positive(head.final_softcap, "lm_head.final_softcap")
        if not md.layers:
            self.err("model has no layers")
        for i, layer in enumerate(md.layers):
            if layer.index != i:
                self.err(f"layers[{i}].index is {layer.index}, expected {i}")
            self.layer(layer, f"layers[{i}]")
        self.ffn_levels()
        for name in sorted(set(self.tensors) - self.used):
            self.err(f"tensor {name!r} is in the tensor table but no block uses it")

    def check_tensor_table(self) -> None:
        n_layers = len(self.model.layers)
        for t in self.model.tensors:
            if t.name in self.tensors:
                self.err(f"tensor name {t.name!r} appears twice")
            self.tensors[t.name] = t
            if not t.name or not t.role:
                self.err(f"tensor {t.name!r} needs a name and a role")
            if not t.shape or any(d <= 0 for d in t.shape):
                self.err(f"tensor {t.name!r} has a bad shape {t.shape}")
            for problem in formats.check(t.encoding.format, t.shape, t.encoding.params):
                self.err(f"tensor {t.name!r}: {problem}")
            if t.source_dtype not in formats.FORMATS:
                self.err(f"tensor {t.name!r} has unknown source dtype {t.source_dtype!r}")
            if type(t.align) is not int or not 16 <= t.align <= MAX_ALIGN or t.align & (t.align - 1):
                self.err(f"tensor {t.name!r}: align {t.align!r} must be a power of two from 16 to {MAX_ALIGN}")
            if t.layer is not None and not 0 <= t.layer < n_layers:
                self.err(f"tensor {t.name!r} has layer {t.layer} outside 0..{n_layers - 1}")

    def ref(self, name: str | None, shape: tuple[int, ...] | None, where: str) -> None:
        if name is None:
            return
        t = self.tensors.get(name)
        if t is None:
            self.err(f"{where} refers to missing tensor {name!r}")
            return
        self.used.add(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            self.err(f"{where}: tensor {name!r} has shape {t.shape}, expected {shape}")

    def linear(self, lin: m.Linear | None, out_f: int, in_f: int, where: str) -> None:
        if lin is None:
            return
        self.ref(lin.weight, (out_f, in_f), f"{where}.weight")
        self.ref(lin.bias, (out_f,), f"{where}.bias")

    def norm(self, norm: m.Norm | None, shape: tuple[int, ...], where: str) -> None:
        if norm is None:
            return
        if norm.kind not in m.NORM_KINDS:
            self.err(f"{where}: unknown norm kind {norm.kind!r} (known: {', '.join(m.NORM_KINDS)})")
        self.positive(norm.eps, f"{where}.eps")
        if not _finite(norm.weight_offset):
            self.err(f"{where}.weight_offset must be a finite number, got {norm.weight_offset!r}")
        self.ref(norm.weight, shape, f"{where}.weight")
        self.ref(norm.bias, shape, f"{where}.bias")

    def layer(self, layer: m.DecoderLayer, where: str) -> None:
        H = self.model.hidden_size
        for name in ("attn_norm", "attn_post_norm", "ffn_norm", "ffn_post_norm"):
            self.norm(getattr(layer, name), (H,), f"{where}.{name}")
        self.attention(layer.attention, f"{where}.attention")
        if isinstance(layer.ffn, m.MoE):
            self.moe(layer.ffn, f"{where}.ffn")
        else:
            self.mlp(layer.ffn, None, f"{where}.ffn")

    def attention(self, a: m.Attention, where: str) -> None:
        H = self.model.hidden_size
        if a.num_heads <= 0 or a.num_kv_heads <= 0 or a.head_dim <= 0:
            self.err(f"{where}: heads and head_dim must be positive")
            return
        if a.num_heads % a.num_kv_heads:
            self.err(f"{where}: num_heads {a.num_heads} is not a multiple of num_kv_heads {a.num_kv_heads}")
        self.positive(a.scale, f"{where}.scale")
        q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        separate = (a.q, a.k, a.v)
        if a.qkv is not None:
            if any(x is not None for x in separate):
                self.err(f"{where}: has both a fused qkv and separate q/k/v projections")
            self.linear(a.qkv, q_out + 2 * kv_out, H, f"{where}.qkv")
        elif all(x is not None for x in separate):
            self.linear(a.q, q_out, H, f"{where}.q")
            self.linear(a.k, kv_out, H, f"{where}.k")
            self.linear(a.v, kv_out, H, f"{where}.v")
        else:
            self.err(f"{where}: needs q, k and v projections or one fused qkv")
        self.linear(a.o, H, q_out, f"{where}.o")
        per_head = a.qk_norm_per_head
        self.norm(a.q_norm, (a.head_dim,) if per_head else (q_out,), f"{where}.q_norm")
        self.norm(a.k_norm, (a.head_dim,) if per_head else (kv_out,), f"{where}.k_norm")
        if a.rope is not None:
            r = a.rope
            if r.kind not in m.ROPE_KINDS:
                self.err(f"{where}.rope: unknown kind {r.kind!r} (known: {', '.join(m.ROPE_KINDS)})")
            if r.rotary_dim <= 0 or r.rotary_dim % 2 or r.rotary_dim > a.head_dim:
                self.err(f"{where}.rope: rotary_dim {r.rotary_dim} must be even and within head_dim {a.head_dim}")
            self.positive(r.theta, f"{where}.rope.theta")
            self.positive(r.factor, f"{where}.rope.factor")
            if r.kind == "llama3":
                self.llama3(r, f"{where}.rope")
            self.yarn(r, f"{where}.rope")
        if a.sliding_window is not None and a.sliding_window <= 0:
            self.err(f"{where}: sliding_window must be positive")
        if a.logit_softcap is not None:
            self.positive(a.logit_softcap, f"{where}.logit_softcap")
        self.ref(a.sinks, (a.num_heads,), f"{where}.sinks")

    def yarn(self, r: m.RoPE, where: str) -> None:
        yarn = (r.beta_fast, r.beta_slow)
        if r.kind != "yarn":
            if yarn != (None, None) or r.attention_factor != 1.0:
                self.err(f"{where}: beta_fast, beta_slow and attention_factor are for yarn, not {r.kind}")
            return
        if None in (*yarn, r.original_max_position_embeddings):
            self.err(f"{where}: yarn needs beta_fast, beta_slow and original_max_position_embeddings")
            return
        if not all(_finite(x) and x > 0 for x in (*yarn, r.attention_factor)):
            self.err(f"{where}: yarn's beta_fast, beta_slow and attention_factor must be finite and positive")
        if r.original_max_position_embeddings <= 0:
            self.err(f"{where}: original_max_position_embeddings must be positive")

    def llama3(self, r: m.RoPE, where: str) -> None:
        if None in (r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings):
            self.err(f"{where}: llama3 scaling needs low/high_freq_factor and original_max_position_embeddings")
            return
        self.positive(r.low_freq_factor, f"{where}.low_freq_factor")
        self.positive(r.high_freq_factor, f"{where}.high_freq_factor")
        self.positive(r.original_max_position_embeddings, f"{where}.original_max_position_embeddings")
        if not r.high_freq_factor > r.low_freq_factor:  # the smoothing divides by their difference
            self.err(f"{where}: high_freq_factor {r.high_freq_factor} must exceed low_freq_factor "
                     f"{r.low_freq_factor}")

    def swiglu(self, mlp: m.MLP, where: str) -> None:
        if not (_finite(mlp.alpha) and mlp.alpha > 0 and _finite(mlp.up_offset)):
            self.err(f"{where}: alpha must be finite and positive, up_offset finite")
        if mlp.limit is not None and not (_finite(mlp.limit) and mlp.limit > 0):
            self.err(f"{where}: limit must be finite and positive")
        clamped = (mlp.alpha, mlp.limit, mlp.up_offset) != (1.0, None, 0.0)
        if clamped and not (mlp.gated and mlp.activation == "silu"):
            self.err(f"{where}: alpha, limit and up_offset belong to a gated silu MLP (clamped SwiGLU)")

    def mlp(self, mlp: m.MLP, intermediate: int | None, where: str) -> int | None:
        H = self.model.hidden_size
        if mlp.activation not in m.ACTIVATIONS:
            self.err(f"{where}: unknown activation {mlp.activation!r} (known: {', '.join(m.ACTIVATIONS)})")
        self.swiglu(mlp, where)
        down = self.tensors.get(mlp.down.weight)
        inter = down.shape[-1] if down is not None and len(down.shape) == 2 else intermediate
        if inter is None:
            self.ref(mlp.down.weight, None, f"{where}.down")
            return None
        self.linear(mlp.down, H, inter, f"{where}.down")
        if mlp.gated:
            if mlp.gate_up is not None:
                if mlp.gate is not None or mlp.up is not None:
                    self.err(f"{where}: has both a fused gate_up and separate gate/up")
                self.linear(mlp.gate_up, 2 * inter, H, f"{where}.gate_up")
            elif mlp.gate is not None and mlp.up is not None:
                self.linear(mlp.gate, inter, H, f"{where}.gate")
                self.linear(mlp.up, inter, H, f"{where}.up")
            else:
                self.err(f"{where}: a gated MLP needs gate and up, or a fused gate_up")
        else:
            if mlp.up is None or mlp.gate is not None or mlp.gate_up is not None:
                self.err(f"{where}: an ungated MLP has exactly an up projection")
            self.linear(mlp.up, inter, H, f"{where}.up")
        return inter

    def moe(self, moe: m.MoE, where: str) -> None:
        H = self.model.hidden_size
        if moe.num_experts <= 0 or not 0 < moe.top_k <= moe.num_experts:
            self.err(f"{where}: need 0 < top_k ({moe.top_k}) <= num_experts ({moe.num_experts})")
        if len(moe.experts) != moe.num_experts:
            self.err(f"{where}: has {len(moe.experts)} experts, num_experts says {moe.num_experts}")
        if moe.scoring not in m.ROUTER_SCORINGS:
            self.err(f"{where}: unknown router scoring {moe.scoring!r}")
        self.linear(moe.router, moe.num_experts, H, f"{where}.router")
        for e, expert in enumerate(moe.experts):
            self.mlp(expert, None, f"{where}.experts[{e}]")
        if moe.shared_expert is not None:
            self.mlp(moe.shared_expert, None, f"{where}.shared_expert")
        self.linear(moe.shared_expert_gate, 1, H, f"{where}.shared_expert_gate")

    def ffn_levels(self) -> None:
        """Elastic FFN levels: by decreasing keep, the first keeping everything; per layer a channel count
        that is a whole number of superblocks (or all); shift and scale tensors only where channels are cut."""
        levels = self.model.ffn_levels
        if not levels:
            return
        widths = []
        for layer in self.model.layers:
            down = self.tensors.get(layer.ffn.down.weight) if isinstance(layer.ffn, m.MLP) else None
            widths.append(down.shape[1] if down is not None and len(down.shape) == 2 else None)
        if None in widths:
            self.err("ffn_levels need a dense MLP in every layer (mixtures of experts have no levels)")
            return
        keeps = [level.keep for level in levels]
        if keeps[0] != 1.0 or any(not (_finite(k) and 0 < k <= 1) for k in keeps) or \
                any(a <= b for a, b in zip(keeps, keeps[1:])):
            self.err(f"ffn_levels keep {keeps} must decrease from 1.0 and stay above 0")
        H = self.model.hidden_size
        for j, level in enumerate(levels):
            where = f"ffn_levels[{j}]"
            n = len(widths)
            if not (len(level.channels) == len(level.shift) == len(level.scale) == n):
                self.err(f"{where}: channels, shift and scale need one entry per layer ({n})")
                continue
            for i, (k, width) in enumerate(zip(level.channels, widths)):
                if type(k) is not int or not 0 < k <= width or (k != width and k % SUPERBLOCK):
                    self.err(f"{where}: layer {i} runs {k!r} channels; a multiple of {SUPERBLOCK} up to {width} "
                             "or all of them")
                    continue
                cut = k < width
                for name, shape, label in ((level.shift[i], (H,), "shift"), (level.scale[i], (k,), "scale")):
                    if not cut and name is not None:
                        self.err(f"{where}: layer {i} runs every channel and takes no {label} tensor")
                    self.ref(name, shape, f"{where}.{label}[{i}]")
        if any(k != w for k, w in zip(levels[0].channels, widths)):
            self.err("ffn_levels[0] must run every channel")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
