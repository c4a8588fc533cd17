"""The flat fragment matvec of examples/benchmarks/exp_flat_step.py with the engine's epilogues, against the shipped
int4 kernels on the same weight: plain rows with a bias, gate/up with SiLU, the deferred norm's producer (residual,
normed row, slots) and its consumer. Under the interpreter on the CPU (the mma's twin), with the mma on a GPU."""

import importlib.util
from pathlib import Path

import pytest
import torch
from kernel_support import DEVICE, poisoned, rel_err
from linear_kernel_cases import make_op

_SPEC = importlib.util.spec_from_file_location(
    "exp_flat_step", Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "exp_flat_step.py")
flat = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(flat)

ASM = DEVICE.type == "cuda"


def _op(shape, bias, seed):
    op, _, _ = make_op("int4", shape, {"group_size": 128}, dtype=torch.bfloat16, bias=bias, seed=seed)
    assert flat.flat_eligible(op)
    op.fragments = flat._fragments(op)
    return op


def _x(k, seed):
    return torch.randn(k, generator=torch.Generator().manual_seed(seed)).bfloat16().to(DEVICE)


@pytest.mark.parametrize("k", [256, 2048], ids=["runs past K", "whole runs"])
def test_plain_rows_with_bias_match_the_shipped_matvec(k):
    op = _op((48, k), True, seed=1)
    x = _x(k, 2)
    out = poisoned(48, dtype=torch.bfloat16)
    flat.flat_call(op, x, out, -1, asm=ASM, pdl=False)
    assert rel_err(out, op.matvec(x)) < 1e-2


def test_gate_up_with_silu_matches_the_shipped_matvec():
    from thin.runtime.kernels.activation import ACTIVATION_CODES

    op = _op((64, 256), False, seed=3)
    x = _x(256, 4)
    out = poisoned(32, dtype=torch.bfloat16)
    flat.flat_call(op, x, out, ACTIVATION_CODES["silu"], asm=ASM, pdl=False)
    assert rel_err(out, op.matvec(x, activation="silu")) < 2e-2


def test_the_deferred_norm_on_both_sides_matches_the_shipped_kernels():
    from thin.runtime.kernels.deferred_norm import Deferred

    producer = _op((96, 256), True, seed=5)
    x = _x(256, 6)
    gen = torch.Generator().manual_seed(7)
    residual = torch.randn(96, generator=gen).bfloat16().to(DEVICE)
    weight = (1 + 0.3 * torch.randn(96, generator=gen)).to(DEVICE)
    shipped = producer.matvec_deferred(x, residual.clone(), poisoned(96, dtype=torch.bfloat16),
                                       torch.zeros(96, device=DEVICE), (weight, 1e-5))
    # the consumers read the shipped producer's count of slots: here more than the flat launch's 6 programs
    ours = Deferred(residual.clone(), poisoned(96, dtype=torch.bfloat16), poisoned(96, dtype=torch.float32),
                    (weight, 1e-5), 20)
    flat.flat_call(producer, x, None, -1, defer=ours, asm=ASM, pdl=False)
    assert rel_err(ours.residual, shipped.residual) < 1e-2
    assert rel_err(ours.out, shipped.out) < 1e-2
    squares = ours.slots[:20].double().sum()  # the 14 past the launch's programs zeroed
    assert abs(float(squares) - float(shipped.slots[:shipped.programs].double().sum())) < 2e-2 * float(squares)
    consumer = _op((64, 256), False, seed=8)  # of a 256-wide deferred row
    producer = _op((256, 256), False, seed=9)
    residual = torch.randn(256, generator=gen).bfloat16().to(DEVICE)
    weight = (1 + 0.3 * torch.randn(256, generator=gen)).to(DEVICE)
    defer = producer.matvec_deferred(x, residual, poisoned(256, dtype=torch.bfloat16),
                                     torch.zeros(256, device=DEVICE), (weight, 1e-5))
    out = poisoned(64, dtype=torch.bfloat16)
    flat.flat_call(consumer, defer.out, out, -1, rstd=defer, asm=ASM, pdl=False)
    assert rel_err(out, consumer.matvec(defer.out, rstd=defer)) < 1e-2
