"""Write -> read round trips, determinism, zero-copy views, writer refusals and version rules."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import thin.artifacts as art
from thin.artifacts import ArtifactWriter, open_artifact

from ir_fixtures import tiny_model
from test_artifact_common import SECTIONS, TOKENIZER, reseal, split, write_artifact


def test_round_trip(tmp_path):
    path = tmp_path / "m.thin"
    model, data = write_artifact(path)
    with open_artifact(path) as a:
        assert a.model == model
        assert a.tensor_names() == [t.name for t in model.tensors]
        for name, arr in data.items():
            assert a.buffer(name).tobytes() == arr.tobytes()
            assert np.array_equal(a.numpy(name).view(np.float32).reshape(arr.shape), arr)
            e = a.tensor_entry(name)
            assert e.offset % 64 == 0 and e.size == arr.nbytes
            assert (e["offset"], e["size"], e["format"]) == (e.offset, e.size, "f32")
        assert a.tokenizer_files() == TOKENIZER
        assert a.chat_template == SECTIONS["chat_template"]
        assert a.generation_config == SECTIONS["generation_config"]
        assert a.compile_config == SECTIONS["compile_config"]
        assert a.key == SECTIONS["key"]
        assert a.provenance == {**SECTIONS["provenance"], "thin_version": art.reader.THIN_VERSION}
        assert a.section("precision_plan") is None and a.section("tokenizer") == TOKENIZER
        assert a.file_size == os.path.getsize(path) and a.path == path
        assert a.verify_checksums() == []
    assert art.verify_file(path) == []


def test_same_inputs_give_identical_bytes(tmp_path):
    write_artifact(tmp_path / "a.thin")
    write_artifact(tmp_path / "b.thin")
    assert (tmp_path / "a.thin").read_bytes() == (tmp_path / "b.thin").read_bytes()
    write_artifact(tmp_path / "a.thin", seed=1)  # replaces the file in place
    assert (tmp_path / "a.thin").read_bytes() != (tmp_path / "b.thin").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["a.thin", "b.thin"]


def test_views_are_zero_copy_and_private(tmp_path):
    path = tmp_path / "m.thin"
    write_artifact(path, align=4096)
    before = path.read_bytes()
    with open_artifact(path) as a:
        e = a.tensor_entry("embed.weight")
        assert e.offset % 4096 == 0
        view = a.numpy("embed.weight")
        assert view.flags.writeable and not view.flags.owndata
        assert np.shares_memory(view, a.numpy("embed.weight"))
        view[:4] = 0  # copy-on-write: visible through the mapping, never in the file
        assert a.buffer("embed.weight")[:4].tobytes() == bytes(4)
        del view
    assert path.read_bytes() == before
    with open_artifact(path, writable=False) as a:
        assert not a.numpy("embed.weight").flags.writeable


def test_torch_takes_views_without_copy_or_warning(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "m.thin"
    _, data = write_artifact(path)
    with open_artifact(path) as a, warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on non-writable buffers
        t = torch.frombuffer(a.buffer("embed.weight"), dtype=torch.float32).view(data["embed.weight"].shape)
        assert np.array_equal(t.numpy(), data["embed.weight"])
        assert t.data_ptr() == a.numpy("embed.weight").ctypes.data  # same memory, no copy
        del t


def test_close_with_live_views_and_after_close(tmp_path):
    path = tmp_path / "m.thin"
    write_artifact(path)
    a = open_artifact(path)
    view = a.numpy("embed.weight")
    a.close()  # views outlive the artifact; the mapping goes with them
    assert view.sum() == view.sum()
    with pytest.raises(art.ArtifactClosedError):
        a.buffer("embed.weight")
    with open_artifact(path) as b, pytest.raises(art.TensorNotFoundError):
        b.tensor_entry("nope")


def test_verify_catches_flipped_data_and_padding(tmp_path):
    path = tmp_path / "m.thin"
    write_artifact(path, align=256)
    with open_artifact(path) as a:
        e = a.tensor_entry("layers.1.attn.k.weight")
        f = next(a.tensor_entry(n) for n in a.tensor_names() if a.tensor_entry(n).offset > a.tensor_entry(n).padding_start)
    blob = bytearray(path.read_bytes())
    blob[e.offset + 5] ^= 0x10
    path.write_bytes(blob)
    assert art.verify_file(path) == ["layers.1.attn.k.weight"]
    blob[e.offset + 5] ^= 0x10
    blob[f.padding_start] = 1
    path.write_bytes(blob)
    assert art.verify_file(path) == [f.name]


def _write_partial(path, model, data, skip=(), extra=None, sections=SECTIONS):
    with ArtifactWriter(path) as w:
        for name, arr in data.items():
            if name not in skip:
                w.add_tensor(name, arr)
        if extra:
            w.add_tensor(*extra)
        w.commit(model, sections)


@pytest.mark.parametrize("case, match", [
    ("missing", "missing tensor 'lm_head.weight'"),
    ("extra", "'stray' is not in the IR"),
    ("size", "takes 2048"),
    ("section", "unknown section"),
    ("section_type", "generation_config must be a mapping"),
    ("tokenizer_name", "plain file name"),
    ("config_version", "integer 'schema'"),
])
def test_writer_refuses_inconsistent_input_and_leaves_nothing(tmp_path, case, match):
    model = tiny_model()
    data = {t.name: np.zeros(t.shape, np.float32) for t in model.tensors}
    path = tmp_path / "m.thin"
    kwargs = {
        "missing": dict(skip=("lm_head.weight",)),
        "extra": dict(extra=("stray", b"1234")),
        "size": dict(skip=("embed.weight",), extra=("embed.weight", bytes(100))),
        "section": dict(sections={"tokenizr": {}}),
        "section_type": dict(sections={"generation_config": [1]}),
        "tokenizer_name": dict(sections={"tokenizer": {"../x": b""}}),
        "config_version": dict(sections={"compile_config": {"vram": 8}}),
    }[case]
    with pytest.raises(art.ArtifactWriteError, match=match):
        _write_partial(path, model, data, **kwargs)
    assert os.listdir(tmp_path) == []


def test_writer_abort_exception_and_missing_commit(tmp_path):
    path = tmp_path / "m.thin"
    path.write_bytes(b"previous")
    with pytest.raises(RuntimeError), ArtifactWriter(path) as w:
        w.add_tensor("a", bytes(10))
        raise RuntimeError("compiler failed")
    with pytest.raises(art.ArtifactWriteError, match="without commit"), ArtifactWriter(path) as w:
        w.add_tensor("a", bytes(10))
    w = ArtifactWriter(path)
    w.abort()
    w.abort()
    with pytest.raises(art.ArtifactWriteError):
        w.add_tensor("a", b"")
    with pytest.raises(art.ArtifactWriteError, match="contiguous"), ArtifactWriter(path) as w:
        w.add_tensor("a", np.zeros((4, 4), np.float32).T)
    with pytest.raises(art.ArtifactWriteError, match="align"), ArtifactWriter(path) as w:
        w.add_tensor("a", b"x", align=48)
    with pytest.raises(art.ArtifactWriteError, match="twice"), ArtifactWriter(path) as w:
        w.add_tensor("a", b"x")
        w.add_tensor("a", b"x")
    assert os.listdir(tmp_path) == ["m.thin"] and path.read_bytes() == b"previous"


def test_newer_major_names_the_thin_it_needs(tmp_path):
    path = tmp_path / "m.thin"
    write_artifact(path)
    blob = path.read_bytes()
    path.write_bytes(reseal(blob, major=2, min_thin_version="0.7.0"))
    with pytest.raises(art.UnsupportedVersionError, match=r"thin >= 0\.7\.0.*upgrade"):
        open_artifact(path)
    path.write_bytes(reseal(blob, major=0))
    with pytest.raises(art.UnsupportedVersionError, match="recompile"):
        open_artifact(path)
    # A newer major that this very release claims to have written is a damaged preamble, not a newer file.
    path.write_bytes(reseal(blob, major=99, min_thin_version=art.reader.THIN_VERSION))
    with pytest.raises(art.CorruptHeaderError, match="format 99.0, which no thin up to .* damaged"):
        open_artifact(path)
    path.write_bytes(b"")
    with pytest.raises(art.BadMagicError, match=r"is empty \(0 bytes\)"):
        open_artifact(path)


def test_newer_minor_extras_are_ignored_same_minor_extras_refused(tmp_path):
    path = tmp_path / "m.thin"
    write_artifact(path)
    blob = path.read_bytes()
    _, header, _ = split(blob)
    header["future_key"] = {"x": 1}
    header["sections"]["residency"] = {"resident": ["embed.weight"]}
    header["tensors"][0]["layout"] = "tiled"
    path.write_bytes(reseal(blob, header, minor=3, flags=1))
    with open_artifact(path) as a:
        assert a.format_version == (1, 3)
        assert a.section("residency") == {"resident": ["embed.weight"]}
        assert a.verify_checksums() == []
    path.write_bytes(reseal(blob, header))
    with pytest.raises(art.CorruptHeaderError, match="unknown keys"):
        open_artifact(path)
    del header["future_key"]
    path.write_bytes(reseal(blob, header))
    with pytest.raises(art.InvalidTensorTableError, match="unknown fields"):
        open_artifact(path)
    del header["tensors"][0]["layout"]
    path.write_bytes(reseal(blob, header))
    with pytest.raises(art.InvalidSectionError, match="residency"):
        open_artifact(path)


def test_truncation_message_is_actionable(tmp_path):
    path = tmp_path / "m.thin"
    write_artifact(path)
    blob = path.read_bytes()
    path.write_bytes(blob[:1000])
    with pytest.raises(art.TruncatedError, match=f"truncated at 1000 of {len(blob)} bytes: re-download"):
        open_artifact(path)
    path.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(art.BadMagicError, match="not a .thin artifact"):
        open_artifact(path)


def test_describe_and_render(tmp_path):
    path = tmp_path / "m.thin"
    model, data = write_artifact(path)
    d = art.describe(path)
    assert d["tensors"]["count"] == len(model.tensors)
    assert d["tensors"]["by_format"]["f32"]["bytes"] == sum(a.nbytes for a in data.values())
    assert d["key"] == SECTIONS["key"] and d["file_size"] == os.path.getsize(path)
    assert set(d["sections"]["tokenizer"]["files"]) == set(TOKENIZER)
    assert art.spec.unpack(art.spec.pack(d)) == d  # plain data, JSON/msgpack-able
    text = art.render_description(d)
    assert "LlamaForCausalLM" in text and "f32" in text and "tokenizer.json" in text


def test_inspecting_needs_no_torch(tmp_path):
    path = tmp_path / "m.thin"
    write_artifact(path)
    code = ("import sys, thin.artifacts as a; a.describe(sys.argv[1]); a.verify_file(sys.argv[1]); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
