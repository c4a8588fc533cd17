"""calibrate_inputs against a direct computation: the inputs of transformers' own modules, captured
with forward hooks on the same token windows."""

from __future__ import annotations

import types

import pytest
import torch

from thin.compiler.evaluate import make_evaluator
from thin.compiler.hf import load_checkpoint
from thin.passes import CalibrateOptions, CalibrationError, PassContext, Scratch, calibrate_inputs
from thin.passes.calibrate_inputs import load_statistics

from hf_tiny import build_model
from tiny_tokenizer import TEXT, write_tokenizer

SIZES = dict(hidden_size=128, intermediate_size=256, head_dim=32, vocab_size=320)


def _calibrate(path, tokens=600):
    source = load_checkpoint(path)
    ctx = PassContext(config=types.SimpleNamespace(calibrate=CalibrateOptions(tokens=tokens)),
                      evaluator=make_evaluator("cpu", dict(source.tokenizer_files)), calibration_text=TEXT * 8,
                      scratch=Scratch())
    return calibrate_inputs(source.program, ctx), ctx


def _hooked_second_moments(model, windows, modules: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """sum(x x^T) / tokens of each module's input, over the windows, from transformers itself."""
    sums = {}

    def hook(name):
        def record(module, args, output):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.T @ x
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    with torch.no_grad():
        for w in windows:
            model(torch.tensor([w]))
    for h in handles:
        h.remove()
    total = sum(len(w) for w in windows)
    return {n: (s / total).float() for n, s in sums.items()}


def _windows(ctx, program):
    ids = ctx.scratch.load("calibration/ids")["ids"].tolist()
    window = program.annotations["calibration"]["window"]
    return [ids[i:i + window] for i in range(0, len(ids), window)]


def test_dense_statistics_match_transformers(tmp_path):
    model = build_model("llama", **SIZES)
    model.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    program, ctx = _calibrate(tmp_path)
    note = program.annotations["calibration"]
    assert note["tokens"] == 600 and note["windows"] == 3  # 256-token windows: the model's positions
    layer = model.model.layers[1]
    want = _hooked_second_moments(model, _windows(ctx, program), {
        "layers.1.attn.q.weight": layer.self_attn.q_proj, "layers.1.attn.o.weight": layer.self_attn.o_proj,
        "layers.1.ffn.up.weight": layer.mlp.up_proj, "layers.1.ffn.down.weight": layer.mlp.down_proj,
        "lm_head.weight": model.lm_head})
    for name, hessian in want.items():
        stats = load_statistics(ctx, program, name)
        torch.testing.assert_close(stats["hessian"], hessian, rtol=1e-4, atol=1e-5 * float(hessian.abs().max()))
        assert int(stats["count"]) == 600
    # q, k and v read one input: one set of statistics, shared.
    assert note["inputs"]["layers.0.attn.q.weight"] == note["inputs"]["layers.0.attn.v.weight"]
    x = load_statistics(ctx, program, "layers.1.ffn.down.weight")
    torch.testing.assert_close(x["mean"] ** 2, x["mean"] ** 2)  # finite
    assert bool((x["absmax"] ** 2 >= torch.diagonal(x["hessian"]) * 0.999).all())  # max x^2 >= mean x^2


def test_experts_see_the_tokens_routed_to_them(tmp_path):
    model = build_model("qwen3_moe", **SIZES, moe_intermediate_size=64)
    model.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    program, ctx = _calibrate(tmp_path, tokens=1200)
    inputs = []
    block = model.model.layers[0].mlp
    handle = block.register_forward_hook(lambda m, args, out: inputs.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        for w in _windows(ctx, program):
            model(torch.tensor([w]))
    handle.remove()
    x = torch.cat(inputs).double()
    # transformers' own routing: softmax over the router, top-k experts per token (renormalised when
    # the config says so), each token's weight in its experts' share of the output.
    top = torch.softmax(x @ block.gate.weight.double().T, -1).topk(model.config.num_experts_per_tok, -1)
    chosen, weight = top.indices, top.values
    if model.config.norm_topk_prob:
        weight = weight / weight.sum(-1, keepdim=True)
    note = program.annotations["calibration"]
    starved = set(note["starved_experts"])
    checked = 0
    for e in range(model.config.num_experts):
        routed = (chosen == e).any(-1)
        name = f"layers.0.ffn.experts.{e}.gate.weight"
        stats = load_statistics(ctx, program, name)
        assert int(stats["count"]) == int(routed.sum())
        if note["inputs"][name].removesuffix(".in") in starved:  # too few tokens: estimated statistics (expert_statistics.py)
            continue
        # Each token weighs with its squared routing weight, the whole keeping the token count's mass.
        g2 = (weight * (chosen == e)).sum(-1)[routed] ** 2
        want = ((x[routed] * g2[:, None]).T @ x[routed] * (len(g2) / g2.sum()) / note["tokens"]).float()
        torch.testing.assert_close(stats["hessian"], want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
        checked += 1
    assert checked >= 6


def test_calibration_refuses_too_little_text(tmp_path):
    model = build_model("llama", **SIZES)
    model.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    source = load_checkpoint(tmp_path)
    ctx = PassContext(config=types.SimpleNamespace(calibrate=CalibrateOptions(tokens=600)),
                      evaluator=make_evaluator("cpu", dict(source.tokenizer_files)), calibration_text="def f",
                      scratch=Scratch())
    with pytest.raises(CalibrationError, match="at least 64"):
        calibrate_inputs(source.program, ctx)


def test_a_spill_that_cannot_be_written_is_one_clear_error(tmp_path, monkeypatch):
    from thin.passes.scratch import ScratchError

    scratch = Scratch(tmp_path, memory_limit=0)  # everything spills
    scratch.save("ok", {"m": torch.randn(4, 4)})
    assert scratch.load("ok")["m"].shape == (4, 4)

    def short_write(obj, path):
        with open(path, "wb") as fh:
            fh.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1152 vs 1046")

    monkeypatch.setattr(torch, "save", short_write)
    with pytest.raises(ScratchError, match="could not write .* MiB free there"):
        scratch.save("full", {"m": torch.randn(64, 64)})
    assert not scratch.has("full")  # no truncated file left to be read back
    assert scratch.has("ok")


def test_probes_from_cached_layer_inputs_measure_what_whole_forwards_do(tmp_path):
    """score_formats runs a probe only from the first layer it changes, on cached hidden states: the
    logits and the probed KLD must be those of running the whole model (CPU: bit for bit)."""
    from thin.ir import formats
    from thin.passes.score_formats import first_changed_layer, override_kld, reference_logprobs

    model = build_model("llama", **SIZES)
    model.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    program, ctx = _calibrate(tmp_path)
    session = ctx.evaluator.session(program)
    windows = _windows(ctx, program)[:2]
    hidden = [session.layer_inputs(w) for w in windows]
    assert len(hidden[0]) == len(program.model.layers) + 1
    for first in range(len(hidden[0])):
        assert torch.equal(session.forward_from(first, hidden[0][first]), session.forward(windows[0]))
    reference = reference_logprobs(session, windows)
    assert all(torch.equal(a, b) for a, b in zip(reference, reference_logprobs(session, windows, hidden)))
    fmt = formats.get("int4")
    for names in (["layers.1.ffn.down.weight"], ["layers.0.attn.v.weight", "layers.1.attn.q.weight"],
                  ["lm_head.weight"], [program.model.embedding.weight]):
        dense = {}
        for n in names:
            r = program.model.tensor(n)
            w = formats.get(r.encoding.format).decode(program.load(n), r.shape, r.encoding.params, torch.float32)
            dense[n] = fmt.decode(fmt.encode(w), r.shape)
        whole = override_kld(session, windows, reference, dense)
        assert whole > 0
        assert override_kld(session, windows, reference, dense, hidden) == whole
    model_ir = program.model
    assert first_changed_layer(model_ir, ["layers.1.ffn.down.weight", "layers.0.attn.v.weight"]) == 0
    assert first_changed_layer(model_ir, ["layers.1.ffn.down.weight"]) == 1
    assert first_changed_layer(model_ir, ["lm_head.weight"]) == len(model_ir.layers)
    assert first_changed_layer(model_ir, [model_ir.embedding.weight]) is None


def test_large_weights_are_scored_a_block_of_rows_at_a_time(tmp_path, monkeypatch):
    """score_formats rounds and scores a weight a block of rows at a time (so a 201088-row LM head needs
    no float32 copies of itself): with blocks of a few rows, every tensor's rounding is the same bit for
    bit and its predicted error (round to nearest, GPTQ estimate, the embedding's lookup error) the same."""
    import importlib

    from thin.ir import Encoding, formats

    sf = importlib.import_module("thin.passes.score_formats")  # the module (the package exports the pass)

    model = build_model("llama", **SIZES, tie_word_embeddings=False)
    model.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    program, ctx = _calibrate(tmp_path)
    encodings = [Encoding("q2", (("group_size", 32),)), Encoding("q1", (("group_size", 32),)),
                 Encoding("int4", (("asymmetric", 1), ("group_size", 32))), Encoding("int8"), Encoding("mxfp4"),
                 Encoding("fp8_e4m3"), Encoding("bf16")]
    names = [program.model.embedding.weight, program.model.lm_head.weight, program.model.layers[0].attention.q.weight]

    def scores():
        out = {}
        for name in names:
            r = program.model.tensor(name)
            w = formats.get(r.encoding.format).decode(program.load(name), r.shape, r.encoding.params, torch.float32)
            for method in ("rtn", "gptq"):
                error = sf._error_model(program, ctx, name, w, method, {})
                out[name, method] = [error(e) for e in encodings]
            out[name, "rounded"] = [sf.rounded(formats.get(e.format), w, e.params) for e in encodings
                                    if not formats.get(e.format).dense]
        return out

    whole = scores()
    monkeypatch.setattr(sf, "BLOCK_ELEMENTS", 3 * SIZES["hidden_size"])
    assert len(sf.row_blocks(torch.zeros(SIZES["vocab_size"], SIZES["hidden_size"]))) > 100
    blocked = scores()
    for key, values in whole.items():
        if key[1] == "rounded":
            assert all(torch.equal(a, b) for a, b in zip(values, blocked[key])), key
        else:
            assert blocked[key] == pytest.approx(values, rel=1e-5), key  # float32 sums in another order
            assert all(v > 0 for v in values), key
