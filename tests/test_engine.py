"""The decode engine (prefill + fused decode step over a paged cache) against the executor.

On a CPU machine the engine's kernels run through Triton's interpreter (registered for the CPU for
these tests only), without CUDA graphs; with a GPU the same tests run on it, graphs on and off.
"""

import pytest
import torch
from kernel_support import DEVICE, HAS_CUDA, rel_err

from thin.compiler import compile_model
from thin.runtime import ConversationCache, generate, load
from thin.runtime.sampling import GenerationOptions

from hf_tiny import make_checkpoint

KERNEL_FAMILIES = {"dense": ("f32", "f16", "bf16"), "rowwise8": ("int8", "fp8_e4m3"),
                   "grouped_int": ("int3", "int4", "int5", "int6"), "mxfp4": ("mxfp4",), "q2": ("q2",), "q1": ("q1",)}


@pytest.fixture(scope="module")
def kernels_here():
    """Serve every format with the Triton kernels on this test's device (the interpreter on a CPU)."""
    from thin.runtime import linear

    if HAS_CUDA:
        yield
        return
    added = []
    for family, names in KERNEL_FAMILIES.items():
        for name in names:
            linear.register(name, "cpu", linear.Implementation("triton", f"thin.runtime.kernels.{family}:make"))
            added.append(name)
    yield
    for name in added:
        linear.unregister(name, "cpu", "triton")


@pytest.fixture(scope="module")
def models(tmp_path_factory, kernels_here):
    """family/format -> loaded model (kernels serving its linears)."""
    tmp = tmp_path_factory.mktemp("engine")
    out = {}

    def get(family, quant=None, **overrides):
        key = (family, quant, tuple(sorted(overrides.items())))
        if key not in out:
            src = tmp / f"{family}-{len(out)}"
            make_checkpoint(family, src, **overrides)
            # Groups that divide the tiny models' 64 columns.
            options = {"quant": quant, **({"group_size": 32} if quant in ("int4", "int3") else {})} if quant else {}
            out[key] = load(compile_model(src, tmp / f"{family}-{len(out)}.thin", **options), device=DEVICE.type)
        return out[key]

    return get


def _engine(model, graphs=True, **options):
    from thin.runtime.engine import DecodeEngine

    return DecodeEngine(model.executor, graphs=graphs, **options)


def _prompt(n=9, seed=0):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _executor_tokens(model, prompt, n):
    opts = GenerationOptions(max_new_tokens=n, stop_token_ids=())
    return list(generate(model.executor, prompt, opts))


def _engine_tokens(engine, prompt, n, cache=None, **options):
    from thin.runtime.generate import engine_generate

    opts = GenerationOptions(max_new_tokens=n, stop_token_ids=options.pop("stop_token_ids", ()), **options)
    return list(engine_generate(engine, prompt, opts, cache=cache))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3", "olmo2"])
def test_greedy_tokens_match_the_executor(models, family):
    model = models(family)
    prompt = _prompt()
    assert _engine_tokens(_engine(model), prompt, 8) == _executor_tokens(model, prompt, 8)


@pytest.mark.parametrize("quant", ["int4", "fp8_e4m3", "mxfp4", "q2"])
def test_quantized_greedy_tokens_match_the_executor(models, quant):
    model = models("llama", quant)
    prompt = _prompt(seed=1)
    assert _engine_tokens(_engine(model), prompt, 6) == _executor_tokens(model, prompt, 6)


@pytest.mark.parametrize("quant", ["int8", "fp8_e4m3", "int4"])
def test_matvecs_that_finish_the_residual_norm(models, quant):
    """o and down finishing the residual norm in their last program (finish_norm=True, every such op)
    instead of add_rmsnorm launches: the executor's tokens, graphed and eager alike (the arrival counter
    is back to zero after every launch, so every replay counts from zero), and under the interpreter
    the very logits of the separate launches."""
    model = models("llama", quant)
    prompt = _prompt(seed=9)
    finishing = _engine(model, finish_norm=True, defer_norm=False)
    layers = model.executor.layers
    assert finishing._finishing == {id(op) for layer in layers for op in (layer.attention.o, layer.ffn.down)}
    want = _executor_tokens(model, prompt, 6)
    cache = finishing.new_cache(64)
    assert _engine_tokens(finishing, prompt, 6, cache=cache) == want
    assert int(finishing.counter) == 0
    eager = _engine(model, graphs=False, finish_norm=True, defer_norm=False)
    assert _engine_tokens(eager, prompt, 6) == want
    plain = _engine(model, finish_norm=False, defer_norm=False)
    assert _engine_tokens(plain, prompt, 6) == want and not plain._finishing
    if not HAS_CUDA:
        assert torch.equal(finishing.logits, plain.logits)


