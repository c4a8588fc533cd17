"""examples/benchmarks/exp_gateup_imma_step.py: gate/up on the int8 tensor cores in the decode step, its int8 x (a
scale a chunk of 16) written by o's 16-row programs. o's residual and norm slots are int8_heads' own and its codes
are the chunk rounding of its normed rows; gate/up gives act(gate) * up of the format's decode times that x and the
deferred 1 / rms; a patched step stays close to the shipped one (the mma's interpreter twin on the CPU)."""

import os
import sys

import pytest
import torch
from kernel_support import DEVICE, rel_err
from test_kernels_int8_heads import _decode_logits, head128_model  # noqa: F401  (a fixture)

from thin.runtime.kernels import int8_heads
from thin.runtime.kernels.deferred_norm import Deferred

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "benchmarks"))

import exp_gateup_imma_step as exp  # noqa: E402
from exp_int4_imma_cols import dequantized_x_cols, quantize_x_cols  # noqa: E402


def _heads(k, seed):
    x = torch.randn(k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    codes, scales = int8_heads.quantize_heads(x)
    return int8_heads.Int8Heads(int8_heads.b_order(codes).to(DEVICE), scales.to(DEVICE),
                                codes.sum(1).int().to(DEVICE))


def test_o_writes_the_shipped_rows_and_gate_ups_x():
    from linear_kernel_cases import make_op

    n, k = 64, 256
    op, _, _ = make_op("int4", (n, k), {"group_size": 128}, dtype=torch.bfloat16, seed=3)
    gen = torch.Generator().manual_seed(4)
    heads = _heads(k, 5)
    start = torch.randn(n, generator=gen).bfloat16().to(DEVICE)
    weight = (1 + 0.2 * torch.randn(n, generator=gen)).to(DEVICE)
    want = [start.clone(), torch.empty_like(start), torch.zeros(n // 16, device=DEVICE)]
    int8_heads.o_deferred(op, heads, want[0], want[1], want[2], (weight, 1e-5))
    got = [start.clone(), torch.empty_like(start), torch.zeros(n // 16, device=DEVICE)]
    way = exp.GateUpImma(n, DEVICE)
    defer = way.o(op, heads, got[0], got[1], got[2], (weight, 1e-5))
    assert way.fresh and defer.programs == n // 16
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    codes, scales = quantize_x_cols(got[1].float().cpu())
    assert torch.equal(way.codes.cpu(), codes) and rel_err(way.scales.cpu(), scales) < 1e-6
    assert way.codes[n // 4:].eq(0).all()  # the zero words past the codes


@pytest.mark.parametrize(("f", "k"), [(32, 256), (48, 384)])
def test_glu_is_act_gate_times_up_of_the_chunk_rounded_x(f, k):
    from linear_kernel_cases import make_op

    op, dense, _ = make_op("int4", (2 * f, k), {"group_size": 128}, dtype=torch.bfloat16, seed=6)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(k, generator=gen).bfloat16()
    way = exp.GateUpImma(k, DEVICE)
    codes, scales = quantize_x_cols(x.float())
    way.codes.copy_(codes)
    way.scales.copy_(scales)
    way.fresh = True
    residual = (3 * torch.randn(k, generator=gen)).bfloat16().to(DEVICE)
    slots = residual.float().pow(2).reshape(-1, 16).sum(1)
    rstd = Deferred(residual, torch.empty_like(residual), slots, (torch.ones(k, device=DEVICE), 1e-5), k // 16)
    out = torch.empty(f, dtype=torch.bfloat16, device=DEVICE)
    way.glu(op, out, rstd)
    assert not way.fresh
    scale = 1 / torch.sqrt(residual.float().cpu().pow(2).mean() + 1e-5)
    sums = (dense @ dequantized_x_cols(x.float())) * scale
    gate, up = sums[:f].bfloat16().float(), sums[f:].bfloat16().float()
    want = (torch.nn.functional.silu(gate).bfloat16().float() * up).bfloat16().float()
    # four roundings to bf16 (gate, up, act, product): the interpreter's truncate, a unit of the last place each
    assert rel_err(out.float().cpu(), want) < 3e-2
    exact = (torch.nn.functional.silu(dense[:f] @ x.float() * scale) * (dense[f:] @ x.float() * scale))
    assert rel_err(out.float().cpu(), exact) < 5e-2  # the chunk rounding of x costs about 0.5% a row


def test_a_patched_step_stays_close_to_the_shipped_step(head128_model, monkeypatch):  # noqa: F811
    from thin.runtime import engine as engine_module

    model = head128_model
    prompt = torch.randint(3, 250, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    _, shipped = _decode_logits(model, prompt, 2, int8_o=True, dependent_launch=True)
    monkeypatch.setattr(int8_heads, "o_deferred", int8_heads.o_deferred)
    monkeypatch.setattr(engine_module.DecodeEngine, "_mlp", engine_module.DecodeEngine._mlp)
    state = {}
    exp.patch(state)
    calls = []
    glu = exp.GateUpImma.glu
    monkeypatch.setattr(exp.GateUpImma, "glu", lambda self, *a, **kw: calls.append(1) or glu(self, *a, **kw))
    _, patched = _decode_logits(model, prompt, 2, int8_o=True, dependent_launch=True)
    assert len(calls) == 2 * len(model.executor.layers)  # gate/up of every layer, both steps
    assert len(state) == 1 and not next(iter(state.values())).fresh
    for a, b in zip(shipped, patched, strict=True):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999
        assert not torch.equal(a, b)
