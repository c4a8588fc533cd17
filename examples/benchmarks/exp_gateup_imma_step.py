"""Experiment: the int4 decode step with gate/up on the int8 tensor cores too, its int8 x written by o: `thin-exec
bench` in this process with two launches of each layer changed, the tokens real.

    python3 examples/benchmarks/exp_gateup_imma_step.py MODEL.thin [--plain] [--runs 3] [--prompt-len 512] [--gen 128]

Why (BENCHMARKS Rounds 22, 23 and 26): the int8 mma matvec gains as a programmatic dependent whose x is int8 with
scales a producer could write. o now runs on it from the merge's codes (runtime/kernels/int8_heads.py, +2.7%), and
o's programs are 16 rows each: each owns 16 of gate/up's x (the deferred norm's row, residual * norm weight). Round
23's chunk-of-16 way (exp_int4_imma_cols.py: a chunk's two halves in B's columns 2t and 2t + 1, each with its own
scale) is what such a producer can write alone: alone and dependent, gate/up took 16.88 us against 18.05 shipped.

Here o (`_o_emit_kernel`: int8_heads' o, then its 16 normed rows rounded to int8 by their max and written in the
chunk layout, exp_int4_imma_cols._emit) and gate/up (`_glu_kernel`: a program a 16-row tile of gate and the same of
up, their weights loaded before the wait, a programmatic dependent of o; after it x's codes and scales, the deferred
norm's 1 / rms from o's slots, act(gate) * up rounded as the shipped epilogue rounds it) replace the shipped
launches wherever the engine runs o from int8 heads and gate/up is one fused symmetric int4 (groups of 128) weight
with SiLU, no bias and no elastic level; every other launch runs as shipped. --plain: gate/up launched plainly.
The rounding of gate/up's x to int8 a chunk of 16 moves its rows by about 0.5% (exp_int4_imma_cols' check).
Checked under the interpreter and on the H200 (tests/test_exp_gateup_imma_step.py). Measured on the H200 (BENCHMARKS
Round 26, item 6): 632.9 tok/s against 653.4 and 653.5 for the shipped step, 3.1% slower; not in the runtime.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from exp_int4_imma_cols import _emit, _quad_rows  # noqa: E402
from exp_int4_imma_max import group_chain_s8  # noqa: E402
from int4_lanes import pick, split4, threads  # noqa: E402

from thin.runtime.kernels.deferred_norm import Deferred, deferred_rows, deferred_scale, store_deferred  # noqa: E402
from thin.runtime.kernels.dependent import release_next, wait_previous  # noqa: E402
from thin.runtime.kernels.int8_heads import _tile_runs, o_tile_sums, o_warps  # noqa: E402
from thin.runtime.kernels.tiles import activate  # noqa: E402


@triton.jit
def _o_emit_kernel(w_ptr, s_ptr, xq_ptr, xs_ptr, xz_ptr, res_ptr, norm_ptr, normed_ptr, slots_ptr, eq_ptr, es_ptr, n,
                   K: tl.constexpr, NW: tl.constexpr, GPW: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = 0):
    """int8_heads' o (its rows into the residual, the norm deferred), then its 16 normed rows (residual * norm
    weight, rounded as store_deferred rounds them) as gate/up's x: int8 by their max, chunk program_id(0)."""
    total = o_tile_sums(w_ptr, s_ptr, xq_ptr, xs_ptr, xz_ptr, K, NW, GPW, ASM, PDL)
    res, w = deferred_rows(res_ptr, norm_ptr, n, 16)
    store_deferred(total, n, 16, res_ptr, False, res_ptr, normed_ptr, slots_ptr, res, w)
    dtype = res_ptr.dtype.element_ty
    new = (res + total.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    _emit((new * w).to(dtype).to(tl.float32), tl.program_id(0), eq_ptr, es_ptr)


@triton.jit
def _glu_kernel(w_ptr, s_ptr, xq_ptr, xs_ptr, out_ptr, slots_ptr, n_slots, H_rows, eps, F, K: tl.constexpr,
                NW: tl.constexpr, GPW: tl.constexpr, ASM: tl.constexpr, SLOTS: tl.constexpr, PDL: tl.constexpr = 0):
    """act(gate) * up for rows 16 * program_id(0) .. + 15 of a fused [gate; up] weight (up F rows on): x's codes
    and chunk scales (quantize_x_cols' layout) after the wait, times the deferred norm's 1 / rms."""
    groups: tl.constexpr = K // 128
    EXACT: tl.constexpr = groups == GPW * NW
    e = threads(NW, ASM)
    g = (e % 32) // 4
    t = e % 4
    q0 = e // 32 * GPW
    row = tl.program_id(0) * 16 + g
    a = _tile_runs(w_ptr, s_ptr, row, q0, t, GPW, groups, K)
    b = _tile_runs(w_ptr, s_ptr, row + F, q0, t, GPW, groups, K)
    x_words = xq_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (q0 * 4 + t) * 8
    lo_ptr = (x_words + (g != 2 * t).to(tl.int32) * (K // 4))[:, None] + tl.arange(0, 4)[None, :]
    hi_ptr = (x_words + 4 + (g != 2 * t + 1).to(tl.int32) * (K // 4))[:, None] + tl.arange(0, 4)[None, :]
    s_ptrs = (xs_ptr + (q0 * 4 + t) * 2)[:, None] + tl.arange(0, 2)[None, :]
    wait_previous(PDL)
    release_next(PDL)
    rstd = deferred_scale(slots_ptr, n_slots, H_rows, eps, SLOTS)
    acc_ag = tl.zeros([32 * NW], dtype=tl.float32)
    acc_ah = acc_ag
    acc_bg = acc_ag
    acc_bh = acc_ag
    for q in tl.static_range(GPW):
        ok = (q0 + q < groups)[:, None]
        lo = split4(tl.load(lo_ptr + 32 * q) if EXACT else tl.load(lo_ptr + 32 * q, mask=ok, other=0))
        hi = split4(tl.load(hi_ptr + 32 * q) if EXACT else tl.load(hi_ptr + 32 * q, mask=ok, other=0))
        s0, s1 = tl.split(tl.load(s_ptrs + 8 * q) if EXACT else tl.load(s_ptrs + 8 * q, mask=ok, other=0.0))
        d = group_chain_s8(a, q, GPW, lo, hi, ASM)
        acc_ag += (d[0].to(tl.float32) * s0 + d[1].to(tl.float32) * s1) * pick(a[2], q, GPW).to(tl.float32)
        acc_ah += (d[2].to(tl.float32) * s0 + d[3].to(tl.float32) * s1) * pick(a[3], q, GPW).to(tl.float32)
        d = group_chain_s8(b, q, GPW, lo, hi, ASM)
        acc_bg += (d[0].to(tl.float32) * s0 + d[1].to(tl.float32) * s1) * pick(b[2], q, GPW).to(tl.float32)
        acc_bh += (d[2].to(tl.float32) * s0 + d[3].to(tl.float32) * s1) * pick(b[3], q, GPW).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    gate = (_quad_rows(acc_ag, acc_ah, NW) * rstd).to(dtype).to(tl.float32)
    up = (_quad_rows(acc_bg, acc_bh, NW) * rstd).to(dtype).to(tl.float32)
    act = activate(gate, 0).to(dtype).to(tl.float32)  # SiLU, as tiles.store_glu rounds it
    tl.store(out_ptr + tl.program_id(0) * 16 + tl.arange(0, 16), (act * up).to(dtype))


class GateUpImma:
    """The buffers the patched o writes and the patched gate/up reads (gate/up's x as int8 chunks of 16: codes and
    then as many zero words, a scale a chunk) for one model's hidden size, and whether o just wrote them."""

    def __init__(self, hidden: int, device, plain: bool = False):
        self.codes = torch.zeros(hidden // 2, dtype=torch.int32, device=device)  # codes, then zero words
        self.scales = torch.zeros(hidden // 16, dtype=torch.float32, device=device)
        self.plain = plain
        self.fresh = False

    def o(self, op, heads, residual, normed, slots, norm) -> Deferred:
        """int8_heads.o_deferred, also writing gate/up's x."""
        from thin.runtime.kernels import dependent, interpreting
        from thin.runtime.kernels.common import INLINE_ASM

        n, k = op.out_features, op.in_features
        warps, gpw = o_warps(k)
        _o_emit_kernel[(n // 16,)](op.low32.reshape(n, k // 8), op.scales.reshape(n, k // 128),
                                   heads.codes.view(torch.int32), heads.scales, heads.sums, residual, norm[0], normed,
                                   slots, self.codes, self.scales, n, k, warps, gpw, INLINE_ASM and not interpreting(),
                                   num_warps=warps, **dependent.kernel_args())
        self.fresh = True
        return Deferred(residual, normed, slots, norm, n // 16)

    def glu(self, op, out: torch.Tensor, rstd: Deferred, warps: int = 4) -> None:
        """out = SiLU(gate) * up of the fused weight `op` from the x o wrote, 1 / rms from o's slots."""
        from thin.runtime.kernels import interpreting
        from thin.runtime.kernels.common import INLINE_ASM, next_power_of_2

        f, k = op.out_features // 2, op.in_features
        gpw = triton.next_power_of_2(-(-(k // 128) // warps))
        launch = {} if self.plain else ({"PDL": 1} if interpreting() else {"PDL": 2, "launch_pdl": True})
        _glu_kernel[(f // 16,)](op.low32.reshape(2 * f, k // 8), op.scales.reshape(2 * f, k // 128), self.codes,
                                self.scales, out, rstd.slots, rstd.programs, rstd.residual.numel(), float(rstd.norm[1]),
                                f, k, warps, gpw, INLINE_ASM and not interpreting(),
                                next_power_of_2(rstd.programs), num_warps=warps, **launch)
        self.fresh = False


def takes(mlp) -> bool:
    """Whether a layer's MLP can take the patched gate/up: one fused symmetric int4 weight (groups of 128) with SiLU,
    no bias, no elastic level, 16-row tiles of each half."""
    from thin.runtime.kernels.grouped_int import GroupedIntLinear

    op = mlp.up[0] if mlp.gated and len(mlp.up) == 1 else None
    return (isinstance(op, GroupedIntLinear) and op.format == "int4" and not op.asym and op.group == 128
            and op.bias is None and mlp.activation == "silu" and mlp.width is None and mlp.scale is None
            and op.in_features % 128 == 0 and (op.out_features // 2) % 16 == 0 and op.in_features <= 16 * 4 * 128)


def patch(state: dict, plain: bool = False) -> None:
    """Route the decode step's int8 o through GateUpImma.o, and the gate/up right after it through GateUpImma.glu
    (`state`: the GateUpImma a device)."""
    from thin.runtime import engine as engine_module
    from thin.runtime.kernels import int8_heads

    mlp_call = engine_module.DecodeEngine._mlp

    def new_o(op, heads, residual, normed, slots, norm):
        way = state.get(residual.device)
        if way is None:  # made once: its buffers' zeroing is no launch of the captured step
            way = state[residual.device] = GateUpImma(residual.numel(), residual.device, plain)
        return way.o(op, heads, residual, normed, slots, norm)

    def new_mlp(self, mlp, x, rstd=None):
        way = state.get(x.device)
        if way is None or not way.fresh or rstd is None or not takes(mlp):
            if way is not None:
                way.fresh = False
            return mlp_call(self, mlp, x, rstd)
        width = mlp.down.in_features
        way.glu(mlp.up[0], self.mlp[:width], rstd)
        return width

    int8_heads.o_deferred = new_o
    engine_module.DecodeEngine._mlp = new_mlp


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--plain"]
    if not args or args[0].startswith("-"):
        raise SystemExit(__doc__)
    from thin.runtime.cli import main as thin_exec

    patch({}, plain="--plain" in sys.argv)
    sys.argv = ["thin-exec", "bench", *args, "--json"]
    thin_exec()


if __name__ == "__main__":
    main()
