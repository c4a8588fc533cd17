"""q1 kernels against the format's decode."""

import pytest
import torch
from kernel_support import DEVICE, rel_err, tolerance
from linear_kernel_cases import check_all, check_matvec, make_op


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_matches_decode(group_size):
    check_all("q1", (96, 256), {"group_size": group_size}, torch.float32, bias=group_size == 32)


def test_matches_decode_bfloat16():
    check_all("q1", (64, 128), dtype=torch.bfloat16)


@pytest.mark.gpu
def test_real_shape_on_gpu():
    op, dense, _ = make_op("q1", (4096, 14336), dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)


@pytest.mark.gpu
def test_plain_path_on_gpu(monkeypatch):
    """Without inline assembly (the interpreter's path), compiled for the GPU."""
    from thin.runtime.kernels import common

    monkeypatch.setattr(common, "INLINE_ASM", False)
    op, dense, _ = make_op("q1", (4096, 14336), dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)


@pytest.mark.parametrize("group_size", [32, 128])
def test_tiled_prefill_matches_decode(group_size):
    """The pipelined prefill kernel (MatmulConfig "tiled"): float32 exact up to summation order (a sign
    in the wrong column fails), several programs both ways, one or several words a step (groups of 32:
    a step per word), a bias, prefixes; bfloat16 against the weight rounded to bf16. The plain kernel
    stays the untuned default, float32's only one."""
    from thin.runtime.kernels.prefill import MatmulConfig

    configs = [MatmulConfig(16, 32, 32, 4, 3), MatmulConfig(16, 32, 64, 4, 3), MatmulConfig(32, 64, 128, 4, 3)]
    op, dense, b = make_op("q1", (80, 256), {"group_size": group_size}, bias=True, seed=3)
    assert [c.kernel for c in op.matmul_candidates(40, 256)] == ["plain"]
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
    op, dense, _ = make_op("q1", (96, 256), {"group_size": group_size}, dtype=torch.bfloat16, seed=5)
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

    op, dense, _ = make_op("q1", (4096, 4096), dtype=torch.bfloat16)
    x = torch.randn(T, 4096, generator=torch.Generator().manual_seed(9)).bfloat16().to(DEVICE)
    want = x.float() @ dense.to(DEVICE).bfloat16().float().T
    candidates = op.matmul_candidates(T, 4096)
    compile_launches([(DEVICE, partial(op._matmul, x, config=c)) for c in candidates], report=False)
    for config in candidates:
        assert rel_err(op._matmul(x, config=config), want) < tolerance(torch.bfloat16), config
    assert rel_err(op(x), want) < tolerance(torch.bfloat16)
