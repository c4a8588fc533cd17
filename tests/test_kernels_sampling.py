"""Device sampling against runtime/sampling.py's filters: greedy, and a draw for a known uniform."""

import pytest
import torch
from kernel_support import DEVICE

from thin.runtime.sampling import GenerationOptions

V = 300


def _state(step=3, seed=11):
    z = lambda *s, dtype: torch.zeros(*s, dtype=dtype, device=DEVICE)  # noqa: E731
    token, out, seen = z(1, dtype=torch.long), z(16, dtype=torch.long), z(V, dtype=torch.int8)
    pos, steps = torch.tensor([7], dtype=torch.int32, device=DEVICE), torch.tensor([step], dtype=torch.int32,
                                                                                  device=DEVICE)
    return token, out, seen, pos, steps, torch.tensor([seed], dtype=torch.long, device=DEVICE)


def _uniform(seed, step):
    from thin.runtime.kernels.sampling import uniform_kernel

    out = torch.zeros(1, device=DEVICE)
    uniform_kernel[(1,)](torch.tensor([seed], device=DEVICE), torch.tensor([step], dtype=torch.int32, device=DEVICE),
                         out)
    return float(out)


def _pick(logits, options, seen_ids=(), step=3, seed=11, advance=True):
    from thin.runtime.kernels.sampling import Sampler

    token, out, seen, pos, steps, seeds = _state(step, seed)
    seen[list(seen_ids)] = 1
    Sampler(options, V, None)(logits.to(DEVICE), token, out, seen, pos, steps, seeds, advance_pos=advance)
    assert out[step] == token[0] and steps.item() == step + 1 and pos.item() == (8 if advance else 7)
    return int(token), seen


def test_greedy_takes_the_first_of_equal_maxima():
    logits = torch.randn(V)
    logits[[40, 170, 260]] = logits.max() + 1.0
    assert _pick(logits, GenerationOptions(temperature=0.0))[0] == 40


def test_greedy_over_several_blocks_takes_the_first_of_equal_maxima():
    """A vocabulary past one block of the greedy kernel (8192): equal maxima in different blocks and in
    the same lane of different blocks, the first one wins (as torch.argmax)."""
    from thin.runtime.kernels.sampling import Sampler

    vocab = 20000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    logits[[9000, 8192 + 9000, 1000 + 8192, 17000]] = logits.max() + 1.0
    token, out, seen, pos, steps, seeds = _state()
    seen = torch.zeros(vocab, dtype=torch.int8, device=DEVICE)
    Sampler(GenerationOptions(temperature=0.0), vocab, None)(logits.to(DEVICE), token, out, seen, pos, steps, seeds,
                                                           advance_pos=True)
    assert int(token) == int(logits.argmax()) == 9000


def test_greedy_with_repetition_penalty_marks_the_token_seen():
    from thin.runtime.kernels.sampling import reference_draw

    logits = torch.randn(V, generator=torch.Generator().manual_seed(1))
    top = int(logits.argmax())
    options = GenerationOptions(temperature=0.0, repetition_penalty=50.0)
    token, seen = _pick(logits, options, seen_ids=[top])
    mask = torch.zeros(V, dtype=torch.int8)
    mask[top] = 1
    assert token != top and token == reference_draw(logits, options, 0.0, mask)
    assert seen[token].item() == 1


@pytest.mark.parametrize("options", [
    dict(temperature=0.8, top_k=0, top_p=1.0),
    dict(temperature=1.3, top_k=20, top_p=1.0),
    dict(temperature=0.7, top_k=0, top_p=0.9),
    dict(temperature=1.0, top_k=50, top_p=0.8, min_p=0.05),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2),
])
def test_draw_matches_the_reference_for_the_same_uniform(options):
    from thin.runtime.kernels.sampling import reference_draw

    opts = GenerationOptions(**options)
    for trial in range(6):
        logits = 2 * torch.randn(V, generator=torch.Generator().manual_seed(trial))
        token, _ = _pick(logits, opts, step=trial, seed=5)
        assert token == reference_draw(logits, opts, _uniform(5, trial)), (options, trial)


def test_same_seed_same_token_other_seed_other_stream():
    logits = torch.zeros(V)  # uniform over the vocabulary: the draw is all randomness
    opts = GenerationOptions(temperature=1.0, top_k=0)
    first = [_pick(logits, opts, step=s, seed=3)[0] for s in range(8)]
    assert first == [_pick(logits, opts, step=s, seed=3)[0] for s in range(8)]
    assert first != [_pick(logits, opts, step=s, seed=4)[0] for s in range(8)]
