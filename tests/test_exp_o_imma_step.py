"""examples/benchmarks/exp_o_imma_step.py: the decode step's o on the int8 tensor cores, its int8 x written by the
attention's merge. The merge's output is the shipped merge's and its codes are exp_int4_imma's rounding of it in its
B order; o adds the format's decode times that x into the residual with the norm deferred as the shipped o does;
and a whole decode step patched so stays close to the shipped step (through the mma's interpreter twin on the CPU)."""

import os
import sys

import pytest
import torch
from kernel_support import DEVICE, HAS_CUDA, rel_err

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "benchmarks"))

import exp_int4_imma as imma  # noqa: E402
import exp_o_imma_step as exp  # noqa: E402


def _attention(heads=4, kv_heads=2, splits_len=96, seed=0):
    """A DecodeAttention whose splits hold random partial outputs, maxima and sums (some splits empty)."""
    from thin.runtime.kernels.attention import DecodeAttention

    attention = DecodeAttention(heads, kv_heads, 128, splits_len, DEVICE, sms=4, tile=16)
    gen = torch.Generator().manual_seed(seed)
    s = attention.splits
    attention.o.copy_(torch.randn(attention.o.shape, generator=gen))
    attention.m.copy_(torch.randn(attention.m.shape, generator=gen))
    attention.m[:, s - 1] = float("-inf")  # an empty split
    attention.l.copy_(torch.rand(attention.l.shape, generator=gen) + 0.5)
    attention.n.copy_(torch.randint(0, 16, attention.n.shape, generator=gen, dtype=torch.int32))
    return attention


def test_merge_writes_the_shipped_output_and_its_int8_codes():
    attention = _attention()
    want = torch.empty(4 * 128, dtype=torch.bfloat16, device=DEVICE)
    attention.merge(want)
    way = exp.OImma(4, DEVICE)
    got = torch.empty_like(want)
    log = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    step = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    way.merge(attention, got, log=log, step=step)
    assert torch.equal(got, want) and way.fresh
    assert int(log[2]) == int(attention.n.sum())
    words, scales, sums = imma.quantize_x(want.float().cpu())
    codes = way.codes.cpu().view(torch.int32)
    # 127 / max is one float32 division here and a rounded double in quantize_x: a value at a half may differ
    differ = (codes.view(torch.int8).int() - words.view(torch.int8).int()).abs()
    assert differ.max() <= 1 and (differ > 0).sum() <= 2
    assert rel_err(way.xs.cpu(), scales) < 1e-6
    assert torch.equal(way.xz.cpu(), codes.view(torch.int8).int().reshape(4, 128).sum(1))
    assert (sums - way.xz.cpu()).abs().max() <= 2


