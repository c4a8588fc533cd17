"""`load()` on a small hand-written artifact: forward, generate, chat, perplexity, verify."""

import json
import warnings

import pytest
import torch

from thin.artifacts import ArtifactError, ArtifactWriter, ChecksumMismatchError
from thin.ir import formats
from thin.runtime import DeviceUnavailableError, ThinModel, load
from thin.runtime.executor import Executor

from ir_fixtures import tiny_model
from tiny_tokenizer import CHATML, write_tokenizer

MAX_NEW = 6


def write_tiny_artifact(path, tmp_dir, *, do_sample=False, chat_template=CHATML):
    """A random 2-layer Llama-shaped model with a real byte-level BPE tokenizer; returns eos id."""
    eos = write_tokenizer(tmp_dir)
    files = {name: (tmp_dir / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")}
    vocab = json.loads(files["tokenizer.json"])["model"]["vocab"]
    model = tiny_model(vocab=len(vocab) + 3)  # padded past the tokenizer, as checkpoints often are
    g = torch.Generator().manual_seed(0)
    with ArtifactWriter(path) as writer:
        for t in model.tensors:
            data = torch.randn(t.shape, generator=g) * (1.0 if "norm" in t.role else 0.3)
            if "norm" in t.role:
                data = data.abs() + 0.5
            writer.add_tensor(t.name, formats.encode(t.encoding.format, data).numpy())
        writer.commit(model, {"tokenizer": files, "chat_template": chat_template,
                              "generation_config": {"do_sample": do_sample, "eos_token_id": eos,
                                                    "max_new_tokens": MAX_NEW, "temperature": 0.9}})
    return eos


@pytest.fixture(scope="module")
def artifact_path(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("art")
    path = tmp / "tiny.thin"
    write_tiny_artifact(path, tmp)
    return path


@pytest.fixture(scope="module")
def model(artifact_path) -> ThinModel:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zero-copy loading must not warn about read-only buffers
        return load(artifact_path)


def test_forward_matches_an_executor_on_the_same_weights(model, artifact_path):
    ids = model.encode("def push(self, x):")
    logits = model.forward(ids)
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), model.ir.vocab_size)
    from thin.artifacts import open_artifact

    art = open_artifact(artifact_path)
    # Copies of the bytes, so the executor below shares nothing with the loaded model.
    weights = {t.name: torch.frombuffer(bytearray(art.buffer(t.name)), dtype=torch.uint8)
               for t in art.model.tensors}
    expected = Executor(art.model, weights.__getitem__).forward(torch.tensor(ids))
    torch.testing.assert_close(logits, expected)


def test_generate_streams_greedy_tokens_and_respects_defaults(model):
    prompt = model.encode("class Stack:")
    got = list(model.generate(prompt))
    assert len(got) <= MAX_NEW  # generation_config's max_new_tokens
    # Greedy (do_sample false): each token is the argmax of a full recompute.
    ids = list(prompt)
    for token in got:
        assert token == int(model.forward(ids)[-1].argmax())
        ids.append(token)
    assert model.last_stats.prompt_tokens == len(prompt)
    assert list(model.generate("class Stack:", max_new_tokens=3)) == got[:3]


def test_sampling_options_and_seeds(model):
    a = list(model.generate("def", max_new_tokens=8, temperature=1.5, seed=1, stop_token_ids=[]))
    assert a == list(model.generate("def", max_new_tokens=8, temperature=1.5, seed=1, stop_token_ids=[]))
    assert len(a) == 8
    with pytest.raises(ValueError, match="top_p"):
        model.generate("def", top_p=2.0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        list(model.generate("def", max_new_tokens=1000))


def test_stop_ids_include_generation_config_and_tokenizer_eos(model):
    assert model.tokenizer.eos_token_id in model.stop_token_ids
    assert model.generation_options().stop_token_ids == model.stop_token_ids


def test_chat_and_perplexity(model):
    text = model.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    result = model.perplexity("def fibonacci(n):\n    return n\n")
    assert result.num_tokens > 5 and 1.0 < result.perplexity < 10 * model.ir.vocab_size


def test_verify_names_the_damaged_tensor(artifact_path, tmp_path):
    from thin.artifacts import open_artifact

    damaged = tmp_path / "damaged.thin"
    data = bytearray(artifact_path.read_bytes())
    art = open_artifact(artifact_path)
    entry = art.tensor_entry("layers.1.attn.k.weight")
    data[entry.offset + 5] ^= 0xFF
    damaged.write_bytes(bytes(data))
    load(damaged)  # without verify, damage inside tensor data goes unseen
    with pytest.raises(ChecksumMismatchError, match="layers.1.attn.k.weight"):
        load(damaged, verify=True)


def test_bad_device_and_bad_file(artifact_path, tmp_path):
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError, match="cuda"):
            load(artifact_path, device="cuda")
    garbage = tmp_path / "garbage.thin"
    garbage.write_bytes(b"not a thin file" * 10)
    with pytest.raises(ArtifactError):
        load(garbage)
