"""Continuous batching on the decode engine: up to `max_batch` sequences decode in one step over one
shared paged KV pool, joining and leaving between steps.

    add(prompt, options)   take a slot and blocks for the sequence, prefill it (the decode engine's
                           own prefill and first pick: the first token is the one it gets alone)
    step()                 one decode step for every sequence in a slot; the next token of each
    remove(slot)           give the blocks back; the last slot's sequence moves into the hole

Sequences sit in slots 0 .. n-1, so a step runs over the first b rows of every per-sequence
tensor, b the smallest batch-size bucket (1, 2, 4, ..., max_batch) that holds n; the rows past n
are padding: a padding row stays at position 0 of a scratch block (block 0 of the pool, never
given to a sequence), so it writes and reads nothing anyone else owns. Each (bucket, sampling
mode) step is captured once in a CUDA graph and replayed; the state it reads (tokens, positions,
block tables, seeds, step counters, each row's sampling options) lives on the device at fixed
addresses, and the host writes a row only when a sequence joins or leaves.

A step of one sequence runs the decode engine's matrix-vector kernels (the cost of `thin-exec`
alone); a step of b > 1 runs each linear layer as one small matrix product over the b rows (the
kernels' dequantize-a-tile-then-dot path, cuBLAS for dense weights; int4 weights through
kernels/grouped_int_batch.py where that timed faster on this device: o's and down's split-K
partial sums summed by the residual norm, gate/up's activation in the kernel's epilogue),
attention per sequence at its own position through its own row of block tables, and picks every
row's token on the device with that row's options (runtime/kernels/sampling.pick_rows). Rows are
independent: what a sequence gets does not depend on the others in the batch, only on the kernels
that run its bucket (the matrix-vector path of bucket 1 and the matrix products of the others round
differently in 16-bit dtypes, so greedy text can part after a near tie there; in float32 they agree).
"""

from __future__ import annotations

import torch

from .engine import DecodeEngine
from .engine_plans import EngineUnsupported, norm_args, qk_norm_args, rope_tables
from .ffn import MLPPlan, activate
from .kv_cache import CacheFullError
from .paged_kv import BLOCK_SIZE
from .sampling import GenerationOptions


class NoCapacity(CacheFullError):
    """No free slot, or not enough free KV blocks, for the sequence now; one may leave first."""


