"""Resource bounds for chat templates: a sandbox that cannot hang, nor build a huge value.

jinja2's sandbox keeps a template away from the interpreter but not from the CPU or memory:
nested `range(100000)` loops run for hours and `'a' * 10**10` asks for 10 GB. `BoundedSandbox`
adds a budget per render, checked at every step a template can take (each loop iteration,
call, attribute or item access, operator, filter and output), and size checks on values:

- time: at most TIME_LIMIT seconds and MAX_STEPS steps per render;
- size: no string (or the text of a printed value) over MAX_CHARS characters, no list over
  MAX_ITEMS items, no integer over MAX_INT_BITS bits. Operations whose result can be far larger
  than their inputs (repetition, powers, padding widths, replace, join, indent, format widths)
  are checked before they run, the rest after;
- output: MAX_CHARS characters in all, literal text included.

Every bound raises TemplateLimitError, which names it.
"""

from __future__ import annotations

import contextvars
import functools
import re
import string
import time
from collections.abc import Mapping

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

MAX_SOURCE_CHARS = 1 << 20  # a template's own text
MAX_CHARS = 8 << 20  # any string a template builds, and its whole output
MAX_ITEMS = 1 << 20  # any list, tuple or mapping it builds
MAX_INT_BITS = 1 << 16
MAX_STEPS = 2_000_000
TIME_LIMIT = 2.0  # seconds of wall clock per render
_ESTIMATE_NODES = 200_000  # values visited when estimating the text size of a container


class TemplateLimitError(jinja2.TemplateError):
    """A template ran past one of the bounds above."""


class _Budget:
    def __init__(self):
        self.deadline = time.monotonic() + TIME_LIMIT
        self.steps = 0
        self.output = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateLimitError(f"the chat template took more than {MAX_STEPS} steps")
        if not self.steps & 255 and time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template ran longer than {TIME_LIMIT:g} s")

    def emit(self, chars: int) -> None:
        self.output += chars
        if self.output > MAX_CHARS:
            raise TemplateLimitError(f"the chat template's output exceeds {MAX_CHARS} characters")


_CURRENT: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("template_budget", default=None)


def _budget() -> _Budget:
    # Outside a render (jinja folds constant expressions while compiling) a fresh budget applies.
    return _CURRENT.get() or _Budget()


class render_budget:
    """Context manager: a fresh budget for one render in this thread or task."""

    def __enter__(self):
        self._token = _CURRENT.set(_Budget())

    def __exit__(self, *exc):
        _CURRENT.reset(self._token)


def text_size(value) -> int:
    """An upper bound on len(str(value)), found without building the string. Each container is measured once
    however often it is held (a list doubled k times into itself is k measurements, not 2^k)."""
    measured: dict[int, int] = {}  # id -> text size of a container measured already
    open_: set[int] = set()  # containers being measured: met again, they print as [...]
    visited = 0

    def size(v) -> int:
        nonlocal visited
        if isinstance(v, str):
            return len(v) + 2
        if v is None or isinstance(v, (bool, float)):
            return 24
        if isinstance(v, int):
            return v.bit_length() // 3 + 2
        if isinstance(v, (bytes, bytearray)):
            return 4 * len(v) + 3
        if not isinstance(v, (Mapping, list, tuple, set, frozenset, jinja2.utils.Namespace)):
            return 64
        key = id(v)
        if key in measured:
            return measured[key]
        if key in open_:
            return 5
        visited += 1
        if visited > _ESTIMATE_NODES:
            raise TemplateLimitError(f"a value in the chat template holds more than {_ESTIMATE_NODES} containers")
        open_.add(key)
        if isinstance(v, Mapping):
            n = 2 + sum(size(k) + size(x) + 4 for k, x in v.items())
        elif isinstance(v, jinja2.utils.Namespace):
            n = 16 + size(v._Namespace__attrs)  # its repr shows its attributes
        else:
            n = 2 + sum(size(x) + 2 for x in v)
        open_.discard(key)
        measured[key] = n
        return n

    return size(value)


def check_value(value):
    """`value` if it is within the size bounds; TemplateLimitError otherwise. A container's text is bounded too
    (text_size): one that holds itself many times over ([a, a] doubled k times) would otherwise print, compare
    or convert to a string of 2^k items."""
    if isinstance(value, (str, bytes, bytearray)) and len(value) > MAX_CHARS:
        raise TemplateLimitError(f"the chat template built a string of {len(value)} characters; the limit is "
                                 f"{MAX_CHARS}")
    if isinstance(value, (list, tuple, Mapping, set, frozenset)):
        if len(value) > MAX_ITEMS:
            raise TemplateLimitError(f"the chat template built a collection of {len(value)} items; the limit is "
                                     f"{MAX_ITEMS}")
        _expect(text_size(value), "a collection")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"the chat template built an integer of more than {MAX_INT_BITS} bits")
    return value


