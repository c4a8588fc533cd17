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
    """The plain output and the split-K partial sums, each against what the configuration the op
    picked computes (`computed`)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(op.in_features, generator=gen).to(dtype).to(DEVICE)
    bias_f = bias.float().cpu() if bias is not None else 0
    want = computed(op, "direct", dense, x) + bias_f
    out = poisoned(op.out_features, dtype=dtype)
    got = op.matvec(x, out=out)
    assert rel_err(got, want) < tolerance(dtype), f"matvec: {rel_err(got, want)}"
    # Split-K partial sums add up to the same product (no bias in them), to float32 summation order.
    parts = poisoned(8, op.out_features, dtype=torch.float32)
    sums = op.matvec(x, partials=parts)
    plain = computed(op, "partial", dense, x)
    exact = PAIRS_EXACT if op.config("partial").packed else 2e-5
    assert rel_err(sums.sum(0), plain) < exact, f"partials {op.config('partial')}: {rel_err(sums.sum(0), plain)}"


def check_glu(op, dense, bias, dtype, activation, *, seed=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(op.in_features, generator=gen).to(dtype).to(DEVICE)
    y = (computed(op, "glu", dense, x) + (bias.float().cpu() if bias is not None else 0)).to(dtype)
    gate, up = y.chunk(2)
    want = activate(activation, gate) * up
    got = op.matvec(x, out=poisoned(op.out_features // 2, dtype=dtype), activation=activation)
    assert rel_err(got, want) < 2 * tolerance(dtype), f"glu {activation}: {rel_err(got, want)}"


# The bf16-pair arithmetic (runtime/kernels/pairs.py): its sums against the emulation below (float32
# summation order; on the GPU fma.rn.bf16x2 rounds once where the emulation may round twice), and
# against the float32 product (its bf16 chunk sums cost ~0.5% rms at 4096 columns).
PAIRS_EXACT = 1e-4
PAIRS_TOLERANCE = 1e-2


def computed(op, mode, dense, x) -> torch.Tensor:
    """x @ dense.T (float32, CPU, no bias) as the configuration `op` runs in `mode` computes it: the
    float32 product, or for a bf16-pair configuration its bf16 chunk sums (pairs_reference), which
    then must stay within PAIRS_TOLERANCE of the float32 product."""
    exact = x.float().cpu() @ dense.T
    if not op.config(mode).packed:
        return exact
    emulated = pairs_reference(op, dense, x)
    assert rel_err(emulated, exact) < PAIRS_TOLERANCE, f"bf16 pairs: {rel_err(emulated, exact)}"
    return emulated


def pairs_reference(op, dense, x) -> torch.Tensor:
    """What the bf16-pair arithmetic computes, in torch (float32 [N]): per 32-column chunk and row,
    columns 8o + k and 8o + k + 4 (octet o, k < 4) summed in two bf16 running sums (each product,
    exact in float32, added with one float32 and one bf16 rounding, as the kernel's plain-Triton
    twin does), then the halves added and scaled by the chunk's scale in float32. The kernels' products
    are these times a power of 2 (int4: 2^-7, mxfp4: 2^-26), which rounds the same."""
    n, k = dense.shape
    scales = chunk_scales(op)
    codes = dense / scales.repeat_interleave(32, 1)  # int4: u - zero point; mxfp4: the E2M1 values (exact)
    codes = codes.view(n, k // 32, 4, 2, 4)  # [row, chunk, octet, half, k]
    xs = x.float().cpu().view(k // 32, 4, 2, 4)
    acc = torch.zeros(n, k // 32, 2)
    for o in range(4):
        for j in range(4):
            acc = (codes[:, :, o, :, j] * xs[:, o, :, j] + acc).bfloat16().float()
    return (scales * acc.sum(-1)).sum(-1)


def chunk_scales(op) -> torch.Tensor:
    """float32 [N, K / 32]: the scale of each 32-column chunk of a grouped-int or mxfp4 op's rows (mxfp4: its
    E8M0 bytes as the format's decode reads them)."""
    if op.format == "mxfp4":
        from thin.ir.formats.mxfp4 import SCALE_BIAS

        return torch.exp2(op.scales.cpu().view(op.out_features, -1).float() - SCALE_BIAS)
    return op.scales.float().cpu().repeat_interleave(op.group // 32, 1)


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


def check_pairs(op, dense, exact, every=True):
    """Every bf16-pair candidate (plain and split-K; `every` False: the first of each) computes
    pairs_reference (to `exact`: float32 summation order; bf16 output rounding for the plain one),
    which a wrong column fails, and stays within PAIRS_TOLERANCE of the float32 product."""
    x = torch.randn(op.in_features, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEVICE)
    want = x.float().cpu() @ dense.T
    emulated = pairs_reference(op, dense, x)
    swapped = dense.clone()
    swapped[:, [37, 41]] = swapped[:, [41, 37]]  # two columns 4 apart: what a pair taken from the wrong octet reads
    wrong = pairs_reference(op, swapped, x)
    for config in [c for c in op.candidates("partial") if c.packed][:None if every else 1]:
        op._configs["partial"] = config
        parts = op.matvec(x, partials=poisoned(8, op.out_features, dtype=torch.float32)).sum(0)
        assert rel_err(parts, emulated) < exact, (config, rel_err(parts, emulated))
        assert rel_err(parts, want) < PAIRS_TOLERANCE and rel_err(parts, wrong) > 10 * exact
    for config in [c for c in op.candidates("direct") if c.packed][:None if every else 1]:
        op._configs["direct"] = config
        got = op.matvec(x, out=poisoned(op.out_features, dtype=torch.bfloat16))
        assert rel_err(got, emulated) < tolerance(torch.bfloat16) / 2, config
        assert rel_err(got, want) < PAIRS_TOLERANCE