def buckets(max_batch: int) -> list[int]:
    """Batch sizes a step is captured for: powers of two below max_batch, and max_batch."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class _SlotCache:
    """The PagedKVCache interface the decode engine's prefill uses, over one slot of the pool: its
    row of the block table, blocks reserved when the sequence joined."""

    def __init__(self, batch: BatchEngine, slot: int, blocks: int):
        self.batch, self.block_table = batch, batch.tables[slot]
        self.max_seq_len = blocks * batch.block_size
        self.out_tokens = batch._first_out
        self.length = 0

    def layer(self, index: int):
        return self.batch.keys[index], self.batch.values[index]

    def check_room(self, n: int) -> None:
        if self.length + n > self.max_seq_len:
            raise CacheFullError(f"this sequence's blocks hold {self.max_seq_len} tokens; {self.length} stored, "
                                 f"{n} more do not fit")

    def reserve(self, n_tokens: int) -> None:
        if n_tokens > self.max_seq_len:
            raise CacheFullError(f"this sequence's blocks hold {self.max_seq_len} tokens; {n_tokens} asked for")

    def advance(self, n: int) -> None:
        self.length += n


class BatchEngine:
    """Batched decode over `engine`'s model: at most `max_batch` sequences, a pool of `kv_tokens`
    positions of keys and values shared by them (each sequence holds the blocks for its prompt and
    max_new_tokens from the moment it joins, so a step never runs out)."""

    def __init__(self, engine: DecodeEngine, max_batch: int, kv_tokens: int, *, graphs: bool = True):
        from .kernels.attention import DecodeAttention
        from .kernels.sampling import RowOptions

        if getattr(engine, "moe", None):
            raise EngineUnsupported("the batched decode step does not run mixture-of-experts layers yet")
        if max_batch < 1 or kv_tokens < 1:
            raise ValueError(f"a batch engine needs max_batch >= 1 and kv_tokens >= 1, got {max_batch}, {kv_tokens}")
        self.engine, e = engine, engine
        self.device, self.dtype = e.device, e.dtype
        self.use_graphs = graphs and e.use_graphs
        self.max_batch, self.block_size = max_batch, BLOCK_SIZE
        self.buckets = buckets(max_batch)
        # Block 0 is the padding rows' scratch; every other block goes to sequences.
        blocks = 1 + -(-kv_tokens // BLOCK_SIZE)
        self.max_seq_len = min(e.max_positions, (blocks - 1) * BLOCK_SIZE)
        per_seq = -(-self.max_seq_len // BLOCK_SIZE)
        shape = (len(e.ex.layers), blocks, e.num_kv_heads, BLOCK_SIZE, e.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._free = list(range(blocks - 1, 0, -1))

        def new(*size, dtype):
            return torch.zeros(*size, dtype=dtype, device=self.device)

        S = max_batch
        self.tables = new(S, per_seq, dtype=torch.int32)
        self.tokens, self.pos = new(S, dtype=torch.long), new(S, dtype=torch.int32)
        self.steps = new(S, dtype=torch.int32)
        self.seeds, self.active = new(S, dtype=torch.long), new(S, dtype=torch.int8)
        self.seen, self.counts = new(S, e.vocab, dtype=torch.int8), new(S, e.vocab, dtype=torch.int32)
        self.options = RowOptions(S, self.device)
        self.residual, self.normed = new(S, e.hidden, dtype=self.dtype), new(S, e.hidden, dtype=self.dtype)
        self.q = new(S, e.num_heads, e.head_dim, dtype=self.dtype)
        self.attn = new(S, e.num_heads * e.head_dim, dtype=self.dtype)
        self.logits = new(S, e.vocab, dtype=self.dtype)
        self._first_out = new(2, dtype=torch.long)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 4
        self.attention = {b: DecodeAttention(e.num_heads, e.num_kv_heads, e.head_dim, self.max_seq_len, self.device,
                                             sms, rows=b) for b in self.buckets}
        self._graphs: dict = {}
        # (rows, columns, group, asymmetric, batch) of int4 weights -> each kernel's time (_rows_kernel).
        self.choices: dict[tuple, dict[str, float]] = {}
        self._slots: list[dict] = []  # per occupied slot: blocks, options, penalties
        self._host = torch.empty(S, dtype=torch.long, pin_memory=self.device.type == "cuda")

    # ---- joining and leaving ---------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Sequences in the batch (slots 0 .. size-1)."""
        return len(self._slots)

    def fits(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` positions could ever join (an empty pool has room for it)."""
        return tokens <= self.max_seq_len

    @torch.inference_mode()
    def add(self, prompt: list[int], options: GenerationOptions, *, frequency: float = 0.0,
            presence: float = 0.0) -> tuple[int, int]:
        """Prefill `prompt` into a new slot; (slot, first token). NoCapacity when no slot or not enough
        free blocks are left now; CacheFullError when the sequence can never fit."""
        e = self.engine
        need = len(prompt) + options.max_new_tokens
        if not self.fits(need):
            raise CacheFullError(f"a sequence of {need} tokens (prompt and max_new_tokens) does not fit in the "
                                 f"{self.max_seq_len} positions one sequence may hold")
        blocks = -(-need // self.block_size)
        if self.size == self.max_batch or blocks > len(self._free):
            raise NoCapacity(f"no room: {self.size} of {self.max_batch} slots taken, {len(self._free)} KV blocks "
                             f"free, {blocks} needed")
        slot = self.size
        taken = [self._free.pop() for _ in range(blocks)]
        self.tables[slot, :blocks].copy_(torch.tensor(taken, dtype=torch.int32))
        self._slots.append({"blocks": taken, "options": options, "penalised": bool(frequency or presence)})
        try:
            cache = _SlotCache(self, slot, blocks)
            sampler = e.sampler(options)
            e.start(cache, prompt, options)
            e.prefill(cache, torch.tensor(prompt, dtype=torch.long), sampler)
            first = int(e.token)
        except BaseException:
            self._release(slot)
            raise
        # The sequence's state moves from the engine's single-sequence tensors into its row.
        self.tokens[slot:slot + 1].copy_(e.token)
        self.pos[slot:slot + 1].copy_(e.pos)
        self.steps[slot:slot + 1].copy_(e.step)
        self.seeds[slot:slot + 1].copy_(e.seed)
        if options.repetition_penalty != 1.0:
            self.seen[slot].copy_(e.seen)
        self.counts[slot].zero_()
        self.counts[slot, first] = 1
        self.options.set(slot, options, frequency, presence)
        self.active[slot] = 1
        return slot, first

    def remove(self, slot: int) -> int | None:
        """Free `slot`; the sequence in the last slot moves into it. Returns the slot that moved
        (now `slot`), or None."""
        if not 0 <= slot < self.size:
            raise IndexError(f"no sequence in slot {slot} (batch of {self.size})")
        last = self.size - 1
        self._free.extend(reversed(self._slots[slot]["blocks"]))
        if slot != last:
            for t in (self.tables, self.tokens, self.pos, self.steps, self.seeds, self.seen, self.counts):
                t[slot].copy_(t[last])
            self.options.move(last, slot)
            self._slots[slot] = self._slots[last]
        self._slots.pop()
        self._reset_row(last)
        return last if slot != last else None

    def _release(self, slot: int) -> None:
        """Undo a join that failed in prefill (the slot is the last one)."""
        self._free.extend(reversed(self._slots.pop()["blocks"]))
        self._reset_row(slot)

    def _reset_row(self, row: int) -> None:
        """A padding row: position 0 of the scratch block, greedy, inactive."""
        self.tables[row].zero_()
        self.pos[row] = 0
        self.tokens[row] = 0
        self.active[row] = 0
        self.options.set(row, GenerationOptions(max_new_tokens=0))

    # ---- the step ---------------------------------------------------------------------------------

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def step(self) -> list[int]:
        """One decode step of every sequence; the next token of slots 0 .. size-1."""
        n = self.size
        if n == 0:
            return []
        if any(isinstance(layer.ffn, MLPPlan) and layer.ffn.width is not None for layer in self.engine.ex.layers):
            raise EngineUnsupported("the batched decode step runs whole FFNs only, not an elastic FFN level")
        o = [s["options"] for s in self._slots]
        sort = any(not x.greedy and ((0 < x.top_k < self.engine.vocab) or x.top_p < 1.0 or x.min_p > 0.0) for x in o)
        track = any(x.repetition_penalty != 1.0 for x in o) or any(s["penalised"] for s in self._slots)
        key = (self.bucket(n), sort, track)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            self.decode_rows(*key)
            if self.use_graphs:
                # Run for real first (compiling anything not yet), then capture: capturing records the
                # launches without running them.
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.engine._pool):
                    self.decode_rows(*key)
                self._graphs[key] = graph
        host = self._host[:n]
        host.copy_(self.tokens[:n], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return host.tolist()

    def decode_rows(self, b: int, sort: bool, track: bool) -> None:
        """Rows 0 .. b-1: feed each its token at its position; leave the next token in self.tokens."""
        from .kernels.norm import add_rmsnorm
        from .kernels.rope import rope_append
        from .kernels.sampling import pick_rows

        e = self.engine
        layers = e.ex.layers
        residual, normed, q, attn = self.residual[:b], self.normed[:b], self.q[:b], self.attn[:b]
        residual.copy_(e._embed(self.tokens[:b]))
        add_rmsnorm(residual, normed, norm=norm_args(layers[0].attn_norm))
        for index, layer in enumerate(layers):
            a = layer.attention
            if b == 1:  # the decode engine's matrix-vector path: a batch of one costs what one sequence does
                e._project(a.qkv, normed[0], e.qkv)
                qkv = e.qkv[None]
            elif len(a.qkv) == 1 and (a.q_norm is None or a.qk_norm_per_head):
                # No whole-projection q/k norm in between: rope_append sums the split-K partial sums itself.
                qkv = self._linear(a.qkv, normed, partial=True)
            else:
                qkv = self._linear(a.qkv, normed)
            e._whole_qk_norm(a, qkv)
            splits = qkv.shape[0] if qkv.dim() == 3 else 0
            rope_append(qkv, q, self.keys[index], self.values[index], self.tables[:b], self.pos, e.num_heads,
                        e.num_kv_heads, e.head_dim, rope=rope_tables(a), **qk_norm_args(a), splits=splits,
                        bias=a.qkv[0].bias if splits else None)
            self.attention[b](q, self.keys[index], self.values[index], self.tables[:b], self.pos, attn, scale=a.scale,
                              window=a.sliding_window, softcap=a.logit_softcap, sinks=getattr(a, "sinks", None))
            self._add_norm(residual, normed, a.o, attn, layer.attn_post_norm, layer.ffn_norm)
            h = e.mlp[:e._mlp(layer.ffn, normed[0])] if b == 1 else self._mlp_rows(layer.ffn, normed)
            following = layers[index + 1].attn_norm if index + 1 < len(layers) else e.ex.final_norm
            self._add_norm(residual, normed, layer.ffn.down, h, layer.ffn_post_norm, following)
        if b == 1:
            e._project([e.ex.lm_head], normed[0], self.logits[0])
            logits = self.logits[:1]
        else:
            logits = self._linear([e.ex.lm_head], normed)
        pick_rows(logits, self.options, b, token=self.tokens, step=self.steps, pos=self.pos, active=self.active,
                  seed=self.seeds, seen=self.seen, counts=self.counts, softcap=e.ex.final_softcap, sort=sort,
                  track=track)

    def _add_norm(self, residual, normed, op, x, post, norm) -> None:
        """residual += post(op(x)); normed = norm(residual); split-K partial sums summed by the norm
        kernel (one row: the matvec's; more: the int4 batch kernel's)."""
        from .kernels.norm import add_rmsnorm

        if residual.shape[0] == 1:
            parts, bias = self.engine._partial_sums(op, x.reshape(-1))
            add_rmsnorm(residual, normed, partials=parts, bias=bias, post=norm_args(post), norm=norm_args(norm))
        else:
            # The int4 batch kernel's split-K partial sums go to the norm as they are (it adds them and the
            # bias): no summing launch, no round trip of the output through the compute dtype.
            h = self._linear([op], x, partial=True)
            if h.dim() == 3:
                add_rmsnorm(residual, normed, partials=h, bias=op.bias, post=norm_args(post), norm=norm_args(norm))
            else:
                add_rmsnorm(residual, normed, dense=h, post=norm_args(post), norm=norm_args(norm))

    def _mlp_rows(self, mlp, x: torch.Tensor) -> torch.Tensor:
        from .kernels.activation import glu
        from .kernels.grouped_int_batch import rows_matmul

        if mlp.gated and len(mlp.up) == 1:
            # act(gate) * up in the int4 batch kernel's epilogue (or, split, with the partial sums' sum).
            choice = self._rows_kernel(mlp.up[0], x, mlp.activation)
            if choice:
                return rows_matmul(mlp.up[0], x, choice, activation=mlp.activation)
            return glu(mlp.up[0](x), mlp.activation)
        if mlp.gated:
            return activate(mlp.activation, self._linear(mlp.up[:1], x)) * self._linear(mlp.up[1:], x)
        return activate(mlp.activation, self._linear(mlp.up, x))

    def _linear(self, ops, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        """x [b, K] @ [W1; W2; ...].T for b > 1 rows: each op as a small matrix product (the int4
        batch kernel where it was measured faster here, else the op's own matmul). partial (one op):
        the int4 batch kernel's float32 partial sums [splits, b, N], bias not added, where it splits
        the columns (grouped_int_batch.rows_matmul's `partial`)."""
        from .kernels.grouped_int_batch import rows_matmul

        outs = []
        for op in ops:
            choice = self._rows_kernel(op, x, "partial" if partial else "")
            outs.append(rows_matmul(op, x, choice, partial=partial) if choice else op(x))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _rows_kernel(self, op, x: torch.Tensor, use: str = "") -> tuple[str, int, int] | None:
        """The (scheme, band width, splits) the int4 batch kernel runs `op` with for x's rows, or None
        for the op's own matmul: on CUDA whichever timed fastest at this shape and row count on the
        first step of the bucket, the candidates compiled on host threads first (self.choices keeps the
        times, in microseconds, by "scheme/band/splits").
        `use` is how the step uses the output, and each candidate is timed so: "" the output itself,
        "partial" split-K partial sums left unsummed (the norm adds them), an activation's name the
        fused [gate; up] GLU (in the epilogue, or summed from the partial sums with it; the op's own
        matmul then followed by activation.glu)."""
        from .kernels import grouped_int_batch
        from .kernels.activation import glu
        from .kernels.tuning import compile_launches

        b = x.shape[0]
        if b > grouped_int_batch.MAX_ROWS or not grouped_int_batch.takes(op):
            return None
        if self.device.type != "cuda":
            return grouped_int_batch.candidates(op, b)[0]
        key = (op.out_features, op.in_features, op.group, op.asym, b) + ((use,) if use else ())
        if key not in self.choices:
            probe = torch.randn(b, op.in_features, device=self.device).to(x.dtype)
            rows_matmul = grouped_int_batch.rows_matmul
            how = {"partial": use == "partial", "activation": use if use not in ("", "partial") else None}
            launches = {"/".join(map(str, c)): (lambda c=c: rows_matmul(op, probe, c, **how))
                        for c in grouped_int_batch.candidates(op, b)}
            compile_launches([(self.device, launch) for launch in launches.values()], report=False)
            times = {name: _time_or_inf(launch) for name, launch in launches.items()}
            times["matmul"] = _time(lambda: glu(op(probe), use) if how["activation"] else op(probe))
            self.choices[key] = times
        best = min(self.choices[key].items(), key=lambda kv: kv[1])[0]
        if best == "matmul":
            return None
        scheme, bn, splits = best.split("/")
        return scheme, int(bn), int(splits)


def _time_or_inf(launch) -> float:
    """Median microseconds of one call of `launch` (compile excluded), or infinity for a candidate
    that does not compile on this GPU: the step then runs another."""
    from .kernels.tuning import median_ms_or_inf

    return 1000 * median_ms_or_inf(launch, repeats=5)


def _time(launch) -> float:
    """Median microseconds of one call of `launch` on the current CUDA stream (compile excluded)."""
    from .kernels.tuning import median_ms

    return 1000 * median_ms(launch, repeats=5)
