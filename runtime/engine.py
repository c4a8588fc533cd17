"""The CUDA decode engine: batched prefill, and a decode step captured once in a CUDA graph.

It runs the executor's plans (the same LinearOps, norm weights and rotary tables: no second copy
of any weight) through the fused kernels of runtime/kernels/ over a paged KV cache:

    prefill(cache, ids)         the whole prompt in one pass per layer; picks the first token
    decode_one_token(cache, s)  one token: embed, per layer [qkv matvec, q/k norm + RoPE + KV
                                append, split-KV attention, o matvec, residual + norm, gate/up
                                matvec + activation, down matvec, residual + norm], LM head, pick
                                (a residual norm in its matvec's last program, or deferred: its 1 / rms
                                applied by the next matvec, kernels/deferred_norm.py Deferred)
    decode_n_tokens(...)        replays the captured step, streaming tokens as they land

Everything a step needs from one token to the next lives on the device: the token, the position
(the KV length is position + 1), the step counter that keys the random draw, the output slot.
So the captured step runs with no host synchronisation inside the loop, and the host reads token
n back (pinned buffer + event) only after launching step n + 1. Greedy tokens do not depend on
whether the graph is used: the same kernels run either way.

A mixture-of-experts layer decodes through kernels/experts.py (router top-k and the chosen experts'
fused gate/up and weighted down, expert indices kept on the device, so the step stays one graph);
its prefill runs the executor's torch path (ffn.run_moe) over the same LinearOps. Models it does
not take (layer norms, norms with a bias, expert formats or router kinds the expert kernels lack)
raise EngineUnsupported; ThinModel then generates through the executor as before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import torch

from .engine_fusions import (
    INT8_O,
    choose_finishing,
    choose_finishing_downs,
    choose_norm_routers,
    deferring_producers,
    int8_o_layers,
)
from .engine_plans import (
    appending_layers,
    block_table,
    check_supported,
    level_rows,
    level_uses,
    moe_kernels,
    norm_args,
    qk_norm_args,
    rope_tables,
)
from .ffn import MLPPlan, MoEPlan, activate, run_moe
from .linear import LinearOp
from .paged_kv import PREFILL_CHUNK, PagedKVCache
from .sampling import GenerationOptions


@contextlib.contextmanager
def _both(first, second):
    """Two context managers as one."""
    with first, second:
        yield


class DecodeEngine:
    """Prefill and graph-captured decode for `executor`'s model on its device (CUDA; also the CPU
    under Triton's interpreter, without graphs, which is how the test suite runs it).

    `finish_norm`: whether o's and down's matvecs (int8, fp8_e4m3, grouped int) add their partial sums into the
    residual and norm it in their own last program instead of an add_rmsnorm launch, and where o's does
    not, a mixture-of-experts layer's router does (norm_router.py), and likewise the residual norm after
    such a layer, in its expert down launch's last program (expert_finish.py, a layer of one down
    format): None (default) times both ways in `warm_up` on a GPU and keeps the faster per kind of weight
    or layer; True every op, router and down launch that can (the tests); False none.

    `fused_attention`: whether a layer's q/k norm, RoPE and KV append run inside its decode attention's
    split kernel (kernels/attention_append.py: two launches, not rope_append's three): None (default)
    times both ways in `warm_up` on a GPU and keeps the faster per kind of layer; True every layer;
    False none.

    `dependent_launch`: which of the step's kernels launch as programmatic dependents (kernels/dependent.py:
    such a kernel may start while the one before it finishes, loading what that one does not write): None
    (default) the attention's (dependent.ATTENTION: the split kernel loads its first tile of cached keys
    and values while the qkv matvec runs, the merge is placed before the split kernel ends) on a GPU of
    compute capability 9 or later with graphs, else none; True every matvec, norm, RoPE and attention
    launch; a frozenset of the step's section names those sections' launches; False none. On the H200 the
    attention's alone gained llama-8b's fp8 and int4 steps 1.1% and 1.0% in fresh processes (BENCHMARKS,
    Round 11); every launch measured no better in one process.

    `defer_norm` (default True): o and down leave the residual norm to the projection after them wherever
    both sides' kernels can (engine_fusions.deferring_producers, kernels/deferred_norm.py Deferred), ahead of
    `finish_norm`'s ways, which then serve the rest; False: never. On the H200 it gained llama-8b's int4,
    fp8 and int8 steps 3.3-3.8%, 3.1% and 2.5% in fresh processes (BENCHMARKS, Round 13).

    `int8_o`: whether o (symmetric int4, groups of 128, deferring the norm) multiplies the attention merge's output
    rounded to int8 a head on the int8 tensor cores (engine_fusions.int8_o_layers): None (default) on GPUs of
    compute capability 9 or later; True wherever the weights allow; False never. llama-8b int4 on the H200: 651
    tok/s against 634 (BENCHMARKS, Round 26)."""

    def __init__(self, executor, *, graphs: bool = True, finish_norm: bool | None = None,
                 fused_attention: bool | None = None, dependent_launch: bool | frozenset | None = None,
                 defer_norm: bool = True, int8_o: bool | None = None):
        check_supported(executor)
        from .kernels import attention, norm, rope, sampling  # noqa: F401  (imports triton)

        self.ex = executor
        self.model = executor.model
        self.device, self.dtype = executor.device, executor.dtype
        self.use_graphs = graphs and self.device.type == "cuda"
        first = executor.layers[0].attention
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.hidden, self.vocab = self.model.hidden_size, self.model.vocab_size
        self.max_positions = self.model.max_position_embeddings
        for layer in executor.layers:
            if layer.attention.rope is not None:  # grown once: captured steps hold the tables' addresses
                layer.attention.rope.get(0, self.max_positions)
        self.moe = moe_kernels(executor)  # layer index -> MoEKernels
        intermediate = max([layer.ffn.down.in_features for layer in executor.layers if isinstance(layer.ffn, MLPPlan)]
                           + [1])
        qkv_width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        # Split-K partial sums come from the projections back into the residual (o and down), and
        # a mixture of experts leaves one row per chosen expert there.
        # Each elastic FFN level's down prefix has a configuration of its own (KernelLinear.config).
        summed = [(layer.attention.o, "partial") for layer in executor.layers]
        summed += [(layer.ffn.down, "partial") for layer in executor.layers if isinstance(layer.ffn, MLPPlan)]
        summed = self._kernel_uses(summed + [use for use in level_uses(self.ex) if use[1] == "partial"])
        if self.device.type == "cuda":
            from .kernels.tuning import choose_together, precompile

            precompile(summed)  # their candidates, compiled on host threads before choosing
            choose_together(summed)  # each kind of weight timed over all of its weights in turn
        splits = max([op.config(mode, *prefix).split for op, mode, *prefix in summed if mode == "partial"]
                     + [m.top_k for m in self.moe.values()] + [1])

        def new(*shape, dtype=self.dtype):
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        # The decode step's state: everything it reads or writes has a fixed address.
        self.token, self.pos, self.step = new(1, dtype=torch.long), new(1, dtype=torch.int32), new(1, dtype=torch.int32)
        self.seed = new(1, dtype=torch.long)
        self.seen = new(self.vocab, dtype=torch.int8)
        self.residual, self.normed = new(self.hidden), new(self.hidden)
        self.qkv, self.q = new(qkv_width), new(self.num_heads, self.head_dim)
        self.attn = new(self.num_heads * self.head_dim)
        self.mlp = new(intermediate)
        self.partials = new(splits, self.hidden, dtype=torch.float32)
        # o and down matvecs that leave the residual norm to the projection after them (deferred_norm.Deferred): each
        # of their programs' sums of squares in `slots`, read by that projection; where both sides can.
        self._deferring = deferring_producers(self) if defer_norm else set()
        self.slots = new(self.hidden, dtype=torch.float32)
        self.logits = new(self.vocab)
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._samplers: dict = {}
        # Names the sections of a step for the profiler (bench --profile); a no-op otherwise.
        self._mark = lambda name: contextlib.nullcontext()
        # o and down ops whose matvec's last program also runs the residual norm (norm.Finish): chosen by
        # timing in warm_up (finish_norm None, on a GPU), on every op that can (True) or none (False).
        self.finish_norm = finish_norm
        self.counter = new(1, dtype=torch.int32)
        self._finishing: set[int] = set()
        # (id, cols) of the downs whose matvec finishes the residual norm over an elastic FFN level's prefix.
        self._finishing_prefixes: set[tuple[int, int]] = set()
        self._level_biases: dict[tuple[int, int], tuple] = {}  # (id(down), shift's address): (shift, bias + shift)
        self.fused_attention = fused_attention
        # What the step launches as dependents: False, True or a frozenset of section names.
        if dependent_launch is None:
            from .kernels.dependent import ATTENTION

            hopper = self.use_graphs and torch.cuda.get_device_capability(self.device) >= (9, 0)
            dependent_launch = ATTENTION if hopper else False
        self._dependent = dependent_launch if isinstance(dependent_launch, frozenset) else bool(dependent_launch)
        # Layers whose o runs on the int8 mma from the merge's int8 heads, and the heads' buffers (engine_fusions).
        self._int8_o, self.heads = int8_o_layers(self, int8_o)
        # {layer index: append_attend's repeat} of the layers whose attention appends (warm_up times it).
        self._appending = appending_layers(executor, timed=False) if fused_attention else {}
        if finish_norm:
            choose_finishing(self, timed=False)
            choose_norm_routers(self, timed=False)
            choose_finishing_downs(self, timed=False)

    # ---- caches ----------------------------------------------------------------------------------

    def new_cache(self, max_seq_len: int, chunk: int = PREFILL_CHUNK) -> PagedKVCache:
        """An empty paged cache for one sequence of up to `max_seq_len` tokens (plus the scratch its
        decode step uses, sized for that length). Sliding-window layers keep rings bounded by their
        window and `chunk`, the most tokens a prefill pass then takes."""
        from .kernels.attention import DecodeAttention

        windows = [layer.attention.sliding_window for layer in self.ex.layers]
        cache = PagedKVCache(len(self.ex.layers), self.num_kv_heads, self.head_dim, max_seq_len, self.dtype,
                             self.device, windows=windows, chunk=chunk)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 4
        cache.attention = DecodeAttention(self.num_heads, self.num_kv_heads, self.head_dim, cache.max_seq_len,
                                          self.device, sms)
        cache.out_tokens = torch.zeros(cache.max_seq_len + 1, dtype=torch.long, device=self.device)
        cache.attended = torch.zeros(cache.max_seq_len + 1, dtype=torch.int32, device=self.device)
        return cache

    def cache_bytes(self, tokens: int) -> int:
        """Device bytes a cache of `tokens` positions takes (keys and values of every layer; at most, as
        sliding layers' rings may hold fewer)."""
        per_token = 2 * len(self.ex.layers) * self.num_kv_heads * self.head_dim * self.residual.element_size()
        return per_token * tokens

    # ---- the three steps -------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, cache: PagedKVCache, ids: torch.Tensor, sampler) -> None:
        """Append `ids` [T] to `cache` in one pass per layer (per chunk of cache.chunk tokens when its
        sliding layers keep rings) and pick the next token into self.token."""
        ids = ids.to(device=self.device, dtype=torch.long)
        T, start = ids.numel(), cache.length
        cache.check_room(T)
        cache.reserve(start + T)
        step = getattr(cache, "chunk", None) or T
        for begin in range(0, T, step):
            last = self._prefill_pass(cache, ids[begin:begin + step])
        self._project([self.ex.lm_head], last, self.logits)
        sampler(self.logits, self.token, cache.out_tokens, self.seen, self.pos, self.step, self.seed,
                advance_pos=False)

    def _prefill_pass(self, cache: PagedKVCache, ids: torch.Tensor) -> torch.Tensor:
        """Every layer over `ids` [T] at positions cache.length..; advances the cache and self.pos by T
        and returns the last position's final-normed hidden state."""
        from .kernels.activation import glu
        from .kernels.attention import prefill as attend
        from .kernels.norm import add_rmsnorm
        from .kernels.rope import rope_append

        T, start = ids.numel(), cache.length
        self.pos.fill_(start)
        residual = self._embed(ids)
        normed = torch.empty_like(residual)
        layers = self.ex.layers
        add_rmsnorm(residual, normed, norm=norm_args(layers[0].attn_norm))
        for index, layer in enumerate(layers):
            a = layer.attention
            qkv = self._project_rows(a.qkv, normed)
            self._whole_qk_norm(a, qkv)
            q = torch.empty(T, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
            k_cache, v_cache = cache.layer(index)
            table = block_table(cache, index)
            rope_append(qkv, q, k_cache, v_cache, table, self.pos, self.num_heads, self.num_kv_heads,
                        self.head_dim, rope=rope_tables(a), **qk_norm_args(a))
            out = attend(q, k_cache, v_cache, table, start, scale=a.scale, window=a.sliding_window,
                         softcap=a.logit_softcap, sinks=getattr(a, "sinks", None))
            add_rmsnorm(residual, normed, dense=a.o(out), post=norm_args(layer.attn_post_norm),
                        norm=norm_args(layer.ffn_norm))
            mlp = layer.ffn
            if isinstance(mlp, MoEPlan):  # token by token over the chosen experts (host-side routing)
                h = run_moe(normed, mlp)
                following = layers[index + 1].attn_norm if index + 1 < len(layers) else self.ex.final_norm
                add_rmsnorm(residual, normed, dense=h, post=norm_args(layer.ffn_post_norm), norm=norm_args(following))
                continue
            if mlp.gated and len(mlp.up) == 1:
                h = glu(level_rows(mlp.up[0], normed, mlp.width, 2), mlp.activation)
            elif mlp.gated:
                gate = level_rows(mlp.up[0], normed, mlp.width, 1)
                h = activate(mlp.activation, gate) * level_rows(mlp.up[1], normed, mlp.width, 1)
            else:
                h = activate(mlp.activation, level_rows(mlp.up[0], normed, mlp.width, 1))
            if mlp.width is None:
                down = mlp.down(h)
            else:  # an elastic FFN level: the first `width` columns of down, the level's scale and shift
                down = mlp.down.prefix(h if mlp.scale is None else h * mlp.scale, cols=mlp.width)
                down = down if mlp.shift is None else down + mlp.shift
            following = layers[index + 1].attn_norm if index + 1 < len(layers) else self.ex.final_norm
            add_rmsnorm(residual, normed, dense=down, post=norm_args(layer.ffn_post_norm), norm=norm_args(following))
        self.pos.add_(T)
        cache.advance(T)
        return normed[-1]

    @torch.inference_mode()
    def decode_one_token(self, cache: PagedKVCache, sampler) -> None:
        """Feed self.token at position self.pos; leave the next token in self.token (and in
        cache.out_tokens[step]), then advance pos and step. Reads nothing from the host."""
        from .kernels.dependent import launching

        with launching(self._dependent):
            self._step(cache, sampler)

    def _section(self, name: str):
        """A named section of the step: for the profiler (`_mark`) and for which launches are dependents
        (kernels/dependent.section)."""
        from .kernels.dependent import section

        return _both(self._mark(name), section(name))

    def _step(self, cache: PagedKVCache, sampler) -> None:
        from .kernels.attention_append import append_attend
        from .kernels.norm import Finish, add_rmsnorm
        from .kernels.rope import rope_append

        mark = self._section
        layers = self.ex.layers
        with mark("embed + norm"):
            self.residual.copy_(self._embed(self.token)[0])
            add_rmsnorm(self.residual, self.normed, norm=norm_args(layers[0].attn_norm))
        pending = None  # the deferred_norm.Deferred whose 1 / rms the next projection owes self.normed
        for index, layer in enumerate(layers):
            a = layer.attention
            k_cache, v_cache = cache.layer(index)
            table = block_table(cache, index)
            with mark("qkv"):
                self._project(a.qkv, self.normed, self.qkv, rstd=pending)
                self._whole_qk_norm(a, self.qkv[None])
            options = dict(scale=a.scale, window=a.sliding_window, softcap=a.logit_softcap,
                           sinks=getattr(a, "sinks", None), log=cache.attended if index == 0 else None, step=self.step,
                           heads=self.heads if index in self._int8_o else None)
            if index in self._appending:  # chosen in warm_up
                with mark("attention + qk norm + rope + append"):
                    append_attend(cache.attention, self.qkv, k_cache, v_cache, table, self.pos, self.attn,
                                  rope=rope_tables(a), **qk_norm_args(a), repeat=self._appending[index], **options)
            else:
                with mark("qk norm + rope + append"):
                    rope_append(self.qkv, self.q, k_cache, v_cache, table, self.pos, self.num_heads,
                                self.num_kv_heads, self.head_dim, rope=rope_tables(a), **qk_norm_args(a))
                with mark("attention"):
                    cache.attention(self.q, k_cache, v_cache, table, self.pos, self.attn, **options)
            moe = self.moe.get(index)
            pending = None
            if index in self._int8_o:  # x is the merge's int8 heads (self.attn's rounding)
                from .kernels.int8_heads import o_deferred

                with mark(INT8_O):
                    pending = o_deferred(a.o, self.heads, self.residual, self.normed, self.slots,
                                         norm_args(layer.ffn_norm))
            elif moe is None or moe.norm_router is None:
                pending = self._add_norm(a.o, self.attn, "o", layer.attn_post_norm, layer.ffn_norm)
            else:  # the router adds o's partial sums into the residual and norms it (no add_rmsnorm launch)
                with mark("o"):
                    parts, bias = self._partial_sums(a.o, self.attn)
                with mark("residual + norm + router"):
                    moe.route_norm(Finish(self.counter, self.residual, self.normed, bias,
                                          norm_args(layer.attn_post_norm), norm_args(layer.ffn_norm)), parts)
            following = layers[index + 1].attn_norm if index + 1 < len(layers) else self.ex.final_norm
            if moe is not None and moe.finish_down is not None:  # down's last program runs the residual norm
                with mark("router + experts + residual + norm"):
                    moe(self.normed, self.partials, routed=moe.norm_router is not None,
                        finish=Finish(self.counter, self.residual, self.normed, None, norm_args(layer.ffn_post_norm),
                                      norm_args(following)))
            elif moe is not None:
                with mark("router + experts"):
                    parts = moe(self.normed, self.partials, routed=moe.norm_router is not None)
                with mark("residual + norm"):
                    add_rmsnorm(self.residual, self.normed, partials=parts, post=norm_args(layer.ffn_post_norm),
                                norm=norm_args(following))
            else:
                with mark("gate/up + act"):
                    width = self._mlp(layer.ffn, self.normed, rstd=pending)
                pending = self._add_norm(layer.ffn.down, self.mlp[:width], "down", layer.ffn_post_norm, following,
                                         layer.ffn.width, layer.ffn.shift)
        with mark("lm head"):
            self._project([self.ex.lm_head], self.normed, self.logits, rstd=pending)
        with mark("sample"):
            sampler(self.logits, self.token, cache.out_tokens, self.seen, self.pos, self.step, self.seed,
                    advance_pos=True)

    def decode_n_tokens(self, cache: PagedKVCache, n: int, sampler, stop_ids: frozenset[int] = frozenset(),
                        graph: bool | None = None) -> Iterator[int]:
        """Run up to `n` decode steps, yielding each new token; stops after yielding a stop token.

        Token i is read back only once step i + 1 has been launched, so the device never waits for
        the host; after a stop token one more step has run (its key/value lies past the length the
        caller keeps)."""
        graph = self.use_graphs if graph is None else graph and self.use_graphs
        if self.device.type != "cuda":
            for _ in range(n):
                self.decode_one_token(cache, sampler)
                token = int(self.token)
                yield token
                if token in stop_ids:
                    return
            return
        host = torch.empty(max(n, 1), dtype=torch.long, pin_memory=True)
        done = [torch.cuda.Event() for _ in range(max(n, 1))]
        for i in range(n + 1):
            if i < n:
                self._launch_step(cache, sampler, graph)
                host[i:i + 1].copy_(self.token, non_blocking=True)
                done[i].record()
            if i > 0:
                done[i - 1].synchronize()
                token = int(host[i - 1])
                yield token
                if token in stop_ids:
                    return

    def _launch_step(self, cache: PagedKVCache, sampler, graph: bool) -> None:
        if not graph:
            self.decode_one_token(cache, sampler)
            return
        # A captured step holds its launches' sizes and addresses: one per sampler, FFN level and launch kind.
        key = (sampler.key, self.ffn_key(), self._dependent)
        captured = cache.graphs.get(key)
        if captured is not None:
            captured.replay()
            return
        # First step with this cache and sampler: run it for real (compiling and tuning anything
        # not yet), then capture it; capturing records the launches without running them.
        self.decode_one_token(cache, sampler)
        torch.cuda.synchronize(self.device)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured, pool=self._pool):
            self.decode_one_token(cache, sampler)
        cache.graphs[key] = captured

    # ---- generation ------------------------------------------------------------------------------

    def sampler(self, options: GenerationOptions):
        """The device sampler for `options` (one per distinct set of filters)."""
        from .kernels.sampling import Sampler

        key = (options.temperature, options.top_k, options.top_p, options.min_p, options.repetition_penalty)
        if key not in self._samplers:
            self._samplers[key] = Sampler(options, self.vocab, self.ex.final_softcap, key=key)
        return self._samplers[key]

    def start(self, cache: PagedKVCache, prompt: Sequence[int], options: GenerationOptions) -> None:
        """Reset the per-call device state: position, step, seed, tokens seen."""
        self.pos.fill_(cache.length)
        self.step.zero_()
        seed = options.seed if options.seed is not None else int.from_bytes(os.urandom(7), "little")
        self.seed.fill_(int(seed))
        if options.repetition_penalty != 1.0:
            self.seen.zero_()
            self.seen[torch.tensor(list(prompt), dtype=torch.long, device=self.device)] = 1

    def warm_up(self) -> None:
        """Choose every matvec's launch configuration now (timed on this device, or read from the
        cache of choices) rather than in the first generate call: the modes the decode step uses."""
        from .kernels.tuning import choose_together, precompile

        for kernels in self.moe.values():
            kernels.warm_up()
        uses = []
        for layer in self.ex.layers:
            uses += [(op, "direct") for op in layer.attention.qkv] + [(layer.attention.o, "partial")]
            mlp = layer.ffn
            if isinstance(mlp, MLPPlan):
                fused = mlp.gated and len(mlp.up) == 1
                uses += [(op, "glu" if fused else "direct") for op in mlp.up] + [(mlp.down, "partial")]
        uses.append((self.ex.lm_head, "direct"))
        levels = level_uses(self.ex)
        # The matvecs that defer the residual norm run one split ("direct"), timed as the others, in turn.
        int8_o = {id(self.ex.layers[index].attention.o) for index in self._int8_o}  # not a matvec of theirs
        deferring = [(op, "direct") for op in self._linear_ops() if id(op) in self._deferring and id(op) not in int8_o]
        deferring += [(op, "direct", None, cols) for op, mode, _, cols in levels
                      if mode == "partial" and id(op) in self._deferring]
        uses = self._kernel_uses(uses + levels + deferring)
        precompile(uses)  # the candidates not chosen yet, compiled on several threads
        choose_together(uses)  # each kind of weight timed over all of its weights in turn (from memory, not L2)
        for op, mode, *prefix in uses:
            op.config(mode, *prefix)
        if self.finish_norm is None and self.device.type == "cuda":
            choose_finishing(self, timed=True)
            choose_norm_routers(self, timed=True)
            choose_finishing_downs(self, timed=True)
        if self.fused_attention is None and self.device.type == "cuda":
            self._appending = appending_layers(self.ex, timed=True)

    def _kernel_uses(self, uses: list[tuple]) -> list[tuple]:
        """The (op, mode, ...) uses of ops with launch configurations, each once, "partial" as the decode
        step runs it: only where the output is the residual (else "direct")."""
        uses = [(op, mode if mode != "partial" or op.out_features == self.hidden else "direct", *prefix)
                for op, mode, *prefix in uses if hasattr(op, "config")]
        return list(dict.fromkeys(uses))

    # ---- pieces ----------------------------------------------------------------------------------

    def _linear_ops(self) -> list[LinearOp]:
        return self.ex.linear_ops()

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        embed = self.ex.embed
        if embed.table is not None:
            x = torch.nn.functional.embedding(ids, embed.table).to(self.dtype)
        else:  # rows decoded by index: no data-dependent shapes, so a graph can hold it
            x = embed.fmt.decode_rows(embed.raw, embed.shape, embed.params, ids, embed.dtype)
        if self.ex.embed_scale is not None:
            x = x * self.ex.embed_scale
        return x.contiguous()

    def _project(self, ops: list[LinearOp], x: torch.Tensor, out: torch.Tensor, rstd=None) -> None:
        """out = x @ [W1; W2; ...].T for one row x, each op writing its slice of `out`; `rstd` (a
        deferred_norm.Deferred): x is a deferred norm's row, the kernels apply its 1 / rms."""
        start = 0
        for op in ops:
            view = out[start:start + op.out_features]
            if rstd is not None:
                op.matvec(x, out=view, rstd=rstd)
            elif hasattr(op, "matvec"):
                op.matvec(x, out=view)
            else:
                view.copy_(op(x[None])[0])
            start += op.out_features

    def _project_rows(self, ops: list[LinearOp], x: torch.Tensor) -> torch.Tensor:
        return ops[0](x) if len(ops) == 1 else torch.cat([op(x) for op in ops], dim=-1)

    def ffn_key(self) -> tuple:
        """What the decode step's dense FFNs run (elastic FFN levels: each one's width and the addresses
        of its scale and shift): a captured graph serves one such state."""
        return tuple((m.width, None if m.scale is None else m.scale.data_ptr(),
                      None if m.shift is None else m.shift.data_ptr())
                     for m in (layer.ffn for layer in self.ex.layers) if isinstance(m, MLPPlan))

    def _partial_sums(self, op: LinearOp, x: torch.Tensor, cols: int | None = None):
        """(partial sums [n, hidden] float32, bias) of x @ W.T (over the first `cols` columns of W when
        given: x is [cols]): split-K from a kernel, else one row."""
        if hasattr(op, "matvec") and op.out_features == self.hidden:
            return op.matvec(x, partials=self.partials, cols=cols), op.bias
        self.partials[0].copy_(op(x[None])[0] if cols is None else op.prefix(x[None], cols=cols)[0])
        return self.partials[:1], None

    def _add_norm(self, op: LinearOp, x: torch.Tensor, name: str, post, norm, cols: int | None = None,
                  shift: torch.Tensor | None = None):
        """residual += op(x) (over the first `cols` columns of W when given) + shift, normed by `post`;
        normed = norm(residual): split-K partial sums then add_rmsnorm, or in one launch where `op`'s matvec
        finishes the norm itself (chosen in warm_up), or, where `op` defers it (`_deferring`), normed =
        residual * norm weight with the norm's 1 / rms left to the next projection: then the deferred_norm.Deferred
        that projection takes is returned (else None)."""
        from .kernels.norm import Finish, add_rmsnorm

        if cols == op.in_features:
            cols = None
        if id(op) in self._deferring and shift is None:
            with self._section(name):
                return op.matvec_deferred(x, self.residual, self.normed, self.slots, norm_args(norm), cols=cols)
        if (id(op) in self._finishing) if cols is None else ((id(op), cols) in self._finishing_prefixes):
            bias = self._level_bias(op, shift)
            finish = Finish(self.counter, self.residual, self.normed, bias, norm_args(post), norm_args(norm))
            with self._section(name):
                if cols is None:
                    op.matvec_finish(x, self.partials, finish)
                else:
                    op.matvec_finish(x, self.partials, finish, cols=cols)
            return None
        with self._section(name):
            parts, bias = self._partial_sums(op, x, cols)
        if shift is not None:  # an elastic FFN level: what its dropped channels add
            bias = shift if bias is None else self._level_bias(op, shift)
        with self._section("residual + norm"):
            add_rmsnorm(self.residual, self.normed, partials=parts, bias=bias, post=norm_args(post),
                        norm=norm_args(norm))
        return None

    def _level_bias(self, op: LinearOp, shift: torch.Tensor | None) -> torch.Tensor | None:
        """op's bias plus an elastic FFN level's `shift` (what its dropped channels add): added once per
        level and kept, so that a step (and its captured graph, which reads it by address) adds no launch."""
        if shift is None or op.bias is None:
            return op.bias if shift is None else shift
        key = (id(op), shift.data_ptr())  # the shift is kept with its sum: its address is not reused
        if key not in self._level_biases:
            self._level_biases[key] = (shift, op.bias + shift)
        return self._level_biases[key][1]

    def _mlp(self, mlp: MLPPlan, x: torch.Tensor, rstd=None) -> int:
        """act(gate(x)) * up(x) (or act(up(x))) into self.mlp; returns its width. At an elastic FFN level
        (mlp.width) only the first `width` channels, read in place, times the level's scale. `rstd`: x is a
        deferred norm's row (deferred_norm.Deferred; only where the fused gate/up kernel takes it, `_deferring`)."""
        width = mlp.down.in_features if mlp.width is None else mlp.width
        out = self.mlp[:width]
        if mlp.gated and len(mlp.up) == 1 and hasattr(mlp.up[0], "matvec"):
            # The level's scale in the kernel's epilogue where it takes one, else a launch of its own.
            extra = {} if rstd is None else {"rstd": rstd}
            mlp.up[0].matvec(x, out=out, activation=mlp.activation, rows=mlp.width, scale=mlp.scale, **extra)
            return width
        if rstd is not None:
            raise ValueError("a deferred norm reaches only a fused gate/up matvec")
        if mlp.gated:
            halves = 2 if len(mlp.up) == 1 else 1
            gate_up = [level_rows(op, x[None], mlp.width, halves)[0] for op in mlp.up]
            gate, up = gate_up[0].chunk(2) if len(gate_up) == 1 else gate_up
            out.copy_(activate(mlp.activation, gate) * up)
        else:
            out.copy_(activate(mlp.activation, level_rows(mlp.up[0], x[None], mlp.width, 1)[0]))
        if mlp.scale is not None:
            out.mul_(mlp.scale)
        return width

    def _whole_qk_norm(self, a, qkv: torch.Tensor) -> None:
        """OLMo-2: RMSNorm over the whole q and k projections (before the head split), in place."""
        if a.q_norm is None or a.qk_norm_per_head:
            return
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        qkv[..., :q_size] = a.q_norm(qkv[..., :q_size])
        qkv[..., q_size:q_size + kv_size] = a.k_norm(qkv[..., q_size:q_size + kv_size])
