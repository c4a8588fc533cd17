"""Experiment: llama-8b's int4 decode step with its matvecs as exp_int4_fragments.py's flat fragment kernels, each
launched as a programmatic dependent, in `thin-exec bench` (a fresh process).

    python3 examples/benchmarks/exp_flat_step.py MODEL.thin [--runs 5]      # FLAT=plain,defer,glu (the default)

Why (BENCHMARKS Round 20): with every matvec replaced by a kernel that only reads its bytes (and loads its
activations after its wait) the step ran 800 tok/s as programmatic dependents and 725 launched plainly, against 629
shipped; the shipped matvecs launch plainly, and as dependents they were never faster in the step (Rounds 11, 15,
19). A matvec made for the dependent launch loads its whole weight before its wait: `_flat_op` is `_flat_matvec`
(one row tile a program, its warps splitting K, every word and scale of a warp's run in registers before the wait)
with the engine's epilogues: plain rows (qkv, the LM head), gate/up's activation (a gate tile and its up tile a
program), and the deferred residual norm on both sides (deferred_norm.py: o and down write the residual, its normed
row and their programs' sums of squares; qkv, gate/up and the LM head scale their sums by 1 / rms).

Each symmetric int4 (group 128) weight under bf16 activations keeps its packed planes and gets the fragment words
(`repack`) beside them at load, so this doubles those weights' memory: an experiment, never a way to ship. FLAT
names which calls take the flat kernel: `plain` (plain rows), `defer` (the deferred norm's producers), `glu`
(gate/up), FLAT_MAX_K the widest weight that takes it (4096: not down); every other call (prefill, elastic
prefixes, finishing launches) runs the shipped kernel. Use a
launch-configuration cache of its own (THIN_CACHE_DIR): the tuner times the patched calls.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from exp_int4_fragments import _tile_loads, _tile_sums, repack  # noqa: E402
from int4_lanes import threads  # noqa: E402

from thin.runtime.kernels.deferred_norm import deferred_epilogue, deferred_reads  # noqa: E402
from thin.runtime.kernels.tiles import store_tile  # noqa: E402


@triton.jit
def _flat_op(w_ptr, s_ptr, x_ptr, out_ptr, bias_ptr, n, K: tl.constexpr, NW: tl.constexpr, RUN: tl.constexpr,
             S: tl.constexpr, ASM: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
             res_ptr=None, norm_ptr=None, normed_ptr=None, slots_ptr=None, n_slots=0, H_rows=1, eps=0.0,
             all_slots=0, DEFER: tl.constexpr = False, SCALED: tl.constexpr = False, SLOTS: tl.constexpr = 1):
    """Program i: output rows 16i .. 16i + 15 over all K columns (NW warps, RUN steps of 64 columns each), with
    ACT >= 0 of gate rows 16i.. and up rows n + 16i.. (the weight [gate; up]). Every weight load is issued before
    the wait for the kernel before (PDL). DEFER: a deferred norm's producer (the slots its consumers read past
    this launch's own, up to all_slots, zeroed); SCALED: its consumer."""
    e = threads(NW, ASM)
    warp = e // 32
    lane = e % 32
    steps: tl.constexpr = K // 64
    groups: tl.constexpr = K // 128
    first = warp * RUN
    tile = tl.program_id(0)
    a = _tile_loads(w_ptr, s_ptr, tile, first, lane, lane // 4, steps, groups, RUN, S)
    b = a
    if ACT >= 0:
        b = _tile_loads(w_ptr, s_ptr, tile + n // 16, first, lane, lane // 4, steps, groups, RUN, S)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x32 = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    rows_a, rows_b = _tile_sums(a, b, x32, first, lane % 4, steps, RUN, S, NW, ACT >= 0, ASM)
    total = rows_a
    if ACT >= 0:
        total = tl.reshape(tl.join(rows_a, rows_b), [32])  # gate r, up r interleaved (tiles.tile_rows)
    rstd, res, w = deferred_reads(slots_ptr, n_slots, H_rows, eps, res_ptr, norm_ptr, n, 16, SCALED, DEFER, SLOTS)
    total = deferred_epilogue(total, rstd, res, w, n, 16, bias_ptr, HAS_BIAS, res_ptr, normed_ptr, slots_ptr, SCALED,
                              DEFER)
    if DEFER:  # the slots the consumers read past this launch's programs: zeros
        extra = tl.num_programs(0) * (1 + tl.arange(0, 8)) + tl.program_id(0)
        tl.store(slots_ptr + extra, tl.zeros([8], dtype=tl.float32), mask=extra < all_slots)
    else:
        store_tile(out_ptr, bias_ptr, total, n, 16, ACT, HAS_BIAS, False)


def _tiling(k: int) -> tuple[int, int] | None:
    """(warps, steps a warp) covering K in one split (Round 20's best one-split flat tilings as dependents: 4 x 16
    at 4096 columns, 16 x 14 at 14336), or None where a warp's run would pass 16 steps of registers."""
    steps = k // 64
    warps = 4 if steps <= 64 else 16
    run = -(-steps // warps)
    run += run % 2
    return (warps, run) if run <= 16 else None


def flat_call(op, x, out, act, defer=None, rstd=None, asm=True, pdl=True) -> None:
    """One decode matvec of `op` (a symmetric int4 GroupedIntLinear with `op.fragments`) by `_flat_op`."""
    words, scales = op.fragments
    n = op.out_features // 2 if act >= 0 else op.out_features
    k = op.in_features
    if _tiling(k) is None:
        raise ValueError(f"no one-split flat tiling for K={k}")
    warps, run = _tiling(k)
    args = {}
    if defer is not None:
        # The consumers read defer.programs slots (the shipped producer's count): this launch's n / 16, the rest
        # zeroed by its programs, at most 8 a program.
        if not n // 16 <= defer.programs <= 9 * (n // 16) or defer.slots.numel() < defer.programs:
            raise ValueError(f"a flat producer of {n // 16} programs cannot fill {defer.programs} slots")
        args.update(res_ptr=defer.residual, norm_ptr=defer.norm[0], normed_ptr=defer.out, slots_ptr=defer.slots,
                    all_slots=defer.programs, DEFER=True)
    if rstd is not None:
        args.update(rstd.consumer_args())
    bias = op.bias if op.bias is not None else x
    extra = {"launch_pdl": True} if pdl else {}
    _flat_op[(n // 16,)](words, scales, x.reshape(-1), out, bias, n, k, warps, run, triton.next_power_of_2(run), asm,
                         act, op.bias is not None, pdl, num_warps=warps, **args, **extra)


def _fragments(op) -> tuple[torch.Tensor, torch.Tensor]:
    """The fragment words [N/16, K/64, 32, 4] of a symmetric int4 weight and its float16 scales [N, K/128]."""
    from thin.ir.formats.quantized import unpack_bits

    codes = unpack_bits(op.low.reshape(op.out_features, -1), 4)
    return repack(codes.reshape(op.out_features, op.in_features)).contiguous(), op.scales.contiguous()


def flat_eligible(op) -> bool:
    return (op.pairs and op.group == 128 and op.out_features % 16 == 0 and op.in_features % 128 == 0
            and _tiling(op.in_features) is not None)


def patch(which: set[str], max_k: int = 1 << 30) -> None:
    """GroupedIntLinear gets the fragment words at load and `_flat_op` for the decode calls named in `which` of
    weights with at most max_k columns."""
    import thin.runtime.kernels.grouped_int as grouped_int

    cls = grouped_int.GroupedIntLinear
    shipped_init, shipped_matvec = cls.__init__, cls._matvec

    def init(self, record, raw, bias, dtype, device):
        shipped_init(self, record, raw, bias, dtype, device)
        self.fragments = _fragments(self) if flat_eligible(self) and self.in_features <= max_k else None

    def matvec(self, x, out, config, act, partial, rows=None, cols=None, scale=None, finish=None, defer=None,
               rstd=None):
        kind = "glu" if act >= 0 else "defer" if defer is not None else "plain"
        if (self.fragments is None or kind not in which or partial or rows is not None or cols is not None
                or scale is not None or finish is not None or x.reshape(-1).numel() != self.in_features):
            return shipped_matvec(self, x, out, config, act, partial, rows, cols, scale, finish, defer, rstd)
        flat_call(self, x, out, act, defer, rstd, asm=x.is_cuda, pdl=x.is_cuda)
        return 1

    cls.__init__, cls._matvec = init, matvec


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    patch(set(os.environ.get("FLAT", "plain,defer,glu").split(",")), int(os.environ.get("FLAT_MAX_K", 1 << 30)))
    from thin.runtime.cli import main as thin_exec

    sys.argv = ["thin-exec", "bench", *sys.argv[1:], "--json"]
    thin_exec()


if __name__ == "__main__":
    main()
