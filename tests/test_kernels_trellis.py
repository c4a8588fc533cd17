"""trellis kernels (runtime/kernels/trellis.py): the contract's torch decode against the format's, the
matvec / gate-up / prefill matmul against the format's decode, and the mixture-of-experts decode kernels
on trellis experts against the executor's torch path; on the CPU through Triton's interpreter at tiny
shapes (random code bytes: every state of the codebook is reached), real shapes behind `gpu`."""

from __future__ import annotations

import pytest
import torch
from kernel_support import DEVICE, poisoned, rel_err, tolerance
from linear_kernel_cases import check_all, check_glu, check_matmul, check_matvec

from thin.ir import formats


def _random_parts(n: int, k: int, bits: int, seed: int, scale: float = 1.0):
    """(codes uint8 [n, k * bits / 8], row_scale float16 [n]) of random bytes (no zero rows)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k * bits // 8), generator=gen, dtype=torch.uint8)
    return codes, (scale * (0.5 + torch.rand(n, generator=gen))).half()


def _decode(codes, row_scale, shape, bits: int):
    """The weight (float32) that trellis parts stand for: the format's own decode, the kernels' reference."""
    fmt = formats.get("trellis")
    params = fmt.normalize({"bits": bits})
    return fmt.decode(fmt.join({"codes": codes, "row_scale": row_scale}, tuple(shape), params), tuple(shape), params,
                      torch.float32)


def _random_op(shape, bits: int, seed: int, *, dtype=torch.float32, bias=False, scale: float = 1.0):
    """(the trellis kernel family's op, its dense weight float32, bias) for random code bytes and row scales
    (the format's encoder is slow; random codes reach every state of the codebook)."""
    from linear_kernel_cases import kernel_factory

    from thin.ir import Encoding, Tensor

    fmt, params = formats.get("trellis"), formats.get("trellis").normalize({"bits": bits})
    codes, row_scale = _random_parts(*shape, bits, seed, scale)
    raw = fmt.join({"codes": codes, "row_scale": row_scale}, tuple(shape), params)
    record = Tensor("layers.0.mlp.experts.0.w", "moe.expert.up", 0, tuple(shape), Encoding("trellis", params), "f32")
    b = (0.1 * torch.randn(shape[0], generator=torch.Generator().manual_seed(seed))).to(dtype).to(DEVICE) \
        if bias else None
    op = kernel_factory("trellis")(record, raw, b, DEVICE, dtype)
    assert op is not None
    return op, fmt.decode(raw, tuple(shape), params, torch.float32), b


@pytest.mark.parametrize("bits", [2, 3])
def test_matvec_on_random_codes(bits):
    """The decode's dot product (trellis.rows_dot, in the matvec kernel) on random code bytes, every state
    reached: rows and 16-column blocks the tiles do not divide (48 rows in tiles of 32, 7 blocks in steps
    of 4), a column prefix (the first 4 blocks), and gate/up with its activation over the two halves."""
    from thin.runtime.ffn import activate
    from thin.runtime.kernels.trellis import _matvec_kernel

    n, k = 48, 112
    codes, scale = _random_parts(n, k, bits, seed=10 + bits)
    w = _decode(codes, scale, (n, k), bits)
    x = torch.randn(k, generator=torch.Generator().manual_seed(3))
    codes, scale, xd = codes.to(DEVICE), scale.to(DEVICE), x.to(DEVICE)
    for cols in (k, 64):
        out = poisoned(n, dtype=torch.float32)
        _matvec_kernel[(2,)](codes, scale, xd, xd, out, n, k, cols, BITS=bits, NG=4, BN=32, ACT=-1, HAS_BIAS=False,
                             PARTIAL=False, DP4A=False)
        assert rel_err(out, w[:, :cols] @ x[:cols]) < 2e-6
    out = poisoned(n // 2, dtype=torch.float32)
    _matvec_kernel[(2,)](codes, scale, xd, xd, out, n // 2, k, k, BITS=bits, NG=4, BN=16, ACT=0, HAS_BIAS=False,
                         PARTIAL=False, DP4A=False)
    gate, up = (w @ x).chunk(2)
    assert rel_err(out, activate("silu", gate) * up) < 2e-6


def test_matches_the_encoders_bytes():
    """Matvec (split-K of one), gate/up with its activation and the prefill matmul on bytes the format's
    encoder wrote, against its decode."""
    check_all("trellis", (64, 48), {"bits": 2}, torch.float32, bias=True)


@pytest.mark.parametrize("bits", [2, 3])
def test_matches_decode(bits):
    """The same on random codes: 96 x 80 (6 bands of 16 rows, 5 blocks of 16 columns), the prefill matmul
    with each of its tilings (80 columns: steps of 16)."""
    op, dense, b = _random_op((96, 80), bits, seed=bits, bias=bits == 3)
    check_matvec(op, dense, b, torch.float32)
    check_glu(op, dense, b, torch.float32, "silu")
    check_matmul(op, dense, b, torch.float32)
    op, dense, b = _random_op((48, 128), bits, seed=bits, bias=True)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(bits)).to(DEVICE)
    configs = op.matmul_candidates(5, 128)
    assert len({c.block_k for c in configs}) == 2
    for config in configs:
        got = op._matmul(x, config=config)
        assert rel_err(got, x.cpu() @ dense.T + b.cpu()) < tolerance(torch.float32), config


def test_matches_decode_bfloat16():
    op, dense, b = _random_op((64, 128), 3, seed=4, dtype=torch.bfloat16)
    check_matvec(op, dense, b, torch.bfloat16)
    check_glu(op, dense, b, torch.bfloat16, "gelu_tanh")
    check_matmul(op, dense, b, torch.bfloat16)


def test_prefixes_read_in_place():
    """An elastic prefix: the first rows of each gate/up half and the first columns, decode and prefill."""
    op, dense, _ = _random_op((128, 64), 2, seed=5)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want = x.cpu() @ torch.cat([dense[:32, :48], dense[64:96, :48]]).T
    assert rel_err(op.prefix(x, rows=32, cols=48, halves=2), want) < tolerance(torch.float32)
    assert rel_err(op.prefix(x[:1], rows=48, cols=48), x[:1].cpu() @ dense[:48, :48].T) < tolerance(torch.float32)


def test_shapes_the_tiles_cannot_take_fall_back():
    """A weight of rows or columns that are not whole 16 x 16 tiles is not the kernel family's."""
    from thin.ir import Encoding, Tensor
    from thin.runtime.kernels.trellis import make

    record = Tensor("w", "moe.expert.up", 0, (40, 64), Encoding("trellis", (("bits", 2),)), "f32")
    assert make(record, torch.zeros(8, dtype=torch.uint8), None, DEVICE, torch.float32) is None


# ---- the mixture-of-experts decode kernels on trellis experts -------------------------------------------

def _moe_plan(bits_of, *, top_k=2, fused=True, bias=False, clamp=False, seed=0, hidden=64, inter=48,
              down_fmts=None, dtype=torch.float32):
    """A MoEPlan whose expert e's gate/up (and down, unless down_fmts[e] names another (format, params))
    are trellis of bits_of[e] bits (random code bytes)."""
    from thin.ir import Encoding, Tensor
    from thin.runtime.ffn import MLPPlan, MoEPlan
    from thin.runtime.linear import make_linear

    gen = torch.Generator().manual_seed(seed)

    def op(fmt, params, shape):
        """Trellis of random code bytes and row scales ~0.3, another format encoded from a random weight."""
        params = formats.get(fmt).normalize(params)
        record = Tensor("layers.0.mlp.experts.0.w", "moe.expert.up", 0, tuple(shape), Encoding(fmt, params), "f32")
        if fmt == "trellis":
            codes, row_scale = _random_parts(*shape, dict(params)["bits"], int(torch.randint(1 << 30, (1,),
                                                                                          generator=gen)), 0.3)
            raw = formats.get(fmt).join({"codes": codes, "row_scale": row_scale}, tuple(shape), params)
        else:
            raw = formats.encode(fmt, 0.3 * torch.randn(*shape, generator=gen), params)
        b = (0.1 * torch.randn(shape[0], generator=gen)).to(dtype).to(DEVICE) if bias else None
        return make_linear(record, raw, b, DEVICE, dtype)

    experts = []
    for e, bits in enumerate(bits_of):
        p = {"bits": bits}
        up = [op("trellis", p, (2 * inter, hidden))] if fused else [op("trellis", p, (inter, hidden)) for _ in "gu"]
        down = op(*(down_fmts[e] if down_fmts else ("trellis", p)), (hidden, inter))
        extra = dict(alpha=1.702, limit=1.5, up_offset=1.0) if clamp else {}
        experts.append(MLPPlan("silu", True, up, down, **extra))
    router = torch.randn(len(bits_of), hidden, generator=gen).to(DEVICE)
    rbias = (0.5 * torch.randn(len(bits_of), generator=gen)).to(DEVICE) if clamp else None
    return MoEPlan(top_k, True, "softmax", router, rbias, experts, None, None)


def _check_moe(plan, dtype=torch.float32, tol=None, trials=3):
    """Every gate/up and down tiling the tuner picks from (the whole row a step and the prefetching one
    under the interpreter; on a GPU every candidate), each on its own tokens: the k weighted expert
    outputs against the executor's torch path (ffn.run_moe), the routing torch's top-k."""
    from thin.runtime.ffn import run_moe
    from thin.runtime.kernels.experts import MoEKernels

    kernels = MoEKernels(plan, DEVICE, dtype, tune=False)
    gen = torch.Generator().manual_seed(1)
    tilings = {(i, kind): kernels.candidates(g, kind) for kind in ("gate_up", "down")
               for i, g in enumerate(kernels.groups(kind))}
    for trial in range(max(trials, *map(len, tilings.values()))):
        for key, options in tilings.items():
            kernels._configs[key] = options[trial % len(options)]
        x = torch.randn(kernels.hidden, generator=gen).to(dtype).to(DEVICE)
        got = kernels(x, poisoned(kernels.top_k + 1, kernels.hidden, dtype=torch.float32))
        want = run_moe(x[None], plan)[0].float()
        assert rel_err(got.sum(0), want) < (tol or 4 * tolerance(dtype)), f"{trial}: {rel_err(got.sum(0), want)}"
        probs = torch.softmax(torch.nn.functional.linear(x.float(), plan.router_weight, plan.router_bias), -1)
        assert kernels.chosen.tolist() == torch.topk(probs, plan.top_k).indices.tolist()


@pytest.mark.parametrize("bits", [2, 3])
def test_trellis_experts_match_the_torch_path(bits):
    _check_moe(_moe_plan([bits] * 4, seed=bits))


def test_trellis_experts_clamped_swiglu_separate_gate_up_and_biases():
    """GPT-OSS's clamped SwiGLU with biases and a router bias; gate and up as two weights; rows and
    blocks the tiles do not divide (inter 80: 5 blocks of 16)."""
    _check_moe(_moe_plan([2, 3, 2], fused=False, bias=True, clamp=True, inter=80, seed=5))


def test_trellis_experts_every_gpu_tiling_at_small_shapes(monkeypatch):
    """Every tiling a GPU times (expert_tiles.trellis_candidates, 32 blocks of 16 columns a warp, the
    prefetching ones included; under the interpreter too) on the tiny GPT-OSS's expert shapes, rows of
    4 blocks (gate/up, hidden 64) and 2 (down, expert FFN 32): most lanes masked, the prefetch's first
    step the last; the clamped SwiGLU with biases, k = 2 and 3 gate/up groups. On a GPU with dp4a."""
    from thin.runtime.kernels import expert_tiles

    monkeypatch.setattr(expert_tiles, "interpreting", lambda: False)
    plan = _moe_plan([2, 3, 3, 2], bias=True, clamp=True, hidden=64, inter=32, seed=21)
    _check_moe(plan)


def test_trellis_experts_beside_other_formats():
    """Routing-aware bits: k = 2 and k = 3 gate/up groups, and downs in trellis, int4 and q2, one launch a
    format, each writing only its experts' slots; under bf16 activations."""
    from thin.runtime.kernels.experts import MoEKernels

    downs = [("trellis", {"bits": 2}), ("int4", {"group_size": 32}), ("trellis", {"bits": 3}),
             ("q2", {"group_size": 16}), ("trellis", {"bits": 2})]
    plan = _moe_plan([2, 2, 3, 3, 2], top_k=3, down_fmts=downs, inter=64, seed=7, dtype=torch.bfloat16)
    kernels = MoEKernels(plan, DEVICE, torch.bfloat16, tune=False)
    assert (len(kernels.groups("gate_up")), len(kernels.groups("down"))) == (2, 4)
    _check_moe(plan, dtype=torch.bfloat16)


def _check_finishing(kernels, seed: int) -> list:
    """Every finishing down tiling of `kernels` (expert_finish.candidates): its rows, residual and normed bit
    for bit those of the plain down launch then add_rmsnorm, twice in a row, the counter back at zero.
    Returns the tilings."""
    from test_kernels_expert_finish import _both

    from thin.runtime.kernels import expert_finish

    gen = torch.Generator().manual_seed(seed)
    kernels(torch.randn(kernels.hidden, generator=gen).to(kernels.dtype).to(DEVICE),
            poisoned(kernels.top_k, kernels.hidden, dtype=torch.float32))
    residual = torch.randn(kernels.hidden, generator=gen).to(kernels.dtype).to(DEVICE)
    norm = ((1 + 0.2 * torch.randn(kernels.hidden, generator=gen)).to(DEVICE), 1e-6)
    configs = expert_finish.candidates(kernels)
    assert configs
    for config in configs:
        got, want, counter = _both(kernels, residual, None, norm, config, 2)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), config
        assert int(counter) == 0
    return configs


def test_trellis_expert_downs_finish_the_residual_norm():
    """A trellis down launch whose last program also runs the residual norm after the layer
    (expert_finish.py), every tiling that may."""
    from thin.runtime.kernels.experts import MoEKernels

    _check_finishing(MoEKernels(_moe_plan([3] * 5, seed=9, dtype=torch.bfloat16), DEVICE, torch.bfloat16,
                                tune=False), seed=2)


# ---- the decode engine on a model whose routed experts are trellis --------------------------------------

def test_engine_on_trellis_experts_matches_the_executor(tmp_path):
    """A tiny random GPT-OSS (expert and router biases, the clamped SwiGLU, sinks) whose routed experts'
    gate/up and down are replaced by trellis weights of random code bytes (k = 2 in even layers, 3 in odd
    ones; row scales the replaced weights' row rms): the engine's decode (its expert kernels reading the
    trellis bytes) gives the executor's greedy tokens (its torch path decoding them) and its logits."""
    from thin.compiler import compile_model
    from thin.ir import Encoding, Tensor
    from thin.runtime import generate, load
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.ffn import MoEPlan
    from thin.runtime.generate import engine_generate
    from thin.runtime.linear import make_linear
    from thin.runtime.sampling import GenerationOptions

    from hf_tiny import make_checkpoint

    make_checkpoint("gpt_oss", tmp_path / "src")
    model = load(compile_model(tmp_path / "src", tmp_path / "m.thin"), device=DEVICE.type)
    ex = model.executor
    fmt = formats.get("trellis")
    gen = torch.Generator().manual_seed(0)

    def trellis_op(op, bits):
        shape = (op.out_features, op.in_features)
        params = fmt.normalize({"bits": bits})
        codes = torch.randint(0, 256, (shape[0], shape[1] * bits // 8), generator=gen, dtype=torch.uint8)
        rms = op.dense_weight().float().pow(2).mean(1).sqrt().cpu()
        raw = fmt.join({"codes": codes, "row_scale": rms.half()}, shape, params)
        record = Tensor("w", "moe.expert.up", 0, shape, Encoding("trellis", params), "f32")
        return make_linear(record, raw, op.bias, DEVICE, ex.dtype)

    moe = [(i, layer.ffn) for i, layer in enumerate(ex.layers) if isinstance(layer.ffn, MoEPlan)]
    assert moe
    for i, plan in moe:
        for mlp in plan.experts:
            mlp.up = [trellis_op(op, 2 + i % 2) for op in mlp.up]
            mlp.down = trellis_op(mlp.down, 2 + i % 2)
    engine = DecodeEngine(ex)
    assert {g.fmt for k in engine.moe.values() for g in k.gate_up_groups + k.down_groups} == {7}
    prompt = torch.randint(3, 250, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    opts = GenerationOptions(max_new_tokens=5, stop_token_ids=())
    tokens = list(engine_generate(engine, prompt, opts))
    assert tokens == list(generate(ex, prompt, opts))
    want = ex.forward(torch.tensor(prompt + tokens[:-1]))[-1].float().cpu()
    got = engine.logits.float().cpu()
    if ex.final_softcap is not None:
        got = torch.tanh(got / ex.final_softcap) * ex.final_softcap
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


# ---- GPU: real shapes, both byte-sum paths -----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("asm", [True, False])
def test_real_shape_on_gpu(bits, asm, monkeypatch):
    """moe-a3b's expert shapes (gate/up 1536 x 2048, down 2048 x 768) and a dense 4096 x 4096, with dp4a
    (common.INLINE_ASM) and with the portable byte sum: down's every matvec tiling and prefill tiling at 100
    tokens, the others' default ones (untimed: compiling every candidate of every shape is minutes)."""
    from thin.runtime.kernels import common

    monkeypatch.setattr(common, "INLINE_ASM", asm)
    for shape in ((1536, 2048), (2048, 768), (4096, 4096)):
        op, dense, _ = _random_op(shape, bits, seed=shape[1], dtype=torch.bfloat16, scale=0.02)
        op.tune = False
        assert op.dp4a == asm
        every = shape == (2048, 768)
        for config in op.candidates("direct")[:None if every else 1]:
            op._configs["direct"] = op._configs["partial"] = config
            check_matvec(op, dense, None, torch.bfloat16)
        x = torch.randn(100, shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
        want = x.float().cpu() @ dense.to(torch.bfloat16).float().T
        for config in op.matmul_candidates(100, shape[1])[:None if every else 1]:
            assert rel_err(op._matmul(x, config=config), want) < tolerance(torch.bfloat16), config


@pytest.mark.gpu
@pytest.mark.parametrize("asm", [True, False])
def test_moe_a3b_shape_experts_on_gpu(asm, monkeypatch):
    """moe-a3b's expert shapes (hidden 2048, expert FFN 768) with 16 experts top-8, every tiling, dp4a
    and the portable byte sum."""
    from thin.runtime.kernels import common

    monkeypatch.setattr(common, "INLINE_ASM", asm)
    _check_moe(_moe_plan([2, 3] * 8, top_k=8, hidden=2048, inter=768, seed=11, dtype=torch.bfloat16),
               dtype=torch.bfloat16)


@pytest.mark.gpu
def test_moe_a3b_shape_finishing_downs_on_gpu():
    """The finishing down at moe-a3b's shape: every tiling, the 2-warp ones over down's 48 blocks (of 64 a
    step) that the 1-warp tilings widen to (a row of 2048 held by 2 warps) included."""
    from thin.runtime.kernels.experts import MoEKernels

    plan = _moe_plan([2] * 16, top_k=8, hidden=2048, inter=768, seed=13, dtype=torch.bfloat16)
    configs = _check_finishing(MoEKernels(plan, DEVICE, torch.bfloat16, tune=False), seed=3)
    assert any(c.num_warps == 2 and c.groups == 64 for c in configs)
