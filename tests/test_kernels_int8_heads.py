"""kernels/int8_heads.py: the attention's merge also rounds its output to int8 a head of 128, and o (symmetric
int4, groups of 128) multiplies those codes on the int8 tensor cores (through the mma's interpreter twin on the
CPU). The merge's output is the plain merge's and its codes the reference rounding in the mma's B order; o adds
the format's decode times that x into the residual with the norm deferred; a decode step that takes the way stays
close to one that does not, and the engine takes it exactly where o's weight can."""

import pytest
import torch
from kernel_support import DEVICE, HAS_CUDA, rel_err

from thin.runtime.kernels import int8_heads
from thin.runtime.kernels.int8_heads import Int8Heads


def _attention(heads=4, kv_heads=2, splits_len=96, seed=0):
    """A DecodeAttention whose splits hold random partial outputs, maxima and sums (one split empty)."""
    from thin.runtime.kernels.attention import DecodeAttention

    attention = DecodeAttention(heads, kv_heads, 128, splits_len, DEVICE, sms=4, tile=16)
    gen = torch.Generator().manual_seed(seed)
    s = attention.splits
    attention.o.copy_(torch.randn(attention.o.shape, generator=gen))
    attention.m.copy_(torch.randn(attention.m.shape, generator=gen))
    attention.m[:, s - 1] = float("-inf")
    attention.l.copy_(torch.rand(attention.l.shape, generator=gen) + 0.5)
    attention.n.copy_(torch.randint(0, 16, attention.n.shape, generator=gen, dtype=torch.int32))
    return attention


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no sinks", "sinks"])
def test_merge_writes_the_plain_output_and_its_int8_codes(with_sinks):
    attention = _attention()
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(9)).to(DEVICE) if with_sinks else None
    want = torch.empty(4 * 128, dtype=torch.bfloat16, device=DEVICE)
    attention.merge(want, sinks)
    heads = Int8Heads.empty(4, DEVICE)
    got = torch.empty_like(want)
    log = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    step = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    attention.merge(got, sinks, log=log, step=step, heads=heads)
    assert torch.equal(got, want)
    assert int(log[2]) == int(attention.n.sum())
    codes, scales = int8_heads.quantize_heads(want.cpu())
    assert codes.abs().max() == 127 and codes.abs().min() < 127  # random values, each head's max at 127
    # 127 / max: one float32 division there, a double rounded once here; a value at a half may round apart
    differ = (heads.codes.cpu().int() - int8_heads.b_order(codes).int()).abs()
    assert differ.max() <= 1 and (differ > 0).sum() <= 2
    assert rel_err(heads.scales.cpu(), scales) < 1e-6
    assert torch.equal(heads.sums.cpu(), heads.codes.cpu().int().reshape(4, 128).sum(1))  # a head's codes stay its
    assert (heads.sums.cpu() - codes.sum(1).int()).abs().max() <= 2


def test_merge_refuses_what_it_cannot_write():
    attention = _attention()
    out = torch.empty(4 * 128, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="int8 heads"):
        attention.merge(out, heads=Int8Heads.empty(3, DEVICE))


