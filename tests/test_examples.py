"""The shipped trained models compile exactly: same perplexity and greedy text as transformers."""

from pathlib import Path

import pytest
import torch

from thin.compiler import compile_model
from thin.compiler.corpus import heldout_text
from thin.runtime import load
from thin.runtime.perplexity import evaluate_perplexity

MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"
PROMPT = "def fibonacci(n):"


class _Reference:
    """transformers behind the `.forward(ids) -> float32 logits [T, vocab]` interface perplexity uses."""

    def __init__(self, model):
        self.model = model
        self.ir = None

    def forward(self, ids):
        with torch.no_grad():
            return self.model(ids[None]).logits[0].float()


@pytest.fixture(scope="module", params=["tiny-coder", "tiny-coder-moe"])
def pair(request, tmp_path_factory):
    import transformers

    src = MODELS / request.param
    ours = load(compile_model(src, tmp_path_factory.mktemp("ex") / f"{request.param}.thin"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(src)
    return request.param, ours, ref, tok


def test_heldout_perplexity_matches_transformers(pair):
    name, ours, ref, tok = pair
    ids = ours.encode(heldout_text())[:3072]
    assert ids == tok(heldout_text())["input_ids"][:3072]
    got = evaluate_perplexity(ours, ids, context=512, stride=256)
    want = evaluate_perplexity(_Reference(ref), ids, context=512, stride=256)
    assert abs(got.perplexity - want.perplexity) / want.perplexity < 1e-3, (name, got, want)
    # A trained model, not noise: far below the vocabulary size (4096).
    assert got.perplexity < 40, (name, got)


def test_greedy_continuation_matches_transformers(pair):
    name, ours, ref, tok = pair
    ids = tok(PROMPT)["input_ids"]
    got = list(ours.generate(ids, max_new_tokens=48, temperature=0.0, stop_token_ids=()))
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
    assert got == want, name
    text = tok.decode(got)
    assert "return" in text or "if " in text, text  # it writes Python
