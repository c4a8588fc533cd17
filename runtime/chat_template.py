"""Chat templates: the checkpoint's Jinja template, rendered as transformers renders it.

Templates come from the Hub and are untrusted code, so they run in jinja2's immutable
sandbox, bounded in time and memory (template_limits.py); whatever goes wrong in a template,
syntax, a refused operation, a bound, or an exception its code raises, is a ChatTemplateError
with a one-line message. To give the same prompt string as transformers' `apply_chat_template(...,
tokenize=False)` we reproduce its environment: trim_blocks and lstrip_blocks, loop
controls, a `{% generation %}` block tag, `raise_exception`, `strftime_now`, a `tojson`
that does not HTML-escape, a `dict` constructor, a `namespace` that refuses underscore
names; and its inputs: messages with None fields dropped, reasoning fields aliased, the
named special tokens (bos_token, eos_token, ...) as variables, caller kwargs over them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes

from .errors import RunError
from .template_limits import BoundedSandbox, bounded_filter, check_value, render_budget

# Names under which a message's reasoning may arrive; templates read the first ("reasoning_content"),
# gpt-oss templates read "thinking". transformers fills both from whichever is set.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(RunError, jinja2.TemplateError):
    """A template raised (via raise_exception) or cannot be rendered; the message says why."""


class _GenerationBlock(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    # only needs its body.
    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML; prompts need the plain JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _DictConstructor:
    # `dict(...)` inside templates without exposing the dict type itself to the sandbox.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    # A namespace that refuses underscore-prefixed names, which could reach interpreter internals.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore names, got {name!r}")


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses, bounded (cached by source).

    Raises ChatTemplateError for a template that is not a string, too large, or does not compile."""
    if not isinstance(source, str):
        raise ChatTemplateError(f"a chat template is a string, got {type(source).__name__}")
    try:
        return _compile(source)
    except ChatTemplateError:
        raise
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"line {e.lineno}: {_message(e)}") from None
    except (jinja2.TemplateError, RecursionError, MemoryError) as e:  # RecursionError: deeply nested syntax
        raise ChatTemplateError(_message(e)) from None


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = bounded_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictConstructor()
    env.globals["namespace"] = _Namespace
    return env.bounded_template(source)


def _message(error: BaseException) -> str:
    text = " ".join(str(error).split())[:500]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _plain(value):
    # The sandbox only protects against attributes it knows; rebuild inputs from plain JSON
    # types so a rich object's methods never reach the template.
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # numpy / torch scalars
    return f"<{type(value).__name__}>"


def _prepare_messages(messages) -> list[dict]:
    prepared = []
    for message in messages:
        if dataclasses.is_dataclass(message) and not isinstance(message, type):
            message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        # Some APIs send content=None; templates handle a missing key better than a None one.
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


class ChatTemplate:
    """A model's chat template bound to its named special tokens."""

    def __init__(self, source: str | dict | list, special_tokens: dict[str, str] | None = None):
        """`source`: the template string, or named templates ({name: str} / [{name, template}]) with a
        "default"; `special_tokens`: {"bos_token": "<s>", ...} as the tokenizer names them."""
        self.source = _select_default(source)
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages, add_generation_prompt: bool = True, tools=None, documents=None,
               **kwargs) -> str:
        """The prompt string for `messages` ([{"role", "content", ...}]); extra kwargs reach the template."""
        if not messages:
            raise ValueError("cannot render an empty conversation")
        template = compile_template(self.source)
        variables = {**self.special_tokens, **_plain(kwargs)}
        try:
            with render_budget():
                return check_value(template.render(
                    messages=_prepare_messages(messages), tools=_plain(tools), documents=_plain(documents),
                    add_generation_prompt=add_generation_prompt, **variables))
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 -- the template is untrusted code: whatever it raises is its failure
            raise ChatTemplateError(f"the chat template failed: {_message(e)}") from None


def _select_default(source) -> str:
    # tokenizer_config.json may hold several named templates; transformers uses "default".
    if isinstance(source, list):
        source = {item["name"]: item["template"] for item in source}
    if isinstance(source, dict):
        if "default" not in source:
            raise ValueError(f"the chat templates have no 'default' entry (names: {sorted(source)})")
        return source["default"]
    if not isinstance(source, str):
        raise TypeError(f"a chat template is a string, got {type(source).__name__}")
    return source


def render_chat(source: str, messages, *, add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, **kwargs) -> str:
    """Render `messages` with template `source`; same output as transformers' apply_chat_template(tokenize=False)."""
    return ChatTemplate(source, special_tokens).render(messages, add_generation_prompt, **kwargs)
