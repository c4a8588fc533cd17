"""Tokenizer: special-token rules as transformers applies them, and streaming detokenisation."""

import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from thin.runtime.tokenizer import Tokenizer, TokenizerError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
CORPUS = ["the quick brown fox jumps over the lazy dog. " * 20, "hello world, hello tokens! " * 20]
# Multi-byte characters the tiny vocabulary never saw: each splits into several byte tokens.
UNICODE_TEXT = "héllo 🦊 wörld — 日本語のテキスト 👩‍💻 ok ✓ 🇫🇷!"


def byte_level_bpe(vocab_size: int = 320) -> Backend:
    """A GPT-2-style byte-level BPE trained on ASCII, so non-ASCII text splits into byte tokens."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def byte_fallback_bpe() -> Backend:
    """A Llama-2-style SentencePiece BPE: metaspace, <0xNN> byte fallback, leading space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "h", "e", "l", "o", "▁h", "▁he", "▁hel", "▁hell", "▁hello", "w", "r", "d", "▁w"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o"), ("▁", "w")]
    tok = Backend(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def _files(backend: Backend, config: dict) -> dict[str, bytes]:
    return {"tokenizer.json": backend.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode()}


def _hf(backend: Backend, config: dict, tmp_path):
    """transformers' tokenizer loaded from the same files, the way a checkpoint directory is read."""
    transformers = pytest.importorskip("transformers")
    for name, data in _files(backend, {"tokenizer_class": "PreTrainedTokenizerFast", **config}).items():
        (tmp_path / name).write_bytes(data)
    return transformers.AutoTokenizer.from_pretrained(str(tmp_path))


CONFIGS = [
    {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True},
    {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True},
    {"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>", "add_bos_token": False},
    {"bos_token": "<|bos|>", "eos_token": "<|endoftext|>", "add_bos_token": True},  # bos not in vocab yet
]


@pytest.mark.parametrize("config", CONFIGS)
def test_encode_decode_match_transformers(config, tmp_path):
    backend = byte_level_bpe()
    ours, theirs = Tokenizer.from_files(_files(backend, config)), _hf(backend, config, tmp_path)
    for text in ["hello world", "the fox <|im_start|>user\nhi<|im_end|>", UNICODE_TEXT]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.bos_token_id == theirs.bos_token_id and ours.eos_token_id == theirs.eos_token_id
    assert ours.special_tokens_map == theirs.special_tokens_map


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_bos_comes_from_tokenizer_json_post_processor(add_bos, tmp_path):
    # transformers 5 ignores add_bos_token when a tokenizer.json exists; so do we.
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    with_bos = Tokenizer.from_files(_files(byte_fallback_bpe(), config))
    assert with_bos.encode("hello")[0] == 1  # tokenizer.json's TemplateProcessing adds <s>
    assert with_bos.encode("hello", add_special_tokens=False)[0] != 1
    without = Tokenizer.from_files(_files(byte_level_bpe(), config))  # no post-processor
    assert without.bos_token_id not in without.encode("hello")
    for i, backend in enumerate((byte_fallback_bpe(), byte_level_bpe())):
        (tmp_path / str(i)).mkdir()
        assert Tokenizer.from_files(_files(backend, config)).encode("hello world") == \
            _hf(backend, config, tmp_path / str(i)).encode("hello world")


def _stream_pieces(tokenizer: Tokenizer, ids, skip_special_tokens=True) -> list[str]:
    stream = tokenizer.stream(skip_special_tokens=skip_special_tokens)
    pieces = [stream.put(i) for i in ids]
    return pieces + [stream.flush()]


@pytest.mark.parametrize("make", [byte_level_bpe, byte_fallback_bpe])
def test_streaming_multibyte_text_never_prints_garbage(make):
    tokenizer = Tokenizer.from_files(_files(make(), {"eos_token": "</s>"}))
    ids = tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)
    assert len(ids) > len(UNICODE_TEXT.encode()) // 2  # really split into byte pieces
    pieces = _stream_pieces(tokenizer, ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == UNICODE_TEXT
    # Some tokens completed nothing (a partial character); nothing printed for those.
    assert "" in pieces[:-1]


def test_streaming_word_spaces_with_sentencepiece_decoder():
    tokenizer = Tokenizer.from_files(_files(byte_fallback_bpe(), {"eos_token": "</s>"}))
    ids = tokenizer.encode("hello world hello", add_special_tokens=False)
    assert "".join(_stream_pieces(tokenizer, ids)) == "hello world hello"


def test_streaming_skips_special_tokens_and_flushes_a_dangling_byte():
    tokenizer = Tokenizer.from_files(_files(byte_level_bpe(), {"eos_token": "<|endoftext|>"}))
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("hi 🦊", add_special_tokens=False)
    assert "".join(_stream_pieces(tokenizer, ids[:2] + [eos] + ids[2:])) == "hi 🦊"
    assert "<|endoftext|>" in "".join(_stream_pieces(tokenizer, ids + [eos], skip_special_tokens=False))
    # Generation stopped mid-character: the flush shows the replacement character, once.
    assert "".join(_stream_pieces(tokenizer, ids[:-1])).endswith("\ufffd")


def test_bad_tokenizer_files():
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_files({"tokenizer_config.json": b"{}"})
    with pytest.raises(TokenizerError, match="could not be loaded"):
        Tokenizer.from_files({"tokenizer.json": b"not json"})
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_files({"tokenizer.json": byte_level_bpe().to_str().encode(),
                              "tokenizer_config.json": b"[1, 2"})
