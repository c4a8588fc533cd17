"""Batched decode on the decode engine (runtime/batch_engine.py): sequences of different lengths in
one step over a shared paged KV pool, joining and leaving between steps, each getting exactly the
tokens it gets alone; and the same engine behind the server's scheduler.

On a CPU machine the kernels run through Triton's interpreter (test_engine.py's fixtures), without
CUDA graphs; with a GPU the same tests run on it, graphs on.
"""

import pytest
import test_engine
from kernel_support import HAS_CUDA
from test_engine import _engine, _engine_tokens, _prompt

from thin.runtime.sampling import GenerationOptions

# test_engine's fixtures: the kernels on this device (the interpreter on a CPU) and the tiny models.
kernels_here, models = test_engine.kernels_here, test_engine.models


def _batch(model, max_batch=4, kv_tokens=256):
    from thin.runtime.batch_engine import BatchEngine

    return BatchEngine(_engine(model), max_batch, kv_tokens)


def _alone(model, prompt, n, **options):
    return _engine_tokens(_engine(model), prompt, n, **options)


def _run(batch, plan: dict[int, tuple[list[int], int, dict]], join_at=None):
    """Decode every sequence of `plan` (name -> (prompt, tokens, options)) in `batch`; a name in
    `join_at` joins only after that many steps. Returns name -> tokens."""
    join_at = join_at or {}
    out: dict = {}
    slots: list = []  # name in each slot
    step = 0
    while True:
        for name, (prompt, n, options) in plan.items():
            if name not in out and join_at.get(name, 0) <= step:
                slot, first = batch.add(prompt, GenerationOptions(max_new_tokens=n, **options))
                assert slot == len(slots)
                slots.append(name)
                out[name] = [first]
        for name in [n for n in slots if len(out[n]) >= plan[n][1]]:
            slot = slots.index(name)
            moved = batch.remove(slot)
            last = slots.pop()
            if moved is not None:
                slots[slot] = last
        if not slots and len(out) == len(plan):
            return out
        for name, token in zip(slots, batch.step(), strict=True):
            out[name].append(token)
        step += 1


@pytest.mark.parametrize("quant", [None, "int4"])
def test_batched_greedy_gives_each_sequence_its_own_tokens(models, quant):
    model = models("llama", quant)
    plan = {i: (_prompt(n, seed=10 + i), 6, {}) for i, n in enumerate((3, 11, 6))}
    got = _run(_batch(model), plan)
    for name, (prompt, n, _) in plan.items():
        assert got[name] == _alone(model, prompt, n), name


def test_the_int4_step_fuses_the_glu_and_the_partial_sums(models, monkeypatch):
    # The batched int4 step asks the batch kernel for act(gate) * up in one go and for qkv's, o's and
    # down's output as split-K partial sums (rope_append and the fused norm add them); the tokens stay
    # those it gets alone.
    from thin.runtime.kernels import grouped_int_batch

    model = models("llama", "int4")
    plan = {i: (_prompt(n, seed=70 + i), 4, {}) for i, n in enumerate((5, 8))}
    want = {name: _alone(model, prompt, n) for name, (prompt, n, _) in plan.items()}
    calls = []
    rows_matmul = grouped_int_batch.rows_matmul

    def spy(op, x, choice, **how):
        calls.append((op.out_features, how))
        return rows_matmul(op, x, choice, **how)

    monkeypatch.setattr(grouped_int_batch, "rows_matmul", spy)
    assert _run(_batch(model), plan) == want
    mlp = model.executor.layers[0].ffn
    assert (mlp.up[0].out_features, {"activation": mlp.activation}) in calls
    assert (mlp.down.out_features, {"partial": True}) in calls
    qkv = model.executor.layers[0].attention.qkv[0]
    assert (qkv.out_features, {"partial": True}) in calls  # rope_append sums qkv's partial sums


def test_sequences_join_and_leave_mid_decode(models):
    # Lengths differ, so sequences leave at different steps; late joiners enter a running batch and
    # move slots when an earlier one leaves (buckets 1, 2 and 4 all run).
    model = models("qwen3")
    plan = {"a": (_prompt(5, seed=20), 7, {}), "b": (_prompt(9, seed=21), 3, {}),
            "c": (_prompt(4, seed=22), 5, {}), "d": (_prompt(13, seed=23), 4, {})}
    batch = _batch(model)
    got = _run(batch, plan, join_at={"b": 1, "c": 2, "d": 5})
    for name, (prompt, n, _) in plan.items():
        assert got[name] == _alone(model, prompt, n), name
    assert batch.size == 0 and len(batch._free) == batch.keys.shape[1] - 1  # every block came back


def test_sampled_rows_draw_what_they_draw_alone(models):
    # Each row draws with its own options and seed (temperature alone, top-k + top-p, min-p), the
    # same uniform numbers as the single-sequence sampler; a greedy row beside them stays greedy.
    model = models("llama")
    rows = {"plain": dict(temperature=0.8, seed=3), "filtered": dict(temperature=1.1, top_k=20, top_p=0.9, seed=4),
            "min_p": dict(temperature=0.7, min_p=0.05, seed=5), "greedy": {}}
    plan = {name: (_prompt(6 + i, seed=30 + i), 5, options) for i, (name, options) in enumerate(rows.items())}
    got = _run(_batch(model), plan)
    for name, (prompt, n, options) in plan.items():
        assert got[name] == _alone(model, prompt, n, **options), name


def test_a_full_pool_refuses_until_a_sequence_leaves(models):
    from thin.runtime.batch_engine import BatchEngine, NoCapacity
    from thin.runtime.kv_cache import CacheFullError

    batch = BatchEngine(_engine(models("llama")), 2, 48)  # three blocks of 16 positions
    options = GenerationOptions(max_new_tokens=8)
    batch.add(_prompt(20, seed=40), options)  # two blocks
    with pytest.raises(NoCapacity):
        batch.add(_prompt(20, seed=41), options)
    with pytest.raises(CacheFullError):
        batch.add(_prompt(45, seed=42), options)  # more than the pool holds at all
    batch.remove(0)
    slot, _ = batch.add(_prompt(20, seed=41), options)
    assert slot == 0


def test_the_scheduler_runs_the_engine_backend(models):
    # The BatchBackend contract through the server's scheduler: concurrent greedy requests give
    # the tokens each gives alone.
    from thin.runtime.serve.engine_backend import EngineBackend
    from thin.runtime.serve.scheduler import SequenceSpec

    model = models("llama")
    backend = EngineBackend(_engine(model), 3, kv_tokens=128)
    specs = [SequenceSpec(i, _prompt(4 + 3 * i, seed=50 + i), GenerationOptions(max_new_tokens=4)) for i in range(3)]
    got = {s.id: [backend.add(s)] for s in specs}
    for _ in range(3):
        for seq_id, token in backend.step().items():
            got[seq_id].append(token)
        if len(got[1]) == 3:
            backend.remove(1)  # leaves early; the others keep decoding
    for s in specs:
        n = 3 if s.id == 1 else 4
        assert got[s.id][:n] == _alone(model, s.prompt, n), s.id


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_graphed_buckets_give_the_eager_tokens(models):
    model = models("llama")
    plan = {i: (_prompt(5 + 2 * i, seed=60 + i), 12, {}) for i in range(5)}
    graphed = _run(_batch(model, max_batch=8), plan, join_at={3: 2, 4: 4})
    from thin.runtime.batch_engine import BatchEngine

    eager = _run(BatchEngine(_engine(model, graphs=False), 8, 256, graphs=False), plan, join_at={3: 2, 4: 4})
    assert graphed == eager
