"""The torch executor: runs any IR model, prefill and decode through one `forward`.

Every projection is a `LinearOp` (runtime/linear.py) made from the tensor's encoded bytes, so
the executor never holds a raw weight and never knows a format. It follows the IR's structure:
a fused qkv or gate_up is one op, separate projections are separate ops. Activations are float32
on the CPU and the embedding's stored dtype on CUDA (norms and softmax accumulate in float32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from thin.ir import MLP, Attention, DecoderLayer, Linear, Model, MoE, Norm, RoPE, formats

from .expert_cache import ExpertCache, HostPages
from .ffn import ACTIVATIONS, MLPPlan, MoEPlan, run_ffn
from .inputs import check_tensor_range
from .kv_cache import KVCache
from .linear import Embedding, LinearOp, load_weight, make_linear
from .rope import RotaryTables, apply_rotary

# Raw bytes of a tensor by name: a flat uint8 torch tensor in the tensor's encoding.
RawGetter = Callable[[str], torch.Tensor]
# wrap_linear(weight name, op) -> op: lets a caller (the compiler's calibration and sensitivity
# probes) interpose on every projection, the LM head included, without the executor knowing why.
LinearWrapper = Callable[[str, LinearOp], LinearOp]


@dataclass
class NormPlan:
    kind: str
    eps: float
    weight: torch.Tensor | None  # float32, weight_offset already added
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.kind == "rms":
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            y = F.layer_norm(xf, xf.shape[-1:], eps=self.eps)
        if self.weight is not None:
            y = y * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


@dataclass
class AttentionPlan:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    qkv: list[LinearOp]  # one fused [q; k; v] op, or three
    o: LinearOp
    q_norm: NormPlan | None
    k_norm: NormPlan | None
    qk_norm_per_head: bool
    rope: RotaryTables | None
    sliding_window: int | None
    logit_softcap: float | None
    sinks: torch.Tensor | None = None  # GPT-OSS: float32 [num_heads] logits in each softmax's denominator


@dataclass
class LayerPlan:
    attention: AttentionPlan
    ffn: MLPPlan | MoEPlan
    attn_norm: NormPlan | None
    attn_post_norm: NormPlan | None
    ffn_norm: NormPlan | None
    ffn_post_norm: NormPlan | None


class Executor:
    """Runs `model` on `device` with the encoded bytes `get_raw(name)` of each tensor.

    `get_raw` is the weight contract shared by the loaded artifact and the compile-time Program:
    a flat uint8 tensor in the tensor's encoding (for dense formats, a free view). `wrap_linear`,
    when given, receives every LinearOp the executor builds (with its weight's name) and returns
    the op to use in its place. `host_experts` (runtime/expert_cache.py) are routed experts kept in
    host memory: the executor builds none of them, and streams each through one of `expert_slots`
    device slots when a token routes to it."""

    def __init__(self, model: Model, get_raw: RawGetter, device="cpu", wrap_linear: LinearWrapper | None = None,
                 host_experts: HostPages | None = None, expert_slots: int = 0):
        self.model = model
        self._wrap = wrap_linear or (lambda name, op: op)
        self.device = torch.device(device)
        self.records = model.tensor_map()
        embed_record = self.records[model.embedding.weight]
        stored = formats.get(embed_record.source_dtype)
        embed_dtype = getattr(torch, stored.torch_dtype) if stored.dense else torch.float32
        # CPU kernels are fastest and exact in float32; on CUDA keep the stored precision.
        self.dtype = torch.float32 if self.device.type == "cpu" else embed_dtype
        self._get = get_raw
        self._tables: dict[RoPE, RotaryTables] = {}
        self.expert_cache = None if host_experts is None else \
            ExpertCache(host_experts, expert_slots, self.device, self._build_expert)
        self.embed = Embedding(embed_record, get_raw(model.embedding.weight), self.device, self.dtype)
        self.embed_scale = None
        if model.embedding.scale is not None:
            # Gemma multiplies by sqrt(hidden) rounded to the embedding's dtype, not the exact value.
            self.embed_scale = torch.tensor(model.embedding.scale, dtype=embed_dtype).to(self.dtype).item()
        self.layers = [self._plan_layer(layer, i) for i, layer in enumerate(model.layers)]
        self.final_norm = self._norm(model.final_norm)
        if model.lm_head.tied:
            self.lm_head = self._wrap(model.lm_head.weight, self.embed.as_linear(embed_record))
        else:
            self.lm_head = self._linear(Linear(model.lm_head.weight))
        self.final_softcap = model.lm_head.final_softcap
        # Elastic FFN levels (thin.ir.FFNLevel): per level and layer (channels, scale, shift), loaded once.
        self.ffn_levels = [[(k, self._dense(scale), self._dense(shift))
                            for k, scale, shift in zip(level.channels, level.scale, level.shift)]
                           for level in model.ffn_levels]
        self._get = None  # construction is over: drop the reference to the source

    # ---- construction -------------------------------------------------------------------

    def _dense(self, name: str | None, dtype: torch.dtype | None = None, get: RawGetter | None = None):
        if name is None:
            return None
        return load_weight(self.records[name], (get or self._get)(name), self.device, dtype or self.dtype)

    def _linear(self, lin: Linear, get: RawGetter | None = None) -> LinearOp:
        get = get or self._get
        op = make_linear(self.records[lin.weight], get(lin.weight), self._dense(lin.bias, get=get), self.device,
                         self.dtype)
        return self._wrap(lin.weight, op)

    def _build_expert(self, layer: int, expert: int, get: RawGetter) -> MLPPlan:
        """A host-resident expert's MLPPlan on the bytes `get` reads (its slot in the expert cache)."""
        return self._plan_mlp(self.model.layers[layer].ffn.experts[expert], get)

    def linear_ops(self) -> list[LinearOp]:
        """Every LinearOp of the model (for reports: which implementation serves what)."""
        ops = []
        for layer in self.layers:
            ops += [*layer.attention.qkv, layer.attention.o]
            ffns = layer.ffn.experts + ([layer.ffn.shared_expert] if layer.ffn.shared_expert else []) \
                if isinstance(layer.ffn, MoEPlan) else [layer.ffn]
            for mlp in filter(None, ffns):  # a streamed expert (None) has ops only while in a slot
                ops += [*mlp.up, mlp.down]
        return [*ops, self.lm_head]

    def set_ffn_level(self, index: int | None) -> None:
        """Run the model's elastic FFN level `index` (model.ffn_levels[index]; None or 0: every channel).
        Only how much of each weight is read changes: no weight is copied or moved."""
        if index is None or index == 0:
            self.set_ffn_prefix([None] * len(self.layers))
            return
        if not 0 <= index < len(self.ffn_levels):
            raise IndexError(f"the model has {len(self.ffn_levels)} FFN levels, not {index + 1}")
        widths, scales, shifts = zip(*self.ffn_levels[index])
        self.set_ffn_prefix(list(widths), list(scales), list(shifts))

    def set_ffn_prefix(self, widths: list[int | None], scales=None, shifts=None) -> None:
        """Run only the first widths[i] intermediate channels of layer i's FFN (None: all of them),
        multiplied by scales[i] before the down projection and with shifts[i] added to its output
        (None: neither). The channels must be importance-ordered for this to be a good model: an
        artifact compiled with --ffn-levels is."""
        n = len(self.layers)
        scales, shifts = scales or [None] * n, shifts or [None] * n
        if not len(widths) == len(scales) == len(shifts) == n:
            raise ValueError(f"one FFN width, scale and shift per layer ({n}) is needed")
        for layer, k, scale, shift in zip(self.layers, widths, scales, shifts):
            mlp = layer.ffn
            if isinstance(mlp, MoEPlan):
                if k is not None:
                    raise ValueError("mixture-of-experts layers have no FFN prefix")
                continue
            full = mlp.down.in_features
            if k is not None and not 0 < k <= full:
                raise ValueError(f"an FFN prefix of {k} channels does not fit {full}")
            mlp.width = None if k is None or (k == full and scale is None and shift is None) else k
            mlp.scale = None if mlp.width is None or scale is None else scale.to(self.device, self.dtype)
            mlp.shift = None if mlp.width is None or shift is None else shift.to(self.device, self.dtype)

    def _norm(self, norm: Norm | None) -> NormPlan | None:
        if norm is None:
            return None
        if norm.kind not in ("rms", "layer"):
            raise NotImplementedError(f"norm kind {norm.kind!r} is not implemented in the torch executor")
        weight = self._dense(norm.weight, torch.float32)
        if weight is not None and norm.weight_offset:
            weight = weight + norm.weight_offset
        return NormPlan(norm.kind, norm.eps, weight, self._dense(norm.bias, torch.float32))

    def _plan_attention(self, a: Attention) -> AttentionPlan:
        qkv = [self._linear(a.qkv)] if a.qkv is not None else [self._linear(x) for x in (a.q, a.k, a.v)]
        rope = None
        if a.rope is not None:
            if a.rope not in self._tables:
                self._tables[a.rope] = RotaryTables(a.rope, self.device, self.dtype)
            rope = self._tables[a.rope]
        return AttentionPlan(
            a.num_heads, a.num_kv_heads, a.head_dim, a.scale, qkv, self._linear(a.o), self._norm(a.q_norm),
            self._norm(a.k_norm), a.qk_norm_per_head, rope, a.sliding_window, a.logit_softcap,
            self._dense(a.sinks, torch.float32))

    def _plan_mlp(self, mlp: MLP, get: RawGetter | None = None) -> MLPPlan:
        if mlp.activation not in ACTIVATIONS:
            raise NotImplementedError(f"activation {mlp.activation!r} is not implemented in the executor")
        if not mlp.gated:
            up = [self._linear(mlp.up, get)]
        elif mlp.gate_up is not None:
            up = [self._linear(mlp.gate_up, get)]
        else:
            up = [self._linear(mlp.gate, get), self._linear(mlp.up, get)]
        return MLPPlan(mlp.activation, mlp.gated, up, self._linear(mlp.down, get), mlp.alpha, mlp.limit,
                       mlp.up_offset)

    def _plan_layer(self, layer: DecoderLayer, index: int) -> LayerPlan:
        if isinstance(layer.ffn, MoE):
            moe = layer.ffn
            host = self.expert_cache.pages.sizes if self.expert_cache is not None else {}
            if moe.scoring != "softmax":
                raise NotImplementedError(f"router scoring {moe.scoring!r} is not implemented")
            ffn = MoEPlan(
                moe.top_k, moe.normalize_top_k, moe.scoring,
                # Routing is a discrete choice: score it in float32 so bf16 rounding can't flip an expert.
                self._dense(moe.router.weight, torch.float32), self._dense(moe.router.bias, torch.float32),
                [None if (index, e) in host else self._plan_mlp(mlp) for e, mlp in enumerate(moe.experts)],
                self._plan_mlp(moe.shared_expert) if moe.shared_expert is not None else None,
                self._dense(moe.shared_expert_gate.weight) if moe.shared_expert_gate is not None else None,
                layer=index, cache=self.expert_cache if any((index, e) in host for e in range(len(moe.experts)))
                else None)
        else:
            ffn = self._plan_mlp(layer.ffn)
        return LayerPlan(self._plan_attention(layer.attention), ffn, self._norm(layer.attn_norm),
                         self._norm(layer.attn_post_norm), self._norm(layer.ffn_norm),
                         self._norm(layer.ffn_post_norm))

    # ---- running ----------------------------------------------------------------------------

    def new_cache(self, max_seq_len: int) -> KVCache:
        """An empty KV cache for one sequence of up to `max_seq_len` tokens."""
        shapes = [(p.attention.num_kv_heads, p.attention.head_dim) for p in self.layers]
        windows = [p.attention.sliding_window for p in self.layers]
        return KVCache(shapes, max_seq_len, self.dtype, self.device, windows)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """float32 logits [T, vocab] for `input_ids` [T].

        With a cache, the tokens continue the cached sequence: they are placed at positions
        cache.length .. cache.length + T - 1 and their keys/values are appended.
        """
        ids = self._checked(input_ids)
        start = 0
        if cache is not None:
            cache.check_room(ids.numel())
            start = cache.length
        x = self._embedded(ids)
        masks = _Masks(ids.numel(), start, self.device)
        for index, layer in enumerate(self.layers):
            x = self._layer(x, layer, index, cache, start, masks)
        if cache is not None:
            cache.advance(ids.numel())
        return self._logits(x)

    @torch.inference_mode()
    def layer_inputs(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """The hidden state entering each layer when `input_ids` [T] run as a new sequence (no cache),
        then the one leaving the last layer: len(layers) + 1 tensors [T, hidden]. `forward_from`
        continues from any of them."""
        ids = self._checked(input_ids)
        x = self._embedded(ids)
        masks = _Masks(ids.numel(), 0, self.device)
        out = [x]
        for index, layer in enumerate(self.layers):
            x = self._layer(x, layer, index, None, 0, masks)
            out.append(x)
        return out

    @torch.inference_mode()
    def forward_from(self, first: int, x: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, vocab] of a new sequence whose hidden state entering layer `first` is `x`
        ([T, hidden], as `layer_inputs` gives; `first` == len(layers): after the last layer): the
        layers before `first` are not run, so this is `forward` for a model that differs from this
        one only in layers `first` on and the head."""
        if not 0 <= first <= len(self.layers):
            raise ValueError(f"first layer {first} is outside 0..{len(self.layers)}")
        masks = _Masks(x.shape[0], 0, self.device)
        for index in range(first, len(self.layers)):
            x = self._layer(x, self.layers[index], index, None, 0, masks)
        return self._logits(x)

    def _checked(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` [T] as long ids on the device, after checking the shape and the id range."""
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor, got shape {tuple(input_ids.shape)}")
        check_tensor_range(input_ids, self.model.vocab_size)
        return input_ids.to(device=self.device, dtype=torch.long)

    def _embedded(self, ids: torch.Tensor) -> torch.Tensor:
        """The hidden state entering layer 0: the embedding rows (times the model's embedding scale)."""
        x = self.embed(ids)
        return x * self.embed_scale if self.embed_scale is not None else x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.final_norm(x)).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _layer(self, x, layer: LayerPlan, index: int, cache: KVCache | None, start: int,
               masks: _Masks) -> torch.Tensor:
        h = layer.attn_norm(x) if layer.attn_norm is not None else x
        h = attention(h, layer.attention, index, cache, start, masks)
        if layer.attn_post_norm is not None:
            h = layer.attn_post_norm(h)
        x = x + h
        h = layer.ffn_norm(x) if layer.ffn_norm is not None else x
        h = run_ffn(h, layer.ffn)
        if layer.ffn_post_norm is not None:
            h = layer.ffn_post_norm(h)
        return x + h


def attention(x: torch.Tensor, p: AttentionPlan, index: int, cache: KVCache | None, start: int,
              masks: _Masks) -> torch.Tensor:
    """Self-attention of x [T, hidden] at positions start.. (keys/values appended to `cache`)."""
    T = x.shape[0]
    q_size, kv_size = p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim
    if len(p.qkv) == 1:
        q, k, v = p.qkv[0](x).split([q_size, kv_size, kv_size], dim=-1)
    else:
        q, k, v = (op(x) for op in p.qkv)
    if p.q_norm is not None and not p.qk_norm_per_head:  # OLMo-2: over the whole projection
        q, k = p.q_norm(q), p.k_norm(k)
    q = q.reshape(T, p.num_heads, p.head_dim)
    k = k.reshape(T, p.num_kv_heads, p.head_dim)
    v = v.reshape(T, p.num_kv_heads, p.head_dim)
    if p.q_norm is not None and p.qk_norm_per_head:
        q, k = p.q_norm(q), p.k_norm(k)
    if p.rope is not None:
        cos, sin = p.rope.get(start, T)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, T, head_dim]
    if cache is not None:
        k, v = cache.update(index, k, v)
    if T == 1 and p.sliding_window is not None and k.shape[1] > p.sliding_window:
        # Decode: the window is exactly the last `sliding_window` keys, so slice instead of masking.
        k, v = k[:, -p.sliding_window:], v[:, -p.sliding_window:]
    group = p.num_heads // p.num_kv_heads
    # Query heads sharing a kv head are stacked along the query axis, so GQA needs no repeated k/v.
    q = q.transpose(0, 1).reshape(p.num_kv_heads, group * T, p.head_dim)
    # A sliding layer's cache hands back only the keys still in reach: they start at key_start.
    mask = masks.get(p.sliding_window, group, key_start=start + T - k.shape[1])
    if p.logit_softcap is None and p.sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=p.scale)
    else:
        out = _explicit_attention(q, k, v, mask, p, group, T)
    out = out.reshape(p.num_heads, T, p.head_dim).transpose(0, 1).reshape(T, q_size)
    return p.o(out)


