"""The residual norm folded into the next matvec (kernels/fold.py): a producer matvec adds its rows into the
residual and their sum of squares into a slot; a consumer matvec norms the residual where it loads it. Against
the separate launches (partial sums + add_rmsnorm, then the plain matvec) under the interpreter."""

from dataclasses import replace

import pytest
import torch
from kernel_support import DEVICE, poisoned
from linear_kernel_cases import make_op

from thin.runtime.kernels.common import ACTIVATION_CODES, MatvecConfig

# (format, weight params, configurations: split-K 1) of the grouped-int and rowwise8 matvecs.
INT4 = {"group_size": 32}
CASES = [
    ("int4", INT4, [MatvecConfig(32, 64, 1, 4), MatvecConfig(32, 64, 1, 4, packed=True),
                    MatvecConfig(32, 64, 1, 4, packed=True, ahead=1), MatvecConfig(16, 64, 1, 4, packed=True, ahead=2)]),
    ("int3", {"group_size": 32, "asymmetric": 1}, [MatvecConfig(32, 64, 1, 4)]),
    ("int5", {"group_size": 32, "asymmetric": 1}, [MatvecConfig(32, 64, 1, 4)]),
    ("fp8_e4m3", None, [MatvecConfig(32, 64, 1, 4), MatvecConfig(32, 64, 1, 4, ahead=2)]),
    ("int8", None, [MatvecConfig(32, 32, 1, 4)]),
]
H = 96  # the residual's length: three 32-column chunks (ragged for every step size above)


