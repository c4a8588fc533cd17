"""The checks every linear kernel family passes, against its format's reference decode."""

from __future__ import annotations

import importlib

import torch
from kernel_support import DEVICE, poisoned, rel_err, tolerance

from thin.ir import Encoding, Tensor, formats
from thin.runtime.ffn import activate


def make_op(fmt: str, shape, params=None, *, dtype=torch.float32, bias=False, seed=0):
    """(op, dense reference weight float32, bias) for a random weight encoded in `fmt`."""
    gen = torch.Generator().manual_seed(seed)
    params = formats.get(fmt).normalize(params or {})
    w = torch.randn(*shape, generator=gen)
    raw = formats.encode(fmt, w, params)
    record = Tensor("layers.0.mlp.w", "ffn.down", 0, tuple(shape), Encoding(fmt, params), "f32")
    b = torch.randn(shape[0], generator=gen).to(dtype).to(DEVICE) if bias else None
    op = kernel_factory(fmt)(record, raw, b, DEVICE, dtype)
    assert op is not None and op.implementation == "triton", f"{fmt} {shape}: no kernel took it"
    dense = formats.get(fmt).decode(raw, tuple(shape), params, torch.float32)
    return op, dense, b


def kernel_factory(fmt: str):
    """The factory the registry holds for `fmt`'s Triton kernels (called here on any device)."""
    from thin.runtime import linear

    impl = next(i for i in linear.implementations(fmt, "cuda") if i.name == "triton")
    module, _, attr = impl.target.partition(":")
    factory = getattr(importlib.import_module(module), attr)

    def make(record, raw, bias, device, dtype):
        op = factory(record, raw, bias, device, dtype)
        if op is not None:
            op.implementation = "triton"
        return op

    return make


def check_matvec(op, dense, bias, dtype, *, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(op.in_features, generator=gen).to(dtype).to(DEVICE)
    want = x.float().cpu() @ dense.T + (bias.float().cpu() if bias is not None else 0)
    out = poisoned(op.out_features, dtype=dtype)
    got = op.matvec(x, out=out)
    assert rel_err(got, want) < tolerance(dtype), f"matvec: {rel_err(got, want)}"
    # Split-K partial sums add up to the same product (no bias in them).
    parts = poisoned(8, op.out_features, dtype=torch.float32)
    sums = op.matvec(x, partials=parts)
    plain = want - (bias.float().cpu() if bias is not None else 0)
    assert rel_err(sums.sum(0), plain) < 2e-5, "partials"


def check_glu(op, dense, bias, dtype, activation, *, seed=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(op.in_features, generator=gen).to(dtype).to(DEVICE)
    y = (x.float().cpu() @ dense.T + (bias.float().cpu() if bias is not None else 0)).to(dtype)
    gate, up = y.chunk(2)
    want = activate(activation, gate) * up
    got = op.matvec(x, out=poisoned(op.out_features // 2, dtype=dtype), activation=activation)
    assert rel_err(got, want) < 2 * tolerance(dtype), f"glu {activation}: {rel_err(got, want)}"


def check_matmul(op, dense, bias, dtype, rows=5, *, seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, op.in_features, generator=gen).to(dtype).to(DEVICE)
    got = op(x)
    w = dense.to(dtype).float()  # prefill multiplies by the weight rounded to the compute dtype
    want = x.float().cpu() @ w.T + (bias.float().cpu() if bias is not None else 0)
    assert got.shape == (rows, op.out_features)
    assert rel_err(got, want) < tolerance(dtype), f"matmul: {rel_err(got, want)}"


def check_all(fmt, shape, params=None, dtype=torch.float32, bias=False, activation="silu"):
    op, dense, b = make_op(fmt, shape, params, dtype=dtype, bias=bias)
    check_matvec(op, dense, b, dtype)
    check_glu(op, dense, b, dtype, activation)
    check_matmul(op, dense, b, dtype)
