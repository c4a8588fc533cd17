"""The IR: verification reports every violation, serialisation round-trips and refuses bad data."""

import dataclasses

import msgpack
import pytest

from thin.ir import (
    IR_VERSION,
    IRSchemaError,
    IRVerificationError,
    Linear,
    format_ir,
    from_plain,
    to_plain,
    verify,
)

from ir_fixtures import tiny_model


def test_tiny_model_verifies_and_round_trips_through_msgpack():
    model = tiny_model(tied=True)
    verify(model)
    plain = to_plain(model)
    assert plain["ir_version"] == list(IR_VERSION)
    again = from_plain(msgpack.unpackb(msgpack.packb(plain)))
    assert again == model
    assert format_ir(again) == format_ir(model)


def test_verify_reports_every_violation_at_once():
    model = tiny_model()
    layer0 = model.layers[0]
    broken_attn = dataclasses.replace(layer0.attention, num_kv_heads=3, o=Linear("nowhere.weight"))
    layers = (dataclasses.replace(layer0, attention=broken_attn, index=5),) + model.layers[1:]
    bad = dataclasses.replace(model, layers=layers, vocab_size=33)
    with pytest.raises(IRVerificationError) as info:
        verify(bad)
    text = str(info.value)
    for expected in ("not a multiple of num_kv_heads", "missing tensor 'nowhere.weight'",
                     "index is 5", "expected (33, 16)", "'layers.0.attn.o.weight' is in the tensor table"):
        assert expected in text
    assert len(info.value.violations) >= 5


def test_verify_rejects_unknown_format_and_activation():
    model = tiny_model()
    t0 = dataclasses.replace(model.tensors[0], encoding=dataclasses.replace(model.tensors[0].encoding,
                                                                            format="int7"))
    layer = dataclasses.replace(model.layers[0], ffn=dataclasses.replace(model.layers[0].ffn, activation="swish"))
    bad = dataclasses.replace(model, tensors=(t0,) + model.tensors[1:], layers=(layer,) + model.layers[1:])
    with pytest.raises(IRVerificationError) as info:
        verify(bad)
    assert "unknown format 'int7'" in str(info.value) and "unknown activation 'swish'" in str(info.value)


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p.update(ir_version=[IR_VERSION[0] + 1, 0]), "not readable"),
    (lambda p: p["model"].update(vocab_size="32"), "expected int"),
    (lambda p: p["model"].update(surprise=1), "unknown fields"),
    (lambda p: p["model"]["embedding"].update(_type="Norm"), "expected Embedding"),
    (lambda p: p["model"].pop("layers"), "lacks field 'layers'"),
    (lambda p: p["model"].update(tensors={"a": 1}), "expected a list"),
])
def test_from_plain_refuses_malformed_data(mutate, message):
    plain = to_plain(tiny_model())
    mutate(plain)
    with pytest.raises(IRSchemaError, match=message):
        from_plain(plain)


def test_newer_minor_version_ignores_unknown_fields():
    plain = to_plain(tiny_model())
    plain["ir_version"] = [IR_VERSION[0], IR_VERSION[1] + 1]
    plain["model"]["future_field"] = {"anything": 1}
    assert from_plain(plain) == tiny_model()


def test_printer_is_deterministic_and_lists_every_tensor():
    model = tiny_model()
    text = format_ir(model)
    assert text == format_ir(tiny_model())
    for t in model.tensors:
        assert f"  {t.name} role={t.role}" in text
