"""The precision map: which format every tensor of an artifact got, layer by layer, as SVG or PNG.

One row per decoder layer (the embedding and an untied LM head get their own rows), one column per
role in the order a forward pass reads them (MoE experts: one column per expert and projection);
a cell is coloured by its bits per weight (red: 1-2 bits, through yellow and green, to blue: 16)
and labelled with its format. The planner's choices are drawn when the artifact has a plan (one
cell per q/k/v, gate/up, even when fused); otherwise the tensors as stored. SVG is written as
text; PNG with a tiny zlib + struct encoder and a 3x5 pixel font, so no imaging library is needed.
"""

from __future__ import annotations

import struct
import zlib
from math import prod
from pathlib import Path

from thin.artifacts import replace_with_bytes
from thin.ir import formats

_ROLE_ORDER = ("attn.q", "attn.k", "attn.v", "attn.qkv", "attn.o", "ffn.gate", "ffn.up", "ffn.gate_up", "ffn.down")
_SHORT = {"fp8_e4m3": "fp8", "mxfp4": "mx4"}


def _label(fmt: str, params) -> str:
    p = dict(params)
    text = _SHORT.get(fmt, fmt.replace("int", "i"))
    if "group_size" in p:
        text += f"g{p['group_size']}"
    if p.get("asymmetric"):
        text += "a"
    return text


def _color(bits: float) -> tuple[int, int, int]:
    """Red at 1 bit per weight, yellow at ~3, green at ~5, teal at 8, blue at 16 (log scale)."""
    stops = [(1.0, (215, 48, 39)), (3.0, (253, 174, 97)), (4.5, (255, 255, 191)), (6.0, (166, 217, 106)),
             (8.5, (26, 152, 80)), (16.0, (69, 117, 180))]
    bits = min(max(bits, stops[0][0]), stops[-1][0])
    for (b0, c0), (b1, c1) in zip(stops, stops[1:]):
        if bits <= b1:
            t = (bits - b0) / (b1 - b0)
            return tuple(round(a + (b - a) * t) for a, b in zip(c0, c1))
    return stops[-1][1]


def grid(artifact) -> dict:
    """The map as plain data: {"columns": [...], "rows": [(label, {column: cell})]}, a cell being
    {"label", "bits", "format", "name"}."""
    plan = ((artifact.section("precision_plan") or {}).get("plan") or {}).get("choices")
    cells = []
    if plan:
        for name, c in plan.items():
            cells.append((name, c["role"], c["layer"], c["expert"], c["format"], c["params"], tuple(c["shape"])))
    else:
        for name in artifact.tensor_names():
            e = artifact.tensor_entry(name)
            if len(e.shape) != 2 or e.role.startswith(("norm", "moe.router")) or e.role.endswith(".bias"):
                continue
            cells.append((name, e.role, e.layer, e.expert, e.format, e.params, tuple(e.shape)))
    model = artifact.model
    rows: dict[str, dict] = {}
    columns: list[str] = []
    for name, role, layer, expert, fmt, params, shape in cells:
        if layer is None:
            row = "embed" if name == model.embedding.weight else "head"
            column = "table"
        else:
            row = f"layer {layer}"
            short = role.replace("moe.expert.", "ffn.").replace("moe.shared_expert.", "shared.")
            column = short if expert is None else f"e{expert}.{short.split('.')[-1]}"
        params = tuple(tuple(p) for p in params)
        bits = 8 * formats.nbytes(fmt, shape, params) / prod(shape)
        rows.setdefault(row, {})[column] = {"label": _label(fmt, params), "bits": bits, "format": fmt, "name": name}
        if column not in columns:
            columns.append(column)

    def column_key(c: str):
        if c == "table":
            return (0, 0, "")
        if c[0] == "e" and c[1:2].isdigit():  # "e3.down": expert 3's down projection
            expert, projection = c[1:].split(".", 1)
            role = "ffn." + projection
            return (2, int(expert), f"{_ROLE_ORDER.index(role) if role in _ROLE_ORDER else 99:02d}")
        return (1, _ROLE_ORDER.index(c) if c in _ROLE_ORDER else 99, c)

    def row_key(r: str):
        return (-1,) if r == "embed" else (10**9,) if r == "head" else (int(r.split()[1]),)

    return {"columns": sorted(columns, key=column_key),
            "rows": [(r, rows[r]) for r in sorted(rows, key=row_key)],
            "title": f"{model.architecture}: format per tensor"}


# ---- SVG ----------------------------------------------------------------------------------------

