"""The residual norm left to the next projection (deferred_norm.Deferred): the producer matvec (o, down) adds its rows
into the residual and writes residual * norm weight and its programs' sums of squares; a consumer matvec
(gate/up, qkv, the LM head) reading that row multiplies its sums by 1 / rms. Against add_rmsnorm and the
consumer's plain matvec of the normed row, for int4 and mxfp4 (both arithmetics each), int8 and fp8_e4m3."""

from dataclasses import replace

import pytest
import torch
from kernel_support import DEVICE, poisoned, rel_err, tolerance
from linear_kernel_cases import make_op

FORMATS = [("int4", {"group_size": 32}, False), ("int4", {"group_size": 32}, True), ("int8", {}, False),
           ("fp8_e4m3", {}, False), ("mxfp4", {}, False), ("mxfp4", {}, True)]


def _op(fmt, params, packed, shape, dtype, bias, seed, mode="direct"):
    op, _, b = make_op(fmt, shape, params, dtype=dtype, bias=bias, seed=seed)
    if packed:  # the bf16-pair arithmetic: a candidate the tuner may pick, never the interpreter's default
        op._configs[mode] = replace(op.config(mode), packed=True)
    return op, b


def _defer(op, x, H, dtype, gen, cols=None):
    """op.matvec_deferred(x) into a random residual and norm weight: (the Deferred, the residual before)."""
    residual = torch.randn(H, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(H, generator=gen)).to(DEVICE)
    slots = poisoned(H, dtype=torch.float32)  # past the producer's programs: never read
    before = residual.clone()
    return op.matvec_deferred(x, residual, poisoned(H, dtype=dtype), slots, (weight, 1e-5), cols=cols), before


@pytest.mark.parametrize(("fmt", "params", "packed"), FORMATS)
@pytest.mark.parametrize("bias", [False, True])
def test_producer_adds_into_the_residual_as_add_rmsnorm(fmt, params, packed, bias):
    """The residual as add_rmsnorm leaves it (bf16: bit for bit, the same roundings of the same sums; float32
    to an ulp, as a GPU may contract the row scale's product and the residual add into one multiply-add); out
    the new residual times the norm weight; the slots sum to its sum of squares; the norm they make with out
    is add_rmsnorm's normed row."""
    from thin.runtime.kernels.norm import add_rmsnorm

    dtype = torch.bfloat16 if packed else torch.float32
    op, b = _op(fmt, params, packed, (96, 256), dtype, bias, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(256, generator=gen).to(dtype).to(DEVICE)
    defer, want_res = _defer(op, x, 96, dtype, gen)
    programs = defer.programs
    assert programs == -(-96 // op.config("direct").block_n)
    want_normed = poisoned(96, dtype=dtype)
    add_rmsnorm(want_res, want_normed, dense=op.matvec(x), norm=defer.norm)
    if dtype == torch.bfloat16:
        assert torch.equal(defer.residual, want_res)
    else:
        assert rel_err(defer.residual, want_res) < 1e-6
    weight, eps = defer.norm
    res = want_res.float()
    assert rel_err(defer.out, res * weight) < tolerance(dtype)
    squares = defer.slots[:programs].double().sum()
    assert abs(float(squares) - float(res.double().pow(2).sum())) <= 1e-5 * float(res.double().pow(2).sum())
    rms = torch.sqrt(squares / 96 + eps).float()
    assert rel_err(defer.out.float() / rms, want_normed) < 2 * tolerance(dtype)


@pytest.mark.parametrize(("fmt", "params", "packed"), FORMATS)
def test_consumer_applies_the_deferred_norm(fmt, params, packed):
    """A consumer fed the deferred row: plain, gate/up with SiLU and split-K partial sums (each partial
    scaled, so their sum is too) match the same matvec of add_rmsnorm's normed row."""
    from thin.runtime.kernels.norm import add_rmsnorm

    dtype = torch.bfloat16 if packed else torch.float32
    H = 256
    producer, _ = _op(fmt, params, False, (H, 128), dtype, True, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(128, generator=gen).to(dtype).to(DEVICE)
    defer, residual = _defer(producer, x, H, dtype, gen)
    normed = poisoned(H, dtype=dtype)
    add_rmsnorm(residual, normed, dense=producer.matvec(x), norm=defer.norm)
    for mode, shape in (("direct", (64, H)), ("glu", (128, H)), ("partial", (64, H))):
        op, _ = _op(fmt, params, packed, shape, dtype, mode != "partial", seed=7, mode=mode)
        if mode == "direct":
            got, want = op.matvec(defer.out, rstd=defer), op.matvec(normed)
        elif mode == "glu":
            got, want = op.matvec(defer.out, activation="silu", rstd=defer), op.matvec(normed, activation="silu")
        else:
            parts = poisoned(8, 64, dtype=torch.float32)
            got = op.matvec(defer.out, partials=parts, rstd=defer).sum(0)
            want = op.matvec(normed, partials=poisoned(8, 64, dtype=torch.float32)).sum(0)
        assert rel_err(got, want) < 3 * tolerance(dtype), (mode, rel_err(got, want))


def test_the_producer_runs_plain_rows_in_one_split_and_only_deferrable_families():
    from thin.runtime.kernels.common import MatvecConfig

    op, _ = _op("int8", {}, False, (96, 256), torch.float32, False, seed=8)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(256, generator=gen).to(DEVICE)
    defer, _ = _defer(op, x, 96, torch.float32, gen)
    with pytest.raises(ValueError, match="one split"):
        op._matvec(x, defer.out, MatvecConfig(32, 64, 2, 4), -1, True, defer=defer)
    with pytest.raises(ValueError, match="programs"):
        op._matvec(x, defer.out, op.config("direct"), -1, False, defer=replace(defer, programs=defer.programs + 1))
    bf16, _, _ = make_op("bf16", (96, 256), dtype=torch.float32)
    assert not bf16.deferrable
    with pytest.raises(ValueError, match="do not"):
        bf16.matvec(x, rstd=defer)
