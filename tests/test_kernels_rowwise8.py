"""int8 and fp8_e4m3 (one scale a row) kernels against the formats' decode."""

from dataclasses import replace

import pytest
import torch
from kernel_support import DEVICE, poisoned, rel_err, tolerance
from linear_kernel_cases import check_all, check_glu, check_matvec, make_op

from thin.runtime.ffn import activate


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_decode(fmt, dtype):
    check_all(fmt, (96, 192), dtype=dtype, bias=dtype == torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [256, 208])
def test_fp8_loads_ahead(K, dtype):
    """fp8 with each step's bytes and activations loaded in their step, 1 or 2 steps ahead
    (MatvecConfig.ahead) or through Triton's pipeliner (MatvecConfig.stages), over several 64-column
    steps: K whole steps (256) or not (208, a ragged last step), each program's share whole or ragged
    (split 1, 2, 3), a partial tile of rows (32-row tiles over 48); outputs, split-K partial sums and
    gate/up."""
    from thin.runtime.kernels.common import MatvecConfig

    op, dense, _ = make_op("fp8_e4m3", (48, K), dtype=dtype, seed=7)
    x = torch.randn(K, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE)
    want = x.float().cpu() @ dense.T
    gate, up = want.to(dtype).chunk(2)
    for ahead, stages in ((0, 0), (1, 0), (2, 0), (0, 3)):
        for split in (1, 2, 3):
            op._configs["partial"] = MatvecConfig(32, 64, split, 4, ahead=ahead, stages=stages)
            sums = op.matvec(x, partials=poisoned(8, 48, dtype=torch.float32)).sum(0)
            assert rel_err(sums, want) < 2e-5, (split, ahead, stages)
        op._configs["direct"] = MatvecConfig(32, 64, 1, 4, ahead=ahead, stages=stages)
        assert rel_err(op.matvec(x, out=poisoned(48, dtype=dtype)), want) < tolerance(dtype), (ahead, stages)
        op._configs["glu"] = MatvecConfig(16, 64, 1, 4, ahead=ahead, stages=stages)
        got = op.matvec(x, out=poisoned(24, dtype=dtype), activation="silu")
        assert rel_err(got, activate("silu", gate) * up) < 2 * tolerance(dtype), (ahead, stages)


def test_fp8_loads_ahead_prefixes():
    """Elastic prefixes through the loads ahead: the first columns (whole steps, split-K cut to
    divide them) and the first rows of each half of a [gate; up] weight."""
    from thin.runtime.kernels.common import MatvecConfig

    op, dense, _ = make_op("fp8_e4m3", (128, 384), seed=9)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(384, generator=gen).to(DEVICE)
    h = torch.randn(256, generator=gen).to(DEVICE)
    y = x.cpu() @ dense.T
    for ahead, stages in ((1, 0), (2, 0), (0, 3)):
        op._configs["partial"] = MatvecConfig(16, 64, 3, 4, ahead=ahead, stages=stages)
        sums = op.matvec(h, partials=poisoned(8, 128, dtype=torch.float32), cols=256)
        assert rel_err(sums.sum(0), h.cpu() @ dense[:, :256].T) < 2e-5, (ahead, stages)
        op._configs["glu"] = MatvecConfig(16, 64, 1, 4, ahead=ahead, stages=stages)
        got = op.matvec(x, out=poisoned(16, dtype=torch.float32), activation="silu", rows=16)
        assert rel_err(got, activate("silu", y[:16]) * y[64:80]) < 2 * tolerance(torch.float32), (ahead, stages)


def test_fp8_ahead_candidates_only_with_several_steps(monkeypatch):
    """The tuner gets each fp8 tiling again with loads two steps ahead where a program takes more
    than one step (a one-step program has nothing to load ahead), and the 1- and 2-warp tilings
    pipelined through shared memory where it takes three or more; the default stays the plain one."""
    from thin.runtime.kernels import rowwise8

    monkeypatch.setattr(rowwise8, "interpreting", lambda: False)
    monkeypatch.setattr(rowwise8, "_sms", lambda: 132)
    for shape, mode in [((6144, 4096), "direct"), ((4096, 4096), "partial"), ((4096, 14336), "partial"),
                        ((28672, 4096), "glu"), ((2048, 1024), "direct")]:
        op, _, _ = make_op("fp8_e4m3", (64, shape[1]), seed=1)
        op.out_features = shape[0]  # candidates depend on the shape only
        configs = op.candidates(mode)
        plain = [c for c in configs if not c.ahead and not c.stages]
        assert configs[0] == plain[0] and not any(c.ahead and c.stages for c in configs)
        ahead = [c for c in configs if c.ahead]
        staged = [c for c in configs if c.stages]
        steps = {c: rowwise8.fp8_steps(shape[1], c) for c in plain}
        assert ahead == [replace(c, ahead=2) for c in plain if steps[c] > 1]
        assert staged == [replace(c, stages=3) for c in plain if c.num_warps <= 2 and steps[c] >= 3]
        # 1024 columns: the 4-warp tilings (1024 columns a step) take one step, the 2-warp ones two.
        assert len(ahead) == len(plain) - (2 if shape[1] == 1024 else 0)
        assert len(staged) == sum(c.num_warps <= 2 for c in plain) - (3 if shape[1] == 1024 else 0)
    assert rowwise8.fp8_steps(4096, rowwise8.MatvecConfig(4, 1024, 4, 4)) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336)])