def to_svg(g: dict) -> str:
    cw, ch, left, top = 56, 18, 70, 60
    width = left + cw * len(g["columns"]) + 160
    height = max(top + ch * len(g["rows"]) + 20, top + 20 * 12)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="monospace" font-size="10">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="4" y="14" font-size="13">{_escape(g["title"])}</text>']
    for j, column in enumerate(g["columns"]):
        x = left + j * cw + cw / 2
        out.append(f'<text x="{x}" y="{top - 6}" text-anchor="middle">{_escape(column)}</text>')
    for i, (row, cells) in enumerate(g["rows"]):
        y = top + i * ch
        out.append(f'<text x="4" y="{y + 13}">{_escape(row)}</text>')
        for j, column in enumerate(g["columns"]):
            cell = cells.get(column)
            if cell is None:
                continue
            r, gr, b = _color(cell["bits"])
            out.append(f'<rect x="{left + j * cw}" y="{y}" width="{cw - 2}" height="{ch - 2}" '
                       f'fill="rgb({r},{gr},{b})"><title>{_escape(cell["name"])}: {_escape(cell["label"])} '
                       f'({cell["bits"]:.2f} bits/weight)</title></rect>')
            out.append(f'<text x="{left + j * cw + cw / 2 - 1}" y="{y + 12}" text-anchor="middle">'
                       f'{_escape(cell["label"])}</text>')
    legend_x = left + cw * len(g["columns"]) + 16
    for k, bits in enumerate((1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 8.0, 16.0)):
        r, gr, b = _color(bits)
        y = top + k * 20
        out.append(f'<rect x="{legend_x}" y="{y}" width="16" height="14" fill="rgb({r},{gr},{b})"/>')
        out.append(f'<text x="{legend_x + 22}" y="{y + 11}">{bits:g} bits/weight</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _escape(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ---- PNG ----------------------------------------------------------------------------------------

# 3x5 glyphs, rows top to bottom, 3 bits each (MSB left).
_FONT = {
    "0": "75557", "1": "26227", "2": "71747", "3": "71717", "4": "55711", "5": "74717", "6": "74757",
    "7": "71111", "8": "75757", "9": "75717", "a": "25755", "b": "65656", "c": "34443", "d": "65556",
    "e": "74647", "f": "74644", "g": "34553", "h": "55755", "i": "72227", "j": "11156", "k": "55655",
    "l": "44447", "m": "57755", "n": "65555", "o": "25552", "p": "65644", "q": "25573", "r": "65655",
    "s": "34216", "t": "72222", "u": "55557", "v": "55552", "w": "55775", "x": "55255", "y": "55222",
    "z": "71247", ".": "00002", "-": "00700", "_": "00007", "/": "11244", ":": "02020", "(": "24442",
    ")": "42224", "+": "02720", " ": "00000",
}


def to_png(g: dict) -> bytes:
    cw, ch, left, top, scale = 30, 9, 34, 10, 2
    columns = g["columns"]
    width = left + cw * len(columns) + 2
    height = top + ch * len(g["rows"]) + 2
    pixels = [[(255, 255, 255)] * width for _ in range(height)]

    def text(x: int, y: int, s: str, color=(0, 0, 0)) -> None:
        for k, c in enumerate(s.lower()):
            glyph = _FONT.get(c, _FONT[" "])
            for dy, row in enumerate(glyph):
                bits = int(row, 16)
                for dx in range(3):
                    if bits & (4 >> dx) and 0 <= y + dy < height and 0 <= x + 4 * k + dx < width:
                        pixels[y + dy][x + 4 * k + dx] = color

    for j, column in enumerate(columns):
        text(left + j * cw + 1, 2, column[:7])
    for i, (row, cells) in enumerate(g["rows"]):
        y = top + i * ch
        text(1, y + 2, row.replace("layer ", "l")[:8])
        for j, column in enumerate(columns):
            cell = cells.get(column)
            if cell is None:
                continue
            color = _color(cell["bits"])
            for yy in range(y, y + ch - 1):
                for xx in range(left + j * cw, left + (j + 1) * cw - 1):
                    pixels[yy][xx] = color
            text(left + j * cw + 1, y + 2, cell["label"][:7])
    big = [[p for p in row for _ in range(scale)] for row in pixels for _ in range(scale)]
    return _encode_png(big)


def _encode_png(pixels: list[list[tuple[int, int, int]]]) -> bytes:
    height, width = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(v for p in row for v in p) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def write_precision_map(artifact, path) -> Path:
    """Draw `artifact`'s precision map to `path` (.svg or .png); returns the path."""
    path = Path(path)
    if path.suffix.lower() not in (".svg", ".png"):
        raise ValueError(f"--precision-map writes .svg or .png, got {path.name!r}")
    g = grid(artifact)
    replace_with_bytes(path, to_svg(g).encode() if path.suffix.lower() == ".svg" else to_png(g))
    return path
