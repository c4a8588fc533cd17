"""The pass runner, fuse_projections and order_tensors."""

import dataclasses

import pytest
import torch

from thin.ir import Encoding, Linear, Program, Tensor, format_ir, formats
from thin.passes import PassContext, PassError, fuse_projections, order_tensors, run_passes

from ir_fixtures import tiny_model


def _program(model):
    gen = torch.Generator().manual_seed(0)
    data = {t.name: torch.randn(t.shape, generator=gen) for t in model.tensors}
    # The weight contract: loaders hand out each tensor's encoded bytes.
    raw = {t.name: formats.encode(t.encoding.format, data[t.name]) for t in model.tensors}
    return Program(model, {name: (lambda v=v: v) for name, v in raw.items()}), data


def _decoded(program, name):
    t = program.model.tensor(name)
    return formats.decode(t.encoding.format, program.load(name), t.shape, t.encoding.params)


def _expected_fused(model):
    """The canonical form of tiny_model written out by hand."""
    tensors = {t.name: t for t in model.tensors}
    layers = []
    for layer in model.layers:
        i, a, f = layer.index, layer.attention, layer.ffn
        p = f"layers.{i}."
        rows = sum(tensors[x.weight].shape[0] for x in (a.q, a.k, a.v))
        tensors[p + "attn.qkv.weight"] = Tensor(p + "attn.qkv.weight", "attn.qkv", i, (rows, 16), Encoding("f32"), "f32")
        tensors[p + "ffn.gate_up.weight"] = Tensor(p + "ffn.gate_up.weight", "ffn.gate_up", i, (48, 16), Encoding("f32"), "f32")
        layers.append(dataclasses.replace(
            layer, attention=dataclasses.replace(a, q=None, k=None, v=None, qkv=Linear(p + "attn.qkv.weight")),
            ffn=dataclasses.replace(f, gate=None, up=None, gate_up=Linear(p + "ffn.gate_up.weight"))))
    order = ["embed.weight"]
    for i in range(len(layers)):
        p = f"layers.{i}."
        order += [p + n for n in ("attn_norm.weight", "attn.qkv.weight", "attn.o.weight", "ffn_norm.weight",
                                  "ffn.gate_up.weight", "ffn.down.weight")]
    order += ["final_norm.weight", "lm_head.weight"]
    return dataclasses.replace(model, layers=tuple(layers), tensors=tuple(tensors[n] for n in order))


def test_fusion_then_order_gives_the_canonical_form():
    before = tiny_model()
    program, data = _program(before)
    after = run_passes(program, [fuse_projections, order_tensors], PassContext())
    assert after.model == _expected_fused(before)
    qkv = _decoded(after, "layers.1.attn.qkv.weight")
    p = "layers.1.attn."
    assert torch.equal(qkv, torch.cat([data[p + "q.weight"], data[p + "k.weight"], data[p + "v.weight"]]))
    gate_up = _decoded(after, "layers.0.ffn.gate_up.weight")
    assert torch.equal(gate_up, torch.cat([data["layers.0.ffn.gate.weight"], data["layers.0.ffn.up.weight"]]))


def test_order_alone_keeps_the_structure():
    before = tiny_model()
    program, _ = _program(before)
    after = run_passes(program, [order_tensors], PassContext())
    assert after.model.layers == before.layers
    assert sorted(t.name for t in after.model.tensors) == sorted(t.name for t in before.tensors)


def test_mixed_formats_are_not_fused():
    before = tiny_model()
    tensors = tuple(dataclasses.replace(t, encoding=Encoding("bf16"), source_dtype="bf16")
                    if t.name == "layers.0.attn.k.weight" else t for t in before.tensors)
    program, _ = _program(dataclasses.replace(before, tensors=tensors))
    after = run_passes(program, [fuse_projections], PassContext())
    assert after.model.layers[0].attention.qkv is None
    assert after.model.layers[1].attention.qkv is not None


def test_runner_names_the_failing_pass_and_those_before(tmp_path):
    def drop_a_layer(program, ctx):
        """Breaks the IR on purpose: the head's shape no longer matches."""
        return program.replace(model=dataclasses.replace(program.model, vocab_size=7))

    program, _ = _program(tiny_model())
    with pytest.raises(PassError, match=r"pass 'drop_a_layer' failed \(passes already run: fuse_projections\)"):
        run_passes(program, [fuse_projections, drop_a_layer], PassContext(), dump_dir=tmp_path)
    # The dump holds the input and each pass that succeeded.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00-input.txt", "01-fuse_projections.txt"]
    assert (tmp_path / "00-input.txt").read_text() == format_ir(tiny_model())