@pytest.mark.parametrize("quant", ["int8", "fp8_e4m3", "int4", "mxfp4"])
def test_residual_norms_left_to_the_next_projection(models, quant):
    """defer_norm (the default): every o and down of a dense llama whose consumers' kernels take it leave the
    norm to gate/up, the next qkv or the LM head (kernels/deferred_norm.py Deferred), with no finishing program: the
    executor's tokens, graphed and eager alike, and logits within rounding of the norms run in full."""
    model = models("llama", quant)
    prompt = _prompt(seed=9)
    engine = _engine(model)
    ex = model.executor
    producers = {id(op) for layer in ex.layers for op in (layer.attention.o, layer.ffn.down)}
    if not ex.lm_head.deferrable:  # the LM head keeps a plain kernel: the last down finishes as before
        producers.discard(id(ex.layers[-1].ffn.down))
    assert engine._deferring == producers and len(producers) >= 3
    assert not engine._finishing & producers
    want = _executor_tokens(model, prompt, 6)
    cache = engine.new_cache(64)
    assert _engine_tokens(engine, prompt, 6, cache=cache) == want
    eager = _engine(model, graphs=False)
    assert _engine_tokens(eager, prompt, 6) == want
    full = _engine(model, defer_norm=False)
    assert _engine_tokens(full, prompt, 6) == want and not full._deferring
    assert rel_err(engine.logits, full.logits) < 1e-2


def test_residual_norms_of_sandwich_norm_families_are_not_deferred(models):
    """Gemma-2's post-norms need o's and down's whole rows before the residual add: nothing defers."""
    assert not _engine(models("gemma2", "int8"))._deferring


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3"])
def test_attention_that_appends_in_its_split_kernel(models, family):
    """fused_attention=True (the q/k norm, RoPE and KV append inside the split kernel on every layer,
    kernels/attention_append.py) against False (rope_append + split + merge): the executor's tokens, the
    positions attended at every step (graphed on a GPU), and under the interpreter the same logits."""
    model = models(family)
    prompt = _prompt(seed=5)
    fused, plain = _engine(model, fused_attention=True), _engine(model, fused_attention=False)
    assert fused._appending == dict.fromkeys(range(len(model.executor.layers)), False) and not plain._appending
    want = _executor_tokens(model, prompt, 8)
    cache = fused.new_cache(64)
    assert _engine_tokens(fused, prompt, 8, cache=cache) == want
    window = model.executor.layers[0].attention.sliding_window or 10 ** 9  # the log is layer 0's
    assert cache.attended[1:8].tolist() == [min(len(prompt) + i, window) for i in range(1, 8)]
    assert _engine_tokens(plain, prompt, 8) == want
    if not HAS_CUDA:
        assert rel_err(fused.logits, plain.logits) < 1e-5


@pytest.mark.parametrize("quant, fused, way", [(None, False, True), ("fp8_e4m3", True, True), ("int8", False, True),
                                             ("int4", True, True), ("fp8_e4m3", True, "attention")])
def test_dependent_launches_change_no_result(models, quant, fused, way):
    """dependent_launch=True (the step's matvecs, norms, RoPE and attention launched as programmatic
    dependents, kernels/dependent.py) against False: the executor's tokens, the positions attended at every
    step, the finishing matvecs' counter back at zero, and under the interpreter (level 1: the kernels'
    dependent code without the grid-dependency instructions) the very logits."""
    model = models("llama", quant)
    prompt = _prompt(seed=13)
    options = dict(fused_attention=fused, finish_norm=True, defer_norm=way is True)
    from thin.runtime.kernels.dependent import ATTENTION

    way = ATTENTION if way == "attention" else way
    dependent, plain = _engine(model, dependent_launch=way, **options), _engine(model, dependent_launch=False, **options)
    assert dependent._dependent and not plain._dependent
    want = _executor_tokens(model, prompt, 7)
    cache = dependent.new_cache(64)
    assert _engine_tokens(dependent, prompt, 7, cache=cache) == want
    assert cache.attended[1:7].tolist() == [len(prompt) + i for i in range(1, 7)]
    assert int(dependent.counter) == 0
    assert _engine_tokens(plain, prompt, 7) == want
    if not HAS_CUDA:
        assert torch.equal(dependent.logits, plain.logits)


