"""Every family, compiled unquantized into a .thin file and loaded back, is the model transformers runs."""

import pytest
import torch

from thin.compiler import compile_model
from thin.runtime import load

from hf_tiny import FAMILIES, load_reference, make_checkpoint

POSITIONS = 48  # longer than the tiny configs' sliding window (8)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    family = request.param
    src = make_checkpoint(family, tmp_path_factory.mktemp(family))
    thin_model = load(compile_model(src, tmp_path_factory.mktemp("out") / f"{family}.thin"))
    return family, thin_model, load_reference(src)


def test_logits_match_transformers(pair):
    family, ours, ref = pair
    ids = torch.randint(3, ref.config.vocab_size, (POSITIONS,), generator=torch.Generator().manual_seed(1))
    got = ours.forward(ids)
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.9999, f"{family}: min cosine {cos.min():.6f}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), family


def test_greedy_generation_matches_transformers(pair):
    family, ours, ref = pair
    prompt = torch.randint(3, ref.config.vocab_size, (6,), generator=torch.Generator().manual_seed(2))
    # No stop tokens on either side, so all 32 tokens are compared.
    got = list(ours.generate(prompt.tolist(), max_new_tokens=32, temperature=0.0, stop_token_ids=()))
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = ref.generate(prompt[None], max_new_tokens=32, do_sample=False, attention_mask=torch.ones(1, 6,
                            dtype=torch.long))[0, 6:].tolist()
    assert len(want) == 32
    assert got == want, family
