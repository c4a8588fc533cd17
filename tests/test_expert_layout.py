"""Page-major experts: the layout_experts pass, and expert pages in the artifact (one aligned contiguous
byte range per expert, packed q2 experts included)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from thin.artifacts import ArtifactWriter, LayoutError, open_artifact
from thin.artifacts.pages import expert_page, expert_pages
from thin.compiler import compile_model
from thin.ir import MLP, Encoding, Linear, MoE, Program, Tensor
from thin.passes import PassContext, layout_experts, run_passes
from thin.passes.layout_experts import PAGE
from thin.runtime import load

from hf_tiny import build_model
from ir_fixtures import tiny_model
from tiny_tokenizer import write_tokenizer


def _moe_model():
    """tiny_model with layer 1's MLP replaced by 2 experts (down with a bias), whose tensors are listed
    scrambled: every gate, then every up, then every down."""
    model = tiny_model()
    H, inter = 16, 24
    tensors = [t for t in model.tensors if not t.name.startswith("layers.1.ffn.")]
    p = "layers.1.ffn."

    def t(name, role, shape, e=None):
        tensors.append(Tensor(p + name, role, 1, shape, Encoding("f32"), "f32", e))
        return p + name

    router = Linear(t("router.weight", "moe.router", (2, H)))
    gates = [t(f"experts.{e}.gate.weight", "moe.expert.gate", (inter, H), e) for e in range(2)]
    ups = [t(f"experts.{e}.up.weight", "moe.expert.up", (inter, H), e) for e in range(2)]
    downs = [Linear(t(f"experts.{e}.down.weight", "moe.expert.down", (H, inter), e),
                    t(f"experts.{e}.down.bias", "moe.expert.down.bias", (H,), e)) for e in range(2)]
    experts = tuple(MLP("silu", gate=Linear(gates[e]), up=Linear(ups[e]), down=downs[e]) for e in range(2))
    layer = dataclasses.replace(model.layers[1], ffn=MoE(2, 1, router, experts))
    return dataclasses.replace(model, layers=(model.layers[0], layer), tensors=tuple(tensors))


def test_layout_puts_each_expert_in_one_aligned_page():
    before = _moe_model()
    program = Program(before, {t.name: (lambda: None) for t in before.tensors})
    after = run_passes(program, [layout_experts], PassContext()).model
    p = "layers.1.ffn.experts."
    page = [p + "{e}.gate.weight", p + "{e}.up.weight", p + "{e}.down.weight", p + "{e}.down.bias"]
    others = [t.name for t in before.tensors if ".experts." not in t.name]
    expected_order = others + [n.format(e=e) for e in range(2) for n in page]
    aligned = {n.format(e=e) for e in range(2) for n in page[:3]}
    records = before.tensor_map()
    expected = dataclasses.replace(before, tensors=tuple(
        dataclasses.replace(records[n], align=PAGE) if n in aligned else records[n] for n in expected_order))
    assert after == expected
    dense = tiny_model()
    program = Program(dense, {t.name: (lambda: None) for t in dense.tensors})
    assert run_passes(program, [layout_experts], PassContext()).model == dense


@pytest.fixture(scope="module")
def mixtral_q2(tmp_path_factory):
    """A tiny Mixtral (dimensions q2's superblocks divide) compiled with --quant q2."""
    root = tmp_path_factory.mktemp("mixtral_q2")
    hf = build_model("mixtral", hidden_size=128, head_dim=32, intermediate_size=128, vocab_size=320)
    hf.save_pretrained(root / "ckpt", safe_serialization=True)
    write_tokenizer(root / "ckpt")
    return hf, compile_model(root / "ckpt", root / "q2.thin", quant="q2")


def test_q2_expert_pages_are_contiguous_and_aligned(mixtral_q2):
    _, path = mixtral_q2
    with open_artifact(path) as art:
        pages = expert_pages(art)
        experts = [t for t in art.model.tensors if t.expert is not None]
        assert {t.encoding.format for t in experts} == {"q2"}
        assert sorted(pages) == [(layer, e) for layer in range(2) for e in range(4)]
        for (layer, e), (offset, length) in pages.items():
            assert offset % PAGE == 0 and (offset, length) == expert_page(art, layer, e)
            mine = sorted((art.tensor_entry(t.name) for t in experts if (t.layer, t.expert) == (layer, e)),
                          key=lambda entry: entry.offset)
            assert [x.name.rsplit(".", 2)[1] for x in mine] == ["gate_up", "down"]
            assert all(x.offset % PAGE == 0 for x in mine)
            assert mine[0].offset == offset and mine[-1].offset + mine[-1].size == offset + length
            # The page holds exactly this expert's bytes (and the padding between them).
            data = bytes(art.buffer(mine[0].name)), bytes(art.buffer(mine[1].name))
            with open(path, "rb") as f:
                f.seek(offset)
                page = f.read(length)
            assert page.startswith(data[0]) and page.endswith(data[1])
        spans = sorted(pages.values())
        assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_q2_mixtral_computes_what_q2_defines(mixtral_q2):
    """The packed q2 experts run through the layout: logits as transformers with every projection
    weight replaced by decode(encode(w)), as for the other quantized families (test_quant_e2e)."""
    from test_quant_e2e import _reference_with_round_tripped_weights

    hf, path = mixtral_q2
    model = load(path)
    ids = torch.arange(5, 53) % 320
    with torch.no_grad():
        want = _reference_with_round_tripped_weights(hf, "q2")(ids[None]).logits[0].float()
    got = model.forward(ids)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99999
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_an_expert_split_by_another_tensor_is_a_layout_error(mixtral_q2, tmp_path):
    _, path = mixtral_q2
    bad = tmp_path / "split.thin"
    with open_artifact(path) as art, ArtifactWriter(bad) as writer:
        names = art.tensor_names()
        moved = "layers.0.ffn.experts.1.down.weight"
        for name in [n for n in names if n != moved] + [moved]:
            writer.add_tensor(name, art.numpy(name), align=art.tensor_entry(name).align)
        writer.commit(art.model, {name: art.section(name) for name in ("tokenizer", "chat_template")})
    with open_artifact(bad) as art, pytest.raises(LayoutError, match="expert 1 of layer 0 is not contiguous"):
        expert_pages(art)