def test_real_shapes_on_gpu(fmt, shape):
    op, dense, _ = make_op(fmt, shape, dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_glu_real_shape_on_gpu(fmt):
    op, dense, _ = make_op(fmt, (28672, 4096), dtype=torch.bfloat16)
    check_glu(op, dense, None, torch.bfloat16, "silu")


@pytest.mark.gpu
def test_plain_path_on_gpu(monkeypatch):
    """int8 without inline assembly (the interpreter's path) compiled for the GPU gives the same."""
    from thin.runtime.kernels import common

    monkeypatch.setattr(common, "INLINE_ASM", False)
    op, dense, _ = make_op("int8", (6144, 4096), dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("inline_asm", [True, False])
def test_fp8_loads_ahead_real_shapes_on_gpu(inline_asm, monkeypatch):
    """The look-ahead candidates at llama-8b shapes (registers: the inline PTX conversion and its
    plain-Triton twin, the interpreter's path; shared memory: Triton's pipeliner) on the GPU."""
    from thin.runtime.kernels import common

    monkeypatch.setattr(common, "INLINE_ASM", inline_asm)
    for shape in [(6144, 4096), (4096, 14336)]:
        op, dense, _ = make_op("fp8_e4m3", shape, dtype=torch.bfloat16)
        for kind in ("ahead", "stages"):
            for mode in ("direct", "partial"):
                op._configs[mode] = next(c for c in op.candidates(mode) if getattr(c, kind))
            check_matvec(op, dense, None, torch.bfloat16)
    op, dense, _ = make_op("fp8_e4m3", (28672, 4096), dtype=torch.bfloat16)
    for kind in ("ahead", "stages"):
        op._configs["glu"] = next(c for c in op.candidates("glu") if getattr(c, kind))
        check_glu(op, dense, None, torch.bfloat16, "silu")


def _finish_case(fmt, shape, config, *, bias, post, dtype=torch.bfloat16, seed=11):
    """(finishing matvec's (residual, normed), separate partials + add_rmsnorm's, counter after) of one case."""
    from thin.runtime.kernels.norm import Finish, add_rmsnorm

    op, _, b = make_op(fmt, shape, dtype=dtype, bias=bias, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(shape[1], generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(shape[0], generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.2 * torch.randn(shape[0], generator=gen)).to(DEVICE)
    post_norm = (weight.flip(0).contiguous(), 1e-5) if post else None
    norm = (weight, 1e-6)
    op._configs["partial"] = config
    want_res, want_out = residual.clone(), poisoned(shape[0], dtype=dtype)
    parts = op.matvec(x, partials=poisoned(8, shape[0], dtype=torch.float32))
    add_rmsnorm(want_res, want_out, partials=parts, bias=b, post=post_norm, norm=norm)
    op.finish_config = config
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got_res, got_out = residual.clone(), poisoned(shape[0], dtype=dtype)
    op.matvec_finish(x, poisoned(8, shape[0], dtype=torch.float32), Finish(counter, got_res, got_out, b, post_norm, norm))
    return (got_res, got_out), (want_res, want_out), counter


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(("bias", "post"), [(False, False), (True, True)])
def test_finishing_matvec_is_add_rmsnorm(fmt, bias, post):
    """A split-K matvec whose last program adds its partial sums into the residual and norms it
    (matvec_finish) gives what its partial sums then add_rmsnorm give, bit for bit (the interpreter: the
    same row function), for 1-3 splits and several programs a split, and leaves the counter zero."""
    from thin.runtime.kernels.common import MatvecConfig

    chunk = 64 if fmt == "fp8_e4m3" else 32
    for split in (1, 2, 3):
        config = MatvecConfig(32, chunk, split, 4)
        got, want, counter = _finish_case(fmt, (96, 192), config, bias=bias, post=post)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), split
        assert int(counter) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_finishing_matvec_real_shapes_on_gpu(fmt):
    """At llama-8b's o and down shapes, every finishing candidate, twice in a row (the counter back to
    zero): the residual as the separate launches leave it, the normed row up to the sum's order."""
    for shape in [(4096, 4096), (4096, 14336)]:
        op, _, _ = make_op(fmt, shape, dtype=torch.bfloat16)
        candidates = op.finish_candidates(8)
        assert candidates and all(c.num_warps >= 4 for c in candidates)
        for config in candidates:
            for _ in range(2):
                got, want, counter = _finish_case(fmt, shape, config, bias=True, post=False)
                assert torch.equal(got[0], want[0]), config
                assert rel_err(got[1], want[1]) < 1e-2 and int(counter) == 0, config
