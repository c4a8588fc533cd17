"""The pieces of elastic FFN levels that need no model run: column prefixes of every format, the
LinearOp prefix (no weight copy), an MLP over a channel prefix against plain torch, the IR's level
checks and the --ffn-levels options."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from thin.ir import Encoding, FFNLevel, IRVerificationError, Tensor, formats, from_plain, to_plain, verify
from thin.ir.elastic import bytes_per_token, ffn_bytes, uniform_channels
from thin.runtime.ffn import MLPPlan, run_mlp
from thin.runtime.linear import DenseLinear, DequantLinear, row_blocks

from ir_fixtures import tiny_model

QUANTIZED = [(name, params) for name, params in (
    ("int4", (("group_size", 32),)), ("int4", (("asymmetric", 1), ("group_size", 128))), ("int3", ()),
    ("int6", (("group_size", 64),)), ("int8", ()), ("fp8_e4m3", ()), ("mxfp4", ()), ("q2", (("group_size", 16),)),
    ("q1", (("group_size", 128),)), ("bf16", ()), ("f32", ()))]


@pytest.mark.parametrize("name,params", QUANTIZED, ids=[f"{n}{dict(p)}" for n, p in QUANTIZED])
def test_a_column_prefix_decodes_the_first_columns_of_every_format(name, params):
    fmt = formats.get(name)
    shape = (12, 384)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    blob = fmt.encode(w, params)
    full = fmt.decode(blob, shape, params, torch.float32)
    for cols in (128, 256, 384):
        got = fmt.decode_prefix(blob, shape, params, rows=slice(3, 9), cols=cols, dtype=torch.float32)
        assert torch.equal(got, full[3:9, :cols])
    # Bytes read: the whole weight is the sum of its parts (padding left out).
    assert fmt.prefix_nbytes(shape, params) == sum(p.nbytes for p in fmt.parts(shape, params))


def test_prefix_bytes_count_each_parts_share():
    # int4, groups of 32: codes of 6 rows x 128 columns (384 bytes) and their 6 x 4 float16 scales (48 bytes).
    assert formats.get("int4").prefix_nbytes((12, 384), (("group_size", 32),), rows=6, cols=128) == 384 + 48
    # int8: values of 6 x 128, and the 6 rows' float32 scales whole.
    assert formats.get("int8").prefix_nbytes((12, 384), (), rows=6, cols=128) == 6 * 128 + 6 * 4


def test_a_prefix_that_cuts_a_group_is_refused():
    fmt, params = formats.get("int4"), (("group_size", 128),)
    blob = fmt.encode(torch.randn(4, 256), params)
    with pytest.raises(ValueError, match="mid-element"):
        fmt.decode_prefix(blob, (4, 256), params, cols=64)


def _quantized_linear(out_f, in_f, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w, b = torch.randn(out_f, in_f, generator=gen), torch.randn(out_f, generator=gen)
    params = (("group_size", 32),)
    record = Tensor("w", "ffn.down", 0, (out_f, in_f), Encoding("int4", params), "f32")
    blob = formats.encode("int4", w, params)
    return DequantLinear(record, blob, b, torch.float32), formats.decode("int4", blob, (out_f, in_f), params), b


def test_linear_prefix_reads_the_rows_of_each_half_and_the_first_columns():
    x = torch.randn(3, 64)
    dq, w, b = _quantized_linear(512, 64)
    dq.row_block = 96  # several row blocks per half
    dense = DenseLinear(w, b, "f32")
    want_rows = torch.cat([F.linear(x, w[:128], b[:128]), F.linear(x, w[256:384], b[256:384])], dim=-1)
    for op in (dense, dq):
        assert torch.allclose(op.prefix(x, rows=128, halves=2), want_rows, atol=1e-4)
        assert torch.allclose(op.prefix(x, rows=128), F.linear(x, w[:128], b[:128]), atol=1e-4)
        assert torch.allclose(op.prefix(x), op(x), atol=1e-4)
    down, wd, bd = _quantized_linear(64, 512, seed=1)
    h = torch.randn(3, 256)
    for op in (DenseLinear(wd, bd, "f32"), down):
        assert torch.allclose(op.prefix(h, cols=256), F.linear(h, wd[:, :256], bd), atol=1e-4)
    with pytest.raises(ValueError):
        row_blocks(512, 300, 2)


def test_the_dense_column_prefix_is_a_view_not_a_copy():
    w = torch.randn(64, 512)
    op = DenseLinear(w, None, "f32")
    seen = []
    original = F.linear

    def spy(x, weight, bias=None):
        seen.append(weight)
        return original(x, weight, bias)

    F.linear = spy
    try:
        op.prefix(torch.randn(2, 128), cols=128)
    finally:
        F.linear = original
    assert seen[0].data_ptr() == w.data_ptr() and seen[0].stride() == (512, 1)


@pytest.mark.parametrize("kind", ["fused", "separate", "ungated"])
def test_mlp_over_a_channel_prefix_is_the_truncated_ffn(kind):
    gen = torch.Generator().manual_seed(1)
    hidden, inter, k = 32, 512, 256
    gate, up, down = (torch.randn(s, generator=gen) / 8 for s in ((inter, hidden), (inter, hidden), (hidden, inter)))
    scale, shift = torch.rand(k, generator=gen) + 0.5, torch.randn(hidden, generator=gen)
    x = torch.randn(5, hidden, generator=gen)
    if kind == "fused":
        ups = [DenseLinear(torch.cat([gate, up]), None, "f32")]
    elif kind == "separate":
        ups = [DenseLinear(gate, None, "f32"), DenseLinear(up, None, "f32")]
    else:
        ups = [DenseLinear(up, None, "f32")]
    plan = MLPPlan("silu", kind != "ungated", ups, DenseLinear(down, None, "f32"), width=k, scale=scale, shift=shift)
    h = F.silu(x @ gate[:k].T) * (x @ up[:k].T) if kind != "ungated" else F.silu(x @ up[:k].T)
    want = (h * scale) @ down[:, :k].T + shift
    assert torch.allclose(run_mlp(x, plan), want, atol=1e-5)
    plan.width = plan.scale = plan.shift = None
    full = F.silu(x @ gate.T) * (x @ up.T) if kind != "ungated" else F.silu(x @ up.T)
    assert torch.allclose(run_mlp(x, plan), full @ down.T, atol=1e-5)


def _leveled(inter=256, channels=(128, 256), shift=True):
    model = tiny_model(inter=inter)
    tensors = list(model.tensors)
    names = []
    for i, k in enumerate(channels):
        if k < inter and shift:
            name = f"layers.{i}.ffn.levels.1.shift"
            tensors.append(dataclasses.replace(tensors[0], name=name, role="ffn.level.shift", layer=i,
                                               shape=(model.hidden_size,)))
            names.append(name)
        else:
            names.append(None)
    none = (None,) * len(channels)
    levels = (FFNLevel(1.0, (inter,) * len(channels), none, none), FFNLevel(0.75, tuple(channels), tuple(names), none))
    return dataclasses.replace(model, tensors=tuple(tensors), ffn_levels=levels)


def test_ir_levels_verify_serialize_and_count_bytes():
    model = _leveled()
    verify(model)
    assert from_plain(to_plain(model)) == model
    full, level = model.ffn_levels
    f32 = 4
    assert ffn_bytes(model) == 2 * 3 * 16 * 256 * f32
    assert ffn_bytes(model, level.channels) == 3 * 16 * (128 + 256) * f32
    assert bytes_per_token(model, full) - bytes_per_token(model, level) == 3 * 16 * 128 * f32 - 16 * f32
    assert uniform_channels(model, 0.5) == (128, 128) and uniform_channels(model, 0.3) == (128, 128)


@pytest.mark.parametrize("change,message", [
    (lambda lv: dataclasses.replace(lv[1], channels=(100, 256)), "multiple of 128"),
    (lambda lv: dataclasses.replace(lv[1], keep=1.0), "must decrease from 1.0"),
    (lambda lv: dataclasses.replace(lv[1], scale=(None,)), "one entry per layer"),
    (lambda lv: dataclasses.replace(lv[1], shift=(None, "layers.0.ffn.levels.1.shift")), "takes no shift"),
])
def test_ir_refuses_bad_levels(change, message):
    model = _leveled()
    levels = list(model.ffn_levels)
    levels[1] = change(levels)
    with pytest.raises(IRVerificationError, match=message):
        verify(dataclasses.replace(model, ffn_levels=tuple(levels)))


def test_ffn_level_options_parse_and_join_the_key():
    from thin.compiler.config import CompileConfig, CompileOptionError

    config = CompileConfig.from_options(ffn_levels="1,0.875, 3/4", device="cpu")
    assert config.ffn.levels == (0.875, 0.75) and config.calibrated and config.certified
    assert config.to_plain()["ffn"]["levels"] == (0.875, 0.75)
    assert CompileConfig.from_options(ffn_levels=(0.5,), ffn_per_layer=False, device="cpu").ffn.per_layer is False
    for bad, match in (({"ffn_levels": "1"}, "below 1"), ({"ffn_levels": "0.5,x"}, "keep fractions"),
                       ({"ffn_levels": "1.5"}, r"\(0, 1\)"), ({"ffn_correction": "shift"}, "give --ffn-levels"),
                       ({"ffn_levels": "0.5", "ffn_importance": "random"}, "importance")):
        with pytest.raises(CompileOptionError, match=match):
            CompileConfig.from_options(device="cpu", **bad)
