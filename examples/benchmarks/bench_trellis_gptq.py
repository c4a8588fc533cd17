"""The `trellis` format under GPTQ on a model's routed experts: the layer error (GPTQ's objective,
trace((W - W_hat) S (W - W_hat)^T), S the expert input's calibration second moment) of BlockLDLQ
trellis coding, with the block's Viterbi unweighted or weighing each column by diag(S) (what
passes/gptq.py does), each without and with a randomized Hadamard rotation of the input (W R under
R^T S R, R = diag(random signs) H, as bench_rotation.py's experiment rotated before its trellis
code), relative to q2 (group 32) under GPTQ on the same weight. Per weight, then the geometric mean.

    OMP_NUM_THREADS=1 python3 examples/benchmarks/bench_trellis_gptq.py examples/models/tiny-coder-moe \
        --layers 1,3,5 --experts 0,4

Columns count 16-column blocks as the GPTQ sweep does; a weight's input width must be a power of two
for the rotation (tiny-coder-moe: 256 for gate/up, 128 for down).
"""

from __future__ import annotations

import argparse
import math
import time
import types
from pathlib import Path


def hadamard(n: int, seed: int):
    """diag(random signs) H / sqrt(n), H the Sylvester Hadamard matrix of size n (a power of two)."""
    import torch

    if n & (n - 1):
        raise SystemExit(f"the rotation needs a power-of-two input width, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return signs[:, None].float() * h / math.sqrt(n)


def block_ldlq(w, hessian, fmt, params, weighted: bool):
    """w_hat of trellis BlockLDLQ: each 16-column block coded from the weights the blocks before it
    left, its error fed forward through U (the upper Cholesky factor of S^-1); `weighted`: the block's
    Viterbi weighs each column by diag(S) (damped), as passes/gptq.py's sweep does."""
    import torch

    from thin.passes.gptq import inverse_cholesky

    upper, damped = inverse_cholesky(hessian)
    q = fmt.quantizer(tuple(w.shape), params)
    q.start(w)
    work, out = w.clone(), torch.empty_like(w)
    for j in range(0, w.shape[1], 16):
        block = work[:, j:j + 16]
        out[:, j:j + 16] = q.fit(block, torch.diagonal(damped)[j:j + 16] if weighted else None)["values"]
        err = torch.linalg.solve_triangular(upper[j:j + 16, j:j + 16], block - out[:, j:j + 16], upper=True,
                                            left=False)
        work[:, j + 16:] -= err @ upper[j:j + 16, j + 16:]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--layers", default="1,3,5")
    parser.add_argument("--experts", default="0,4")
    parser.add_argument("--bits", default="2,3")
    parser.add_argument("--calib-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0, help="rotation signs")
    args = parser.parse_args()

    import torch

    from thin.compiler.corpus import calibration_text
    from thin.compiler.evaluate import make_evaluator
    from thin.compiler.hf import load_checkpoint
    from thin.ir import formats
    from thin.passes import CalibrateOptions, PassContext, Scratch, calibrate_inputs
    from thin.passes.calibrate_inputs import load_statistics
    from thin.passes.gptq import gptq, output_error

    torch.set_num_threads(1)
    source = load_checkpoint(Path(args.model))
    ctx = PassContext(config=types.SimpleNamespace(calibrate=CalibrateOptions(tokens=args.calib_tokens)),
                      evaluator=make_evaluator("cpu", dict(source.tokenizer_files)),
                      calibration_text=calibration_text(20_000), scratch=Scratch())
    program = calibrate_inputs(source.program, ctx)
    trellis, q2 = formats.get("trellis"), formats.get("q2")
    variants = ("unweighted", "weighted", "rotated unweighted", "rotated weighted")
    logs: dict = {}
    print("| weight | shape | k | " + " | ".join(variants) + " | seconds |")
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in variants) + " | ---: |")
    for layer in map(int, args.layers.split(",")):
        for expert in map(int, args.experts.split(",")):
            for proj in ("gate", "up", "down"):
                name = f"layers.{layer}.ffn.experts.{expert}.{proj}.weight"
                r = program.model.tensor(name)
                w = formats.get(r.encoding.format).decode(program.load(name), r.shape, r.encoding.params,
                                                          torch.float32)
                s = load_statistics(ctx, program, name)["hessian"].float()
                rot = hadamard(w.shape[1], args.seed)
                reference = output_error(w, gptq(w, s, q2, (("group_size", 32),))[1], s)
                for k in map(int, args.bits.split(",")):
                    t0 = time.perf_counter()
                    p = (("bits", k),)
                    errors = [output_error(w, block_ldlq(w, s, trellis, p, False), s),
                              output_error(w, block_ldlq(w, s, trellis, p, True), s)]
                    wr, sr = w @ rot, rot.T @ s @ rot
                    errors += [output_error(wr, block_ldlq(wr, sr, trellis, p, weighted), sr)
                               for weighted in (False, True)]
                    ratios = [e / reference for e in errors]
                    for v, x in zip(variants, ratios):
                        logs.setdefault((k, v), []).append(math.log(x))
                    print(f"| {name} | {tuple(w.shape)} | {k} | " + " | ".join(f"{x:.3f}" for x in ratios)
                          + f" | {time.perf_counter() - t0:.0f} |", flush=True)
    for k in sorted({k for k, _ in logs}):
        means = [math.exp(sum(logs[k, v]) / len(logs[k, v])) for v in variants]
        print(f"| geometric mean | | {k} | " + " | ".join(f"**{x:.3f}**" for x in means) + " | |")


if __name__ == "__main__":
    main()
