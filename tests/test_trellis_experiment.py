"""The trellis-code experiment (examples/benchmarks/trellis.py): Viterbi finds the cheapest path of a
tiny trellis (checked against every path), and the stored bitstream decodes to the chosen codewords."""

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

_SPEC = importlib.util.spec_from_file_location(
    "trellis_experiment", Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "trellis.py")
trellis = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(trellis)

K, L, T = 2, 4, 5  # 16 states, 4 successors each, 5 weights


def _paths(overlap=None):
    """Every state sequence of the tiny trellis (tail-biting ones with `overlap` when given)."""
    for bits in itertools.product(range(2 ** K), repeat=L // K + T - 1):
        states = [sum(bits[t + j] << (K * (L // K - 1 - j)) for j in range(L // K)) for t in range(T)]
        if overlap is None or (states[0] >> K == overlap and states[-1] & (2 ** (L - K) - 1) == overlap):
            yield states


def _cost(x, values, states):
    return float(((x - values[torch.tensor(states)]) ** 2).sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_viterbi_is_the_cheapest_path(seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(2 ** L, generator=g)
    x = torch.randn(3, T, generator=g)
    found = trellis.viterbi(x, values, K, L)
    for b in range(3):
        best = min(_cost(x[b], values, p) for p in _paths())
        assert list(found[b].tolist()) in [list(p) for p in _paths()]  # a path of the trellis
        assert _cost(x[b], values, found[b].tolist()) == pytest.approx(best, rel=1e-5)
    overlap = torch.tensor([0, 2, 3])
    held = trellis.viterbi(x, values, K, L, overlap)
    for b in range(3):
        paths = list(_paths(int(overlap[b])))
        assert held[b].tolist() in paths
        assert _cost(x[b], values, held[b].tolist()) == pytest.approx(min(_cost(x[b], values, p) for p in paths),
                                                                       rel=1e-5)


def test_stream_decodes_to_the_chosen_codewords():
    g = torch.Generator().manual_seed(3)
    for k, bits in ((2, 8), (3, 9), (2, 12)):
        values = trellis.codebook(bits, "hash", k)
        x = torch.randn(4, 32, generator=g)
        states = trellis.encode(x, values, k, bits)
        chunks = trellis.pack(states, k)
        assert int(chunks.max()) < 2 ** k  # k bits per weight
        assert torch.equal(trellis.unpack(chunks, k, bits), states)  # tail-biting: the stream is all there is
        assert torch.equal(trellis.decode(chunks, values, k, bits), values[states])
        assert float(((values[states] - x) ** 2).mean()) < 0.2 * float((x ** 2).mean())


def test_tiles_round_trip_and_block_feedback_reduce_the_objective():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(2, 32, 48, generator=g)
    assert torch.equal(trellis.untiles(trellis.tiles(w), 2, 32, 48), w)
    x = torch.randn(400, 48, generator=g) * torch.linspace(0.2, 3, 48)
    x[:, 1::2] += x[:, ::2]  # correlated inputs, where error feedback has something to do
    h = x.T @ x / 400
    from thin.passes.gptq import inverse_cholesky, output_error

    upper, _ = inverse_cholesky(h)
    books = {2: trellis.codebook(8, "hash", 2)}
    plain = trellis.trellis_gptq(w, None, books, 2, 8)
    fed = trellis.trellis_gptq(w, torch.stack([upper, upper]), books, 2, 8)
    assert sum(output_error(a, b, h) for a, b in zip(w, fed)) < sum(output_error(a, b, h) for a, b in zip(w, plain))
