"""The decode engine on mixtures of experts (Mixtral, Qwen3-MoE, GPT-OSS) against the executor.

As in test_engine: on a CPU machine the engine's kernels (and the linear kernels) run through
Triton's interpreter, without CUDA graphs; with a GPU the same tests run there.
"""

import pytest
import torch
from kernel_support import DEVICE, HAS_CUDA

from thin.compiler import compile_model
from thin.runtime import generate, load
from thin.runtime.sampling import GenerationOptions

from hf_tiny import make_checkpoint

KERNEL_FAMILIES = {"dense": ("f32", "f16", "bf16"), "rowwise8": ("int8", "fp8_e4m3"),
                   "grouped_int": ("int3", "int4", "int5", "int6"), "mxfp4": ("mxfp4",), "q2": ("q2",), "q1": ("q1",)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, quant) -> loaded model, its linears served by the Triton kernels on this device."""
    from thin.runtime import linear

    added = []
    if not HAS_CUDA:
        for family, names in KERNEL_FAMILIES.items():
            for name in names:
                linear.register(name, "cpu", linear.Implementation("triton", f"thin.runtime.kernels.{family}:make"))
                added.append(name)
    tmp = tmp_path_factory.mktemp("engine_moe")
    out = {}

    def get(family, quant=None):
        if (family, quant) not in out:
            src = tmp / f"{family}-{len(out)}"
            make_checkpoint(family, src)
            options = {"quant": quant, **({"group_size": 32} if quant.startswith("int") else {})} if quant else {}
            out[family, quant] = load(compile_model(src, tmp / f"{family}-{len(out)}.thin", **options),
                                      device=DEVICE.type)
        return out[family, quant]

    yield get
    for name in added:
        linear.unregister(name, "cpu", "triton")


def _tokens(model, prompt, n, engine=None):
    opts = GenerationOptions(max_new_tokens=n, stop_token_ids=())
    if engine is None:
        return list(generate(model.executor, prompt, opts))
    from thin.runtime.generate import engine_generate

    return list(engine_generate(engine, prompt, opts))


def _prompt(n, seed):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family,quant", [("mixtral", None), ("mixtral", "int4"), ("qwen3_moe", None),
                                          ("gpt_oss", None), ("gpt_oss", "mxfp4")])
def test_greedy_tokens_match_the_executor(models, family, quant):
    """Sinks, sliding windows, router and expert biases and the clamped SwiGLU (GPT-OSS) included;
    12 positions past a window of 8, so the window bounds what the decode steps attend to."""
    from thin.runtime.engine import DecodeEngine

    model = models(family, quant)
    engine = DecodeEngine(model.executor)
    assert engine.moe, "the engine runs the MoE layers on its expert kernels"
    prompt = _prompt(9, seed=len(family))
    assert _tokens(model, prompt, 6, engine) == _tokens(model, prompt, 6)


def test_decode_step_logits_match_the_executor(models):
    """Beyond greedy tokens: the engine's last logits after a few decode steps are the executor's."""
    from thin.runtime.engine import DecodeEngine

    model = models("gpt_oss")
    engine = DecodeEngine(model.executor)
    prompt = _prompt(10, seed=3)
    tokens = _tokens(model, prompt, 4, engine)
    want = model.executor.forward(torch.tensor(prompt + tokens[:-1]))[-1]
    got = engine.logits.float().cpu()
    if model.executor.final_softcap is not None:
        got = torch.tanh(got / model.executor.final_softcap) * model.executor.final_softcap
    assert torch.allclose(got, want.cpu(), rtol=1e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("family,quant", [("mixtral", "int4"), ("qwen3_moe", None), ("gpt_oss", None)])
def test_routers_that_run_the_residual_norm(models, family, quant):
    """The MoE layers' routers adding o's partial sums into the residual and norming it, and their expert
    down launches the residual norm after the layer (finish_norm=True: every layer; norm_router.py,
    expert_finish.py) instead of add_rmsnorm launches: the executor's tokens (GPT-OSS: o's and the
    router's biases), the arrival counter back at zero after every step, and under the interpreter the
    very logits of the separate launches."""
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.engine_fusions import choose_norm_routers

    model = models(family, quant)
    fused = DecodeEngine(model.executor, finish_norm=True)
    if fused._finishing:  # o's matvec finishes the norm itself (int4): routers where it does not
        assert all(k.norm_router is None for k in fused.moe.values())
        fused._finishing.clear()
        choose_norm_routers(fused, timed=False)
    plain = DecodeEngine(model.executor, finish_norm=False)
    assert fused.moe and all(k.norm_router is not None and k.finish_down is not None for k in fused.moe.values())
    assert all(k.norm_router is None and k.finish_down is None for k in plain.moe.values())
    prompt = _prompt(9, seed=5)
    want = _tokens(model, prompt, 6)
    assert _tokens(model, prompt, 6, fused) == want and int(fused.counter) == 0
    assert _tokens(model, prompt, 6, plain) == want
    if not HAS_CUDA:
        assert torch.equal(fused.logits, plain.logits)
    else:  # the timed choice (norm_router.choose), whichever way it goes
        timed = DecodeEngine(model.executor)
        timed.warm_up()
        assert _tokens(model, prompt, 6, timed) == want


@pytest.mark.parametrize("family,quant", [("mixtral", "int4"), ("qwen3_moe", None), ("gpt_oss", None)])
def test_expert_downs_that_run_the_residual_norm(models, family, quant):
    """The down launches' last programs running the residual norm after each MoE layer alone (the routers
    launched apart, add_rmsnorm before them; engine_fusions.choose_finishing_downs untimed): the executor's
    tokens, the counter back at zero, and under the interpreter the plain engine's very logits."""
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.engine_fusions import choose_finishing_downs

    model = models(family, quant)
    fused = DecodeEngine(model.executor, finish_norm=False)
    choose_finishing_downs(fused, timed=False)
    assert fused.moe and all(k.finish_down is not None and k.norm_router is None for k in fused.moe.values())
    plain = DecodeEngine(model.executor, finish_norm=False)
    prompt = _prompt(7, seed=11)
    want = _tokens(model, prompt, 5)
    assert _tokens(model, prompt, 5, fused) == want and int(fused.counter) == 0
    assert _tokens(model, prompt, 5, plain) == want
    if not HAS_CUDA:
        assert torch.equal(fused.logits, plain.logits)


