"""The HF frontend + torch executor reproduce transformers on random tiny checkpoints of every family.

For each family: full-sequence logits over 48 positions (past every sliding window), cached
decode (prefill half, then one token at a time) against the full forward, and 32 greedy
tokens against transformers' `generate`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from thin.compiler.hf import load_checkpoint
from thin.runtime.executor import Executor

from hf_tiny import FAMILIES, load_reference, make_checkpoint

pytest.importorskip("transformers")

SEQ = 48
MIN_COSINE = 0.9999


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    family = request.param
    path = make_checkpoint(family, tmp_path_factory.mktemp(family))
    source = load_checkpoint(path)
    return family, Executor(source.program.model, source.program.load), load_reference(path)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _reference_logits(reference, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(ids[None]).logits[0].float()


def test_full_forward_matches_transformers(case):
    family, executor, reference = case
    ids = _ids(SEQ)
    got, want = executor.forward(ids), _reference_logits(reference, ids)
    assert got.dtype == torch.float32 and got.shape == (SEQ, 256)
    cosine = F.cosine_similarity(got, want, dim=-1)
    assert cosine.min().item() > MIN_COSINE, f"{family}: worst position cosine {cosine.min().item():.6f}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{family}: argmax differs"


def test_cached_decode_matches_full_forward(case):
    family, executor, _ = case
    ids = _ids(SEQ, seed=1)
    full = executor.forward(ids)
    cache = executor.new_cache(SEQ)
    half = SEQ // 2
    steps = [executor.forward(ids[:half], cache)]
    steps += [executor.forward(ids[i:i + 1], cache) for i in range(half, SEQ)]
    assert cache.length == SEQ
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-4, rtol=1e-4, msg=f"{family}: cached decode")


def _greedy(executor: Executor, prompt: torch.Tensor, n: int) -> list[int]:
    cache = executor.new_cache(prompt.numel() + n)
    token = int(executor.forward(prompt, cache)[-1].argmax())
    out = [token]
    for _ in range(n - 1):
        token = int(executor.forward(torch.tensor([token]), cache)[-1].argmax())
        out.append(token)
    return out


def test_greedy_generation_matches_transformers(case):
    family, executor, reference = case
    prompt, n = _ids(12, seed=2), 32
    reference.generation_config.eos_token_id = None  # generate exactly n tokens
    with torch.no_grad():
        want = reference.generate(prompt[None], do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                  pad_token_id=0)[0, prompt.numel():].tolist()
    assert _greedy(executor, prompt, n) == want, f"{family}: greedy tokens differ"


def test_parity_check_can_fail(tmp_path):
    """Dropping Mistral's sliding window must break parity past the window (guards the test itself)."""
    path = make_checkpoint("mistral", tmp_path)
    source = load_checkpoint(path)
    model = source.program.model
    layers = tuple(
        dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, sliding_window=None))
        for layer in model.layers)
    wrong = Executor(dataclasses.replace(model, layers=layers), source.program.load)
    ids = _ids(SEQ)
    want = _reference_logits(load_reference(path), ids)
    cosine = F.cosine_similarity(wrong.forward(ids), want, dim=-1)
    assert cosine[:8].min() > MIN_COSINE  # inside the window nothing changes
    assert cosine[8:].min() < MIN_COSINE


def test_bf16_checkpoint_runs_at_stored_precision(tmp_path):
    """A bf16 checkpoint keeps bf16 encodings; on CPU the executor matches transformers upcast to float32."""
    path = make_checkpoint("qwen3", tmp_path, dtype=torch.bfloat16)
    source = load_checkpoint(path)
    assert {t.encoding.format for t in source.program.model.tensors} == {"bf16"}
    raw = source.program.load("embed.weight")  # the weight contract: encoded bytes, here bf16's
    assert raw.dtype == torch.uint8 and raw.numel() == 2 * source.program.model.vocab_size * 64
    executor = Executor(source.program.model, source.program.load)
    ids = _ids(SEQ)
    cosine = F.cosine_similarity(executor.forward(ids), _reference_logits(load_reference(path), ids), dim=-1)
    assert cosine.min().item() > MIN_COSINE
