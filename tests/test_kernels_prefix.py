"""Elastic FFN prefixes on the Triton kernels (thin.ir.FFNLevel): the first rows of each half of a
[gate; up] weight and the first columns of a down weight, read in place, against the format's
reference decode (under TRITON_INTERPRET=1 on the CPU)."""

import pytest
import torch
from kernel_support import DEVICE, poisoned, rel_err, tolerance
from linear_kernel_cases import make_op

from thin.runtime.ffn import activate

CASES = [
    ("int4", {"group_size": 32, "asymmetric": 1}, True),
    ("int3", {"group_size": 128}, False),
    ("int8", {}, True),
    ("fp8_e4m3", {}, False),
    ("mxfp4", {}, False),
    ("q2", {"group_size": 16}, False),
    ("q1", {"group_size": 128}, False),
    ("bf16", {}, True),
]
N, K, ROWS, COLS = 512, 384, 128, 256  # a [gate; up] of two 256-row halves; prefixes of whole superblocks


@pytest.mark.parametrize("fmt,params,bias", CASES, ids=[c[0] for c in CASES])
def test_prefix_matvec_and_matmul_match_the_decoded_prefix(fmt, params, bias):
    dtype = torch.float32 if fmt != "bf16" else torch.bfloat16
    op, dense, b = make_op(fmt, (N, K), params, dtype=dtype, bias=bias)
    weights = {name: t.data_ptr() for name, t in op.parts.items()}
    bias_f = b.float().cpu() if b is not None else torch.zeros(N)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(K, generator=gen).to(dtype).to(DEVICE)
    h = torch.randn(COLS, generator=gen).to(dtype).to(DEVICE)
    tol = tolerance(dtype)
    # Rows: the first ROWS outputs.
    got = op.matvec(x, out=poisoned(ROWS, dtype=dtype), rows=ROWS)
    assert got.shape == (ROWS,)
    assert rel_err(got, x.float().cpu() @ dense[:ROWS].T + bias_f[:ROWS]) < tol
    # Columns: the first COLS of every row, as the output and as split-K partial sums.
    want = h.float().cpu() @ dense[:, :COLS].T
    assert rel_err(op.matvec(h, cols=COLS), want + bias_f) < tol
    sums = op.matvec(h, partials=poisoned(8, N, dtype=torch.float32), cols=COLS)
    assert rel_err(sums.sum(0), want) < 2e-5
    # Gate/up: act(gate) * up over the first ROWS of each half.
    y = (x.float().cpu() @ dense.T + bias_f).to(dtype)
    gate, up = y[:ROWS], y[N // 2:N // 2 + ROWS]
    got = op.matvec(x, out=poisoned(ROWS, dtype=dtype), activation="silu", rows=ROWS)
    assert rel_err(got, activate("silu", gate) * up) < 2 * tol
    # Prefill (several rows of activations): rows of both halves side by side, and leading columns.
    w = dense.to(dtype).float()
    xs = torch.randn(5, K, generator=gen).to(dtype).to(DEVICE)
    halves = torch.cat([w[:ROWS], w[N // 2:N // 2 + ROWS]])
    both = torch.cat([bias_f[:ROWS], bias_f[N // 2:N // 2 + ROWS]])
    assert rel_err(op.prefix(xs, rows=ROWS, halves=2), xs.float().cpu() @ halves.T + both) < tol
    hs = torch.randn(5, COLS, generator=gen).to(dtype).to(DEVICE)
    assert rel_err(op.prefix(hs, cols=COLS), hs.float().cpu() @ w[:, :COLS].T + bias_f) < tol
    # One row through prefix() is the matvec; nothing was copied or re-laid.
    assert rel_err(op.prefix(h[None], cols=COLS)[0], want + bias_f) < tol
    assert {name: t.data_ptr() for name, t in op.parts.items()} == weights


def test_a_prefix_that_does_not_fit_is_refused():
    op, _, _ = make_op("int4", (N, K), {"group_size": 32})
    with pytest.raises(ValueError):
        op.prefix(torch.zeros(2, K, device=DEVICE), rows=300, halves=2)
    with pytest.raises(ValueError):
        op.prefix(torch.zeros(2, 512, device=DEVICE), cols=512)


@pytest.mark.parametrize("fmt,params", [("int4", {"group_size": 32}), ("int8", {}), ("q2", {"group_size": 16}),
                                        ("fp8_e4m3", {}), ("f32", {})])
def test_a_column_prefix_takes_a_split_k_that_divides_it(fmt, params):
    from thin.runtime.kernels.common import MatvecConfig, prefix_split

    op, dense, _ = make_op(fmt, (64, K), params)
    base = op.config("partial", cols=COLS)
    # Three programs along the prefix's columns, which do not split its 256 columns in three, and
    # along the whole weight's.
    op._configs[("partial", None, COLS)] = op._configs["partial"] = MatvecConfig(base.block_n, base.chunk, 3,
                                                                                 base.num_warps)
    h = torch.randn(COLS, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    sums = op.matvec(h, partials=poisoned(8, 64, dtype=torch.float32), cols=COLS)
    assert 1 <= sums.shape[0] <= 3 and torch.isfinite(sums).all()
    assert rel_err(sums.sum(0), h.cpu() @ dense[:, :COLS].T) < 2e-5
    full = op.matvec(torch.randn(K, generator=torch.Generator().manual_seed(8)).to(DEVICE),
                     partials=poisoned(8, 64, dtype=torch.float32))
    assert full.shape[0] == 3
    assert prefix_split(MatvecConfig(4, 64, 4), 14, 2).split == 2  # 14 = 2 x 7: whole steps of 2 each
    assert prefix_split(MatvecConfig(4, 64, 8), 12, 2).split == 6
    assert prefix_split(MatvecConfig(4, 64, 8), 7, 2).split == 7 and prefix_split(MatvecConfig(4, 64, 4), 7).split == 1


def test_a_prefix_has_the_configuration_of_a_weight_of_its_shape(monkeypatch):
    """A prefix's candidates are those of a weight of the prefix's shape (its own tiles, splits and
    steps, not the whole weight's cut to fit), chosen and kept apart from the whole weight's; a
    prefix of everything is the weight itself."""
    from thin.runtime.kernels import common

    monkeypatch.setattr(common, "interpreting", lambda: False)  # the GPU's candidate lists
    monkeypatch.setattr(common, "sm_count", lambda: 132)
    for fmt, params in (("int4", {"group_size": 128}), ("int8", {}), ("q2", {"group_size": 16})):
        op = make_op(fmt, (4096, 4480), params)[0]
        cut = make_op(fmt, (4096, 1792), params)[0]
        assert op.candidates("partial", None, 1792) == cut.candidates("partial")
        assert op.candidates("partial", None, 1792) != op.candidates("partial")
        gate_up = make_op(fmt, (2 * 1792, 128), params)[0]
        assert make_op(fmt, (2 * 4480, 128), params)[0].candidates("glu", 1792) == gate_up.candidates("glu")
    monkeypatch.undo()
    op = make_op("int4", (N, K), {"group_size": 32})[0]
    whole, prefix = op.config("partial"), op.config("partial", cols=COLS)
    assert set(op._configs) == {"partial", ("partial", None, COLS)}
    assert op.config("partial", cols=K) is whole and op.config("glu", rows=N // 2) is op.config("glu")
    assert prefix == op.candidates("partial", None, COLS)[0]  # the interpreter takes the first


def test_a_prefix_split_past_the_partials_buffer_writes_no_more_rows_than_it_has():
    from thin.runtime.kernels.common import MatvecConfig

    op, dense, _ = make_op("int4", (64, K), {"group_size": 32})
    base = op.config("partial", cols=COLS)
    op._configs[("partial", None, COLS)] = MatvecConfig(base.block_n, base.chunk, 4, base.num_warps)
    h = torch.randn(COLS, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    buffer = poisoned(3, 64, dtype=torch.float32)
    sums = op.matvec(h, partials=buffer, cols=COLS)
    assert sums.shape[0] == 2 and torch.isfinite(buffer[:2]).all() and torch.isnan(buffer[2]).all()
    assert rel_err(sums.sum(0), h.cpu() @ dense[:, :COLS].T) < 2e-5


@pytest.mark.parametrize("fmt,params,dtype", [("int4", {"group_size": 32}, torch.bfloat16),
                                              ("int4", {"group_size": 32, "asymmetric": 1}, torch.float32),
                                              ("int8", {}, torch.bfloat16)])
def test_a_gate_up_scale_is_the_product_times_the_scale_rounded_as_torch_rounds_it(fmt, params, dtype):
    """An elastic level's per-channel scale: in the int kernels' epilogue (no launch of its own), else
    multiplied after; either way (act(gate) * up) rounded, times the scale, rounded: on a GPU exactly
    the torch product (Triton's interpreter rounds to bfloat16 toward zero, torch to nearest)."""
    op, _, _ = make_op(fmt, (N, K), params, dtype=dtype, bias=True)
    assert op.glu_scale == (fmt == "int4")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(K, generator=gen).to(dtype).to(DEVICE)
    scale = (1 + torch.rand(ROWS, generator=gen)).to(dtype).to(DEVICE)
    plain = op.matvec(x, out=poisoned(ROWS, dtype=dtype), activation="silu", rows=ROWS)
    got = op.matvec(x, out=poisoned(ROWS, dtype=dtype), activation="silu", rows=ROWS, scale=scale)
    want = plain * scale
    assert torch.equal(got, want) if DEVICE.type == "cuda" or dtype == torch.float32 else \
        rel_err(got, want) < 2 ** -7 and rel_err(plain, want) > 0.1
    if op.glu_scale:
        with pytest.raises(ValueError, match="scale must match"):
            op._matvec(x, poisoned(ROWS, dtype=dtype), op.config("glu", ROWS), 0, False, ROWS, scale=scale[:64])


def test_precompile_takes_each_prefix_apart_from_the_whole_weight(monkeypatch):
    """precompile's (op, mode, rows, cols) uses: a prefix's candidates are compiled with that prefix, once;
    a prefix of the whole weight is the weight's own use, and a chosen prefix is skipped."""
    import contextlib

    from thin.runtime.kernels import tuning

    launched = []
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_launcher", lambda op, config, mode, rows=None, cols=None:
                        lambda: launched.append((mode, rows, cols, config)))
    monkeypatch.setattr(tuning, "cache_key", lambda op, mode, *_: mode)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(tuning.TuneCache, "get", classmethod(lambda cls: type(
        "Cache", (), {"lookup": lambda self, key: None})()))

    class Op:
        device, in_features, out_features, tune = torch.device("cuda"), 4096, 8192, True
        _configs = {("partial", None, 1024): "chosen"}

        def candidates(self, mode, rows=None, cols=None):
            return ["a", "b"]

    op = Op()
    uses = [(op, "glu"), (op, "glu", 2048, None), (op, "glu", 4096, None), (op, "partial", None, 1024),
            (op, "partial", None, 2048), (op, "partial", None, 2048)]
    assert tuning.precompile(uses, workers=1) == 6
    assert sorted(launched, key=repr) == sorted(((mode, rows, cols, c) for mode, rows, cols in
                                                 (("glu", None, None), ("glu", 2048, None), ("partial", None, 2048))
                                                 for c in "ab"), key=repr)
