"""The artifact's tokenizer, through the `tokenizers` library, with transformers' special-token rules.

An artifact carries the checkpoint's tokenizer files as bytes: tokenizer.json (the whole
pipeline, bos/eos insertion included) and tokenizer_config.json (named special tokens, the
chat template), sometimes special_tokens_map.json. We follow what transformers 5 does when
it loads a checkpoint with a tokenizer.json, so `encode` gives the ids the model was trained
on. Model-specific transformers classes that rebuild the pipeline from vocab and merges
(e.g. Qwen2Tokenizer) are not emulated: the tokenizer.json is taken as written.
"""

from __future__ import annotations

import json

from .errors import RunError

# Named special tokens, in transformers' order; these are what chat templates receive.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(RunError, ValueError):
    """The artifact's tokenizer files are missing or unreadable."""


def _token_content(name: str, value) -> str | None:
    # tokenizer_config.json writes a special token either as a string or as a serialised AddedToken.
    if value is None:
        return None
    content = value.get("content") if isinstance(value, dict) else value
    if not isinstance(content, str):
        raise TokenizerError(f"special token {name} must be a string or {{'content': str}}, got {str(value)[:60]!r}")
    return content


def _read_json(files: dict[str, bytes], name: str) -> dict:
    if name not in files:
        return {}
    try:
        data = json.loads(files[name])
    except RecursionError:
        raise TokenizerError(f"{name} in the artifact is nested too deeply to be JSON config") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, integers of too many digits
        raise TokenizerError(f"{name} in the artifact is not valid JSON: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{name} in the artifact is not a JSON object")
    return data


class Tokenizer:
    """Text <-> token ids for one model. Build it with `Tokenizer.from_files(artifact.tokenizer_files())`."""

    def __init__(self, backend, config: dict | None = None, special_tokens_map: dict | None = None):
        """`backend` is a `tokenizers.Tokenizer`; `config` the tokenizer_config.json dict."""
        self.backend = backend
        self.config = dict(config or {})
        merged = dict(special_tokens_map or {})
        merged.update({k: v for k, v in self.config.items() if k in SPECIAL_TOKEN_NAMES and v is not None})
        self.special_tokens_map: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            content = _token_content(name, merged.get(name))
            if content is not None:
                self.special_tokens_map[name] = content
        self._register_special_tokens()
        # Whether encode() adds bos/eos is tokenizer.json's post-processor alone: transformers 5
        # drops tokenizer_config.json's add_bos_token / add_eos_token when a tokenizer.json exists,
        # and a missing post-processor adds nothing.

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> Tokenizer:
        """Build from the artifact's tokenizer files ({file name: bytes}); tokenizer.json is required."""
        from tokenizers import Tokenizer as Backend

        if "tokenizer.json" not in files:
            raise TokenizerError(f"the artifact has no tokenizer.json (it has: {sorted(files) or 'nothing'})")
        raw = files["tokenizer.json"]
        try:
            backend = Backend.from_str(raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw)
        except Exception as e:  # noqa: BLE001 -- the tokenizers library raises plain Exception
            raise TokenizerError(f"tokenizer.json in the artifact could not be loaded: {e}") from None
        return cls(backend, _read_json(files, "tokenizer_config.json"),
                   _read_json(files, "special_tokens_map.json"))

    def _register_special_tokens(self):
        # transformers adds a named special token that the vocabulary lacks as a special added token.
        from tokenizers import AddedToken

        missing = [c for c in self.special_tokens_map.values() if self.backend.token_to_id(c) is None]
        if missing:
            self.backend.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in missing])

    # Named special tokens and their ids, None when the tokenizer has none.
    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary including added tokens."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> set[int]:
        """Ids of every special token: the named ones and added tokens marked special."""
        ids = {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(i for i in (self.token_to_id(t) for t in self.special_tokens_map.values()) if i is not None)
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; `add_special_tokens` adds bos/eos as the post-processor says."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text for `ids`. No clean-up of spaces: transformers skips it for BPE, which LLMs use."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental decoder for a stream of generated ids."""
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Turns token ids arriving one by one into text, emitting a piece only once it is complete.

    A byte-level BPE token can hold part of a UTF-8 character; decoding it alone gives U+FFFD.
    We decode a short window of recent ids and emit only the text that grew beyond what the
    window's earlier ids gave, and only when it does not end in U+FFFD. Decoding a window
    rather than one id also keeps word-boundary spaces right for SentencePiece-style decoders.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # ids before this are already emitted

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def put(self, token_id: int) -> str:
        """Add one id; return the text it completes ('' when a character is still partial)."""
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end decodes to U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self.ids):
            return ""
        emitted = self._decode(self.ids[self._prefix_offset:self._read_offset])
        text = self._decode(self.ids[self._prefix_offset:])
        if not final and (text.endswith("\ufffd") or len(text) <= len(emitted)):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return text[len(emitted):]
