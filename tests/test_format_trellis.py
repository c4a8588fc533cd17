"""The `trellis` format against its byte contract (ir/formats/trellis.py's docstring): hand-built bytes
decode to the contract's formula, the encoder's error on Gaussian weights, GPTQ's block feedback, shape
checks, stacking rows and decoding row subsets (the runtime's CPU path)."""

from __future__ import annotations

import itertools

import pytest
import torch

from thin.ir import formats
from thin.ir.formats import trellis
from thin.passes.gptq import gptq, gptq_many, inverse_cholesky, output_error

FMT = formats.get("trellis")
NORM = (4 * (2**16 - 1) / 12) ** 0.5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _c(s: int) -> int:
    """The contract's codeword, in plain integers."""
    h = (s * 0x2F6B4E95 + 0x1D3C5A17) % 2**32
    return sum((h >> (8 * i)) & 0xFF for i in range(4)) - 510


def _value(c: int, scale: float) -> torch.Tensor:
    """c * (row_scale / NORM) in float32, the scale's factor rounded once (the reference's order)."""
    factor = torch.tensor(scale, dtype=torch.float16).float() / torch.tensor(NORM, dtype=torch.float32)
    return torch.tensor(c, dtype=torch.float32) * factor


def _blob(chunks: dict, n: int, cols: int, k: int, scales) -> torch.Tensor:
    """Bytes laid out by the contract from the chunks {(tile row band, tile column, t): b} (others 0)."""
    codes = torch.zeros(n, cols * k // 8, dtype=torch.uint8)
    for r in range(n):
        for b in range(cols // 16):
            i = r % 16
            s = sum(chunks.get((r // 16, b, 16 * i + j), 0) << ((15 - j) * k) for j in range(16))
            codes[r, 2 * k * b:2 * k * (b + 1)] = torch.tensor(list(s.to_bytes(2 * k, "little")), dtype=torch.uint8)
    return FMT.join({"codes": codes, "row_scale": torch.tensor(scales, dtype=torch.float16)}, (n, cols),
                    (("bits", k),))


def _stream_decode(chunks: dict, n: int, cols: int, k: int, scales) -> torch.Tensor:
    """The contract's sequence form: s_t = sum_m b_{(t - m) mod 256} << (k m) over each tile's stream."""
    out = torch.empty(n, cols)
    for r, col in itertools.product(range(n), range(cols)):
        a, b, t = r // 16, col // 16, 16 * (r % 16) + col % 16
        s = sum(chunks.get((a, b, (t - m) % 256), 0) << (k * m) for m in range(12 // k))
        out[r, col] = _value(_c(s), scales[r])
    return out


@pytest.mark.parametrize("k", [2, 3])
def test_hand_built_bytes_decode_to_the_contract(k):
    # All chunks 0: every state is 0, c(0) = 0x1D + 0x3C + 0x5A + 0x17 - 510 = -308.
    zero = FMT.decode(_blob({}, 16, 16, k, [1.0] * 16), (16, 16), (("bits", k),))
    assert _c(0) == -308 and torch.equal(zero, _value(-308, 1.0).expand(16, 16))
    # One chunk at the end of the tile (row 15, column 15) feeds the circular first row: s_0 = b_255 << k,
    # s_1 = b_255 << 2k, ... ; one at the end of row 2 feeds the first column of row 3's segment.
    b = 2**k - 1
    chunks = {(0, 0, 255): b, (0, 0, 16 * 2 + 15): 1}
    got = FMT.decode(_blob(chunks, 16, 16, k, [1.0] * 16), (16, 16), (("bits", k),))
    expect = {(15, 15): b, (2, 15): 1}
    expect.update({(0, m - 1): b << (k * m) for m in range(1, 12 // k)})
    expect.update({(3, m - 1): 1 << (k * m) for m in range(1, 12 // k)})
    for (r, col), s in expect.items():
        assert got[r, col] == _value(_c(s), 1.0), (r, col, s)
    others = torch.ones(16, 16, dtype=torch.bool)
    others[tuple(zip(*expect))] = False
    assert (got[others] == zero[others]).all()


@pytest.mark.parametrize("k", [2, 3])
def test_random_bytes_decode_to_the_sequence_form(k):
    """Random chunks over 2 x 3 tiles with mixed row scales (a zero row too): the vectorised decode is
    the contract's sequence form, tile bands and segments in their places."""
    g = torch.Generator().manual_seed(k)
    n, cols = 32, 48
    chunks = {(a, b, t): int(v) for a in range(2) for b in range(3) for t, v in
              enumerate(torch.randint(0, 2**k, (256,), generator=g))}
    scales = [0.0 if r == 7 else float(0.25 + r / 16) for r in range(n)]
    blob = _blob(chunks, n, cols, k, scales)
    assert blob.numel() == FMT.nbytes((n, cols), (("bits", k),))
    want = _stream_decode(chunks, n, cols, k, scales)
    assert torch.equal(FMT.decode(blob, (n, cols), (("bits", k),)), want)


@pytest.mark.parametrize("k, bound", [(2, 0.09), (3, 0.03)])
def test_encode_error_on_gaussian_weights(k, bound):
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    p = (("bits", k),)
    blob = FMT.encode(w, p)
    out = FMT.decode(blob, w.shape, p)
    assert FMT.bits_per_weight(w.shape, p) == k + 16 / 128
    assert float(((out - w) ** 2).sum() / (w**2).sum()) < bound
    # the stored scale is each row's rms in float16
    scales = FMT.split(blob, w.shape, p)["row_scale"]
    assert torch.equal(scales, w.pow(2).mean(1).sqrt().half())


def test_viterbi_weighs_each_position():
    """A per-position weight: the cheapest weighted path of a tiny trellis (every path checked)."""
    k, bits, steps = 2, 4, 5
    g = torch.Generator().manual_seed(5)
    values, x = torch.randn(2**bits, generator=g), torch.randn(2, steps, generator=g)
    weight = torch.rand(2, steps, generator=g) * 3

    def cost(row, states):
        return float((weight[row] * (x[row] - values[torch.tensor(states)]) ** 2).sum())

    found = trellis.viterbi(x, values, k, bits, weight=weight)
    for row in range(2):
        paths = [[sum(c[t + j] << (k * (bits // k - 1 - j)) for j in range(bits // k)) for t in range(steps)]
                 for c in itertools.product(range(2**k), repeat=bits // k + steps - 1)]
        assert found[row].tolist() in paths
        assert cost(row, found[row].tolist()) == pytest.approx(min(cost(row, p) for p in paths), rel=1e-5)


def test_importance_weighted_fit_lowers_the_weighted_error():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(32, 64, generator=g)
    importance = torch.exp(2 * torch.randn(64, generator=g))
    q = FMT.quantizer(w.shape, (("bits", 2),))
    q.start(w)
    plain, weighted = q.fit(w)["values"], q.fit(w, importance)["values"]
    assert float((importance * (weighted - w) ** 2).sum()) < 0.7 * float((importance * (plain - w) ** 2).sum())
    stacked = q.fit(w, importance.expand(32, 64))  # one row of importance per row: the same code
    assert torch.equal(stacked["values"], weighted)


def _problem(rows=32, cols=64, seed=1):
    """A weight and the second moments of inputs correlated across blocks, with a few loud channels."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    x = torch.randn(1024, cols, generator=g) @ mix
    x[:, :4] *= 8
    return torch.randn(rows, cols, generator=g), x.T @ x / x.shape[0]


@pytest.mark.parametrize("k", [2, 3])
def test_gptq_block_feedback_beats_plain_encoding(k):
    w, h = _problem()
    p = (("bits", k),)
    blob, w_hat = gptq(w, h, FMT, p)
    assert torch.equal(FMT.decode(blob, w.shape, p), w_hat)
    plain = FMT.decode(FMT.encode(w, p), w.shape, p)
    assert output_error(w, w_hat, h) < 0.8 * output_error(w, plain, h)


def test_gptq_feedback_is_block_ldlq():
    """The column sweep with a jointly coded block is BlockLDLQ: the block's codes come from the weights
    as updated by the blocks before it (under diag(H) as importance), W[:, rest] -= (W_J - Q_J) U_JJ^-1 U_J,rest."""
    w, h = _problem(rows=16, cols=48, seed=2)
    p = (("bits", 2),)
    _, w_hat = gptq(w, h, FMT, p)
    upper, damped = inverse_cholesky(h)
    q = FMT.quantizer(w.shape, p)
    q.start(w)
    work, want = w.clone(), torch.empty_like(w)
    for j in range(0, 48, 16):
        block = q.fit(work[:, j:j + 16], torch.diagonal(damped)[j:j + 16])["values"]
        want[:, j:j + 16] = block
        err = torch.linalg.solve_triangular(upper[j:j + 16, j:j + 16], work[:, j:j + 16] - block, upper=True,
                                            left=False)
        work[:, j + 16:] -= err @ upper[j:j + 16, j + 16:]
    torch.testing.assert_close(w_hat, want, rtol=0, atol=0)


def test_gptq_many_codes_every_weight_as_alone():
    problems = [_problem(rows=16, cols=32, seed=s) for s in (3, 4)]
    p = (("bits", 3),)
    blob, w_hat = gptq_many([w for w, _ in problems], [h for _, h in problems], FMT, p)
    for i, (w, h) in enumerate(problems):
        alone_blob, alone = gptq(w, h, FMT, p)
        assert torch.equal(w_hat[16 * i:16 * (i + 1)], alone)


def test_act_order_is_refused():
    w, h = _problem(rows=16, cols=32)
    with pytest.raises(ValueError, match="act_order"):
        gptq(w, h, FMT, (("bits", 2),), act_order=True)


@pytest.mark.parametrize("shape", [(24, 32), (32, 40), (8, 8)])
def test_shapes_off_the_tiles_are_one_line_errors(shape):
    problems = FMT.check(shape)
    assert len(problems) == 1 and "\n" not in problems[0]
    assert "trellis" in problems[0] and str(shape) in problems[0] and "16" in problems[0]
    with pytest.raises(ValueError, match="multiples of 16"):
        FMT.encode(torch.zeros(shape))
    assert formats.check("trellis", (32, 48), (("bits", 3),)) == []


def test_stacked_rows_decode_to_the_stacked_weights():
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(32, 64, generator=g), 3 * torch.randn(16, 64, generator=g)
    p = (("bits", 2),)
    blobs = [FMT.encode(a, p), FMT.encode(b, p)]
    stacked = FMT.stack_rows(blobs, [a.shape, b.shape], p)
    want = torch.cat([FMT.decode(blobs[0], a.shape, p), FMT.decode(blobs[1], b.shape, p)])
    assert torch.equal(FMT.decode(stacked, (48, 64), p), want)


def test_row_subsets_and_column_prefixes_decode_whole_tile_bands():
    """The runtime's CPU path decodes blocks of rows and column prefixes: a row needs its tile's
    previous row, so a subset that cuts a band still decodes to the same numbers."""
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(7))
    p = (("bits", 3),)
    blob = FMT.encode(w, p)
    full = FMT.decode(blob, w.shape, p)
    assert torch.equal(FMT.decode_rows(blob, w.shape, p, slice(5, 37)), full[5:37])
    assert torch.equal(FMT.decode_rows(blob, w.shape, p, slice(0, 48, 5)), full[0:48:5])
    index = torch.tensor([47, 0, 17, 17, 16])
    assert torch.equal(FMT.decode_rows(blob, w.shape, p, index), full[index])
    assert torch.equal(FMT.decode_prefix(blob, w.shape, p, slice(3, 20), 32), full[3:20, :32])
    with pytest.raises(ValueError, match="16-column"):
        FMT.decode_prefix(blob, w.shape, p, None, 8)