def test_two_plane_expert_formats_match_the_executor(models):
    """int5 experts (a 4-bit and a 1-bit code plane) through the engine."""
    from thin.runtime.engine import DecodeEngine

    model = models("mixtral", "int5")
    prompt = _prompt(9, seed=12)
    assert _tokens(model, prompt, 6, DecodeEngine(model.executor)) == _tokens(model, prompt, 6)


def test_bench_counts_only_the_routed_experts_a_token_reads(models):
    """bytes per token: every other tensor once (the embedding one row), experts top_k / num_experts."""
    from thin.runtime.bench import bytes_per_token, expert_bytes_per_token

    model = models("mixtral")
    art, ir = model.artifact, model.ir
    entries = [art.tensor_entry(t.name) for t in ir.tensors]
    experts = sum(e.size for e in entries if e.expert is not None)
    embedding = art.tensor_entry(ir.embedding.weight)
    others = sum(e.size for e in entries if e.expert is None) - embedding.size + embedding.size // ir.vocab_size
    moe = ir.layers[0].ffn
    assert experts > 0 and expert_bytes_per_token(art) == round(experts * moe.top_k / moe.num_experts)
    assert bytes_per_token(art) == others + expert_bytes_per_token(art)


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
def test_sliding_layers_keep_a_bounded_ring(models, family):
    """A cache whose sliding layers (window 8) keep rings of two 16-position blocks, prefilled in chunks
    of 8 tokens: 40 prompt and 10 new tokens wrap each ring, and the tokens are still the executor's."""
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.generate import engine_generate

    model = models(family)
    engine = DecodeEngine(model.executor)
    prompt = _prompt(40, seed=11)
    cache = engine.new_cache(len(prompt) + 10, chunk=8)
    windows = [layer.attention.sliding_window for layer in model.executor.layers]
    assert [r is not None for r in cache.rings] == [w is not None for w in windows] and any(windows)
    assert cache.ring_keys.shape[1] == 2 < cache.num_blocks
    opts = GenerationOptions(max_new_tokens=10, stop_token_ids=())
    assert list(engine_generate(engine, prompt, opts, cache=cache)) == _tokens(model, prompt, 10)


def test_a_ring_cannot_roll_back_past_its_window():
    from thin.runtime.paged_kv import PagedKVCache

    cache = PagedKVCache(2, 1, 8, 128, torch.float32, "cpu", block_size=4, windows=[None, 6], chunk=4)
    assert cache.rings == [None, 4] and cache.ring_keys.shape[:2] == (1, 4)
    cache.advance(30)  # the ring holds blocks 4..7 (positions 16..31)
    assert cache.keepable(30) == 30
    assert cache.keepable(21) == 21  # the token at 21 sees 16..21
    assert cache.keepable(20) == 0  # ... at 20 sees 15, overwritten: start over
    with pytest.raises(ValueError, match="sliding-window"):
        cache.truncate(20)
    cache.truncate(21)
    assert cache.length == 21 and cache.keepable(0) == 0
    cache.reset()
    assert cache.length == 0