def _state(seed=3, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    residual = torch.randn(H, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.2 * torch.randn(H, generator=gen)).to(DEVICE)
    return residual, (weight, 1e-6)


@pytest.mark.parametrize(("fmt", "params", "configs"), CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_accumulating_matvec_is_the_residual_add(fmt, params, configs, bias):
    """residual += x @ W.T + bias bit for bit as partial sums then add_rmsnorm; the slot gains the new
    residual's sum of squares (added to what it held), the next slot is zeroed, nothing else written."""
    from thin.runtime.kernels.fold import Accumulate
    from thin.runtime.kernels.norm import add_rmsnorm

    op, _, b = make_op(fmt, (H, 256), params, dtype=torch.bfloat16, bias=bias, seed=5)
    x = torch.randn(256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEVICE)
    for config in configs:
        residual, norm = _state()
        want_res = residual.clone()
        parts = poisoned(1, H, dtype=torch.float32)
        op._matvec(x, parts, config, -1, True)
        add_rmsnorm(want_res, poisoned(H, dtype=torch.bfloat16), partials=parts, bias=b, norm=norm)
        slots = torch.tensor([2.5, 7.0, 9.0], device=DEVICE)
        op._matvec(x, residual, config, -1, False, accumulate=Accumulate(residual, slots[0:1], slots[1:2]))
        assert torch.equal(residual, want_res), config
        ss = float(want_res.float().pow(2).sum())
        assert slots[0].item() == pytest.approx(2.5 + ss, rel=1e-5), config
        assert slots[1].item() == 0.0 and slots[2].item() == 9.0, config


@pytest.mark.parametrize(("fmt", "params", "configs"), CASES)
@pytest.mark.parametrize("glu", [False, True])
def test_normed_input_matvec_is_norm_then_matvec(fmt, params, configs, glu):
    """The consumer's output (plain rows, or act(gate) * up) equals the plain matvec of add_rmsnorm's output,
    bit for bit: a residual of eighths, whose float32 sum of squares is exact in any order, so the consumer's
    scale (from the slot) is add_rmsnorm's."""
    from thin.runtime.kernels.fold import NormedInput
    from thin.runtime.kernels.norm import add_rmsnorm

    rows = 64
    op, _, _ = make_op(fmt, (2 * rows if glu else rows, H), params, dtype=torch.bfloat16, bias=True, seed=7)
    gen = torch.Generator().manual_seed(8)
    residual = (torch.randint(-24, 25, (H,), generator=gen) / 8).to(torch.bfloat16).to(DEVICE)
    _, norm = _state(seed=8)
    x = poisoned(H, dtype=torch.bfloat16)
    add_rmsnorm(residual.clone(), x, norm=norm)
    ss = residual.float().pow(2).sum().reshape(1)
    act = ACTIVATION_CODES["silu"] if glu else -1
    for config in configs:
        config = replace(config, block_n=config.block_n // 2) if glu else config
        want, got = poisoned(rows, dtype=torch.bfloat16), poisoned(rows, dtype=torch.bfloat16)
        op._matvec(x, want, config, act, False)
        op._matvec(residual, got, config, act, False, normed=NormedInput(residual, ss.clone(), norm))
        assert torch.equal(got, want), config


def test_folding_methods_and_bad_configs():
    """matvec_accumulate / matvec_normed (the engine's calls) with the modes' own configurations; a split-K or
    gate/up configuration cannot accumulate."""
    from thin.runtime.kernels.fold import Accumulate, NormedInput, reference

    op, dense, b = make_op("fp8_e4m3", (H, 128), dtype=torch.bfloat16, bias=True, seed=9)
    x = torch.randn(128, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16).to(DEVICE)
    residual, norm = _state(seed=11)
    want_res, want_x, ss = reference(residual, x.float() @ dense.T.to(DEVICE), b, norm)
    slots = torch.zeros(3, device=DEVICE)
    op.matvec_accumulate(x, Accumulate(residual, slots[1:2], slots[2:3]))
    assert (residual.float() - want_res.float()).abs().max() <= want_res.float().abs().max() * 2 ** -6
    assert slots[1].item() == pytest.approx(ss, rel=1e-2)
    consumer, dense2, _ = make_op("int4", (64, H), INT4, dtype=torch.bfloat16, seed=12)
    got = consumer.matvec_normed(NormedInput(residual, slots[1:2], norm), poisoned(64, dtype=torch.bfloat16))
    want = want_x.float() @ dense2.T.to(DEVICE)
    assert torch.nn.functional.cosine_similarity(got.float(), want, dim=0) > 0.999
    with pytest.raises(ValueError, match="split-K 1"):
        op._matvec(x, residual, MatvecConfig(32, 64, 2, 4), -1, False, accumulate=Accumulate(residual, slots[0:1],
                                                                                            slots[1:2]))
    with pytest.raises(ValueError, match="float32 norm weight"):
        consumer.matvec_normed(NormedInput(residual, slots[1:2], (norm[0].half(), 1e-6)),
                               poisoned(64, dtype=torch.bfloat16))


def test_slot_plan_never_gives_a_producer_its_own_next():
    """Around the cycle of a step's producers, each one's next slot is the following producer's own and differs
    from its own; fewer than two producers cannot rotate."""
    from thin.runtime.kernels.fold import slot_plan

    assert slot_plan(0) == slot_plan(1) == []
    for m in range(2, 9):
        plan = slot_plan(m)
        assert len(plan) == m and {s for s, _ in plan} <= {0, 1, 2}
        for j, (slot, following) in enumerate(plan):
            assert following == plan[(j + 1) % m][0] != slot


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int4"])
def test_folding_candidates_at_llama_shapes_on_gpu(fmt):
    """A candidate of each kind (arithmetic, loads ahead, pipelined) accumulating at llama-8b's o shape (residual
    bit for bit, slot sum close), and of each kind of the direct and gate/up candidates with a normed input over
    a 4096 residual (bit for bit as add_rmsnorm then the plain matvec): the GPU's own conversions and the
    inline-asm pair packing."""
    from thin.runtime.kernels.fold import Accumulate, NormedInput
    from thin.runtime.kernels.norm import add_rmsnorm

    params = {"group_size": 128} if fmt == "int4" else None
    n = 4096
    op, _, _ = make_op(fmt, (n, n), params, dtype=torch.bfloat16, seed=13)
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEVICE)
    start = (torch.randint(-24, 25, (n,), generator=gen) / 8).to(torch.bfloat16).to(DEVICE)
    norm = ((1 + 0.2 * torch.randn(n, generator=gen)).to(DEVICE), 1e-5)
    for config in _kinds(op.candidates("direct")):
        want = start.clone()
        parts = poisoned(1, n, dtype=torch.float32)
        op._matvec(x, parts, config, -1, True)
        add_rmsnorm(want, poisoned(n, dtype=torch.bfloat16), partials=parts, norm=norm)
        got, slots = start.clone(), torch.zeros(3, device=DEVICE)
        op._matvec(x, got, config, -1, False, accumulate=Accumulate(got, slots[0:1], slots[1:2]))
        assert torch.equal(got, want), config
        assert slots[0].item() == pytest.approx(float(want.float().pow(2).sum()), rel=1e-4), config
    normed = poisoned(n, dtype=torch.bfloat16)
    add_rmsnorm(start.clone(), normed, norm=norm)
    ss = start.float().pow(2).sum().reshape(1)
    glu, _, _ = make_op(fmt, (2 * 2048, n), params, dtype=torch.bfloat16, seed=15)
    for weight, mode, act, rows in ((op, "direct", -1, n), (glu, "glu", ACTIVATION_CODES["silu"], 2048)):
        for config in _kinds(weight.candidates(mode)):
            want, got = poisoned(rows, dtype=torch.bfloat16), poisoned(rows, dtype=torch.bfloat16)
            weight._matvec(normed, want, config, act, False)
            weight._matvec(start, got, config, act, False, normed=NormedInput(start, ss.clone(), norm))
            assert torch.equal(got, want), (mode, config)


def _kinds(candidates):
    """The first candidate of each kind (packed, ahead, stages)."""
    return list({(c.packed, c.ahead, c.stages): c for c in reversed(candidates)}.values())