@pytest.mark.parametrize("n", [32, 48])
def test_o_adds_the_decode_times_its_x_with_the_norm_deferred(n):
    from linear_kernel_cases import make_op

    k = 256
    op, dense, _ = make_op("int4", (n, k), {"group_size": 128}, dtype=torch.bfloat16, seed=3)
    gen = torch.Generator().manual_seed(4)
    way = exp.OImma(k // 128, DEVICE)
    x = torch.randn(k, generator=gen)
    words, scales, sums = imma.quantize_x(x)
    way.codes.view(torch.int32).copy_(words)
    way.xs.copy_(scales)
    way.xz.copy_(sums)
    way.fresh = True
    residual = torch.randn(n, generator=gen).bfloat16().to(DEVICE)
    weight = (1 + 0.2 * torch.randn(n, generator=gen)).to(DEVICE)
    normed = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.full((n // 16 + 3,), 7.0, device=DEVICE)
    start = residual.float().cpu()
    defer = way.o(op, residual, normed, slots, (weight, 1e-5))
    assert defer.programs == n // 16 and not way.fresh
    want = (start + (imma.dequantized_x(x) @ dense.T).bfloat16().float()).bfloat16().float()
    assert rel_err(residual.float().cpu(), want) < 1e-2
    # rounded to bf16 (the interpreter's conversion truncates: within a unit of bf16's last place)
    assert rel_err(normed.float().cpu(), (residual.float() * weight).float().cpu()) < 1e-2
    squares = residual.float().cpu().pow(2).reshape(-1, 16).sum(1)
    assert rel_err(slots[: n // 16].cpu(), squares) < 1e-5


@pytest.fixture(scope="module")
def head128_model(tmp_path_factory):
    """A tiny bf16 llama with heads of 128 features, compiled to int4 with groups of 128, its linears served by
    the kernels (the interpreter on a CPU)."""
    from thin.compiler import compile_model
    from thin.runtime import linear, load

    from hf_tiny import make_checkpoint

    added = []
    if not HAS_CUDA:
        for name in ("int4", "bf16"):
            family = "grouped_int" if name == "int4" else "dense"
            linear.register(name, "cpu", linear.Implementation("triton", f"thin.runtime.kernels.{family}:make"))
            added.append(name)
    tmp = tmp_path_factory.mktemp("oimma")
    src = make_checkpoint("llama", tmp / "src", dtype=torch.bfloat16, hidden_size=256, intermediate_size=256,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    yield load(compile_model(src, tmp / "m.thin", quant="int4", group_size=128), device=DEVICE.type)
    for name in added:
        linear.unregister(name, "cpu", "triton")


def _decode_logits(model, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """The logits of `steps` greedy decode steps after `prompt`, from a fresh engine (eager, norms deferred)."""
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.sampling import GenerationOptions

    options = GenerationOptions(max_new_tokens=steps + 1, stop_token_ids=())
    engine = DecodeEngine(model.executor, graphs=False, defer_norm=True)
    cache = engine.new_cache(32)
    sampler = engine.sampler(options)
    engine.start(cache, prompt, options)
    engine.prefill(cache, torch.tensor(prompt), sampler)
    return [engine.logits.float().cpu().clone() for _ in engine.decode_n_tokens(cache, steps, sampler, graph=False)]


def _counted(monkeypatch, name: str) -> list:
    """A list that grows by one at every call of OImma's method `name` from here on."""
    calls = []
    method = getattr(exp.OImma, name)
    monkeypatch.setattr(exp.OImma, name, lambda self, *a, **kw: calls.append(1) or method(self, *a, **kw))
    return calls


@pytest.mark.parametrize(("fold", "dep"), [(False, False), (False, True), (True, False)],
                         ids=["two launches", "o a dependent", "one launch"])
def test_a_patched_step_stays_close_to_the_shipped_step(head128_model, monkeypatch, fold, dep):
    from thin.runtime.engine import DecodeEngine

    model = head128_model
    prompt = torch.randint(3, 250, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    shipped = _decode_logits(model, prompt, 2)
    _undo_patch_after(monkeypatch)
    state = {}
    exp.patch(state, fold=fold, dep=dep, sleep=100 * fold)
    calls, made = _counted(monkeypatch, "o"), _counted(monkeypatch, "__init__")
    patched = _decode_logits(model, prompt, 2)
    assert len(calls) == 2 * len(model.executor.layers)  # o of every layer, both steps
    assert len(made) == 1  # its buffers made (and zeroed) once, not in every step's launches
    way = next(way for key, way in state.items() if key != "steps")
    assert len(state["steps"]) == 1  # the one cache this engine made takes the int8 way
    assert (way.fold, way.dep) == (fold, dep) and way.pending is None and not way.fresh
    assert way.flag.tolist() == [0, 0]  # the folded launch's counters left for the next one
    for a, b in zip(shipped, patched, strict=True):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999
    with pytest.raises(SystemExit, match="defer the residual norm"):  # an o left without the merge's x: refused
        DecodeEngine(model.executor, graphs=False, defer_norm=False)


def test_the_bounds_take_one_half_each(head128_model, monkeypatch):
    """--only merge: the merge writes the codes and o runs as shipped (the shipped logits); --only o: the shipped
    merge and o on the int8 mma (from codes the merge never wrote: zeros)."""
    model = head128_model
    prompt = [5, 9, 17, 33]
    shipped = _decode_logits(model, prompt, 1)
    for only in ("merge", "o"):
        _undo_patch_after(monkeypatch)
        state = {}
        exp.patch(state, only=only)
        calls = _counted(monkeypatch, "o")
        got = _decode_logits(model, prompt, 1)
        way = next(way for key, way in state.items() if key != "steps")
        assert len(calls) == (0 if only == "merge" else len(model.executor.layers)) and not way.fresh
        assert bool(way.xs.abs().sum()) == (only == "merge")  # the codes' scales written by the merge alone
        if only == "merge":
            assert all(torch.equal(a, b) for a, b in zip(shipped, got, strict=True))
        monkeypatch.undo()


def _undo_patch_after(monkeypatch):
    """What exp.patch replaces, put back by monkeypatch at the test's end."""
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.kernels import attention as attention_module
    from thin.runtime.kernels.grouped_int import GroupedIntLinear

    for owner, name in ((attention_module.DecodeAttention, "merge"), (GroupedIntLinear, "matvec_deferred"),
                        (DecodeEngine, "__init__"), (DecodeEngine, "new_cache")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
