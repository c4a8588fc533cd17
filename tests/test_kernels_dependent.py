"""Programmatic dependent launch (runtime/kernels/dependent.py): the matvecs' reordered code (weights
loaded before the wait, the words carried a step ahead) gives the plain launch's very outputs. Under
the interpreter the level is 1 (the code without the grid-dependency instructions); on a GPU 2."""

import pytest
import torch
from kernel_support import DEVICE, HAS_CUDA, poisoned
from linear_kernel_cases import make_op


def test_level_follows_the_block():
    from thin.runtime.kernels.dependent import launch_args, launching, level

    assert level() == 0 and launch_args(level()) == {}
    with launching(True):
        on = level()
        with launching(False):
            assert level() == 0
        assert level() == on
    assert level() == 0
    assert on == (2 if HAS_CUDA else 1)
    assert launch_args(2) == {"launch_pdl": True} and launch_args(1) == {}


def _same_both_ways(op, x, configs, n, dtype):
    from thin.runtime.kernels.dependent import launching

    for config in configs:
        for mode, shape in (("partial", (8, n)), ("direct", (n,)), ("glu", (n // 2,))):
            op._configs[mode] = config
            outs = []
            for on in (False, True):
                with launching(on):
                    out = poisoned(*shape, dtype=torch.float32 if mode == "partial" else dtype)
                    if mode == "partial":
                        got = op.matvec(x, partials=out)
                    elif mode == "glu":
                        got = op.matvec(x, out=out, activation="silu")
                    else:
                        got = op.matvec(x, out=out)
                    outs.append(got.clone())
            assert torch.equal(outs[0], outs[1]), (config, mode)


@pytest.mark.parametrize("asymmetric", [0, 1])
def test_grouped_int_dependent_matvec_equals_plain(asymmetric):
    """int4 over several steps (2 chunks a step) in ragged shares (split 3 of 8 chunks: masked steps),
    groups' sides and words loaded in their step or ahead, bf16 pairs and the float path."""
    from thin.runtime.kernels.common import MatvecConfig

    op, _, _ = make_op("int4", (48, 256), {"group_size": 32, "asymmetric": asymmetric}, dtype=torch.bfloat16, seed=3)
    x = torch.randn(256, generator=torch.Generator().manual_seed(4)).bfloat16().to(DEVICE)
    configs = [MatvecConfig(32, 64, split, 4, packed=packed, ahead=ahead) for packed in (False, True)[:2 - asymmetric]
               for split in (3,) for ahead in (0, 1, 2)]
    _same_both_ways(op, x, configs, 48, torch.bfloat16)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_rowwise8_dependent_matvec_equals_plain(fmt):
    """fp8 loaded ahead (1, 2 steps), pipelined and plain, its first weights before the wait; int8 over
    several steps (32 columns a step), its words one step ahead."""
    from thin.runtime.kernels.common import MatvecConfig

    op, _, _ = make_op(fmt, (48, 256), dtype=torch.bfloat16, seed=5)
    x = torch.randn(256, generator=torch.Generator().manual_seed(6)).bfloat16().to(DEVICE)
    kinds = ((0, 0), (1, 0), (2, 0), (0, 3)) if fmt == "fp8_e4m3" else ((0, 0),)
    configs = [MatvecConfig(32, 64 if fmt == "fp8_e4m3" else 32, split, 4, ahead=ahead, stages=stages)
               for ahead, stages in kinds for split in (1, 3)]
    _same_both_ways(op, x, configs, 48, torch.bfloat16)
