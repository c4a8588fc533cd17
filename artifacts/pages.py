"""Expert pages: where each routed expert's bytes lie in a .thin file.

The tensor table records every tensor's layer, expert index, offset and size; the compiler's
layout_experts pass puts an expert's tensors (gate/up or gate_up, down, their biases) next to
each other, weights on 4 KiB boundaries. So an expert is one byte range, its page, and moving it
(host to device, file to pinned memory) is one copy.
"""

from __future__ import annotations

from .errors import LayoutError


def expert_pages(artifact) -> dict[tuple[int, int], tuple[int, int]]:
    """{(layer, expert): (offset, length)} for every expert of an open Artifact: offset of its first
    tensor's bytes, length up to the end of its last. Raises LayoutError when another tensor lies
    inside an expert's range (an artifact written without the page-major layout)."""
    entries = sorted((artifact.tensor_entry(n) for n in artifact.tensor_names()), key=lambda e: e.offset)
    spans: dict[tuple[int, int], list[int]] = {}
    for i, e in enumerate(entries):
        if e.expert is not None and e.layer is not None:
            spans.setdefault((e.layer, e.expert), []).append(i)
    pages = {}
    for key, rows in spans.items():
        if rows[-1] - rows[0] + 1 != len(rows):
            stray = next(entries[i].name for i in range(rows[0], rows[-1]) if i not in rows)
            raise LayoutError(f"{artifact.path}: expert {key[1]} of layer {key[0]} is not contiguous "
                              f"({stray!r} lies inside it); recompile with this thin for page-major experts")
        first, last = entries[rows[0]], entries[rows[-1]]
        pages[key] = (first.offset, last.offset + last.size - first.offset)
    return pages


def expert_page(artifact, layer: int, expert: int) -> tuple[int, int]:
    """(offset, length) of one expert's page in an open Artifact; KeyError if there is no such expert."""
    pages = expert_pages(artifact)
    if (layer, expert) not in pages:
        raise KeyError(f"{artifact.path} has no expert {expert} in layer {layer}")
    return pages[(layer, expert)]