def _expect(size: int, what: str) -> None:
    if size > MAX_CHARS:
        raise TemplateLimitError(f"{what} would build about {size} characters; the limit is {MAX_CHARS}")


def _length(value) -> int:
    """The characters `value` becomes as text (what join, '~' and padding make of it)."""
    return len(value) if isinstance(value, (str, bytes)) else text_size(value)


def _repeat_size(left, right) -> None:
    """Refuse `left * right` when it repeats a sequence too often or multiplies integers too large."""
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and n > 0:
            limit = MAX_CHARS if isinstance(seq, str) else MAX_ITEMS
            if len(seq) * n > limit:
                raise TemplateLimitError(f"repeating a sequence of {len(seq)} {n} times exceeds {limit}")
    if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"the chat template built an integer of more than {MAX_INT_BITS} bits")


def _power_size(base, exponent) -> None:
    big = isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1
    if big and (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
        raise TemplateLimitError(f"{base} ** {exponent} exceeds {MAX_INT_BITS} bits")


_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_NUMBER = re.compile(r"\d+")


def _percent_format_size(template: str, args) -> None:
    """Refuse printf-style formatting whose field widths add up past the limit (`*` widths are refused)."""
    total = len(template) + text_size(args)
    for width, precision in _PERCENT.findall(template):
        if "*" in (width, precision):
            raise TemplateLimitError("'*' widths in % formatting are not allowed in chat templates")
        total += int(width or 0) + int(precision or 0)
    _expect(total, "% formatting")


def _brace_format_size(template: str, args, kwargs) -> None:
    """The same for str.format: widths in specs add up; nested fields in specs are refused."""
    total = len(template) + text_size(args) + text_size(kwargs)
    for _, _, spec, _ in string.Formatter().parse(template):
        if spec and "{" in spec:
            raise TemplateLimitError("nested fields in format specs are not allowed in chat templates")
        total += sum(int(n) for n in _NUMBER.findall(spec or ""))
    _expect(total, "str.format")


def _replace_size(text: str, old: str, new: str, count: int = -1) -> None:
    occurrences = len(text) + 1 if old == "" else text.count(old)
    if isinstance(count, int) and count >= 0:
        occurrences = min(occurrences, count)
    _expect(len(text) + occurrences * max(0, len(new) - len(old)), "replace")


def _width_size(text, width) -> None:
    if isinstance(width, int):
        _expect(max(_length(text), width), "padding")


def _join_size(parts, separator="") -> None:
    if not isinstance(parts, (str, list, tuple)):
        return  # an iterator: the filter wrapper has made it a list; str.join's argument is checked after
    _expect(sum(_length(p) for p in parts) + len(str(separator)) * len(parts), "join")


def _indent_size(text, width=4, *args, **kwargs) -> None:
    text = str(text) if not isinstance(text, str) else text
    pad = width if isinstance(width, int) else len(str(width))
    _expect(len(text) + (text.count("\n") + 1) * pad, "indent")


def _wordwrap_size(text, width=79, break_long_words=True, wrapstring=None, *args, **kwargs) -> None:
    lines = len(text) // max(int(width) if isinstance(width, int) else 1, 1) + text.count("\n") + 1
    _expect(len(text) + lines * (len(wrapstring) if isinstance(wrapstring, str) else 1), "wordwrap")


def _tojson_size(value, indent=None, *args, **kwargs) -> None:
    base = text_size(value)
    _expect(base * (1 + (indent if isinstance(indent, int) and indent > 0 else 0)), "tojson")


def _sum_start(iterable, attribute=None, start=0) -> None:
    if not isinstance(start, (int, float)) or isinstance(start, bool):
        raise TemplateLimitError("sum() of lists or strings is not allowed in chat templates")


# Filter name -> check of its arguments (value first), run before the filter.
_FILTER_CHECKS = {
    "replace": lambda s, old, new, count=None, *a: _replace_size(str(s), str(old), str(new), count or -1),
    "center": lambda s, width=80, *a, **k: _width_size(s, width),
    "indent": _indent_size,
    "wordwrap": _wordwrap_size,
    "join": lambda value, d="", *a, **k: _join_size(value, d),
    "format": lambda value, *args, **kwargs: _percent_format_size(str(value), args or kwargs),
    "tojson": _tojson_size,
    "sum": _sum_start,
}
# str method name -> check of (the string, arguments), run before the call.
_METHOD_CHECKS = {
    "replace": lambda s, old="", new="", count=-1, *a: _replace_size(s, str(old), str(new), count),
    "center": lambda s, width=0, *a: _width_size(s, width),
    "ljust": lambda s, width=0, *a: _width_size(s, width),
    "rjust": lambda s, width=0, *a: _width_size(s, width),
    "zfill": lambda s, width=0, *a: _width_size(s, width),
    "expandtabs": lambda s, tabsize=8, *a: _expect(len(s) * max(int(tabsize), 1), "expandtabs"),
    "join": lambda s, parts=(), *a: _join_size(parts, s),
}


class _Bounds(jinja2.ext.Extension):
    """Rewrites a parsed template so loops, literal text and `~` pass through the budget."""

    def _iterate(self, iterable):
        budget = _budget()
        for item in iterable:
            budget.step()
            yield item

    def _literal(self, text):
        return text  # printed through finalize, which charges it to the output budget

    def _container(self, value):
        return check_value(value)  # a list, tuple or dict literal: bounded as it is built

    def _concat(self, *parts):
        budget = _budget()
        budget.step()
        _expect(sum(_length(p) for p in parts), "'~' concatenation")
        return "".join(map(str, parts))

    def bound(self, tree: nodes.Template) -> nodes.Template:
        return _Rewrite(self).visit(tree)


class _Rewrite(NodeTransformer):
    """Loops iterate through `_iterate`, literal text goes out as a call (so it is charged), `~` is `_concat`, list,
    tuple and dict literals pass through `_container` (bounded like any value a call returns)."""

    def __init__(self, bounds: _Bounds):
        self.bounds = bounds

    def _call(self, name: str, args: list, lineno: int) -> nodes.Call:
        return nodes.Call(self.bounds.attr(name, lineno=lineno), args, [], None, None, lineno=lineno)

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = self._call("_iterate", [node.iter], node.lineno)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        self.generic_visit(node)
        node.nodes = [self._call("_literal", [nodes.Const(n.data, lineno=n.lineno)], n.lineno)
                      if isinstance(n, nodes.TemplateData) else n for n in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        return self._call("_concat", node.nodes, node.lineno)

    def _literal_container(self, node):
        self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load":  # a tuple being assigned to: `{% set a, b = ... %}`
            return node
        return self._call("_container", [node], node.lineno)

    visit_List = visit_Tuple = visit_Dict = _literal_container


def bounded_filter(name: str, f):
    """Filter (or test) `f` run under the budget, its arguments checked first when `name` can grow text."""
    check = _FILTER_CHECKS.get(name)
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # context/environment comes first

    @functools.wraps(f)
    def run(*args, **kwargs):
        _budget().step()
        if check is not None and len(args) > skip:
            if name == "join" and not isinstance(args[skip], (str, list, tuple)):
                # Measured before joining, so an iterator (map(...)) is read once, into a list.
                args = (*args[:skip], check_value(list(args[skip])), *args[skip + 1:])
            check(*args[skip:], **kwargs)
        return check_value(f(*args, **kwargs))

    return run


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox plus the time and size bounds of this module."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options):
        options["extensions"] = [*options.get("extensions", ()), _Bounds]
        super().__init__(finalize=self._finalize, **options)
        self.globals.pop("lipsum", None)  # generates text in bulk; no chat template needs it
        self.filters = {name: bounded_filter(name, f) for name, f in self.filters.items()}
        self.tests = {name: bounded_filter(name, f) for name, f in self.tests.items()}

    def bounded_template(self, source: str) -> jinja2.Template:
        """Parse, rewrite for the budget, and compile `source`."""
        if len(source) > MAX_SOURCE_CHARS:
            raise TemplateLimitError(f"the chat template is {len(source)} characters; the limit is {MAX_SOURCE_CHARS}")
        bounds = next(e for e in self.extensions.values() if isinstance(e, _Bounds))
        return self.from_string(bounds.bound(self.parse(source)))

    @staticmethod
    def _finalize(value):
        budget = _budget()
        budget.step()
        budget.emit(text_size(value) if not isinstance(value, str) else len(value))
        return value

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- jinja's signature
        _budget().step()
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_CHARS:
                raise TemplateLimitError(f"a call in the chat template passes the integer {arg}; arguments are "
                                         f"limited to {MAX_CHARS}")
        method_self = getattr(__obj, "__self__", None)
        check = _METHOD_CHECKS.get(getattr(__obj, "__name__", ""))
        if isinstance(method_self, str) and check is not None:
            if __obj.__name__ == "join" and args and not isinstance(args[0], (str, list, tuple)):
                args = (check_value(list(args[0])), *args[1:])  # measured before joining: read it once
            check(method_self, *args, **kwargs)
        return check_value(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        _budget().step()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _budget().step()
        return super().getitem(obj, argument)

    def call_binop(self, context, op, left, right):
        _budget().step()
        if op == "*":
            _repeat_size(left, right)
        elif op == "**":
            _power_size(left, right)
        elif op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _expect(len(left) + len(right), "'+'")
        elif op == "%" and isinstance(left, str):
            _percent_format_size(left, right)
        return check_value(super().call_binop(context, op, left, right))

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        template = value.__self__

        def checked(*args, **kwargs):
            if value.__name__ == "format_map":
                _brace_format_size(template, (), args[0] if args else {})
            else:
                _brace_format_size(template, args, kwargs)
            return check_value(wrapped(*args, **kwargs))

        return checked

