"""Symmetric int4 products on the tensor cores (runtime/kernels/mma_pairs.py, MatvecConfig.mma): against the
float32 product of the format's decode, plain, split-K and gate/up, on the interpreter (the mma's twin) and on the
GPU (mma.sync), and only where they apply."""

from dataclasses import replace

import pytest
import torch
from kernel_support import DEVICE, poisoned, rel_err, tolerance
from linear_kernel_cases import make_op

from thin.runtime.ffn import activate
from thin.runtime.kernels.common import MatvecConfig

EXACT = 2e-6  # float32 partial sums: float32 rounding of the same products in another order


def _x(k, seed):
    return torch.randn(k, generator=torch.Generator().manual_seed(seed)).bfloat16().to(DEVICE)


def check_mma(op, dense, config, mode, x):
    """op's matvec in `mode` with `config` against x @ dense.T (float32): partial sums to float32 rounding, the
    outputs to their dtype's rounding (gate/up: of act(gate) * up)."""
    op._configs[mode] = config
    want = x.float().cpu() @ dense.T
    if mode == "partial":
        sums = op.matvec(x, partials=poisoned(config.split, op.out_features, dtype=torch.float32)).sum(0)
        assert rel_err(sums, want) < EXACT, (config, rel_err(sums, want))
    elif mode == "glu":
        gate, up = want.bfloat16().chunk(2)
        got = op.matvec(x, out=poisoned(op.out_features // 2, dtype=torch.bfloat16), activation="silu")
        assert rel_err(got, activate("silu", gate) * up) < 2 * tolerance(torch.bfloat16), config
    else:
        got = op.matvec(x, out=poisoned(op.out_features, dtype=torch.bfloat16))
        assert rel_err(got, want) < tolerance(torch.bfloat16), (config, rel_err(got, want))


@pytest.mark.parametrize(("mode", "block_n", "split"), [("partial", 2, 2), ("direct", 8, 1), ("glu", 2, 1)])
def test_matches_the_decode(mode, block_n, split):
    """Two loop steps a program (1 warp: 1024 columns a step), 2 to 8 weight rows a tile, a row pair's codes
    from two rows of their own and the zero point off per group; a swapped pair of columns is caught."""
    rows = 32 if mode != "glu" else 64
    op, dense, _ = make_op("int4", (rows, 2048 * split), {"group_size": 128}, dtype=torch.bfloat16, seed=block_n)
    x = _x(op.in_features, 1)
    config = MatvecConfig(block_n, 1024, split, 1, mma=True)
    check_mma(op, dense, config, mode, x)
    if mode == "partial":
        swapped = dense.clone()
        swapped[:, [37, 41]] = swapped[:, [41, 37]]
        wrong = x.float().cpu() @ swapped.T
        sums = op.matvec(x, partials=poisoned(split, rows, dtype=torch.float32)).sum(0)
        assert rel_err(sums, wrong) > 100 * EXACT


def test_only_where_they_apply():
    """Symmetric int4 under bf16 activations with groups of 128 (or a multiple): otherwise no candidate, and a
    launch asked for one says why."""
    op, _, _ = make_op("int4", (32, 1024), {"group_size": 64}, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="groups of a multiple of 128"):
        op._matvec(_x(1024, 2), poisoned(32, dtype=torch.bfloat16), MatvecConfig(4, 1024, 1, 1, mma=True), -1, False)
    for fmt, params, dtype in [("int4", {"asymmetric": 1}, torch.bfloat16), ("int5", {}, torch.bfloat16),
                               ("int4", {}, torch.float16)]:
        other, _, _ = make_op(fmt, (32, 1024), {"group_size": 128, **params}, dtype=dtype)
        assert not any(c.mma for mode in ("direct", "partial", "glu") for c in other.candidates(mode))
        with pytest.raises(ValueError, match="bf16 pairs"):
            other._matvec(torch.randn(1024).to(dtype).to(DEVICE), poisoned(32, dtype=dtype),
                          MatvecConfig(4, 1024, 1, 1, mma=True), -1, False)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336)])
def test_real_shapes_on_gpu(shape):
    """Every tensor-core candidate of llama-8b's qkv and down, plain and split-K."""
    op, dense, _ = make_op("int4", shape, {"group_size": 128}, dtype=torch.bfloat16)
    x = _x(shape[1], 3)
    for mode in ("direct", "partial"):
        configs = [c for c in op.candidates(mode) if c.mma]
        assert configs, f"no tensor-core candidate for {shape} {mode}"
        for config in configs:
            check_mma(op, dense, config, mode, x)


@pytest.mark.gpu
def test_glu_real_shape_on_gpu():
    op, dense, _ = make_op("int4", (28672, 4096), {"group_size": 128}, dtype=torch.bfloat16)
    x = _x(4096, 4)
    configs = [c for c in op.candidates("glu") if c.mma]
    assert configs
    for config in configs:
        check_mma(op, dense, config, "glu", x)


@pytest.mark.gpu
def test_deferred_norm_on_gpu():
    """A producer (down) and a consumer (qkv) of the deferred residual norm on the tensor cores give what the
    bf16-pair tilings give, to bf16 rounding."""
    from test_kernels_deferred_norm import _defer

    op, _, _ = make_op("int4", (4096, 14336), {"group_size": 128}, dtype=torch.bfloat16, seed=5)
    x = _x(14336, 6)
    results = []
    for mma in (False, True):
        op._configs["direct"] = replace(MatvecConfig(4, 2048, 1, 2), packed=not mma, mma=mma)
        defer, _ = _defer(op, x, 4096, torch.bfloat16, torch.Generator().manual_seed(7))
        results.append((defer.residual.float(), defer.out.float()))
    assert rel_err(results[1][0], results[0][0]) < 2e-2 and rel_err(results[1][1], results[0][1]) < 2e-2
