"""int3-int6 kernels (one family, bits constexpr) against the format's decode."""

from dataclasses import replace
from functools import partial

import pytest
import torch
from kernel_support import DEVICE, poisoned, rel_err, tolerance
from linear_kernel_cases import (
    PAIRS_TOLERANCE,
    check_all,
    check_glu,
    check_matvec,
    check_pairs,
    make_op,
    pairs_reference,
)

from thin.runtime.ffn import activate

FORMATS = ["int3", "int4", "int5", "int6"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("asymmetric", [0, 1])
def test_matches_decode_float32(fmt, asymmetric):
    check_all(fmt, (96, 256), {"group_size": 64, "asymmetric": asymmetric}, torch.float32, bias=asymmetric == 1)


@pytest.mark.parametrize("fmt", ["int4", "int5"])
def test_matches_decode_bfloat16(fmt):
    check_all(fmt, (64, 128), {"group_size": 32}, torch.bfloat16, activation="gelu_tanh")


def test_rows_not_a_multiple_of_the_block():
    op, dense, _ = make_op("int4", (40, 128), {"group_size": 128})
    check_matvec(op, dense, None, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_real_shapes_on_gpu(fmt, shape):
    assert DEVICE.type == "cuda"
    op, dense, _ = make_op(fmt, shape, {"group_size": 128}, dtype=torch.bfloat16)
    check_matvec(op, dense, None, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4", "int5"])
def test_glu_real_shape_on_gpu(fmt):
    op, dense, _ = make_op(fmt, (28672, 4096), {"group_size": 128}, dtype=torch.bfloat16)
    check_glu(op, dense, None, torch.bfloat16, "silu")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,asymmetric", [("int4", 0), ("int3", 1), ("int6", 0)])
def test_plain_path_on_gpu(fmt, asymmetric, monkeypatch):
    """The path without inline assembly (the interpreter's) compiled for the GPU gives the same."""
    from thin.runtime.kernels import common

    monkeypatch.setattr(common, "INLINE_ASM", False)
    op, dense, _ = make_op(fmt, (4096, 14336), {"group_size": 128, "asymmetric": asymmetric}, dtype=torch.bfloat16)
    op.pairs = False  # the float path's tilings only: the pairs' twin is slow to compile (tested below, one tiling)
    check_matvec(op, dense, None, torch.bfloat16)


# ---- the bf16-pair arithmetic (runtime/kernels/pairs.py), a candidate for symmetric int4 --------------

def pairs_op(shape, group, seed=0):
    """An int4 op under bf16 activations whose matvec modes all run the bf16-pair arithmetic."""
    op, dense, _ = make_op("int4", shape, {"group_size": group}, dtype=torch.bfloat16, seed=seed)
    for mode in ("direct", "partial", "glu"):
        op._configs[mode] = next(c for c in op.candidates(mode) if c.packed)
    return op, dense


@pytest.mark.parametrize("group", [32, 128])
def test_bf16_pairs_match_their_arithmetic_and_the_decode(group):
    op, dense = pairs_op((48, 256), group)
    check_pairs(op, dense, 1e-5)
    check_matvec(op, dense, None, torch.bfloat16)  # the shared check, on the pair configurations


@pytest.mark.parametrize("asymmetric", [0, 1])
def test_several_steps_whole_or_ragged(asymmetric):
    """Pairs (symmetric) and float path, group scales (and offsets) loaded in their step or one step
    ahead, and words two steps ahead (MatvecConfig.ahead), over several loop steps (2 chunks a step), each program's share whole
    (split 1, 2) or ragged (split 3 of 8 chunks: masked steps and side loads), with a partial tile of
    rows (32-row tiles over 48)."""
    from thin.runtime.kernels.common import MatvecConfig

    op, dense, _ = make_op("int4", (48, 256), {"group_size": 32, "asymmetric": asymmetric}, dtype=torch.bfloat16,
                           seed=7)
    x = torch.randn(256, generator=torch.Generator().manual_seed(8)).bfloat16().to(DEVICE)
    want = {False: x.float().cpu() @ dense.T}
    if not asymmetric:
        want[True] = pairs_reference(op, dense, x)
    for packed, expected in want.items():
        for split in (1, 2, 3):
            for ahead in (0, 1, 2):
                op._configs["partial"] = MatvecConfig(32, 64, split, 4, packed=packed, ahead=ahead)
                sums = op.matvec(x, partials=poisoned(8, 48, dtype=torch.float32)).sum(0)
                assert rel_err(sums, expected) < 1e-5, (packed, split, ahead)


def test_bf16_pairs_glu():
    op, dense = pairs_op((64, 128), 64, seed=4)
    check_glu(op, dense, None, torch.bfloat16, "silu")


def test_bf16_pairs_prefixes():
    """Elastic FFN prefixes (the first rows of each half, the first columns) through the pairs."""
    op, dense = pairs_op((512, 384), 32, seed=6)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(384, generator=gen).bfloat16().to(DEVICE)
    h = torch.randn(256, generator=gen).bfloat16().to(DEVICE)
    sums = op.matvec(h, partials=poisoned(8, 512, dtype=torch.float32), cols=256)
    assert rel_err(sums.sum(0), h.float().cpu() @ dense[:, :256].T) < PAIRS_TOLERANCE
    y = (x.float().cpu() @ dense.T).bfloat16()
    got = op.matvec(x, out=poisoned(128, dtype=torch.bfloat16), activation="silu", rows=128)
    assert rel_err(got, activate("silu", y[:128]) * y[256:384]) < 2 * tolerance(torch.bfloat16)


def test_bf16_pairs_only_where_they_apply():
    op, _, _ = make_op("int4", (32, 128), {"group_size": 32}, dtype=torch.bfloat16)
    assert any(c.packed for c in op.candidates("direct")) and not op.candidates("direct")[0].packed
    for fmt, params, dtype in [("int4", {"asymmetric": 1}, torch.bfloat16), ("int5", {}, torch.bfloat16),
                               ("int4", {}, torch.float16), ("int4", {}, torch.float32)]:
        other, _, _ = make_op(fmt, (32, 128), {"group_size": 32, **params}, dtype=dtype)
        assert not any(c.packed for mode in ("direct", "partial", "glu") for c in other.candidates(mode))
        with pytest.raises(ValueError, match="bf16 pairs"):
            other._matvec(torch.randn(128).to(dtype).to(DEVICE), poisoned(32, dtype=dtype),
                          replace(other.candidates("direct")[0], packed=True), -1, False)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("inline_asm", [True, False])
def test_bf16_pairs_real_shapes_on_gpu(shape, inline_asm, monkeypatch):
    """The inline PTX (every candidate) and its plain-Triton twin (the interpreter's path, slow: one
    tiling) compiled for the GPU."""
    from thin.runtime.kernels import common

    monkeypatch.setattr(common, "INLINE_ASM", inline_asm)
    op, dense = pairs_op(shape, 128)
    check_pairs(op, dense, 1e-4, every=inline_asm)  # fma.rn.bf16x2 rounds once, the emulation maybe twice


@pytest.mark.gpu
def test_bf16_pairs_glu_real_shape_on_gpu():
    op, dense = pairs_op((28672, 4096), 128)
    for config in [c for c in op.candidates("glu") if c.packed]:
        op._configs["glu"] = config
        check_glu(op, dense, None, torch.bfloat16, "silu")


def test_partial_candidates_include_one_step_programs(monkeypatch):
    """Split-K candidates of a short reduction (llama's o projection, 4096 x 4096, on 132
    multiprocessors) include one loop step a program where those programs fit 8 a multiprocessor;
    a plain matvec never splits."""
    from thin.runtime.kernels import chunks, common

    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(common, "sm_count", lambda: 132)
    partial = chunks.chunk_candidates(4096, 4096, 32, "partial", 4)
    steps = {(c.block_n, c.chunk, c.split): 4096 // c.chunk // c.split for c in partial}
    assert steps[(8, 2048, 2)] == 1 and steps[(16, 1024, 4)] == 1 and (8, 2048, 1) in steps
    assert all(-(-4096 // c.block_n) * c.split <= 8 * 132 for c in partial if 4096 // c.chunk // c.split == 1)
    assert {c.split for c in chunks.chunk_candidates(6144, 4096, 32, "direct", 4)} == {1}


# ---- the prefill matmul's pipelined tiling (MatmulConfig "tiled") ---------------------------------------

def tiled_configs(group, wide=False):
    """Tilings of the pipelined prefill kernel for the interpreter: several programs along the tokens
    and the rows (the GROUP_M order, partial tiles of both), one or several steps a group, split-K;
    `wide`: a 64 x 128 tile too (16-bit activations only: on a GPU float32's exact dot is unrolled
    multiply-adds, which at that size ptxas spills for minutes)."""
    from thin.runtime.kernels.prefill import MatmulConfig

    steps = [bk for bk in (32, 64, 128) if group % bk == 0]
    return ([MatmulConfig(16, 32, bk, 4, 3) for bk in steps] + [MatmulConfig(64, 128, steps[-1], 4, 3)] * wide
            + [MatmulConfig(16, 32, 32, 4, 3, split=2), MatmulConfig(16, 64, 32, 4, 3, split=4)])  # split-K


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("asymmetric,group", [(0, 128), (1, 64), (0, 32)])
def test_tiled_prefill_matches_decode(fmt, asymmetric, group):
    """Every grouped-int format through the tiled prefill kernel, float32 (exact up to summation order:
    a code in the wrong column fails) and bfloat16, with a bias, and over elastic prefixes."""
    op, dense, b = make_op(fmt, (80, 256), {"group_size": group, "asymmetric": asymmetric}, bias=True, seed=3)
    gen = torch.Generator().manual_seed(4)
    for T in (5, 40):
        x = torch.randn(T, 256, generator=gen).to(DEVICE)
        want = x.cpu() @ dense.T + b.cpu()
        for config in tiled_configs(group):
            got = op._matmul(x, config=config)
            assert got.shape == (T, 80)
            assert rel_err(got, want) < 2e-5, (T, config, rel_err(got, want))
    # Prefixes: the first 32 rows of each half side by side; the first 128 columns (whole, split-K).
    x = torch.randn(7, 256, generator=gen).to(DEVICE)
    halves = torch.cat([dense[:32], dense[40:72]])
    bias = torch.cat([b[:32], b[40:72]]).cpu()
    h = x[:, :128].contiguous()
    for config in (tiled_configs(group)[0], tiled_configs(group)[-1]):
        assert rel_err(op._matmul(x, rows=32, halves=2, config=config), x.cpu() @ halves.T + bias) < 2e-5
        assert rel_err(op._matmul(h, cols=128, config=config), h.cpu() @ dense[:, :128].T + b.cpu()) < 2e-5


@pytest.mark.parametrize("fmt", ["int4", "int6"])
def test_tiled_prefill_bfloat16(fmt):
    op, dense, _ = make_op(fmt, (96, 256), {"group_size": 128}, dtype=torch.bfloat16, seed=5)
    x = torch.randn(21, 256, generator=torch.Generator().manual_seed(6)).bfloat16().to(DEVICE)
    want = x.float().cpu() @ dense.bfloat16().float().T
    configs = tiled_configs(128, wide=True)
    if fmt == "int4":  # the bf16-pair twin: exact products, the scale after the step's sums
        configs += [replace(c, kernel="pairs") for c in configs]
    for config in configs:
        assert rel_err(op._matmul(x, config=config), want) < tolerance(torch.bfloat16), config
    if fmt == "int4":  # ... which only takes symmetric int4 under bf16 activations
        with pytest.raises(ValueError, match="bf16 pairs"):
            op._matmul(x.float(), config=configs[-1])


def test_tiled_prefill_pairs_column_order():
    """The pairs tile's column order: float32 sums of x times the exact codes, scaled per group, match
    to float32 rounding (a code in the wrong column would not)."""
    from thin.runtime.kernels.prefill import MatmulConfig

    op, dense, _ = make_op("int4", (48, 256), {"group_size": 64}, dtype=torch.bfloat16, seed=8)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(9)).bfloat16().to(DEVICE)
    want = x.float().cpu() @ dense.T  # the weights unrounded: the pairs' product is exact before the scale
    swapped = dense.clone()
    swapped[:, [1, 4]] = swapped[:, [4, 1]]  # two codes of one int16 half
    wrong = x.float().cpu() @ swapped.T
    for bk, split in ((32, 1), (64, 1), (32, 2)):
        got = op._launch_matmul(x, 48, 256, 48, 0, MatmulConfig(16, 32, bk, 4, 3, "pairs", split))
        assert rel_err(got, want) < 5e-3 and rel_err(got, wrong) > 2e-2, (bk, split, rel_err(got, want))


def test_prefill_candidates_start_with_the_plain_kernel():
    """The untuned default stays the first kernel; the tiled ones are only ever picked by timing, and
    each takes whole steps of a group (groups of 32: 32-column steps). Float32 activations keep the
    plain kernel alone (their exact dot has no tensor cores to feed)."""
    for group in (32, 128):
        op, _, _ = make_op("int4", (64, 256), {"group_size": group}, dtype=torch.bfloat16)
        candidates = op.matmul_candidates(100, 256)
        assert candidates[0].kernel == "plain" and len(candidates) > 1
        assert all(group % c.block_k == 0 for c in candidates[1:])
    op, _, _ = make_op("int4", (64, 256), {"group_size": 128})
    assert [c.kernel for c in op.matmul_candidates(100, 256)] == ["plain"]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,asymmetric,group", [("int4", 0, 128), ("int4", 1, 32), ("int3", 0, 128),
                                                  ("int5", 1, 64), ("int6", 0, 128)])
@pytest.mark.parametrize("T", [16, 100, 512])
def test_tiled_prefill_real_shapes_on_gpu(fmt, asymmetric, group, T, monkeypatch):
    """Every prefill candidate at a real shape (whatever timing would pick) against the decode."""
    from thin.runtime.kernels.tuning import compile_launches

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    op, dense, _ = make_op(fmt, (4096, 4096), {"group_size": group, "asymmetric": asymmetric},
                           dtype=torch.bfloat16)
    x = torch.randn(T, 4096, generator=torch.Generator().manual_seed(9)).bfloat16().to(DEVICE)
    want = x.float() @ dense.to(DEVICE).bfloat16().float().T
    candidates = op.matmul_candidates(T, 4096)
    compile_launches([(DEVICE, partial(op._matmul, x, config=c)) for c in candidates], report=False)  # threads
    for config in candidates:
        got = op._matmul(x, config=config)
        assert rel_err(got, want) < tolerance(torch.bfloat16), (config, rel_err(got, want))
    assert rel_err(op(x), want) < tolerance(torch.bfloat16)  # the timed choice
