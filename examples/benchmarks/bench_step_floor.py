"""A bound on the int4 decode step if every grouped-int matvec cost only the reading of its bytes: `thin-exec bench`
in a fresh process with each matvec launch replaced by a kernel that reads the weight's packed words and scales at
the best rate bench_read_floor.py found (8 warps, 16 loads of 16 bytes a lane issued at once, launched as a
programmatic dependent that waits for the kernel before only after its loads) and writes zeros where the matvec
would have written its output. With --with-x each program also loads all of the matvec's activations after its
wait (as a matvec program over whole rows must), so the bound keeps the step's chain of activations. With
--plain the reads launch plainly (stream order, no wait in the kernel). Two stand-ins for what a real matvec has
and the reads have not, to tell which one costs a dependent its gain in the step (Round 20: real matvecs as
dependents lose where the reads gain 10%): --loads N, N 16-byte loads a lane (32: about twice the registers held
across the wait, half the programs), and --chain N, N dependent float multiply-adds a lane after the wait (about 4
cycles each; a matvec's x loads, products and sums take some hundreds to a few thousand cycles).

    python examples/benchmarks/bench_step_floor.py MODEL.thin [--runs 5] [--with-x] [--plain] [--loads N] [--chain N]

The attention, the embedding, the sampler and every other kernel of the step run as shipped; every matvec's output
(and the LM head's) is zeros, so the tokens are meaningless (token 0; the run's checks compare the patched step with
itself) and the result is a bound, never a way to run: what the step would cost with matvecs as fast as reading
their bytes can be, their launches kept. Use a launch-configuration cache of its own (THIN_CACHE_DIR).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def _option(name: str, default: int) -> int:
    """The integer after `name` on the command line (removed from it), or default."""
    if name not in sys.argv:
        return default
    i = sys.argv.index(name)
    value = int(sys.argv[i + 1])
    del sys.argv[i:i + 2]
    return value


NW = 8  # bench_read_floor.py's best for every int4 matvec size of llama-8b (BENCHMARKS Round 20)
PER = _option("--loads", 16)  # 16-byte loads a lane (16: that best; 32: twice the registers, half the programs)
CHAIN = _option("--chain", 0)  # dependent float multiply-adds after the wait (a matvec's post-wait work, stood in)
CHUNK = 32 * NW * PER * 4  # int32 words a program reads
WITH_X = "--with-x" in sys.argv  # every program also loads the matvec's x after its wait
PLAIN = "--plain" in sys.argv  # plain launches (in stream order, no wait inside the kernel)


@triton.jit
def _read_zero(words_ptr, n_words, scales_ptr, n_scales, out_ptr, n_out, per_program, programs_words, x_ptr, k,
               PER: tl.constexpr, NW: tl.constexpr, XPER: tl.constexpr, PDL: tl.constexpr = True,
               CHAIN: tl.constexpr = 0):
    """Programs below programs_words read CHUNK words of the codes, the rest of the scales (as int32), all at once;
    then (PDL) the wait for the kernel before, CHAIN dependent multiply-adds a lane, and zeros into the program's
    share of out."""
    lanes: tl.constexpr = 32 * NW
    pid = tl.program_id(0)
    offs = (tl.arange(0, PER)[None, :, None] * lanes + tl.arange(0, lanes)[:, None, None]) * 4 + \
        tl.arange(0, 4)[None, None, :]
    if pid < programs_words:
        base = pid.to(tl.int64) * (lanes * PER * 4)
        words = tl.load(words_ptr + base + offs, mask=base + offs < n_words, other=0)
    else:
        base = (pid - programs_words).to(tl.int64) * (lanes * PER * 4)
        words = tl.load(scales_ptr + base + offs, mask=base + offs < n_scales, other=0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    seen = tl.xor_sum(tl.xor_sum(tl.xor_sum(words, axis=2), axis=1), axis=0)
    if XPER:  # the activations after the wait, as a matvec's program loads them (all K of them)
        xi = tl.arange(0, lanes)[:, None] + lanes * tl.arange(0, XPER)[None, :]
        seen ^= (tl.sum(tl.load(x_ptr + xi, mask=xi < k, other=0.0).to(tl.float32)) > 1e30).to(tl.int32)
    if CHAIN:  # each waits for the one before: about 4 cycles each
        v = (seen & 1).to(tl.float32) + tl.arange(0, lanes).to(tl.float32)
        for _ in range(CHAIN):
            v = v * 0.999 + 0.5
        seen ^= (tl.max(v, axis=0) < -1.0).to(tl.int32)
    i = pid * per_program + tl.arange(0, 1024)
    zero = tl.where(seen == 0x2545F491, 1.0, 0.0)  # zeros that depend on the loads: they cannot be left out
    for start in range(0, per_program, 1024):
        j = i + start
        tl.store(out_ptr + j, zero.to(out_ptr.dtype.element_ty), mask=(j < n_out) & (j < (pid + 1) * per_program))


def _read_matvec(self, x, out, config, act, partial, rows=None, cols=None, scale=None, finish=None, defer=None,
                 rstd=None):
    """GroupedIntLinear._matvec's signature: read the weight, write zeros."""
    words = self.low32.reshape(-1)
    scales = self.scales.reshape(-1).view(torch.int32) if self.scales.numel() % 2 == 0 else words[:0]
    programs_words = -(-words.numel() // CHUNK)
    programs = programs_words + -(-scales.numel() // CHUNK)
    flat = out.reshape(-1)
    _read_zero[(programs,)](words, words.numel(), scales, scales.numel(), flat, flat.numel(),
                            -(-flat.numel() // programs), programs_words, x, x.numel(), PER, NW,
                            triton.next_power_of_2(-(-x.numel() // (32 * NW))) if WITH_X else 0, not PLAIN, CHAIN,
                            num_warps=NW, **({} if PLAIN else {"launch_pdl": True}))
    return config.split


def main() -> None:
    args = [a for a in sys.argv[1:] if a not in ("--with-x", "--plain")]
    if not args:
        raise SystemExit(__doc__)
    import thin.runtime.kernels.grouped_int as grouped_int
    from thin.runtime.cli import main as thin_exec

    grouped_int.GroupedIntLinear._matvec = _read_matvec
    sys.argv = ["thin-exec", "bench", *args, "--json"]
    thin_exec()


if __name__ == "__main__":
    main()
