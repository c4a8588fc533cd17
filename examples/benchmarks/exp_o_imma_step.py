"""Experiment: the int4 decode step with o's matvec on the int8 tensor cores, its int8 activations written by the
attention's merge, the tokens real: `thin-exec bench` in this process with two launches of each layer changed.

    python3 examples/benchmarks/exp_o_imma_step.py MODEL.thin [--dep | --fold [--sleep NS]] [--only merge|o]
        [--runs 3] [--prompt-len 512] [--gen 128]

Why (BENCHMARKS Rounds 22-24): the int8 mma matvec (exp_int4_imma.py) gains only with x already int8 and a scale
a group of 128, and of the kernels before the step's matvecs only the attention's merge owns such a group (a head of
128 features is o's group). Alone, o on the int8 mma took 3.37 us against 4.31 (Round 22); in the step it was not
measured: a stand-in for o alone dropped o's deferred residual norm and failed the bench's check (Round 24, item 5).
Here both launches compute: the merge (`_merge_codes_kernel`: attention.py's merge, a program and the shipped warps a
head) also rounds its head to int8 (scale max |out| / 127 of the bf16 output, round to nearest even) and writes the
codes in exp_int4_imma's B order, the scale and the code sum; o (`_o_kernel`: exp_int4_imma's kernel, one tile of 16
rows a program) adds its rows into the residual and leaves the norm to gate/up as the shipped o does
(deferred_norm.store_deferred, a slot a program). x's int8 rounding moves o's output by about 0.6% (exp_int4_imma's
check), so the tokens may differ from the shipped step's; the bench's own checks (positions attended, graph against
eager tokens) still hold.

--dep: o's launch a programmatic dependent of the merge (its weight loaded before its wait), as Round 22's int8 mma
matvecs were; without it o launches plainly, as the shipped o does (Round 22: the int8 mma matvec gains only as a
dependent).

--fold: the merge and o in one launch (`_fold_kernel`), a programmatic dependent of the split kernel as the merge is:
its first programs merge (one a head) and count themselves in a flag; o's tiles load their weight at once, while the
split kernel still runs, and wait on the flag, not on a kernel boundary, before they read x (Round 24's bound: the
merge launch costs the step 1.5 us a layer; the launches of Rounds 3 and 18 that merged in a last-arriving program
were slower). Safe while every program of the launch fits on the GPU at once (llama-8b: 32 + 256 programs of 4
warps); the merge programs come first in the launch order, and the interpreter runs programs in order. --sleep NS:
o's tiles sleep NS nanoseconds between polls of the flag (on the GPU). --only merge: the merge writes the codes, o
runs as shipped; --only o: the shipped merge, o on the int8 mma from codes nothing writes (a bound, the tokens wrong).

Takes models whose every o is symmetric int4 with groups of 128 over heads of 128 features and defers the residual
norm (the engine refuses others at load, so no merge is ever left for an o that does not take it); only the decode
step's own attention takes the int8 way (the warm-up's timing of the attention and the batched server's keep the
shipped merge); every other launch runs as shipped. Tested under the interpreter and on the H200
(tests/test_exp_o_imma_step.py, BENCHMARKS Round 25); not in the runtime.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from exp_int4_imma import _scaled_sums, _tile_rows, _tile_runs  # noqa: E402
from int4_lanes import pick, split4, threads  # noqa: E402

from thin.runtime.kernels.attention import merged_head  # noqa: E402
from thin.runtime.kernels.deferred_norm import Deferred, deferred_rows, store_deferred  # noqa: E402
from thin.runtime.kernels.dependent import release_next, wait_previous  # noqa: E402

ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: added to a float32 below 2^22 in magnitude, rounds it to even


@triton.jit
def _merge_head(i, o_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, codes_ptr, xs_ptr, xz_ptr, log_ptr, n_ptr, step_ptr, HQ,
                SPLITS, SP: tl.constexpr, D: tl.constexpr, SINKS: tl.constexpr, LOG: tl.constexpr):
    """Query head i: attention.py's merge for one sequence (`merged_head`, heads of D = 128), then the head rounded to
    int8: codes (byte position ((((c * 2 + jj) * 2 + p) * 2 + jm) * 4 + m) of feature c * 32 + jj * 16 + jm * 8
    + m * 2 + p, exp_int4_imma.fragment_words' order), scale xs[i] = max |out| / 127, code sum xz[i]."""
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    out = merged_head(o_ptr, m_ptr, l_ptr, sink_ptr, i, HQ, D, SPLITS, SP, D, SINKS).to(out_ptr.dtype.element_ty)
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
def _merge_codes_kernel(o_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, codes_ptr, xs_ptr, xz_ptr, log_ptr, n_ptr,
                        step_ptr, HQ, SPLITS, SP: tl.constexpr, D: tl.constexpr, SINKS: tl.constexpr,
                        LOG: tl.constexpr, PDL: tl.constexpr = 0):
    """The merge launch: program i merges head i and rounds it to int8 (`_merge_head`)."""
    wait_previous(PDL)
    release_next(PDL)
    _merge_head(tl.program_id(0), o_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, codes_ptr, xs_ptr, xz_ptr, log_ptr, n_ptr,
                step_ptr, HQ, SPLITS, SP, D, SINKS, LOG)


@triton.jit
def _o_tile(tile, w_ptr, s_ptr, xq_ptr, xs_ptr, xz_ptr, flag_ptr, ready, K: tl.constexpr, NW: tl.constexpr,
            GPW: tl.constexpr, ASM: tl.constexpr, SPIN: tl.constexpr, PDL: tl.constexpr = 0,
            SLEEP: tl.constexpr = 0):
    """Rows 16 * tile .. + 15 of W @ x, float32 [16] (exp_int4_imma's `_imma_matvec`, one tile; x's codes, scales
    and code sums from `_merge_head`). Every weight word and scale is loaded first; then, with SPIN, the program
    waits until flag_ptr holds `ready` (the merge programs' count) before it reads x (SLEEP: nanoseconds a poll
    sleeps, on the GPU), else for the kernel before (`wait_previous(PDL)`) and releases the next."""
    groups: tl.constexpr = K // 128
    e = threads(NW, ASM)
    g = (e % 32) // 4
    t = e % 4
    q0 = e // 32 * GPW  # the warp's first group
    a = _tile_runs(w_ptr, s_ptr, tile * 16 + g, q0, t, GPW, GPW, groups, K)
    if SPIN:
        while tl.load(flag_ptr, volatile=True) < ready:
            if SLEEP and ASM:
                tl.inline_asm_elementwise("nanosleep.u32 $1; mov.b32 $0, $1;", "=r,r", [tl.full([1], SLEEP, tl.int32)],
                                          dtype=tl.int32, is_pure=False, pack=1)
        tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")  # the merge programs' stores, seen from here on
    else:
        wait_previous(PDL)
        release_next(PDL)
    acc_g = tl.zeros([32 * NW], dtype=tl.float32)
    acc_h = acc_g
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
    return _tile_rows(acc_g, acc_h, NW)


@triton.jit
def _o_kernel(w_ptr, s_ptr, xq_ptr, xs_ptr, xz_ptr, res_ptr, norm_ptr, normed_ptr, slots_ptr, n, K: tl.constexpr,
              NW: tl.constexpr, GPW: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = 0):
    """The o launch after the merge launch: tile program_id(0) (`_o_tile`; with PDL a dependent of the merge, its
    weight loaded before the wait), added into the residual with the norm deferred (store_deferred: rows and slot
    of program_id(0))."""
    total = _o_tile(tl.program_id(0), w_ptr, s_ptr, xq_ptr, xs_ptr, xz_ptr, xs_ptr, 0, K, NW, GPW, ASM, False, PDL)
    res, w = deferred_rows(res_ptr, norm_ptr, n, 16)
    store_deferred(total, n, 16, res_ptr, False, res_ptr, normed_ptr, slots_ptr, res, w)


@triton.jit
def _fold_kernel(o_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, codes_ptr, xs_ptr, xz_ptr, log_ptr, n_ptr, step_ptr,
                 w_ptr, s_ptr, res_ptr, norm_ptr, normed_ptr, slots_ptr, flag_ptr, n, HQ: tl.constexpr, SPLITS,
                 SP: tl.constexpr, SINKS: tl.constexpr, LOG: tl.constexpr, K: tl.constexpr, NW: tl.constexpr,
                 GPW: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = 0, SLEEP: tl.constexpr = 0):
    """Merge and o in one launch (FOLD): programs 0 .. HQ - 1 wait for the split kernel, merge their head
    (`_merge_head`) and count themselves into flag[0]; the others are o's tiles, pid - HQ, which load their weight
    at once (the launch a programmatic dependent: while the split kernel still runs), wait until flag[0] is HQ,
    and add their rows into the residual with the norm deferred. The last tile to finish (flag[1] counts them)
    zeroes both counters for the next launch. The deferred-norm helpers place rows and slots by program_id(0):
    the o programs' pointers and row count are moved back by HQ tiles so that they land on tile pid - HQ."""
    pid = tl.program_id(0)
    if pid < HQ:
        wait_previous(PDL)
        release_next(PDL)
        _merge_head(pid, o_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, codes_ptr, xs_ptr, xz_ptr, log_ptr, n_ptr, step_ptr,
                    HQ, SPLITS, SP, 128, SINKS, LOG)
        tl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")
    else:
        release_next(PDL)
        shift = HQ * 16
        res, w = deferred_rows(res_ptr - shift, norm_ptr - shift, n + shift, 16)
        total = _o_tile(pid - HQ, w_ptr, s_ptr, codes_ptr, xs_ptr, xz_ptr, flag_ptr, HQ, K, NW, GPW, ASM, True,
                        SLEEP=SLEEP)
        store_deferred(total, n + shift, 16, res_ptr, False, res_ptr - shift, normed_ptr - shift, slots_ptr - HQ,
                       res, w)
        if tl.atomic_add(flag_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - HQ - 1:
            tl.store(flag_ptr, 0)
            tl.store(flag_ptr + 1, 0)


class OImma:
    """The two launches' shared buffers (one model, one sequence) and the patches that use them. fold: merge and o
    in one launch (`_fold_kernel`), made when o runs, with the merge's arguments and launch kind kept from its
    call."""

    def __init__(self, heads: int, device, fold: bool = False, dep: bool = False, sleep: int = 0):
        self.codes = torch.zeros(heads * 128, dtype=torch.int8, device=device)
        self.xs = torch.zeros(heads, dtype=torch.float32, device=device)
        self.xz = torch.zeros(heads, dtype=torch.int32, device=device)
        self.flag = torch.zeros(2, dtype=torch.int32, device=device)  # fold: merges done, o tiles done
        self.fold, self.dep, self.sleep = fold, dep, sleep
        self.fresh = False  # the merge just wrote them (o consumes them once)
        self.pending = None  # fold: the merge's launch arguments, waiting for o's
        self.checked = False  # fold: the launch's residency checked (`_fits`)

    def merge(self, attention, out, sinks=None, log=None, step=None) -> None:
        """DecodeAttention.merge for one sequence of 128-feature heads, also writing o's int8 x (fold: kept for
        o's launch)."""
        from thin.runtime.kernels import dependent

        args = (attention.o, attention.m, attention.l, sinks if sinks is not None else attention.m, out, self.codes,
                self.xs, self.xz, log if log is not None else attention.n, attention.n,
                step if step is not None else attention.n)
        options = dict(SP=triton.next_power_of_2(attention.splits), SINKS=sinks is not None, LOG=log is not None)
        if self.fold:
            self.pending = (args, attention.num_heads, attention.splits, options, dependent.kernel_args())
        else:
            # the shipped merge's warps (one where a head's partials fit 128 floats a lane, else four)
            _merge_codes_kernel[(attention.num_heads,)](*args, attention.num_heads, attention.splits, D=128,
                                                        num_warps=1 if options["SP"] <= 32 else 4, **options,
                                                        **dependent.kernel_args())
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
        weights = (op.low32.reshape(n, k // 8), op.scales.reshape(n, k // 128))
        if self.fold:
            args, heads, splits, options, launch = self.pending
            call = (*args, *weights, residual, norm[0], normed, slots, self.flag, n, heads, splits)
            keywords = dict(K=k, NW=warps, GPW=gpw, ASM=asm, SLEEP=self.sleep, num_warps=warps, **options, **launch)
            if not common.interpreting() and not self.checked:
                self._fits(call, keywords, heads + programs, warps)
                self.checked = True
            _fold_kernel[(heads + programs,)](*call, **keywords)
            self.pending = None
        else:
            launch = ({"PDL": 1} if common.interpreting() else {"PDL": 2, "launch_pdl": True}) if self.dep else {}
            _o_kernel[(programs,)](*weights, self.codes.view(torch.int32), self.xs, self.xz, residual, norm[0], normed,
                                   slots, n, k, warps, gpw, asm, num_warps=warps, **launch)
        self.fresh = False
        return defer

    @staticmethod
    def _fits(call, keywords, programs: int, warps: int) -> None:
        """Refuse a folded launch whose programs cannot all be resident at once (its o tiles would wait for merge
        programs that never start): the compiled kernel's registers a thread, 64K registers and 64 warps a
        multiprocessor."""
        from thin.runtime.kernels import common

        options = {key: value for key, value in keywords.items() if key != "launch_pdl"}
        compiled = _fold_kernel.warmup(*call, grid=(programs,), **options)
        compiled._init_handles()
        regs = -(-compiled.n_regs // 8) * 8
        per_sm = min(65536 // (regs * 32 * warps), 64 // warps, 32)
        if programs > per_sm * common.sm_count():
            raise ValueError(f"--fold: {programs} programs of {warps} warps and {compiled.n_regs} registers a "
                             f"thread do not all fit at once ({per_sm} a multiprocessor)")


def applies(op) -> bool:
    """Whether an o projection can take this experiment's way."""
    from thin.runtime.kernels.grouped_int import GroupedIntLinear

    return (isinstance(op, GroupedIntLinear) and op.format == "int4" and not op.asym and op.group == 128
            and op.bias is None and op.in_features % 128 == 0 and op.out_features % 16 == 0)


def patch(state: dict, fold: bool = False, dep: bool = False, sleep: int = 0, only: str | None = None) -> None:
    """Route the decode step's merges, and the deferred o after each, through OImma (`state` keeps the OImma a
    device and the ids of the step caches' attentions; fold: the two in one launch). A DecodeEngine refuses a model
    that has an o this way does not take. only="merge": the merge writes the codes and o runs as shipped; only="o":
    the shipped merge, and o on the int8 mma from codes nothing writes (zeros; a bound, its tokens wrong)."""
    from thin.runtime.engine import DecodeEngine
    from thin.runtime.kernels import attention as attention_module
    from thin.runtime.kernels.grouped_int import GroupedIntLinear

    merge, deferred = attention_module.DecodeAttention.merge, GroupedIntLinear.matvec_deferred
    init, new_cache = DecodeEngine.__init__, DecodeEngine.new_cache
    steps = state.setdefault("steps", set())

    def checked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for index, layer in enumerate(self.ex.layers):
            o = layer.attention.o
            if not applies(o) or id(o) not in self._deferring or self.head_dim != 128:
                raise SystemExit("exp_o_imma_step: every o must be symmetric int4 (groups of 128) over heads of 128 "
                                 f"features and defer the residual norm; layer {index}'s is not")

    def step_cache(self, *args, **kwargs):
        cache = new_cache(self, *args, **kwargs)
        steps.add(id(cache.attention))
        return cache

    def new_merge(self, out, sinks=None, log=None, step=None):
        if id(self) not in steps or self.rows != 1:
            return merge(self, out, sinks, log, step)
        way = state.get(out.device)
        if way is None:  # made once (its buffers' zeroing is no launch of the captured step)
            way = state[out.device] = OImma(self.num_heads, out.device, fold, dep, sleep)
        if only == "o":
            merge(self, out, sinks, log, step)
            way.fresh = True
        else:
            way.merge(self, out, sinks, log, step)
        return None

    def new_deferred(self, x, residual, out, slots, norm, cols=None):
        way = state.get(x.device)
        if way is None or not way.fresh or cols is not None or only == "merge":
            if way is not None and cols is None:
                way.fresh = False
            return deferred(self, x, residual, out, slots, norm, cols=cols)
        return way.o(self, residual, out, slots, norm)

    DecodeEngine.__init__, DecodeEngine.new_cache = checked_init, step_cache
    attention_module.DecodeAttention.merge = new_merge
    GroupedIntLinear.matvec_deferred = new_deferred


def main() -> None:
    args, sleep, only = [], 0, None
    rest = iter(sys.argv[1:])
    for a in rest:
        if a == "--sleep":
            sleep = int(next(rest))
        elif a == "--only":
            only = next(rest)
        elif a not in ("--fold", "--dep"):
            args.append(a)
    if not args or args[0].startswith("-") or only not in (None, "merge", "o") or (only and "--fold" in sys.argv):
        raise SystemExit(__doc__)
    from thin.runtime.cli import main as thin_exec

    patch({}, fold="--fold" in sys.argv, dep="--dep" in sys.argv, sleep=sleep, only=only)
    sys.argv = ["thin-exec", "bench", *args, "--json"]
    thin_exec()


if __name__ == "__main__":
    main()
