"""Reading one expert's rows: the expert kernels' per-format decoding (experts.py launches them).

Every expert's weight stays as the executor loaded it, one blob (or dense tensor) per expert. The
experts of a layer that share a format form an `ExpertGroup`: a table of byte offsets (int64 [experts, 6]:
up to five parts and the bias) from one base address, so a program turns its slot's expert into
addresses with one load. `rows_dot` is the dot product of a block of an expert's rows with the
activations, in any of the formats: bf16 / f16 / f32, int8, fp8_e4m3, int3-int6 (one or two code
planes), mxfp4, q2, q1, each tile decoded in registers, and trellis (its family's rows_dot, trellis.py)
(the format's reference `decode` is what it must match).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thin.ir import formats

from . import trellis

# Format codes of the kernels' FMT constexpr; SUB is a dense format's dtype code or a grouped int's bits.
DENSE, INT8, FP8, GINT, MXFP4, Q2, Q1, TRELLIS = range(8)
FORMAT_CODES = {"bf16": DENSE, "f16": DENSE, "f32": DENSE, "int8": INT8, "fp8_e4m3": FP8, "int3": GINT,
                "int4": GINT, "int5": GINT, "int6": GINT, "mxfp4": MXFP4, "q2": Q2, "q1": Q1, "trellis": TRELLIS}
# The parts each format's kernel reads, in the table's column order (column 5 is the bias; a grouped
# int's low code plane is "codes" for int4, "codes_low" otherwise, its high plane column 3).
_PARTS = {DENSE: ("weight",), INT8: ("values", "scales"), FP8: ("values", "scales"),
          GINT: ("codes", "scales", "offsets", "codes_high"), MXFP4: ("values", "scales"),
          Q2: ("codes", "scales", "offsets", "row_scale", "row_offset"), Q1: ("signs", "scales", "row_scale"),
          TRELLIS: ("codes", "row_scale")}
_DENSE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
SUPPORTED = tuple(FORMAT_CODES)


# ---- reading one expert's rows ------------------------------------------------------------------------

@triton.jit
def _part(base, offs, j: tl.constexpr, dtype: tl.constexpr):
    """The address of part j of the expert whose offsets row is `offs` (16-byte aligned), typed."""
    off = tl.multiple_of(tl.load(offs + j), 16)
    return (base + off).to(tl.pointer_type(dtype))


@triton.jit
def _e4m3(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _byte_step(acc, w, x_ptr, k0, ks, cmask, FMT: tl.constexpr):
    x = tl.load(x_ptr + k0 + ks, mask=cmask, other=0.0).to(tl.float32)
    if FMT == 1:  # int8: v + 128 is 0..255, converted by _small_int
        wf = _small_int(w.to(tl.int32) + 128, 128.0)
    elif FMT == 2:  # fp8_e4m3 bytes
        wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        wf = w.to(tl.float32)
    return acc + wf * x[None, :]


@triton.jit
def _bytewise_dot(w_ptr, x_ptr, rows, row_mask, K, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  PREFETCH: tl.constexpr):
    """sum_k W[rows, k] x[k] for one element a column (dense, int8, fp8): float32 [BN]. PREFETCH:
    the next tile's loads are issued before this tile's math (two tiles in flight)."""
    ks = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    if PREFETCH:
        w_next = tl.load(ptrs, mask=row_mask[:, None] & (ks < K)[None, :], other=0)
        for k0 in range(0, K, BK):
            w = w_next
            w_next = tl.load(ptrs + k0 + BK, mask=row_mask[:, None] & (k0 + BK + ks < K)[None, :], other=0)
            acc = _byte_step(acc, w, x_ptr, k0, ks, k0 + ks < K, FMT)
    else:
        for k0 in range(0, K, BK):
            cmask = k0 + ks < K
            w = tl.load(ptrs + k0, mask=row_mask[:, None] & cmask[None, :], other=0)
            acc = _byte_step(acc, w, x_ptr, k0, ks, cmask, FMT)
    return tl.sum(acc, axis=1)


@triton.jit
def _x_split(x_ptr, start, gi, gmask, GB: tl.constexpr, G: tl.constexpr, PER: tl.constexpr):
    """x at the columns of NG groups of G from `start`, as PER tensors [NG, GB]: element j holds the
    columns PER * i + j (the codes packed at bits j * 8 / PER of byte i of a group's GB bytes)."""
    offs = start + gi[:, None] * G + tl.arange(0, G)[None, :]
    x = tl.load(x_ptr + offs, mask=gmask[:, None], other=0.0).to(tl.float32)
    x = tl.reshape(x, [gi.shape[0], GB, PER])
    if PER == 2:
        x0, x1 = tl.split(x)
        out = (x0, x1)
    elif PER == 4:
        a, b = tl.split(tl.reshape(x, [gi.shape[0], GB, 2, 2]))  # a: j even, b: j odd; split again by j // 2
        x0, x2 = tl.split(a)
        x1, x3 = tl.split(b)
        out = (x0, x1, x2, x3)
    else:
        a, b = tl.split(tl.reshape(x, [gi.shape[0], GB, 2, 2, 2]))  # j % 2
        aa, ab = tl.split(a)  # (j // 2) % 2 of the even j
        ba, bb = tl.split(b)
        x0, x4 = tl.split(aa)
        x2, x6 = tl.split(ab)
        x1, x5 = tl.split(ba)
        x3, x7 = tl.split(bb)
        out = (x0, x1, x2, x3, x4, x5, x6, x7)
    return out


@triton.jit
def _small_int(u, zero: tl.constexpr):
    """float(u - zero) for integers 0 <= u < 2^23 (int32), without the int-to-float unit (a fraction of
    the float rate): u OR-ed into the mantissa of 2^23 is exactly 2^23 + u."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + zero)


@triton.jit
def _e2m1(code):
    """The E2M1 value of 4-bit codes (int32): magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6, sign bit 3, built
    as float32 bits: a normal code (exponent e >= 1) has exponent e - 1 and the mantissa bit on top;
    code 1 is 0.5 (0x3F000000), code 0 zero."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(byte):
    """2^(byte - 127) for E8M0 scale bytes (int32, 0..254): the float32 with that biased exponent."""
    return tl.where(byte == 0, 5.877471754111438e-39, (byte << 23).to(tl.float32, bitcast=True))


@triton.jit
def _grouped_dot(base, offs, x_ptr, rows, row_mask, K, FMT: tl.constexpr, SUB: tl.constexpr, G: tl.constexpr,
                 NG: tl.constexpr, BN: tl.constexpr, ASYM: tl.constexpr, PREFETCH: tl.constexpr):
    """sum_k W[rows, k] x[k] for the formats with a scale per group of G columns (int3-int6, mxfp4,
    q2, q1): NG groups a step, each group's packed bytes [BN, NG, GB] (a grouped int's low plane)
    decoded in registers against x split the same way (_x_split). float32 [BN]. PREFETCH: the next
    step's codes are loaded before this step's math."""
    PER: tl.constexpr = (4 if SUB == 3 else 2) if FMT == 3 else (2 if FMT == 4 else (4 if FMT == 5 else 8))
    GB: tl.constexpr = G // PER
    groups = K // G
    row_bytes = K // PER
    gi = tl.arange(0, NG)
    bi = tl.arange(0, GB)
    r64 = rows.to(tl.int64)
    codes_ptr = _part(base, offs, 0, tl.uint8)
    byte_offs = r64[:, None, None] * row_bytes + gi[None, :, None] * GB + bi[None, None, :]
    side_offs = r64[:, None] * groups + gi[None, :]
    acc = tl.zeros([BN, NG, GB], dtype=tl.float32)
    row_scale = tl.zeros([BN, 1], dtype=tl.float32)  # q2 and q1 only
    row_offset = row_scale  # q2 only
    if FMT == 5:
        row_scale = tl.load(_part(base, offs, 3, tl.float32) + rows, mask=row_mask, other=0.0)[:, None]
        row_offset = tl.load(_part(base, offs, 4, tl.float32) + rows, mask=row_mask, other=0.0)[:, None]
    if FMT == 6:
        row_scale = tl.load(_part(base, offs, 2, tl.float32) + rows, mask=row_mask, other=0.0)[:, None]
    if PREFETCH:
        first = row_mask[:, None] & (gi < groups)[None, :]
        b_next = tl.load(codes_ptr + byte_offs, mask=first[:, :, None], other=0)
        for g0 in range(0, groups, NG):
            b = b_next
            following = row_mask[:, None] & (g0 + NG + gi < groups)[None, :]
            b_next = tl.load(codes_ptr + byte_offs + (g0 + NG) * GB, mask=following[:, :, None], other=0)
            acc = _group_step(acc, b.to(tl.int32), base, offs, x_ptr, g0, gi, r64, row_mask, side_offs, groups,
                              row_scale, row_offset, K, FMT, SUB, G, GB, PER, ASYM)
    else:
        for g0 in range(0, groups, NG):
            mask2 = row_mask[:, None] & (g0 + gi < groups)[None, :]
            b = tl.load(codes_ptr + byte_offs + g0 * GB, mask=mask2[:, :, None], other=0).to(tl.int32)
            acc = _group_step(acc, b, base, offs, x_ptr, g0, gi, r64, row_mask, side_offs, groups, row_scale,
                              row_offset, K, FMT, SUB, G, GB, PER, ASYM)
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _group_step(acc, b, base, offs, x_ptr, g0, gi, r64, row_mask, side_offs, groups, row_scale, row_offset, K,
                FMT: tl.constexpr, SUB: tl.constexpr, G: tl.constexpr, GB: tl.constexpr, PER: tl.constexpr,
                ASYM: tl.constexpr):
    """acc [BN, NG, GB] + the products of one step's codes `b` (int32 bytes) with x, scaled per group."""
    gmask = g0 + gi < groups
    mask2 = row_mask[:, None] & gmask[None, :]
    xs = _x_split(x_ptr, g0 * G, gi, gmask, GB, G, PER)
    if FMT == 3 and SUB == 4 and not ASYM:  # int4: (u - 8) * scale, the 8 taken off in _small_int
        scale = tl.load(_part(base, offs, 1, tl.float16) + side_offs + g0, mask=mask2, other=0.0).to(tl.float32)
        lo, hi = _small_int(b & 15, 8.0), _small_int(b >> 4, 8.0)
        acc += scale[:, :, None] * (lo * xs[0][None] + hi * xs[1][None])
    elif FMT == 3:  # int3-int6: u = low | high << WL; (u - 2^(bits-1)) * scale, or u * scale + offset
        scale = tl.load(_part(base, offs, 1, tl.float16) + side_offs + g0, mask=mask2, other=0.0).to(tl.float32)
        if PER == 2:  # a 4-bit low plane
            dot = _small_int(b & 15, 0.0) * xs[0][None] + _small_int(b >> 4, 0.0) * xs[1][None]
            xsum = xs[0] + xs[1]
        else:  # int3's 2-bit low plane
            dot = _small_int(b & 3, 0.0) * xs[0][None] + _small_int((b >> 2) & 3, 0.0) * xs[1][None] \
                + _small_int((b >> 4) & 3, 0.0) * xs[2][None] + _small_int(b >> 6, 0.0) * xs[3][None]
            xsum = xs[0] + xs[1] + xs[2] + xs[3]
        if ASYM:
            offset = tl.load(_part(base, offs, 2, tl.float16) + side_offs + g0, mask=mask2,
                             other=0.0).to(tl.float32)
            acc += scale[:, :, None] * dot + offset[:, :, None] * xsum[None]
        else:
            acc += scale[:, :, None] * (dot - (1 << (SUB - 1)) * xsum[None])
        WL: tl.constexpr = 8 // PER
        WH: tl.constexpr = SUB - WL
        if WH > 0:
            # The high plane's codes weigh 2^WL. Its dot has its own split of x ([.., G / (8 / WH)]), so
            # its per-group sum is spread evenly over the low plane's GB lanes (GB is a power of 2: exact).
            PH: tl.constexpr = 8 // WH
            GH: tl.constexpr = G // PH
            hb = tl.load(_part(base, offs, 3, tl.uint8) + r64[:, None, None] * (K // PH)
                         + (g0 + gi)[None, :, None] * GH + tl.arange(0, GH)[None, None, :],
                         mask=mask2[:, :, None], other=0).to(tl.int32)
            xh = _x_split(x_ptr, g0 * G, gi, gmask, GH, G, PH)
            high = tl.zeros(hb.shape, dtype=tl.float32)
            for j in tl.static_range(PH):
                high += _small_int((hb >> (j * WH)) & ((1 << WH) - 1), 0.0) * xh[j][None]
            acc += (scale * tl.sum(high, axis=2) * ((1 << WL) / GB))[:, :, None]
    elif FMT == 4:  # mxfp4: E2M1 * 2^(scale byte - 127)
        e8 = tl.load(_part(base, offs, 1, tl.uint8) + side_offs + g0, mask=mask2, other=127).to(tl.int32)
        scale = _e8m0(e8)
        acc += scale[:, :, None] * (_e2m1(b & 15) * xs[0][None] + _e2m1(b >> 4) * xs[1][None])
    elif FMT == 5:  # q2: u * (row_scale * scale) + row_offset * offset
        step = row_scale * _e4m3(_part(base, offs, 1, tl.uint8), side_offs + g0, mask2)
        zero = row_offset * _e4m3(_part(base, offs, 2, tl.uint8), side_offs + g0, mask2)
        dot = _small_int(b & 3, 0.0) * xs[0][None] + _small_int((b >> 2) & 3, 0.0) * xs[1][None] \
            + _small_int((b >> 4) & 3, 0.0) * xs[2][None] + _small_int(b >> 6, 0.0) * xs[3][None]
        acc += step[:, :, None] * dot + zero[:, :, None] * (xs[0] + xs[1] + xs[2] + xs[3])[None]
    else:  # q1: (2 b - 1) * row_scale * scale
        step = row_scale * _e4m3(_part(base, offs, 1, tl.uint8), side_offs + g0, mask2)
        signed = tl.zeros(b.shape, dtype=tl.float32)
        for j in tl.static_range(8):  # + x where the bit is set, - x where not: a select, no conversion
            xj = xs[j][None]
            signed += tl.where(((b >> j) & 1) != 0, xj, -xj)
        acc += step[:, :, None] * signed
    return acc


@triton.jit
def rows_dot(base, offs, x_ptr, rows, row_mask, K, FMT: tl.constexpr, SUB: tl.constexpr, G: tl.constexpr,
             NG: tl.constexpr, BN: tl.constexpr, ASYM: tl.constexpr, PREFETCH: tl.constexpr, ASM: tl.constexpr):
    """sum_k W[rows, k] x[k] of the expert whose offsets row is `offs`, any format: float32 [BN]. ASM: the
    GPU's inline assembly where a format has some (trellis: dp4a)."""
    if FMT == 0:
        if SUB == 0:
            w_ptr = _part(base, offs, 0, tl.bfloat16)
        elif SUB == 1:
            w_ptr = _part(base, offs, 0, tl.float16)
        else:
            w_ptr = _part(base, offs, 0, tl.float32)
        total = _bytewise_dot(w_ptr, x_ptr, rows, row_mask, K, FMT, BN, G, PREFETCH)
    elif FMT == 1:
        total = _bytewise_dot(_part(base, offs, 0, tl.int8), x_ptr, rows, row_mask, K, FMT, BN, G, PREFETCH)
        total *= tl.load(_part(base, offs, 1, tl.float32) + rows, mask=row_mask, other=0.0)
    elif FMT == 2:
        total = _bytewise_dot(_part(base, offs, 0, tl.uint8), x_ptr, rows, row_mask, K, FMT, BN, G, PREFETCH)
        total *= tl.load(_part(base, offs, 1, tl.float32) + rows, mask=row_mask, other=0.0)
    elif FMT == 7:  # trellis: SUB bits a weight, NG blocks of 16 columns a step
        total = trellis.rows_dot(_part(base, offs, 0, tl.uint8), _part(base, offs, 1, tl.float16), x_ptr, rows,
                                 row_mask, K, K, SUB, NG, PREFETCH, ASM)
    else:
        total = _grouped_dot(base, offs, x_ptr, rows, row_mask, K, FMT, SUB, G, NG, BN, ASYM, PREFETCH)
    return total


@triton.jit
def row_bias(base, offs, rows, row_mask, HAS_BIAS: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The expert's bias at `rows` (float32), or 0."""
    if HAS_BIAS:
        b = tl.load((base + tl.load(offs + 5)).to(tl.pointer_type(OUT_DTYPE)) + rows, mask=row_mask,
                    other=0.0).to(tl.float32)
    else:
        b = tl.zeros(rows.shape, dtype=tl.float32)
    return b


def weight_parts(op) -> tuple[str, dict, tuple]:
    """(format, {part: tensor}, params) of a LinearOp's weight as the executor holds it: the dense
    tensor of a dense op, the packed parts (views, no copy) of a quantized one."""
    weight = getattr(op, "weight", None)
    if isinstance(weight, torch.Tensor):
        return op.format, {"weight": weight}, ()
    raw, shape, params = getattr(op, "raw", None), getattr(op, "shape", None), getattr(op, "params", ())
    if raw is None or shape is None:
        raise NotImplementedError(f"{op!r} exposes neither a dense weight nor its packed bytes")
    fmt = formats.get(op.format)
    return op.format, fmt.split(raw, tuple(shape), params), tuple(fmt.normalize(params))


class ExpertGroup:
    """The experts of one layer that share a format: their offset tables and launch constants."""

    def __init__(self, key, members: list[int], num_experts: int, gate_ops, up_ops, down_ops, fused: bool,
                 device, dtype):
        fmt_name, dense_dtype, params, has_bias = key
        self.fmt = FORMAT_CODES[fmt_name]
        self.params = dict(params)
        self.dt = int(fmt_name[3:]) if self.fmt == GINT else int(self.params["bits"]) if self.fmt == TRELLIS \
            else _DENSE_DTYPES.get(dense_dtype, 0)
        self.asym = bool(self.params.get("asymmetric", 0))
        self.group = {GINT: self.params.get("group_size", 0), MXFP4: 32, Q2: self.params.get("group_size", 0),
                      Q1: self.params.get("group_size", 0), TRELLIS: trellis.TILE}.get(self.fmt, 0)
        self.has_bias = has_bias
        self.fused = fused
        member = torch.full((num_experts,), -1, dtype=torch.int32)
        member[torch.tensor(members, dtype=torch.long)] = torch.arange(len(members), dtype=torch.int32)
        self.member = member.to(device)
        self.members = list(members)
        self.every = len(members) == num_experts  # the kernels then skip the membership check
        self.ops = (gate_ops, up_ops, down_ops)
        self.tensors = []  # every tensor whose address a table holds (kept alive here too)
        self.addresses = {}
        for role, ops in (("gate", gate_ops), ("up", up_ops), ("down", down_ops)):
            rows = []
            for op in ops:
                _, parts, _ = weight_parts(op)
                names = list(_PARTS[self.fmt])
                if self.fmt == GINT and "codes_low" in parts:
                    names[0] = "codes_low"
                row = [parts.get(name) for name in names]  # absent parts (offsets, a high plane): 0
                self.tensors += [t for t in row if t is not None]
                if op.bias is not None:
                    self.tensors.append(op.bias)
                rows.append([t.data_ptr() if t is not None else 0 for t in row] + [0] * (5 - len(row))
                            + [op.bias.data_ptr() if op.bias is not None else 0])
            self.addresses[role] = rows

    def tables(self, base: int, device) -> None:
        """The offset tables (int64 [num_experts, 6], one row per expert of the layer, by expert index: a
        program finds its rows with no look-up of the member index first; zeros for other groups' experts)."""
        num_experts = self.member.numel()
        for role, rows in self.addresses.items():
            table = torch.zeros(num_experts, 6, dtype=torch.int64)
            table[torch.tensor(self.members, dtype=torch.long)] = torch.tensor(
                [[a - base if a else 0 for a in row] for row in rows], dtype=torch.int64)
            if (table < 0).any():
                raise NotImplementedError("an expert part below the base address")
            if (table[:, :5] % 16).any():
                raise NotImplementedError("an expert part is not 16-byte aligned")
            setattr(self, f"{role}_table", table.to(device))
