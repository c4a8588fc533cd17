"""The files beside the weights, checked as what they claim to be before they enter an artifact.

An artifact carries the tokenizer files, the chat template and the generation config for the
runtime, so each is checked here with the runtime's own code: the tokenizer loads and its ids fit
the model's vocabulary, the template is UTF-8 and compiles in the runtime's sandbox, the
generation config gives valid generation options. Nothing is stored blind.
"""

from __future__ import annotations

from .errors import AuxiliaryFileError
from .files import ModelFolder, parse_json_object

_JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.json")


def read_tokenizer_files(folder: ModelFolder, names) -> dict[str, bytes]:
    """{name: bytes} of the tokenizer and chat-template files `names`, within the artifact's size limit."""
    from thin.artifacts.spec import MAX_TOKENIZER_FILE

    return {name: folder.read(name, MAX_TOKENIZER_FILE) for name in names}


def find_chat_template(files: dict[str, bytes]) -> str | None:
    """The default chat template. transformers lets chat_template.jinja override tokenizer_config.json."""
    if "chat_template.jinja" in files:
        try:
            return files["chat_template.jinja"].decode("utf-8")
        except UnicodeDecodeError as e:
            raise AuxiliaryFileError(f"chat_template.jinja is not UTF-8 text: {e.reason} at byte {e.start}") from None
    for name in ("chat_template.json", "tokenizer_config.json"):
        if name not in files:
            continue
        template = parse_json_object(files[name], name).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise AuxiliaryFileError(f"{name}: chat_template lists named templates but none is 'default'")
            template = named["default"]
            if not isinstance(template, str):
                raise AuxiliaryFileError(f"{name}: chat_template's 'default' entry has no template string")
        if template is not None and not isinstance(template, str):
            raise AuxiliaryFileError(f"{name}: chat_template must be a string or a list of named templates, "
                                     f"got {type(template).__name__}")
        if template is not None:
            return template
    return None


def check_auxiliary(files: dict[str, bytes], generation_config: dict, vocab_size: int) -> str | None:
    """Check the tokenizer files, chat template and generation config; return the chat template."""
    for name in _JSON_FILES:
        if name in files:
            parse_json_object(files[name], name)
    if "tokenizer.json" in files:
        _check_tokenizer(files, vocab_size)
    template = find_chat_template(files)
    if template is not None:
        _check_template(template)
    _check_generation_config(generation_config)
    return template


def _check_tokenizer(files: dict[str, bytes], vocab_size: int) -> None:
    from thin.runtime.tokenizer import Tokenizer, TokenizerError

    try:
        tokenizer = Tokenizer.from_files(files)
    except TokenizerError as e:
        raise AuxiliaryFileError(" ".join(str(e).replace("in the artifact ", "").split())[:500]) from None
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    largest = max(vocab.values(), default=-1)
    if largest >= vocab_size:
        token = next(t for t, i in vocab.items() if i == largest)
        raise AuxiliaryFileError(f"tokenizer.json gives token {token[:40]!r} the id {largest}, but the model's "
                                 f"vocabulary has {vocab_size} entries (ids 0..{vocab_size - 1}); the tokenizer "
                                 "does not belong to these weights")


def _check_template(template: str) -> None:
    from thin.runtime.chat_template import ChatTemplateError, compile_template

    try:
        compile_template(template)
    except ChatTemplateError as e:
        raise AuxiliaryFileError(f"the chat template does not compile: {' '.join(str(e).split())[:500]}") from None


def _check_generation_config(config: dict) -> None:
    from thin.runtime.errors import RunError
    from thin.runtime.sampling import GenerationOptions

    try:
        GenerationOptions.from_generation_config(config)
    except RunError as e:
        raise AuxiliaryFileError(f"generation_config.json: {' '.join(str(e).split())[:500]}") from None