@pytest.mark.parametrize(("n", "k"), [(32, 256), (48, 384), (16, 1152)])
def test_o_adds_the_decode_times_its_x_with_the_norm_deferred(n, k):
    from linear_kernel_cases import make_op

    op, dense, _ = make_op("int4", (n, k), {"group_size": 128}, dtype=torch.bfloat16, seed=3)
    assert int8_heads.takes(op, 128) and not int8_heads.takes(op, 64)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(k, generator=gen).bfloat16()
    codes, scales = int8_heads.quantize_heads(x)
    heads = Int8Heads(int8_heads.b_order(codes).to(DEVICE), scales.to(DEVICE), codes.sum(1).int().to(DEVICE))
    residual = torch.randn(n, generator=gen).bfloat16().to(DEVICE)
    weight = (1 + 0.2 * torch.randn(n, generator=gen)).to(DEVICE)
    normed = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.full((n // 16 + 3,), 7.0, device=DEVICE)
    start = residual.float().cpu()
    defer = int8_heads.o_deferred(op, heads, residual, normed, slots, (weight, 1e-5))
    assert defer.programs == n // 16
    product = int8_heads.reference_o(dense, x)
    assert rel_err(product, dense.float() @ x.float()) < 2e-2  # what the int8 rounding of x costs
    want = (start + product.bfloat16().float()).bfloat16().float()
    assert rel_err(residual.float().cpu(), want) < 1e-2
    # rounded to bf16 (the interpreter's conversion truncates: within a unit of bf16's last place)
    assert rel_err(normed.float().cpu(), (residual.float() * weight).float().cpu()) < 1e-2
    squares = residual.float().cpu().pow(2).reshape(-1, 16).sum(1)
    assert rel_err(slots[: n // 16].cpu(), squares) < 1e-5
    assert slots[n // 16:].eq(7.0).all()  # no slot past its programs


def test_o_refuses_a_weight_it_cannot_take():
    from linear_kernel_cases import make_op

    op, _, _ = make_op("int4", (32, 256), {"group_size": 64}, dtype=torch.bfloat16, seed=3)
    heads = Int8Heads.empty(2, DEVICE)
    residual = torch.zeros(32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="symmetric int4"):
        int8_heads.o_deferred(op, heads, residual, residual.clone(), torch.zeros(8, device=DEVICE),
                              (torch.ones(32, device=DEVICE), 1e-5))


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
    tmp = tmp_path_factory.mktemp("int8heads")
    src = make_checkpoint("llama", tmp / "src", dtype=torch.bfloat16, hidden_size=256, intermediate_size=256,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    yield load(compile_model(src, tmp / "m.thin", quant="int4", group_size=128), device=DEVICE.type)
    for name in added:
        linear.unregister(name, "cpu", "triton")


def _decode_logits(model, prompt: list[int], steps: int, **engine_options):
    """(the engine, the logits of `steps` greedy decode steps after `prompt`) from a fresh engine (eager)."""
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.sampling import GenerationOptions

    options = GenerationOptions(max_new_tokens=steps + 1, stop_token_ids=())
    engine = DecodeEngine(model.executor, graphs=False, **engine_options)
    cache = engine.new_cache(32)
    sampler = engine.sampler(options)
    engine.start(cache, prompt, options)
    engine.prefill(cache, torch.tensor(prompt), sampler)
    logits = [engine.logits.float().cpu().clone() for _ in engine.decode_n_tokens(cache, steps, sampler, graph=False)]
    return engine, logits


@pytest.mark.parametrize(("dependent", "appending"), [(False, False), (True, True)],
                         ids=["plain, three attention launches", "dependents, the appending attention"])
def test_a_step_with_int8_o_stays_close_to_the_plain_step(head128_model, monkeypatch, dependent, appending):
    model = head128_model
    prompt = torch.randint(3, 250, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    plain_engine, plain = _decode_logits(model, prompt, 2, int8_o=False, fused_attention=appending)
    assert not plain_engine._int8_o and plain_engine.heads is None
    calls = []
    o_deferred = int8_heads.o_deferred
    monkeypatch.setattr(int8_heads, "o_deferred", lambda *a, **kw: calls.append(1) or o_deferred(*a, **kw))
    engine, got = _decode_logits(model, prompt, 2, int8_o=True, dependent_launch=dependent,
                                 fused_attention=appending)
    assert bool(engine._appending) == appending
    layers = len(model.executor.layers)
    assert engine._int8_o == set(range(layers)) and len(calls) == 2 * layers  # o of every layer, both steps
    assert engine.heads.scales.abs().min() > 0  # written by the merges
    for a, b in zip(plain, got, strict=True):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999
        assert not torch.equal(a, b)  # o's x was rounded
    # by default only on a GPU of compute capability 9 or later (never on the CPU)
    assert not _decode_logits(model, prompt, 1)[0]._int8_o or (
        HAS_CUDA and torch.cuda.get_device_capability() >= (9, 0))
    # o must defer the residual norm to take its x from the merge
    assert not _decode_logits(model, prompt, 1, int8_o=True, defer_norm=False)[0]._int8_o


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_int8_o_at_llama_8b_shapes_on_the_gpu():
    """o [4096, 4096] from 32 heads of 128: the mma's sums against the format's decode times the rounded x."""
    from linear_kernel_cases import make_op

    n = k = 4096
    op, dense, _ = make_op("int4", (n, k), {"group_size": 128}, dtype=torch.bfloat16, seed=7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(k, generator=gen).bfloat16()
    codes, scales = int8_heads.quantize_heads(x)
    heads = Int8Heads(int8_heads.b_order(codes).to(DEVICE), scales.to(DEVICE), codes.sum(1).int().to(DEVICE))
    residual = torch.zeros(n, dtype=torch.bfloat16, device=DEVICE)
    normed = torch.empty_like(residual)
    slots = torch.zeros(n, device=DEVICE)
    int8_heads.o_deferred(op, heads, residual, normed, slots, (torch.ones(n, device=DEVICE), 1e-5))
    want = int8_heads.reference_o(dense, x).bfloat16().float()
    assert rel_err(residual.float().cpu(), want) < 5e-3
