"""Deterministic text form of the IR, for --dump-ir and `thinc inspect --ir`."""

from __future__ import annotations

import dataclasses

from . import model as m


def printable(text: str) -> str:
    """`text` with every non-printable character (controls, escapes, bidirectional overrides, line
    separators) written as a Python escape, so text from an untrusted file is shown, never obeyed."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def format_ir(model: m.Model) -> str:
    """The whole model as stable, diffable text: the block tree, then the tensor table."""
    lines = [f"model {model.architecture} family={model.family} vocab_size={model.vocab_size} "
             f"hidden_size={model.hidden_size} max_position_embeddings={model.max_position_embeddings}"]
    _block(lines, "embedding", model.embedding, 1)
    for layer in model.layers:
        lines.append(f"  layer {layer.index}")
        for f in dataclasses.fields(layer):
            value = getattr(layer, f.name)
            if f.name != "index" and value is not None:
                _block(lines, f.name, value, 2)
    _block(lines, "final_norm", model.final_norm, 1)
    _block(lines, "lm_head", model.lm_head, 1)
    for level in model.ffn_levels:
        lines.append(f"  ffn_level keep={level.keep!r} channels={','.join(map(str, level.channels))}")
        for label, names in (("shift", level.shift), ("scale", level.scale)):
            if any(names):
                lines.append(f"    {label}: {' '.join(n or '-' for n in names)}")
    lines.append(f"tensors {len(model.tensors)}")
    for t in model.tensors:
        params = "".join(f" {k}={v}" for k, v in t.encoding.params)
        layer = "-" if t.layer is None else t.layer
        expert = "" if t.expert is None else f" expert={t.expert}"
        shape = "x".join(map(str, t.shape))
        align = "" if t.align == 64 else f" align={t.align}"
        lines.append(f"  {t.name} role={t.role} layer={layer}{expert} shape={shape} "
                     f"format={t.encoding.format}{params} source={t.source_dtype}{align}")
    # Names and roles come from files: each line is made printable before the lines are joined.
    return "\n".join(map(printable, lines)) + "\n"


def _scalar(value) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, m.Linear):
        return value.weight + (f" + {value.bias}" if value.bias else "")
    return str(value)


def _block(lines: list[str], label: str, node, depth: int) -> None:
    pad = "  " * depth
    if not dataclasses.is_dataclass(node) or isinstance(node, m.Linear):
        lines.append(f"{pad}{label}: {_scalar(node)}")
        return
    children, attrs = [], []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if value is None:
            continue
        if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            children.extend((f"{f.name}[{i}]", v) for i, v in enumerate(value))
        elif dataclasses.is_dataclass(value) and not isinstance(value, m.Linear):
            children.append((f.name, value))
        else:
            attrs.append(f"{f.name}={_scalar(value)}")
    lines.append(f"{pad}{label} {type(node).__name__}" + ("" if not attrs else " " + " ".join(attrs)))
    for name, child in children:
        _block(lines, name, child, depth + 1)
