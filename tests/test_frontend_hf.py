"""The Hugging Face frontend: IR per family, the ledger, and every way a checkpoint can be refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from thin.compiler.hf import (
    ADAPTERS,
    CheckpointError,
    FrontendError,
    LedgerError,
    PickleCheckpointError,
    UnsupportedArchitectureError,
    UnsupportedConfigError,
    load_checkpoint,
    register,
)
from thin.ir import MoE, formats, verify

from hf_tiny import FAMILIES, build_model, make_checkpoint

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _copy(src, dst):
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family", FAMILIES)
def test_ir_verifies_and_loads_every_tensor(family, tmp_path):
    source = load_checkpoint(make_checkpoint(family, tmp_path))
    model = source.program.model
    verify(model)
    assert model.family == family
    for t in model.tensors:
        assert t.encoding.format == t.source_dtype == "f32"
        raw = source.program.load(t.name)  # encoded bytes, which f32 decodes back to the tensor
        assert raw.dtype == torch.uint8 and raw.dim() == 1, t.name
        assert tuple(formats.decode("f32", raw, t.shape).shape) == t.shape, t.name
    assert set(source.program.weights) == {t.name for t in model.tensors}
    assert source.config["architectures"] == [model.architecture]
    assert source.generation_config.get("eos_token_id") == 2
    assert tmp_path / "config.json" in source.files and tmp_path / "model.safetensors" in source.files


def test_family_features_reach_the_ir(tmp_path):
    gemma = load_checkpoint(make_checkpoint("gemma3", tmp_path / "g")).program.model
    windows = [layer.attention.sliding_window for layer in gemma.layers]
    assert windows == [8, None, 8]
    assert gemma.layers[0].attention.rope.theta == 10000.0 and gemma.layers[1].attention.rope.kind == "linear"
    assert gemma.layers[0].attn_post_norm.weight_offset == 1.0 and gemma.embedding.scale == 8.0
    assert not gemma.lm_head.tied
    gemma2 = load_checkpoint(make_checkpoint("gemma2", tmp_path / "g2")).program.model
    assert gemma2.lm_head.tied and gemma2.lm_head.weight == "embed.weight"
    assert not any(t.name == "lm_head.weight" for t in gemma2.tensors) and gemma2.lm_head.final_softcap == 3.0
    moe = load_checkpoint(make_checkpoint("qwen3_moe", tmp_path / "m")).program.model
    assert [isinstance(layer.ffn, MoE) for layer in moe.layers] == [True, False, True]  # mlp_only_layers=[1]
    experts = [t for t in moe.tensors if t.role.startswith("moe.expert")]
    assert {t.expert for t in experts} == set(range(8)) and len(experts) == 2 * 8 * 3
    phi = load_checkpoint(make_checkpoint("phi3", tmp_path / "p")).program.model
    assert phi.layers[0].attention.qkv is not None and phi.layers[0].ffn.gate_up is not None
    assert phi.layers[0].attention.rope.rotary_dim == 8


def _v4_config(path, family):
    """Rewrite a v5 config.json in transformers v4's spelling (rope_theta/rope_scaling, no layer_types)."""
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    if family == "gemma3":
        config.pop("layer_types")
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope == {"rope_type": "default"} else rope
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2"])
def test_v4_config_spelling_gives_the_same_ir(family, tmp_path):
    path = make_checkpoint(family, tmp_path)
    v5 = load_checkpoint(path).program.model
    _v4_config(path, family)
    assert load_checkpoint(path).program.model == v5


def test_fused_expert_layout_is_sliced_per_expert(tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, H]) maps to the same IR tensors."""
    path = make_checkpoint("qwen3_moe", tmp_path / "per_expert")
    per_expert = load_checkpoint(path).program
    tensors = load_file(path / "model.safetensors")
    for i in (0, 2):
        p = f"model.layers.{i}.mlp.experts."
        gate_up = [torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
                   for e in range(8)]
        down = [tensors.pop(f"{p}{e}.down_proj.weight") for e in range(8)]
        tensors[p + "gate_up_proj"], tensors[p + "down_proj"] = torch.stack(gate_up), torch.stack(down)
    # A second folder: loaders read lazily, so the per-expert file must stay as it was.
    fused_dir = tmp_path / "fused"
    shutil.copytree(path, fused_dir)
    save_file(tensors, fused_dir / "model.safetensors", metadata={"format": "pt"})
    fused = load_checkpoint(fused_dir).program
    assert fused.model.tensors == per_expert.model.tensors
    for name in per_expert.weights:
        assert torch.equal(fused.load(name), per_expert.load(name)), name


def test_ledger_names_a_forgotten_tensor(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LedgerError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_checkpoint(path)


def test_declared_unused_tensors_pass_the_ledger(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load_checkpoint(path).program.weights


def test_unknown_architecture_names_it_and_the_supported_ones(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "ckpt")
    _edit_config(path, architectures=["FooForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "FooForCausalLM" in message and "LlamaForCausalLM" in message and "\n" not in message
    assert isinstance(info.value, FrontendError)


def test_unsupported_math_config_is_refused(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "ckpt")
    _edit_config(path, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedConfigError, match="dynamic"):
        load_checkpoint(path)
    _edit_config(path, rope_parameters=None, rope_theta=10000.0, hidden_act="swiglu_oai")
    with pytest.raises(UnsupportedConfigError, match="swiglu_oai"):
        load_checkpoint(path)


def test_pickle_checkpoint_is_refused_without_unpickling(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle: must never be opened")
    with pytest.raises(PickleCheckpointError, match="safetensors"):
        load_checkpoint(tmp_path)


def test_sharded_checkpoint_loads_like_a_single_file(llama_dir, tmp_path):
    build_model("llama").save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded, single = load_checkpoint(tmp_path), load_checkpoint(llama_dir)
    shards = [f for f in sharded.files if f.suffix == ".safetensors"]
    assert len(shards) > 1
    assert sharded.program.model == single.program.model
    for name in single.program.weights:
        assert torch.equal(sharded.program.load(name), single.program.load(name)), name


def test_missing_shard_is_named(tmp_path):
    build_model("llama").save_pretrained(tmp_path, max_shard_size="40KB")
    shard = max(tmp_path.glob("model-*.safetensors"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_checkpoint(tmp_path)


def test_truncated_safetensors_is_one_clear_line(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors") as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)


def test_missing_config_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path)


def test_tokenizer_files_and_chat_template(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "ckpt")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from-config"}))
    source = load_checkpoint(path)
    assert source.chat_template == "from-config"
    assert path / "tokenizer_config.json" in source.files
    (path / "chat_template.jinja").write_text("from-jinja")  # transformers v5 writes this file
    source = load_checkpoint(path)
    assert source.chat_template == "from-jinja"
    assert set(source.tokenizer_files) == {"tokenizer_config.json", "chat_template.jinja"}


def test_registering_an_architecture_twice_is_an_error():
    with pytest.raises(ValueError, match="twice"):
        register("LlamaForCausalLM", "llama")(lambda cfg, b: None)
    assert ADAPTERS["LlamaForCausalLM"].family == "llama"
