"""The decode engine with its residual norms folded into the next matvec's input (fold_norm, engine_fold.py,
kernels/fold.py) against the same engine without: greedy tokens, logits, and the rotation of the slots that
carry each norm's sum of squares from a producer to its consumers, over several steps.

On a CPU machine the kernels run through Triton's interpreter (registered for the CPU for these tests only)."""

import pytest
import torch
from kernel_support import DEVICE, HAS_CUDA

from thin.compiler import compile_model
from thin.runtime import load
from thin.runtime.sampling import GenerationOptions

from hf_tiny import make_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """quant -> a tiny llama compiled in that format, served by the Triton kernels on this test's device."""
    from thin.runtime import linear

    added = []
    if not HAS_CUDA:
        for name, family in (("int4", "grouped_int"), ("fp8_e4m3", "rowwise8"), ("bf16", "dense")):
            linear.register(name, "cpu", linear.Implementation("triton", f"thin.runtime.kernels.{family}:make"))
            added.append(name)
    tmp = tmp_path_factory.mktemp("fold")
    src = tmp / "llama"
    make_checkpoint("llama", src)
    models = {}

    def get(quant):
        if quant not in models:
            options = {"quant": quant, **({"group_size": 32} if quant == "int4" else {})}
            models[quant] = load(compile_model(src, tmp / f"llama-{quant}.thin", **options), device=DEVICE.type)
        return models[quant]

    yield get
    for name in added:
        linear.unregister(name, "cpu", "triton")


def _tokens(engine, prompt, n):
    from thin.runtime.engine import generate

    return list(generate(engine, prompt, GenerationOptions(max_new_tokens=n, stop_token_ids=())))


@pytest.mark.parametrize("quant", ["fp8_e4m3", "int4"])
def test_folded_norms_give_the_same_tokens(llama, quant):
    """fold_norm=True folds every o and down (slots alternating 0, 1 over the step's even count): the same
    greedy tokens as fold_norm=False, logits with cosine > 0.9999 (the sums of squares added in another
    order); after every eager step slot 0 (the step's first producer's) is zero again, slot 2 unused, and
    slot 1 holds the last residual's sum of squares, which the LM head read."""
    from thin.runtime.engine import DecodeEngine

    model = llama(quant)
    layers = model.executor.layers
    folded = DecodeEngine(model.executor, graphs=False, fold_norm=True)
    plain = DecodeEngine(model.executor, graphs=False, fold_norm=False)
    producers = [op for layer in layers for op in (layer.attention.o, layer.ffn.down)]
    assert list(folded._folding) == [id(op) for op in producers] and not plain._folding
    slots = [(a.sums.data_ptr() - folded.norm_sums.data_ptr()) // 4 for a, _ in folded._folding.values()]
    assert slots == [j % 2 for j in range(len(producers))]

    seen = []
    step = folded.decode_one_token

    def spy(*args, **kwargs):
        step(*args, **kwargs)
        seen.append((folded.norm_sums.clone(), float(folded.residual.float().pow(2).sum())))

    folded.decode_one_token = spy
    prompt = torch.randint(3, 250, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    assert _tokens(folded, prompt, 6) == _tokens(plain, prompt, 6)
    cosine = torch.nn.functional.cosine_similarity(folded.logits.float(), plain.logits.float(), dim=0)
    assert cosine > 0.9999, cosine
    assert len(seen) >= 5
    for sums, ss in seen:
        assert sums[0].item() == 0.0 and sums[2].item() == 0.0
        assert sums[1].item() == pytest.approx(ss, rel=1e-4)
    if HAS_CUDA:  # the same steps replayed from a captured graph
        graphed = DecodeEngine(model.executor, fold_norm=True)
        assert _tokens(graphed, prompt, 6) == _tokens(plain, prompt, 6)
        assert not graphed.norm_sums[0].item() and not graphed.norm_sums[2].item()


def test_fold_norm_false_and_models_that_cannot_fold(llama):
    """fold_norm=False folds nothing; a layer with a post-norm (Gemma's sandwich norms need the whole row
    before the add) stops every pair from folding."""
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.engine_fold import fold_pairs

    model = llama("fp8_e4m3")
    engine = DecodeEngine(model.executor, graphs=False, fold_norm=False)
    assert not engine._folding and len(fold_pairs(engine)) == 2 * len(model.executor.layers)
    assert not engine.norm_sums.any()
    layer = model.executor.layers[-1]
    layer.ffn_post_norm = layer.ffn_norm
    try:
        assert fold_pairs(engine) == []
    finally:
        layer.ffn_post_norm = None


@pytest.mark.parametrize("folded_faster", [True, False])
def test_timed_choice_keeps_the_faster_and_tunes_the_normed_consumers(llama, monkeypatch, folded_faster):
    """choose_folding(timed=True) (warm_up's, on a GPU) with the timer replaced (each launch run once, for real):
    every kind of pair folds where its folded launches time faster, none where slower; the consumers' normed-
    input configurations come from their candidates; the slots are zeroed and assigned in launch order."""
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.engine_fold import choose_folding
    from thin.runtime.kernels import common

    model = llama("int4")
    engine = DecodeEngine(model.executor, graphs=False, fold_norm=False)
    ran = []

    def timer(ms):
        def median(launch, *args, **kwargs):
            launch()
            ran.append(ms)
            return ms
        return median

    monkeypatch.setattr(common, "_small", lambda op: False)
    monkeypatch.setattr(common, "precompile", lambda uses: None)
    monkeypatch.setattr(common, "compile_launches", lambda jobs, **kwargs: None)
    monkeypatch.setattr(common, "median_ms", timer(2.0))
    monkeypatch.setattr(common, "median_ms_or_inf", timer(1.0 if folded_faster else 3.0))
    engine.norm_sums.fill_(5.0)
    choose_folding(engine, timed=True)
    layers = model.executor.layers
    producers = [op for layer in layers for op in (layer.attention.o, layer.ffn.down)]
    assert list(engine._folding) == ([id(op) for op in producers] if folded_faster else [])
    assert not engine.norm_sums.any()
    assert 2.0 in ran and len(ran) >= 6  # three kinds: separate, folded, and each consumer's candidates
    gate_up = layers[0].ffn.up[0]
    assert gate_up.normed_configs["glu"] in gate_up.candidates("glu")
    assert model.executor.lm_head.normed_configs["direct"] in model.executor.lm_head.candidates("direct")
    for layer in layers:  # the module's model serves the other tests with the modes' own configurations
        layer.ffn.up[0].normed_configs = None
        for op in layer.attention.qkv:
            op.normed_configs = None
    model.executor.lm_head.normed_configs = None