def _explicit_attention(q, k, v, mask, p: AttentionPlan, group: int, T: int) -> torch.Tensor:
    """softmax(q k^T * scale) v written out, for what SDPA has no argument for: Gemma-2's softcap on the
    logits, GPT-OSS's sinks (a per-head logit in the softmax's denominator, dropped from the weights)."""
    scores = torch.matmul(q, k.transpose(1, 2)).float() * p.scale
    if p.logit_softcap is not None:
        scores = torch.tanh(scores / p.logit_softcap) * p.logit_softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if p.sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # query rows are (head in group, position): sink of head kv * group + g on rows g * T ..
        sink = p.sinks.reshape(p.num_kv_heads, group, 1, 1).expand(-1, -1, T, 1).reshape(p.num_kv_heads, -1, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


class _Masks:
    """Visibility masks for one forward call, built once per (window, group) and shared by the layers."""

    def __init__(self, T: int, start: int, device: torch.device):
        self.T, self.start, self.device = T, start, device
        self._built: dict[tuple[int | None, int], torch.Tensor] = {}

    def get(self, window: int | None, group: int, key_start: int = 0) -> torch.Tensor | None:
        """bool [group * T, start + T - key_start] for keys at positions key_start..: key j is visible to
        query i (at position start + i) iff start + i - window < j <= start + i. None for one query,
        which sees every key it is given."""
        if self.T == 1:
            return None
        key = (window, group, key_start)
        if key not in self._built:
            query_pos = torch.arange(self.start, self.start + self.T, device=self.device)[:, None]
            key_pos = torch.arange(key_start, self.start + self.T, device=self.device)[None, :]
            visible = key_pos <= query_pos
            if window is not None:
                visible &= key_pos > query_pos - window
            self._built[key] = visible.repeat(group, 1) if group > 1 else visible
        return self._built[key]