def test_dependent_launch_levels():
    """What a kernel launch takes: nothing outside `launching(True)`; inside it level 1 under the
    interpreter (no grid-dependency instructions, no launch attribute) and 2 on a GPU (the attribute)."""
    from thin.runtime.kernels import dependent, interpreting

    assert dependent.level() == 0 and dependent.kernel_args() == {}
    with dependent.launching(True):
        want = {"PDL": 1} if interpreting() else {"PDL": 2, "launch_pdl": True}
        assert dependent.kernel_args() == want and dependent.preloads(want)
        with dependent.launching(False):
            assert dependent.kernel_args() == {}
    # Only the named sections' launches are dependents; the others release theirs at once (level 3).
    with dependent.launching(dependent.ATTENTION):
        with dependent.section("attention"):
            assert dependent.kernel_args() == ({"PDL": 1} if interpreting() else {"PDL": 2, "launch_pdl": True})
        with dependent.section("qkv"):
            assert dependent.kernel_args() == ({"PDL": 1} if interpreting() else {"PDL": 3})
            assert dependent.preloads(dependent.kernel_args()) == interpreting()
    assert dependent.level() == 0


def test_dependent_launch_default_is_the_attentions_on_hopper_with_graphs(models):
    """dependent_launch=None: the attention's launches as dependents where the GPU has programmatic dependent
    launch (compute capability 9+) and the step is graphed; none elsewhere (the CPU, eager steps)."""
    from thin.runtime.kernels.dependent import ATTENTION

    model = models("llama", "fp8_e4m3")
    engine = _engine(model)
    hopper = HAS_CUDA and torch.cuda.get_device_capability() >= (9, 0)
    assert engine._dependent == (ATTENTION if hopper and engine.use_graphs else False)
    assert _engine(model, dependent_launch=True)._dependent is True


def test_conversation_cache_prefills_only_the_new_turn(models):
    model = models("qwen3")
    engine = _engine(model)
    conversation = ConversationCache(engine, model.ir.max_position_embeddings, min_tokens=40)
    first = _prompt(7, seed=2)
    cache = conversation.prepare(first, 5)
    reply = _engine_tokens(engine, first, 5, cache=cache)
    conversation.record(first, reply)
    second = first + reply + _prompt(4, seed=3)
    cache = conversation.prepare(second, 5)
    assert cache.length == len(first) + len(reply) - 1  # the last reply token was never fed back
    assert _engine_tokens(engine, second, 5, cache=cache) == _executor_tokens(model, second, 5)


def test_stop_token_ends_generation_and_sets_the_kept_length(models):
    model = models("llama")
    engine = _engine(model)
    prompt = _prompt(seed=4)
    full = _engine_tokens(engine, prompt, 8)
    stop = full[3]
    cache = engine.new_cache(32)
    got = _engine_tokens(engine, prompt, 8, cache=cache, stop_token_ids=(stop,))
    assert got == full[:full.index(stop)]
    assert cache.length == len(prompt) + len(got)


def test_sampling_same_seed_same_tokens(models):
    engine = _engine(models("llama"))
    prompt = _prompt(seed=5)
    options = dict(temperature=0.9, top_k=20, top_p=0.95, seed=7)
    first = _engine_tokens(engine, prompt, 6, **options)
    assert first == _engine_tokens(engine, prompt, 6, **options)
    assert first != _engine_tokens(engine, prompt, 6, **{**options, "seed": 8})


@pytest.mark.gpu
def test_graph_and_eager_steps_give_the_same_tokens_and_attend_every_position(models):
    model = models("llama")
    prompt = _prompt(seed=6)
    graphed, eager = _engine(model, graphs=True), _engine(model, graphs=False)
    cache = graphed.new_cache(64)
    tokens = _engine_tokens(graphed, prompt, 20, cache=cache)
    assert tokens == _engine_tokens(eager, prompt, 20)
    attended = cache.attended[1:20].tolist()
    assert attended == [len(prompt) + i for i in range(1, 20)]
