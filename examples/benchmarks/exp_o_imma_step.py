"""Experiment: the int4 decode step with o's matvec on the int8 tensor cores, its int8 activations written by the
attention's merge, the tokens real: `thin-exec bench` in this process with two launches of each layer changed.

    python3 examples/benchmarks/exp_o_imma_step.py MODEL.thin [--runs 3] [--prompt-len 512] [--gen 128]   # GPU

Why (BENCHMARKS Rounds 22-24): the int8 mma matvec (exp_int4_imma.py) gains only with x already int8 and a scale
a group of 128, and of the kernels before the step's matvecs only the attention's merge owns such a group (a head of
128 features is o's group). Alone, o on the int8 mma took 3.37 us against 4.31 (Round 22); in the step it was not
measured: a stand-in for o alone dropped o's deferred residual norm and failed the bench's check (Round 24, item 5).
Here both launches compute: the merge (`merge_codes`: attention.py's merge, one warp a head) also rounds its head to
int8 (scale max |out| / 127 of the bf16 output, round to nearest even) and writes the codes in exp_int4_imma's B
order, the scale and the code sum; o (`o_matvec`: exp_int4_imma's kernel, one tile of 16 rows a program) adds its
rows into the residual and leaves the norm to gate/up as the shipped o does (deferred_norm.store_deferred, a slot a
program). x's int8 rounding moves o's output by about 0.6% (exp_int4_imma's check), so the tokens may differ from
the shipped step's; the bench's own checks (positions attended, graph against eager tokens) still hold.

Applies where the model's o is symmetric int4 with groups of 128 over heads of 128 features, one sequence (the
other layers and launches run as shipped). Checked on the CPU only, under the interpreter
(tests/test_exp_o_imma_step.py); not in the runtime.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from exp_int4_imma import _scaled_sums, _tile_rows, lane_tiles, waited_zeros  # noqa: E402
from int4_lanes import pick, split4  # noqa: E402

from thin.runtime.kernels.deferred_norm import Deferred, deferred_rows, store_deferred  # noqa: E402
from thin.runtime.kernels.dependent import release_next, wait_previous  # noqa: E402

ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: added to a float32 below 2^22 in magnitude, rounds it to even


@triton.jit
def _merge_codes_kernel(o_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, codes_ptr, xs_ptr, xz_ptr, log_ptr, n_ptr,
                        step_ptr, HQ, SPLITS, SP: tl.constexpr, D: tl.constexpr, SINKS: tl.constexpr,
                        LOG: tl.constexpr, PDL: tl.constexpr = 0):
    """Query head i: attention.py's `_merge_kernel` for one sequence (heads of D = 128), then the head rounded to
    int8: codes (byte position ((((c * 2 + jj) * 2 + p) * 2 + jm) * 4 + m) of feature c * 32 + jj * 16 + jm * 8
    + m * 2 + p, exp_int4_imma.fragment_words' order), scale xs[i] = max |out| / 127, code sum xz[i]."""
    wait_previous(PDL)
    release_next(PDL)
    i = tl.program_id(0)
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    o = tl.load(o_ptr + (s[:, None] * HQ + i) * D + d[None, :], mask=(s < SPLITS)[:, None], other=0.0)
    ms = tl.load(m_ptr + s * HQ + i, mask=s < SPLITS, other=float("-inf"))
    ls = tl.load(l_ptr + s * HQ + i, mask=s < SPLITS, other=0.0)
    top = tl.max(ms, axis=0)
    w = tl.where(s < SPLITS, tl.exp(ms - top), 0.0)
    w = tl.where(ms == float("-inf"), 0.0, w)
    total = tl.sum(w * ls, axis=0)
    if SINKS:
        total += tl.exp(tl.load(sink_ptr + i) - top)
    out = (tl.sum(o * w[:, None], axis=0) / total).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + i * D + d, out)
    v = out.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-30)
    code = (v * (127.0 / amax) + ROUND).to(tl.int32, bitcast=True) - 0x4B400000  # round to nearest even
    e = d % 32
    pos = (((((i * 4 + d // 32) * 2 + e // 16) * 2 + e % 2) * 2 + (e // 8) % 2) * 4 + (e % 8) // 2)
    tl.store(codes_ptr + pos, code.to(tl.int8))
    tl.store(xs_ptr + i, amax / 127.0)
    tl.store(xz_ptr + i, tl.sum(code, axis=0))
    if LOG:  # noqa: SIM102  (a constexpr condition, then a run-time one)
        if i == 0:
            n = tl.sum(tl.load(n_ptr + s, mask=s < SPLITS, other=0), axis=0)
            tl.store(log_ptr + tl.load(step_ptr), n)


@triton.jit
def _o_kernel(w_ptr, s_ptr, xq_ptr, xs_ptr, xz_ptr, res_ptr, norm_ptr, normed_ptr, slots_ptr, n, K: tl.constexpr,
              NW: tl.constexpr, GPW: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = 0):
    """Rows 16 * program_id(0) .. + 15 of W @ x (exp_int4_imma's `_imma_matvec`, one tile, x's codes, scales and
    code sums from `_merge_codes_kernel`), added into the residual with the norm deferred (store_deferred)."""
    groups: tl.constexpr = K // 128
    g, t, q0, tile0, a, b = lane_tiles(w_ptr, s_ptr, K, NW, GPW, 1, ASM)
    res, w = deferred_rows(res_ptr, norm_ptr, n, 16)
    acc_g, acc_h, _, _ = waited_zeros(NW, PDL)
    x_base = (xq_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (q0 * 4 + t) * 8)[:, None] + \
        tl.arange(0, 4)[None, :]
    for q in tl.static_range(GPW):
        ok = q0 + q < groups
        x0, x1, x2, x3 = split4(tl.load(x_base + 32 * q, mask=ok[:, None], other=0))
        x4, x5, x6, x7 = split4(tl.load(x_base + (32 * q + 4), mask=ok[:, None], other=0))
        xs = tl.load(xs_ptr + q0 + q, mask=ok, other=0.0)
        zero = -8 * tl.load(xz_ptr + q0 + q, mask=ok, other=0)
        sum_g, sum_h = _scaled_sums(a, q, GPW, (x0, x1, x2, x3, x4, x5, x6, x7), xs, zero, False, ASM)
        acc_g += sum_g * pick(a[2], q, GPW).to(tl.float32)
        acc_h += sum_h * pick(a[3], q, GPW).to(tl.float32)
    store_deferred(_tile_rows(acc_g, acc_h, NW), n, 16, res_ptr, False, res_ptr, normed_ptr, slots_ptr, res, w)


class OImma:
    """The two launches' shared buffers (one model, one sequence) and the patches that use them."""

    def __init__(self, heads: int, device):
        self.codes = torch.zeros(heads * 128, dtype=torch.int8, device=device)
        self.xs = torch.zeros(heads, dtype=torch.float32, device=device)
        self.xz = torch.zeros(heads, dtype=torch.int32, device=device)
        self.fresh = False  # the merge just wrote them (o consumes them once)

    def merge(self, attention, out, sinks=None, log=None, step=None) -> None:
        """DecodeAttention.merge for one sequence of 128-feature heads, also writing o's int8 x."""
        from thin.runtime.kernels import dependent

        _merge_codes_kernel[(attention.num_heads,)](
            attention.o, attention.m, attention.l, sinks if sinks is not None else attention.m, out, self.codes,
            self.xs, self.xz, log if log is not None else attention.n, attention.n,
            step if step is not None else attention.n, attention.num_heads, attention.splits,
            SP=triton.next_power_of_2(attention.splits), D=128, SINKS=sinks is not None, LOG=log is not None,
            num_warps=1, **dependent.kernel_args())
        self.fresh = True

    def o(self, op, residual, normed, slots, norm, warps: int = 4) -> Deferred:
        """o's matvec_deferred on the int8 mma from the merge's codes: residual += W @ x, normed = residual * norm
        weight, a slot a program; returns the Deferred gate/up takes."""
        from thin.runtime.kernels import common

        n, k = op.out_features, op.in_features
        programs = n // 16
        defer = Deferred(residual, normed, slots, norm, programs)
        gpw = triton.next_power_of_2(-(-(k // 128) // warps))
        asm = common.INLINE_ASM and not common.interpreting()
        _o_kernel[(programs,)](op.low32.reshape(n, k // 8), op.scales.reshape(n, k // 128),
                               self.codes.view(torch.int32), self.xs, self.xz, residual, norm[0], normed, slots, n, k,
                               warps, gpw, asm, num_warps=warps)
        self.fresh = False
        return defer


def applies(op, attention) -> bool:
    """Whether `op` (an o projection) and the attention before it take this experiment's way."""
    from thin.runtime.kernels.grouped_int import GroupedIntLinear

    return (isinstance(op, GroupedIntLinear) and op.format == "int4" and not op.asym and op.group == 128
            and op.bias is None and op.in_features % 128 == 0 and op.out_features % 16 == 0
            and attention.head_dim == 128 and attention.rows == 1)


def patch(state: dict) -> None:
    """Route every eligible merge and the deferred o after it through OImma (`state` keeps the OImma a device)."""
    from thin.runtime.kernels import attention as attention_module
    from thin.runtime.kernels.grouped_int import GroupedIntLinear

    merge, deferred = attention_module.DecodeAttention.merge, GroupedIntLinear.matvec_deferred

    def new_merge(self, out, sinks=None, log=None, step=None):
        if self.head_dim != 128 or self.rows != 1:
            return merge(self, out, sinks, log, step)
        way = state.setdefault(out.device, OImma(self.num_heads, out.device))
        way.merge(self, out, sinks, log, step)
        way.attention = self
        return None

    def new_deferred(self, x, residual, out, slots, norm, cols=None):
        way = state.get(x.device)
        if way is None or not way.fresh or cols is not None or self.in_features != way.codes.numel() or \
                not applies(self, way.attention):
            return deferred(self, x, residual, out, slots, norm, cols=cols)
        return way.o(self, residual, out, slots, norm)

    attention_module.DecodeAttention.merge = new_merge
    GroupedIntLinear.matvec_deferred = new_deferred


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        raise SystemExit(__doc__)
    from thin.runtime.cli import main as thin_exec

    patch({})
    sys.argv = ["thin-exec", "bench", *args, "--json"]
    thin_exec()


if __name__ == "__main__":
    main()
