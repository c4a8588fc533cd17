"""mxfp4 kernels against the format's decode (every E2M1 code, subnormal 0.5 included)."""

from dataclasses import replace

import pytest
import torch
from kernel_support import DEVICE, poisoned, rel_err, tolerance
from linear_kernel_cases import check_all, check_glu, check_matvec, check_pairs, make_op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_decode(dtype):
    check_all("mxfp4", (96, 192), dtype=dtype, bias=dtype == torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336)])
def test_real_shapes_on_gpu(shape):
    op, dense, _ = make_op("mxfp4", shape, dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)


def test_tiled_prefill_matches_decode():
    """The pipelined prefill kernel (MatmulConfig "tiled"): float32 exact up to summation order (a code
    in the wrong column fails), several programs both ways, one or several blocks a step, a bias,
    prefixes; bfloat16 against the weight rounded to bf16. The plain kernel stays the untuned default."""
    from thin.runtime.kernels.prefill import MatmulConfig

    configs = [MatmulConfig(16, 32, 32, 4, 3), MatmulConfig(16, 32, 64, 4, 3), MatmulConfig(32, 64, 128, 4, 3)]
    op, dense, b = make_op("mxfp4", (80, 256), bias=True, seed=3)
    assert [c.kernel for c in op.matmul_candidates(40, 256)] == ["plain"]  # float32: the plain kernel only
    gen = torch.Generator().manual_seed(4)
    for T in (5, 40):
        x = torch.randn(T, 256, generator=gen).to(DEVICE)
        for config in configs:
            assert rel_err(op._matmul(x, config=config), x.cpu() @ dense.T + b.cpu()) < 2e-5, (T, config)
    x = torch.randn(7, 256, generator=gen).to(DEVICE)
    halves = torch.cat([dense[:32], dense[40:72]])
    got = op._matmul(x, rows=32, halves=2, config=configs[1])
    assert rel_err(got, x.cpu() @ halves.T + torch.cat([b[:32], b[40:72]]).cpu()) < 2e-5
    h = x[:, :128].contiguous()
    assert rel_err(op._matmul(h, cols=128, config=configs[2]), h.cpu() @ dense[:, :128].T + b.cpu()) < 2e-5
    op, dense, _ = make_op("mxfp4", (96, 256), dtype=torch.bfloat16, seed=5)
    assert op.matmul_candidates(21, 256)[0].kernel == "plain" and len(op.matmul_candidates(21, 256)) > 1
    x = torch.randn(21, 256, generator=gen).bfloat16().to(DEVICE)
    want = x.float().cpu() @ dense.bfloat16().float().T
    for config in configs + [MatmulConfig(64, 128, 64, 4, 3)]:
        assert rel_err(op._matmul(x, config=config), want) < tolerance(torch.bfloat16), config


@pytest.mark.gpu
@pytest.mark.parametrize("T", [16, 100, 512])
def test_tiled_prefill_real_shape_on_gpu(T):
    """Every prefill candidate at a real shape against the decode, then the timed choice."""
    from functools import partial

    from thin.runtime.kernels.tuning import compile_launches

    op, dense, _ = make_op("mxfp4", (4096, 4096), dtype=torch.bfloat16)
    x = torch.randn(T, 4096, generator=torch.Generator().manual_seed(9)).bfloat16().to(DEVICE)
    want = x.float() @ dense.to(DEVICE).bfloat16().float().T
    candidates = op.matmul_candidates(T, 4096)
    compile_launches([(DEVICE, partial(op._matmul, x, config=c)) for c in candidates], report=False)
    for config in candidates:
        assert rel_err(op._matmul(x, config=config), want) < tolerance(torch.bfloat16), config
    assert rel_err(op(x), want) < tolerance(torch.bfloat16)


# ---- the bf16-pair arithmetic (pairs.e2m1_word_dot), a candidate under bf16 activations ----------------------

def test_bf16_pairs_match_their_arithmetic_and_the_decode():
    op, dense, _ = make_op("mxfp4", (48, 256), dtype=torch.bfloat16, seed=6)
    assert any(c.packed for c in op.candidates("direct")) and not op.candidates("direct")[0].packed
    check_pairs(op, dense, 1e-5)
    for mode in ("direct", "partial", "glu"):
        op._configs[mode] = next(c for c in op.candidates(mode) if c.packed)
    check_matvec(op, dense, None, torch.bfloat16)
    check_glu(op, dense, None, torch.bfloat16, "silu")


def test_bf16_pairs_only_under_bf16():
    op, _, _ = make_op("mxfp4", (32, 128), dtype=torch.float32)
    assert not any(c.packed for mode in ("direct", "partial", "glu") for c in op.candidates(mode))
    with pytest.raises(ValueError, match="bf16 pairs"):
        op._matvec(torch.randn(128).to(DEVICE), poisoned(32, dtype=torch.float32),
                   replace(op.candidates("direct")[0], packed=True), -1, False)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("inline_asm", [True, False])
def test_bf16_pairs_real_shapes_on_gpu(shape, inline_asm, monkeypatch):
    """The inline PTX (every candidate) and its plain-Triton twin (one tiling) compiled for the GPU."""
    from thin.runtime.kernels import common

    monkeypatch.setattr(common, "INLINE_ASM", inline_asm)
    op, dense, _ = make_op("mxfp4", shape, dtype=torch.bfloat16)
    check_pairs(op, dense, 1e-4, every=inline_asm)  # fma.rn.bf16x2 rounds once, the emulation maybe twice
