"""Mixture-of-experts decode: the router's top-k and the chosen experts' gate/up + activation and
weighted down projection, each expert read from its own packed bytes where they lie.

Per MoE layer and token, three launches, none of which needs the host:

    _router_kernel   logits[E] = x @ router.T (+ bias), float32 (programs over experts); or, where the
                     engine's timing prefers it, norm_router.py's, which also runs the residual norm
                     that computes x (the add_rmsnorm launch before the layer)
    _gate_up_kernel  program (slot, row block): the top-k of the logits (every program recomputes
                     it: E <= 256 numbers in registers, cheaper than a launch; row block 0 also
                     stores it in `chosen` / `weights`), e = the slot's expert,
                     h[slot] = act(gate_e x + b) * (up_e x + b), GPT-OSS's clamped SwiGLU included
                     (alpha, limit, the offset added to up)
    _down_kernel     program (slot, row block): e and w from `chosen` / `weights`,
                     partials[slot] = w * (down_e h[slot] + b), float32; the fused residual norm
                     adds the k rows (norm.add_rmsnorm), or, where the engine's timing prefers it,
                     the launch's last program does (expert_finish.py)

So expert indices never leave the device and a captured decode step holds the whole layer. The
weights stay as the executor loaded them; how a program finds and decodes its expert's rows (a
table of byte offsets per group of experts sharing a format, a row per expert index) is
expert_rows.py. Experts of different formats in one layer (routing-aware bits) are served by one
launch per format, each program checking that its slot's expert is one of the group's (`member` is
-1 otherwise, and it writes nothing; a group of every expert skips that load); gate/up launches
group the experts by their gate/up format and down launches by their down format, so an expert's
down may be stored finer or coarser than its gate/up. The router's tiles are timed at load as the
expert kernels' are (RouterConfig).

Formats: bf16 / f16 / f32, int8, fp8_e4m3, int3-int6 (one or two code planes), mxfp4, q2, q1, trellis
(each tile decoded in registers, trellis by its family's rows_dot in trellis.py; the format's
reference `decode` is what it must match). Grouped ints also
and mxfp4 have whole-word tilings (expert_words.py: the dense int4 matvec's chunk scheme, bf16 pairs
for int4 and mxfp4 under bf16 activations), candidates the load-time timing may pick. What the
kernels do not run (shared experts, other router scorings, experts kept in host memory) raises
NotImplementedError at construction, which the engine turns into a clear refusal.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import common, interpreting
from .common import ACTIVATION_CODES, MAGIC_BITS, next_power_of_2
from .expert_rows import FORMAT_CODES, GINT, MXFP4, SUPPORTED, ExpertGroup, row_bias, rows_dot, weight_parts
from .expert_tiles import ExpertConfig, RouterConfig, expert_candidates, router_candidates, routings
from .expert_words import words_dot
from .norm import finish_partials, prefetch_norms
from .pairs import code_zero
from .tiles import activate, glu_halves
from .tuning import compile_launches, median_ms_or_inf

_CHOSEN: dict = {}  # launch tiles chosen by timing, by shape and format (MoEKernels.config)


# ---- routing --------------------------------------------------------------------------------------------

@triton.jit
def _router_kernel(x_ptr, w_ptr, b_ptr, out_ptr, E, H, BE: tl.constexpr, BH: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program i: logits of experts i*BE.. = router rows . x (float32 weights, x widened), + bias."""
    rows = tl.program_id(0) * BE + tl.arange(0, BE)
    row_mask = rows < E
    hs = tl.arange(0, BH)
    acc = tl.zeros([BE, BH], dtype=tl.float32)
    for h0 in range(0, H, BH):
        cmask = h0 + hs < H
        w = tl.load(w_ptr + rows[:, None] * H + h0 + hs[None, :], mask=row_mask[:, None] & cmask[None, :], other=0.0)
        x = tl.load(x_ptr + h0 + hs, mask=cmask, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    logits = tl.sum(acc, axis=1)
    if HAS_BIAS:
        logits += tl.load(b_ptr + rows, mask=row_mask, other=0.0)
    tl.store(out_ptr + rows, logits, mask=row_mask)


@triton.jit
def _route(logits_ptr, slot, E, EP: tl.constexpr, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr):
    """(expert, weight) of `slot` (0 .. TOP_K-1, best first): softmax over the E logits, the TOP_K
    largest probabilities (ties to the lower index), renormalised to sum 1 when NORMALIZE."""
    ei = tl.arange(0, EP)
    logits = tl.load(logits_ptr + ei, mask=ei < E, other=float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    # One reduction a pick, not two (the largest p, then its lowest index): p >= 0, so its float32 bits
    # order as integers; below them the index's complement, so of equal p the lower index is the larger key.
    keys = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (EP - 1 - ei).to(tl.int64)
    keys = tl.where(ei < E, keys, -1)
    expert = slot * 0
    weight = 0.0
    total = 0.0
    for j in tl.static_range(TOP_K):
        key = tl.max(keys, axis=0)
        index = EP - 1 - (key & 0xFFFFFFFF).to(tl.int32)
        best = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        total += best
        expert = tl.where(slot == j, index, expert)
        weight = tl.where(slot == j, best, weight)
        keys = tl.where(keys == key, -1, keys)
    if NORMALIZE:
        weight = weight / total
    return expert, weight


# ---- the expert kernels ---------------------------------------------------------------------------------

@triton.jit
def _gate_up_kernel(base, gate_table, up_table, member_ptr, logits_ptr, chosen_ptr, weights_ptr, x_ptr, h_ptr, E, K, n,
                    up_row0,
                    alpha, limit, up_offset, magic,
                    FMT: tl.constexpr, SUB: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, BN: tl.constexpr,
                    ASYM: tl.constexpr, HAS_BIAS: tl.constexpr, EP: tl.constexpr, TOP_K: tl.constexpr,
                    NORMALIZE: tl.constexpr, ACT: tl.constexpr, CLAMP: tl.constexpr, GAIN: tl.constexpr,
                    PREFETCH: tl.constexpr, FUSED: tl.constexpr, WORDS: tl.constexpr, PACKED: tl.constexpr,
                    ZERO_BITS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                    EVERY: tl.constexpr):
    """Program (slot, i): h[slot, i*BN..] = act(gate) * (up + up_offset) of the slot's expert, as the
    torch path rounds it (projection outputs, then the product, in h's dtype). FUSED: gate and up
    are row halves of one weight, read in one pass over x (gate row r and up row n + r interleaved in
    a tile of 2 * BN rows). WORDS (grouped ints, mxfp4): the rows read as whole words, NG chunks of 32
    columns a step (expert_words.words_dot; magic, PACKED, ZERO_BITS, EVEN_* are its; ASM: its inline
    assembly and trellis's dp4a)."""
    slot = tl.program_id(0)
    expert, weight = _route(logits_ptr, slot, E, EP, TOP_K, NORMALIZE)
    if tl.program_id(1) == 0:  # for the down kernel (every format's launch stores the same)
        tl.store(chosen_ptr + slot, expert)
        tl.store(weights_ptr + slot, weight)
    g_offs = gate_table + expert * 6
    u_offs = up_table + expert * 6
    if EVERY:  # noqa: SIM108  (constexpr branches: only one is compiled). Every expert is the group's
        member = 0
    else:
        member = tl.load(member_ptr + expert)
    if member >= 0:
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        row_mask = rows < n
        dtype: tl.constexpr = h_ptr.dtype.element_ty
        if WORDS:
            if FUSED:
                gate, up = glu_halves(words_dot(base, g_offs, x_ptr, tl.program_id(1), n, K, magic, FMT, SUB, ASYM, G,
                                                NG, BN, True, EVEN_N, EVEN_K, ASM, PACKED, ZERO_BITS), BN)
            else:
                gate = words_dot(base, g_offs, x_ptr, tl.program_id(1), n, K, magic, FMT, SUB, ASYM, G, NG, BN, False,
                                 EVEN_N, EVEN_K, ASM, PACKED, ZERO_BITS)
                up = words_dot(base, u_offs, x_ptr, tl.program_id(1), n, K, magic, FMT, SUB, ASYM, G, NG, BN, False,
                               EVEN_N, EVEN_K, ASM, PACKED, ZERO_BITS)
        elif FUSED:
            both = tl.reshape(tl.join(rows, rows + up_row0), [2 * BN])
            both_mask = tl.reshape(tl.join(rows, rows), [2 * BN]) < n
            total = rows_dot(base, g_offs, x_ptr, both, both_mask, K, FMT, SUB, G, NG, 2 * BN, ASYM, PREFETCH, ASM)
            gate, up = tl.split(tl.reshape(total, [BN, 2]))
        else:
            gate = rows_dot(base, g_offs, x_ptr, rows, row_mask, K, FMT, SUB, G, NG, BN, ASYM, PREFETCH, ASM)
            up = rows_dot(base, u_offs, x_ptr, rows + up_row0, row_mask, K, FMT, SUB, G, NG, BN, ASYM, PREFETCH, ASM)
        gate = (gate + row_bias(base, g_offs, rows, row_mask, HAS_BIAS, dtype)).to(dtype).to(tl.float32)
        up = (up + row_bias(base, u_offs, rows + up_row0, row_mask, HAS_BIAS, dtype)).to(dtype).to(tl.float32)
        if CLAMP:  # GPT-OSS: gate clamped from above, up on both sides
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        if GAIN:  # noqa: SIM108  (constexpr branches: only one is compiled). silu with a gain
            act = gate * (1.0 / (1.0 + tl.exp(tl.minimum(-alpha * gate, 80.0))))
        else:
            act = activate(gate, ACT)
        act = act.to(dtype).to(tl.float32)
        up = (up + up_offset).to(dtype).to(tl.float32)
        tl.store(h_ptr + slot * n + rows, (act * up).to(dtype), mask=row_mask)


@triton.jit
def _down_kernel(base, table, member_ptr, chosen_ptr, weights_ptr, h_ptr, out_ptr, K, n, magic,
                 FMT: tl.constexpr, SUB: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, BN: tl.constexpr,
                 ASYM: tl.constexpr, HAS_BIAS: tl.constexpr, PREFETCH: tl.constexpr, WORDS: tl.constexpr,
                 PACKED: tl.constexpr, ZERO_BITS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                 ASM: tl.constexpr, EVERY: tl.constexpr, counter_ptr=None, res_ptr=None, finish_bias_ptr=None,
                 post_ptr=None, norm_ptr=None, normed_ptr=None, post_eps=0.0, eps=0.0, FINISH: tl.constexpr = False,
                 FINISH_BIAS: tl.constexpr = False, POST: tl.constexpr = False, NORM: tl.constexpr = False,
                 H_BLOCK: tl.constexpr = 1, N_PARTS: tl.constexpr = 0, NORM_PREFETCH: tl.constexpr = False):
    """Program (slot, i): out[slot, i*BN..] = w_slot * (down h[slot] + bias), float32, each factor
    rounded to h's dtype as the torch path rounds it. WORDS: as _gate_up_kernel's. FINISH: the launch's
    last program (norm.last_program) also adds the top_k rows of `out` into the residual and norms it
    (norm.Finish: add_rmsnorm's arithmetic, the rows read past L1), so no residual-norm launch follows;
    NORM_PREFETCH: program (0, 0) first asks L2 for the norm weights that program reads."""
    if NORM_PREFETCH:
        prefetch_norms(norm_ptr, post_ptr, n, NORM, POST)
    slot = tl.program_id(0)
    expert = tl.load(chosen_ptr + slot)
    weight = tl.load(weights_ptr + slot)
    offs = table + expert * 6
    if EVERY:  # noqa: SIM108  (constexpr branches: only one is compiled)
        member = 0
    else:
        member = tl.load(member_ptr + expert)
    if member >= 0:
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        row_mask = rows < n
        dtype: tl.constexpr = h_ptr.dtype.element_ty
        if WORDS:  # K is a multiple of 32 (whole chunks): h's row keeps x's 16-byte alignment
            y = words_dot(base, offs, h_ptr + tl.multiple_of(slot * K, 32), tl.program_id(1), n, K, magic, FMT,
                          SUB, ASYM, G, NG, BN, False, EVEN_N, EVEN_K, ASM, PACKED, ZERO_BITS)
        else:
            y = rows_dot(base, offs, h_ptr + slot * K, rows, row_mask, K, FMT, SUB, G, NG, BN, ASYM, PREFETCH, ASM)
        y = (y + row_bias(base, offs, rows, row_mask, HAS_BIAS, dtype)).to(dtype).to(tl.float32)
        w = weight.to(dtype).to(tl.float32)
        tl.store(out_ptr + slot * n + rows, (y * w).to(dtype).to(tl.float32), mask=row_mask)
    if FINISH:  # every program arrives, member of the group or not
        finish_partials(counter_ptr, res_ptr, out_ptr, finish_bias_ptr, post_ptr, norm_ptr, normed_ptr, n,
                        tl.num_programs(0), post_eps, eps, FINISH_BIAS, POST, NORM, H_BLOCK, N_PARTS)


# ---- launchers --------------------------------------------------------------------------------------------

class MoEKernels:
    """The decode path of one MoE layer (executor's MoEPlan) on the kernels above (`tune`: time the
    launch tiles on a GPU, else take the first candidate).

    `__call__(x, partials)` reads x [hidden], writes partials[:top_k] (float32 [top_k, hidden]) and
    returns that view: the caller adds its rows into the residual."""

    def __init__(self, plan, device: torch.device, dtype: torch.dtype, *, tune: bool = True):
        if plan.scoring != "softmax":
            raise NotImplementedError(f"router scoring {plan.scoring!r}")
        if plan.shared_expert is not None:
            raise NotImplementedError("shared experts (Qwen2-MoE)")
        experts = plan.experts
        if any(e is None for e in experts) or getattr(plan, "cache", None) is not None:
            raise NotImplementedError("experts kept in host memory (the expert cache)")
        first = experts[0]
        if any(not e.gated for e in experts) or any(e.activation not in ACTIVATION_CODES for e in experts):
            raise NotImplementedError("experts that are not gated MLPs of a known activation")
        clamps = {(e.activation, e.alpha, e.limit, e.up_offset, len(e.up)) for e in experts}
        if len(clamps) != 1:
            raise NotImplementedError("experts of one layer with different activations or clamps")
        self.device, self.dtype, self.tune = torch.device(device), dtype, tune
        self.num_experts, self.top_k, self.normalize = len(experts), plan.top_k, plan.normalize_top_k
        if self.num_experts > 256:
            raise NotImplementedError(f"{self.num_experts} experts (at most 256)")
        self.hidden = first.down.out_features
        self.inter = first.down.in_features
        if any(e.down.out_features != self.hidden or e.down.in_features != self.inter for e in experts):
            raise NotImplementedError("experts of different shapes in one layer")
        self.act, self.alpha, self.limit, self.up_offset = first.activation, first.alpha, first.limit, first.up_offset
        self.fused = len(first.up) == 1
        self.router_weight = plan.router_weight.contiguous()
        self.router_bias = plan.router_bias
        # Experts grouped by the format of their gate/up and, separately, of their down projection (routing-
        # aware bits may store an expert's down finer than its gate/up): one launch per group and kernel.
        up_groups: dict = {}
        down_groups: dict = {}
        for e, mlp in enumerate(experts):
            keys = {self._key(op, dtype) for op in mlp.up}
            if len(keys) != 1:
                raise NotImplementedError("an expert whose gate and up differ in format")
            up_groups.setdefault(keys.pop(), []).append(e)
            down_groups.setdefault(self._key(mlp.down, dtype), []).append(e)
        # A gate/up group's tables for down, and a down group's for gate/up, point at its own weights
        # (one format per group); its kernel never reads them.
        self.gate_up_groups = []
        for key, members in up_groups.items():
            gate = [experts[e].up[0] for e in members]
            up = gate if self.fused else [experts[e].up[1] for e in members]
            self.gate_up_groups.append(ExpertGroup(key, members, self.num_experts, gate, up, gate, self.fused,
                                                   self.device, dtype))
        self.down_groups = []
        for key, members in down_groups.items():
            down = [experts[e].down for e in members]
            self.down_groups.append(ExpertGroup(key, members, self.num_experts, down, down, down, self.fused,
                                                self.device, dtype))
        groups = self.gate_up_groups + self.down_groups
        for g in groups:
            if g.group and (self.hidden % g.group or self.inter % g.group):
                raise NotImplementedError(f"expert shapes that groups of {g.group} columns do not divide")
        # The lowest address of all is the base: every table entry is a non-negative byte offset.
        anchor = min((t for g in groups for t in g.tensors), key=lambda t: t.data_ptr())
        if not anchor.is_contiguous():
            raise NotImplementedError("expert weights that are not contiguous")
        self.base = anchor.reshape(-1).view(torch.uint8)
        for g in groups:
            g.tables(anchor.data_ptr(), self.device)
        self.logits = torch.zeros(self.num_experts, dtype=torch.float32, device=self.device)
        self.h = torch.zeros(self.top_k, self.inter, dtype=dtype, device=self.device)
        # The routing of the last token: experts best first and their weights (gate/up writes, down reads).
        self.chosen = torch.zeros(self.top_k, dtype=torch.int32, device=self.device)
        self.weights = torch.zeros(self.top_k, dtype=torch.float32, device=self.device)
        self._configs: dict = {}
        # The router's tiles when it also runs the residual norm before the layer (norm_router.py; the
        # engine chooses, by timing): None while it does not.
        self.norm_router: RouterConfig | None = None
        # The down kernel's tiles when its last program also runs the residual norm after the layer
        # (expert_finish.py; the engine chooses, by timing; one down group only): None while it does not.
        self.finish_down: ExpertConfig | None = None

    @staticmethod
    def _key(op, dtype) -> tuple:
        """(format, dense dtype, params, has bias) of an expert projection: what one launch reads alike."""
        fmt, parts, params = weight_parts(op)
        if fmt not in FORMAT_CODES:
            raise NotImplementedError(f"{fmt} experts (the expert kernels read {', '.join(SUPPORTED)})")
        if op.bias is not None and op.bias.dtype != dtype:
            raise NotImplementedError("expert biases in another dtype than the activations")
        return fmt, parts["weight"].dtype if "weight" in parts else None, params, op.bias is not None

    def groups(self, kind: str) -> list[ExpertGroup]:
        """The expert groups of the gate/up ("gate_up") or the down ("down") kernel."""
        return self.gate_up_groups if kind == "gate_up" else self.down_groups

    # ---- configurations ----

    def candidates(self, group: ExpertGroup, kind: str) -> list[ExpertConfig]:
        """Tiles worth timing for `group`'s gate/up ("gate_up") or down ("down") kernel; first is the default."""
        K, n = (self.hidden, self.inter) if kind == "gate_up" else (self.inter, self.hidden)
        return expert_candidates(group, K, n, self.dtype, kind == "gate_up")  # gate and up: two rows an output

    def router_candidates(self) -> list[RouterConfig]:
        """The router's tilings worth timing; first is the default."""
        return router_candidates(self.num_experts, self.hidden)

    def timed(self) -> bool:
        """Whether the tiles are chosen by timing here (on a GPU, for kernels to be tuned), not the first
        candidate taken."""
        return self.device.type == "cuda" and self.tune and not interpreting()

    @contextlib.contextmanager
    def _state_kept(self):
        """Put back the routing and intermediates (logits, chosen, weights, h) that the launches inside
        (timing, compiling) overwrite with their own x's: a choice made inside a call (the first decode
        step of an engine whose kernels were not warmed up) leaves the call's own."""
        state = (self.logits, self.chosen, self.weights, self.h)
        kept = [t.clone() for t in state]
        try:
            yield
        finally:
            for t, saved in zip(state, kept):
                t.copy_(saved)

    def config(self, index: int, kind: str) -> ExpertConfig:
        """The tiles of group `index`'s `kind` kernel: the first candidate off a GPU, else the fastest,
        timed once per shape and format in this process (every layer of a model shares it)."""
        key = (index, kind)
        if key not in self._configs:
            g = self.groups(kind)[index]
            shape = self._shape(index, kind)
            candidates = self.candidates(g, kind)
            if len(candidates) == 1 or not self.timed():
                self._configs[key] = candidates[0]
            else:
                if shape not in _CHOSEN:
                    with self._state_kept():
                        times = {c: self._time(index, kind, c) for c in candidates}
                    best = min(times, key=times.get)
                    if times[best] == float("inf"):
                        raise RuntimeError(f"no launch tiling of the {kind} expert kernel compiles here")
                    _CHOSEN[shape] = best
                self._configs[key] = _CHOSEN[shape]
        return self._configs[key]

    def _shape(self, index: int, kind: str) -> tuple:
        """What a tiling choice depends on (the key of _CHOSEN)."""
        g = self.groups(kind)[index]
        return (kind, g.fmt, g.dt, g.group, g.asym, g.has_bias, self.hidden, self.inter, self.num_experts,
                self.top_k, len(self.groups(kind)), str(self.dtype), str(self.device))

    def _time(self, index: int, kind: str, config: ExpertConfig) -> float:
        """Median milliseconds of one launch with `config`; infinite when it does not compile here (a
        tiling past the registers or shared memory this GPU has). Successive launches route to different
        experts of the group (expert_tiles.routings), so, as in a model's step, their weights come from
        memory, not from the L2 the launch before filled."""
        x = torch.randn(self.hidden, device=self.device).to(self.dtype)
        out = torch.empty(self.top_k, self.hidden, dtype=torch.float32, device=self.device)
        logits, chosen, weights = routings(self.groups(kind)[index], self.num_experts, self.top_k, self.normalize,
                                           self.device)
        calls = []

        def launch():
            if not calls:  # the first (compiling) call also routes x, which the down kernel reads
                self._prime(x)
            r = len(calls) % logits.shape[0]
            calls.append(True)
            if kind == "gate_up":
                self._gate_up(index, x, config, logits=logits[r])
            else:
                self._down(index, out, config, chosen=chosen[r], weights=weights[r])

        return median_ms_or_inf(launch, repeats=5, inner=10, device=self.device)

    def router_config(self) -> RouterConfig:
        """The router's tiles: the first candidate off a GPU, else the fastest (timed once per shape)."""
        if "router" not in self._configs:
            candidates = self.router_candidates()
            shape = ("router", self.num_experts, self.hidden, self.router_bias is not None, str(self.device))
            if len(candidates) == 1 or not self.timed():
                self._configs["router"] = candidates[0]
            else:
                if shape not in _CHOSEN:
                    x = torch.randn(self.hidden, device=self.device).to(self.dtype)
                    with self._state_kept():
                        times = {c: median_ms_or_inf(lambda c=c: self._route(x, c), repeats=5, inner=10,
                                                     device=self.device) for c in candidates}
                    best = min(times, key=times.get)
                    if times[best] == float("inf"):
                        raise RuntimeError("no launch tiling of the router kernel compiles here")
                    _CHOSEN[shape] = best
                self._configs["router"] = _CHOSEN[shape]
        return self._configs["router"]

    def _prime(self, x: torch.Tensor) -> None:
        """Route x and run every gate/up group's default tiles (the router's too: its own are timed apart):
        the chosen experts and every slot's h, whichever group holds it, that a down kernel reads."""
        self._route(x, self.router_candidates()[0])
        for i, g in enumerate(self.gate_up_groups):
            self._gate_up(i, x, self.candidates(g, "gate_up")[0])

    def warm_up(self) -> None:
        """Choose every kernel's tiles now (timed on a GPU), not inside the first decode step; the
        candidates still to be timed are compiled first, on several host threads."""
        if self.timed():
            with self._state_kept():
                self._precompile()
        self.router_config()
        for kind in ("gate_up", "down"):
            for index in range(len(self.groups(kind))):
                self.config(index, kind)

    def _precompile(self) -> None:
        """Launch every candidate of each kernel whose tiles are not chosen yet once, on host threads
        (tuning.compile_launches): what compiles them. `_prime` first, here, so the chosen experts and
        their intermediates the down kernels read are in place."""
        pending = [(index, kind) for kind in ("gate_up", "down") for index, g in enumerate(self.groups(kind))
                   if self._shape(index, kind) not in _CHOSEN and len(self.candidates(g, kind)) > 1]
        if not pending:
            return
        x = torch.randn(self.hidden, device=self.device).to(self.dtype)
        out = torch.empty(self.top_k, self.hidden, dtype=torch.float32, device=self.device)
        self._prime(x)
        jobs = [(self.device, lambda c=c: self._route(x, c)) for c in self.router_candidates()]
        for index, kind in pending:
            for config in self.candidates(self.groups(kind)[index], kind):
                if kind == "gate_up":
                    jobs.append((self.device, lambda i=index, c=config: self._gate_up(i, x, c)))
                else:
                    jobs.append((self.device, lambda i=index, c=config: self._down(i, out, c)))
        compile_launches(jobs)

    # ---- launches ----

    def route(self, x: torch.Tensor) -> None:
        """self.logits = router logits of x [hidden] (float32)."""
        self._route(x, self.router_config())

    def _route(self, x: torch.Tensor, config: RouterConfig) -> None:
        E, H = self.num_experts, self.hidden
        _router_kernel[(-(-E // config.block_e),)](
            x, self.router_weight, self.router_bias if self.router_bias is not None else self.logits, self.logits, E,
            H, BE=config.block_e, BH=config.block_h, HAS_BIAS=self.router_bias is not None,
            num_warps=config.num_warps)

    def _common(self, g: ExpertGroup, config: ExpertConfig, n: int, K: int, x: torch.Tensor) -> dict:
        """The constexprs (and `magic`) every launch of group g's kernel with `config` passes."""
        words = dict(WORDS=config.words, PACKED=config.packed, ZERO_BITS=code_zero(8) if config.packed else 0,
                     EVEN_N=n % config.block_n == 0, EVEN_K=(K // 32) % config.groups == 0,
                     ASM=common.INLINE_ASM and not interpreting(), magic=MAGIC_BITS)
        if config.words and (g.fmt not in (GINT, MXFP4) or g.group % 32 or K % 32):
            raise ValueError(f"whole-word expert tiles read grouped ints of 32-column groups and mxfp4, not {config}")
        if config.packed and not ((g.fmt == MXFP4 or (g.dt == 4 and not g.asym)) and x.dtype == torch.bfloat16
                                  and x.data_ptr() % 4 == 0):
            raise ValueError(f"{config}: bf16 pairs need symmetric int4 or mxfp4, bfloat16 activations and x 4-byte "
                             "aligned")
        return dict(FMT=g.fmt, SUB=g.dt, ASYM=g.asym, HAS_BIAS=g.has_bias, EVERY=g.every, **words)

    def _gate_up(self, index: int, x: torch.Tensor, config: ExpertConfig, logits=None) -> None:
        g = self.gate_up_groups[index]
        n = self.inter
        grid = (self.top_k, -(-n // config.block_n))
        _gate_up_kernel[grid](
            self.base, g.gate_table, g.up_table, g.member, self.logits if logits is None else logits, self.chosen,
            self.weights, x, self.h,
            self.num_experts, self.hidden, n, n if self.fused else 0, float(self.alpha),
            float(self.limit if self.limit is not None else 0.0), float(self.up_offset),
            G=g.group or config.groups, NG=config.groups if g.group else 1, BN=config.block_n,
            ACT=ACTIVATION_CODES[self.act], CLAMP=self.limit is not None, GAIN=self.alpha != 1.0,
            EP=max(2, next_power_of_2(self.num_experts)), TOP_K=self.top_k, NORMALIZE=self.normalize,
            FUSED=self.fused, PREFETCH=config.prefetch, num_warps=config.num_warps,
            **self._common(g, config, n, self.hidden, x))

    def _down(self, index: int, out: torch.Tensor, config: ExpertConfig, chosen=None, weights=None,
              finish=None) -> None:
        """Group `index`'s down launch into out [top_k, hidden]; with `finish` (a norm.Finish, the layer's one
        down group) its last program also adds out's rows into the residual and norms it."""
        g = self.down_groups[index]
        n = self.hidden
        grid = (self.top_k, -(-n // config.block_n))
        extra = {}
        if finish is not None:
            if len(self.down_groups) != 1 or out.shape != (self.top_k, n) or not out.is_contiguous():
                raise ValueError("a finishing down launch writes every one of the top_k rows [top_k, hidden] itself")
            extra = finish.launch_args(self.top_k, n)
            extra["NORM_PREFETCH"] = extra.pop("PREFETCH")
        _down_kernel[grid](
            self.base, g.down_table, g.member, self.chosen if chosen is None else chosen,
            self.weights if weights is None else weights, self.h, out, self.inter, n,
            G=g.group or config.groups, NG=config.groups if g.group else 1, BN=config.block_n,
            PREFETCH=config.prefetch, num_warps=config.num_warps, **self._common(g, config, n, self.inter, self.h),
            **extra)

    def route_norm(self, finish, partials: torch.Tensor) -> None:
        """add_rmsnorm(finish's residual and normed, `partials` [n, hidden] float32, its bias and norms), then
        self.route(finish.normed), in one launch of the `norm_router` tiles (norm_router.py)."""
        from .norm_router import norm_route

        if self.norm_router is None:
            raise ValueError("route_norm runs with chosen norm_router tiles")
        norm_route(self, finish, partials, self.norm_router)

    def __call__(self, x: torch.Tensor, partials: torch.Tensor, *, routed: bool = False, finish=None) -> torch.Tensor:
        """partials[:top_k] = the k chosen experts' weighted outputs for x [hidden]; returns that view.
        `routed`: self.logits already hold x's router logits (route_norm), so the router is not launched.
        `finish` (a norm.Finish): the down launch of the `finish_down` tiles also runs add_rmsnorm of those
        rows (expert_finish.py), so the caller launches none."""
        out = partials[:self.top_k]
        if not routed:
            self.route(x)
        for index in range(len(self.gate_up_groups)):
            self._gate_up(index, x, self.config(index, "gate_up"))
        if finish is not None:
            if self.finish_down is None:
                raise ValueError("a finishing down launch runs with chosen finish_down tiles")
            self._down(0, out, self.finish_down, finish=finish)
            return out
        for index in range(len(self.down_groups)):
            self._down(index, out, self.config(index, "down"))
        return out


def reference(x: torch.Tensor, plan) -> torch.Tensor:
    """What MoEKernels computes, through the executor's torch path: the MoE output [hidden] for x [hidden]."""
    from ..ffn import run_moe

    return run_moe(x[None], plan)[0]
