"""Experiment: does a randomized Hadamard rotation of the routed experts' inputs (incoherence
processing, as in QuIP# and QuaRot) make low-bit experts better? Measured on held-out text, as
bench_budgets.py measures, with and without the rotation, at several `--bpw` budgets.

    OMP_NUM_THREADS=1 python3 examples/benchmarks/bench_rotation.py examples/models/tiny-coder-moe \
        --bpw 3.0,3.5,4.2 --expert-formats q2 --group-sizes

Calibration and scoring run once; per budget the compile's own passes plan and quantize
(check_budget, plan_precision, quantize_weights with GPTQ), as `thinc compile --bpw B
--expert-formats F` does before certifying. That program is the `none` row. Then, for every routed
expert projection W [out, in] the plan stores in a quantized format, with S its input's calibration
second moment (the statistics GPTQ used for it) and R = diag(random signs) H (signs first, then the
mixing, as QuIP# orders them so that any fixed W is made incoherent; H the normalized
Hadamard matrix of size `in`, block-diagonal with the largest power-of-two block dividing `in` when
`in` is not a power of two; `--block group` makes the block each tensor's quantization group, so the
rotation mixes columns only inside a group, `--block N` N columns), W' = W R is quantized by the
same GPTQ (passes/gptq.py) to the same format and parameters the plan chose, under S' = R^T S R,
and the model runs with the effective weight decode(W') R^T in place of the plan's (a dense
override in the evaluator's session, so nothing is stored differently: the bits per weight are the
plan's). A runtime would keep decode(W') and rotate the activation instead, x -> R^T x: once per
MoE layer for gate and up (every expert reads the same x, so one R per layer), and once per
selected expert for down's input (each expert's own intermediate). Rows: `none`; `gate/up` (gate
and up rotated); `all` (down too); `exact` (a bound, not a rotation: every routed expert at its
source weights, the rest of the model as planned, so what no better expert format could go below
at that plan). `--error-scales A,B,...` adds, per budget, a row per scale a (not a rotation either):
every routed expert at source + a (decode(W) - source), the plan's own expert error shrunk to a of
its size (layer error a^2), which says how much smaller the expert error has to be for a target KLD.
`trellis2` and `trellis` (not a rotation of the plan's format: another code, trellis.py): every routed
expert projection rotated as in `all`, then coded by a bitshift trellis (QTIP-like, L-bit states,
`--trellis-L`, `--trellis-codebook`) with GPTQ's error feedback a block of 16 columns at a time, one
float16 scale per row; `trellis2` at k = 2 bits per weight everywhere (fewer bits than any q2 choice),
`trellis` with as many 16-column blocks at k = 3 as the plan's bytes for that tensor allow. Their
bits-per-weight column counts the trellis bytes in place of the plan's for those tensors.

Columns: bits per weight of the stored program, mean KLD, top-1 and perplexity against the float32
source, and `layer error`: the rotated experts' GPTQ objective, sum over them of trace((W - W_hat)
S (W - W_hat)^T), relative to the same sum for the plan's unrotated weights (1 for `none`, 0 for
`exact`). `--group-sizes` adds a table per expert role and group size: that objective summed over
every expert, unrotated and rotated, and how coherent the weights and inputs are without and with R.
Not a compile option: thin's artifacts and runtime have no rotation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

VARIANTS = {"none": (), "gate/up": ("moe.expert.gate", "moe.expert.up"),
            "all": ("moe.expert.gate", "moe.expert.up", "moe.expert.down"), "exact": (),
            "trellis2": (), "trellis": ()}


def hadamard(n: int):
    """The normalized Sylvester Hadamard matrix of size n (a power of two), float64."""
    import torch

    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def rotation(n: int, seed: int, block: int | None = None):
    """R = diag(s) blockdiag(H_b, ...) [n, n], orthogonal: s random signs (from `seed`), H_b the
    normalized Hadamard matrix of size `block` (default: the largest power of two dividing n). x -> R^T x
    = H (s * x) is what a runtime would do: flip signs, then a fast Walsh-Hadamard transform per block."""
    import torch

    block = block or n & -n
    if n % block:
        raise ValueError(f"a rotation block of {block} does not divide {n} columns")
    h = torch.block_diag(*[hadamard(block)] * (n // block))
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 - 1
    return signs[:, None] * h


def block_size(block: str, params) -> int | None:
    """The rotation block `--block` asks for: None (the largest power of two dividing the input, up to
    all of it), the quantization group size of the tensor's format (`group`), or a number of columns."""
    if block == "full":
        return None
    if block == "group":
        if "group_size" not in dict(params):
            raise SystemExit(f"--block group: a format with no group size ({dict(params)})")
        return dict(params)["group_size"]
    return int(block)


def rotated_weights(program, ctx, quantized, roles, seed: int, block: str = "full"):
    """({name: effective weight decode(W R) R^T, float32}, rotated error, unrotated error) for every
    quantized routed expert projection of `quantized` whose role is in `roles`."""
    import torch

    from thin.ir import formats
    from thin.passes.calibrate_inputs import load_statistics
    from thin.passes.gptq import gptq, output_error

    out, err_rot, err_plain = {}, 0.0, 0.0
    source = program.model.tensor_map()
    for rec in quantized.model.tensors:
        fmt = formats.get(rec.encoding.format)
        if rec.role not in roles or rec.expert is None or fmt.dense:
            continue
        src = source[rec.name]
        w = formats.get(src.encoding.format).decode(program.load(rec.name), src.shape, src.encoding.params,
                                                    torch.float32).double()
        plain = fmt.decode(quantized.load(rec.name), rec.shape, rec.encoding.params, torch.float32).double()
        # One R per layer and input: gate and up share theirs (all experts read the same x).
        r = rotation(rec.shape[1], seed + 2 * rec.layer + (rec.role == "moe.expert.down"),
                     block_size(block, rec.encoding.params))
        stats = load_statistics(ctx, program, rec.name)
        if stats is None:  # no calibration statistics: round to nearest, as quantize_weights does
            blob = fmt.encode((w @ r).float(), rec.encoding.params)
        else:
            hessian = stats["hessian"].double()
            blob, _ = gptq((w @ r).float(), (r.T @ hessian @ r).float(), fmt, rec.encoding.params)
        effective = fmt.decode(blob, rec.shape, rec.encoding.params, torch.float32).double() @ r.T
        out[rec.name] = effective.float()
        if stats is not None:
            err_rot += output_error(w, effective, stats["hessian"].double())
            err_plain += output_error(w, plain, stats["hessian"].double())
    return out, err_rot, err_plain


def trellis_weights(program, ctx, quantized, seed: int, L: int, book: str, mixed: bool):
    """({name: effective weight, float32}, trellis GPTQ objective, plan's GPTQ objective, stored bytes of the
    trellis-coded experts minus the plan's bytes for them) for every quantized routed expert projection:
    W R (the `all` variant's rotations) trellis-coded by trellis.py's trellis_gptq under R^T S R, L-bit
    states and the `book` codebook, every column block at k = 2 bits (`mixed` False) or, per tensor, as
    many 16-column blocks at k = 3 as the plan's bytes for the tensor allow, the rest at k = 2; the k = 3
    blocks are those whose columns carry the largest GPTQ weights d_j = 1 / U_jj^2 (the share of the
    objective a column's error costs once the later columns have absorbed what they can)."""
    import torch
    import trellis

    from thin.ir import formats
    from thin.passes.calibrate_inputs import load_statistics
    from thin.passes.gptq import inverse_cholesky, output_error

    books = {k: trellis.codebook(L, book, k, seed) for k in ((2, 3) if mixed else (2,))}
    source = program.model.tensor_map()
    batches: dict = {}
    for rec in quantized.model.tensors:
        fmt = formats.get(rec.encoding.format)
        if rec.expert is None or fmt.dense:
            continue
        src = source[rec.name]
        w = formats.get(src.encoding.format).decode(program.load(rec.name), src.shape, src.encoding.params,
                                                    torch.float32).double()
        r = rotation(rec.shape[1], seed + 2 * rec.layer + (rec.role == "moe.expert.down"))
        stats = load_statistics(ctx, program, rec.name)
        hessian = stats["hessian"].double() if stats is not None else None
        # No statistics: no error feedback (identity second moment), as quantize_weights rounds to nearest.
        upper, _ = inverse_cholesky(r.T @ hessian @ r) if hessian is not None else (
            torch.eye(rec.shape[1]), None)
        rows, cols = rec.shape
        blocks = cols // trellis.TILE
        plan_bytes = formats.nbytes(rec.encoding.format, rec.shape, rec.encoding.params)
        # bytes = rows * (cols * 2 + threes * TILE) / 8 + 2 * rows (float16 scales) <= plan_bytes
        threes = max(0, min(blocks, int((8 * (plan_bytes - 2 * rows) / rows - 2 * cols) // trellis.TILE)))
        ks = torch.full((blocks,), 2)
        if mixed and threes:
            weight = (1 / torch.diagonal(upper).double() ** 2).reshape(blocks, trellis.TILE).sum(1)
            ks[torch.argsort(weight, descending=True)[:threes]] = 3
        batch = batches.setdefault(tuple(rec.shape), [])
        batch.append((rec.name, w, r, hessian, upper.float(), ks, plan_bytes,
                      fmt.decode(quantized.load(rec.name), rec.shape, rec.encoding.params, torch.float32).double()))
    out, err_new, err_plain, delta = {}, 0.0, 0.0, 0
    for shape, batch in batches.items():
        w_hat = trellis.trellis_gptq(torch.stack([(w @ r).float() for _, w, r, *_ in batch]),
                                     torch.stack([u for *_, u, _, _, _ in batch]), books,
                                     torch.stack([ks for *_, ks, _, _ in batch]), L)
        for (name, w, r, hessian, _, ks, plan_bytes, plain), wh in zip(batch, w_hat):
            effective = wh.double() @ r.T
            out[name] = effective.float()
            delta += shape[0] * (shape[1] * 2 + int((ks == 3).sum()) * trellis.TILE) // 8 + 2 * shape[0] - plan_bytes
            if hessian is not None:
                err_new += output_error(w, effective, hessian)
                err_plain += output_error(w, plain, hessian)
    return out, err_new, err_plain, delta


def source_experts(program, quantized) -> dict:
    """{name: source weight, float32} for every routed expert projection `quantized` stores quantized."""
    import torch

    from thin.ir import formats

    source = program.model.tensor_map()
    return {t.name: formats.get(s.encoding.format).decode(program.load(t.name), s.shape, s.encoding.params,
                                                          torch.float32)
            for t in quantized.model.tensors
            if t.expert is not None and not formats.get(t.encoding.format).dense
            for s in (source[t.name],)}


def scaled_errors(program, quantized, scale: float) -> dict:
    """{name: source + scale * (decoded - source), float32} for every routed expert projection
    `quantized` stores quantized: its quantization error scaled by `scale`."""
    import torch

    from thin.ir import formats

    out = {}
    for name, w in source_experts(program, quantized).items():
        rec = quantized.model.tensor_map()[name]
        plain = formats.get(rec.encoding.format).decode(quantized.load(name), rec.shape, rec.encoding.params,
                                                        torch.float32)
        out[name] = w + scale * (plain - w)
    return out


def by_group_size(program, ctx, fmt_name: str, seed: int, block: str = "full") -> list[dict]:
    """Per role of the routed experts and per group size of `fmt_name`: the GPTQ objective summed over
    every expert with calibration statistics, unrotated and rotated (the same R as `rotated_weights`),
    and the incoherence of the weights (max |W| sqrt(numel) / ||W||_F, mean over experts) and of the
    inputs (max diag S / mean diag S, mean over experts) without and with R (with `--block group`,
    the R of the smallest group size)."""
    import torch

    from thin.ir import formats
    from thin.passes.calibrate_inputs import load_statistics
    from thin.passes.gptq import gptq, output_error

    fmt = formats.get(fmt_name)
    sizes = fmt.params["group_size"].choices if "group_size" in fmt.params else (None,)
    rows = {}
    for rec in program.model.tensors:
        stats = load_statistics(ctx, program, rec.name) if rec.expert is not None else None
        if stats is None or not rec.role.startswith("moe.expert."):
            continue
        w = formats.get(rec.encoding.format).decode(program.load(rec.name), rec.shape, rec.encoding.params,
                                                    torch.float32).double()
        h = stats["hessian"].double()
        row = rows.setdefault(rec.role, {"experts": 0, "shape": rec.shape, "mu_w": [0.0, 0.0], "mu_s": [0.0, 0.0],
                                         **{g: [0.0, 0.0] for g in sizes}})
        row["experts"] += 1
        for g in sizes:
            params = fmt.normalize({} if g is None else {"group_size": g})
            r = rotation(rec.shape[1], seed + 2 * rec.layer + (rec.role == "moe.expert.down"),
                         block_size(block, params))
            for k, (wk, hk) in enumerate(((w, h), (w @ r, r.T @ h @ r))):
                if g == sizes[0]:
                    row["mu_w"][k] += float(wk.abs().max() * wk.numel() ** 0.5 / wk.norm())
                    d = torch.diagonal(hk)
                    row["mu_s"][k] += float(d.max() / d.mean())
                _, w_hat = gptq(wk.float(), hk.float(), fmt, params)
                row[g][k] += output_error(wk, w_hat.double(), hk)
    def bits(shape, g) -> float:
        return 8 * formats.nbytes(fmt_name, shape, fmt.normalize({} if g is None else {"group_size": g})) / \
            torch.Size(shape).numel()

    return [{"role": role, "group_size": g, "error": v[g], "mu_w": [m / v["experts"] for m in v["mu_w"]],
             "mu_s": [m / v["experts"] for m in v["mu_s"]], "bits_per_weight": bits(v["shape"], g)}
            for role, v in rows.items() for g in sizes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--bpw", required=True, help="comma-separated budgets")
    parser.add_argument("--expert-formats", default="q2", help="formats the routed experts may take (default q2)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rotations' random signs")
    parser.add_argument("--block", default="full",
                        help="rotation block: 'full' (default: the largest power of two dividing the input), "
                             "'group' (each tensor's quantization group size: the rotation mixes only inside "
                             "a group), or a number of columns")
    parser.add_argument("--trellis-L", type=int, default=12, help="trellis variants: bits of state (default 12)")
    parser.add_argument("--trellis-codebook", default="hash", choices=("hash", "gauss", "lloyd"),
                        help="trellis variants: codebook (default hash, see trellis.py)")
    parser.add_argument("--tokens", type=int, default=4224)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--stride", type=int, default=128)
    parser.add_argument("--group-sizes", action="store_true",
                        help="also: every expert at each group size of the first --expert-formats format, "
                             "layer error and incoherence without and with the rotation")
    parser.add_argument("--error-scales", default="",
                        help="comma-separated scales a: also rows with every routed expert at source + a x its "
                             "plan's quantization error")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        scales = [float(a) for a in args.error_scales.split(",") if a]
    except ValueError:
        raise SystemExit(f"--error-scales takes comma-separated numbers, got {args.error_scales!r}") from None
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}; variants are {', '.join(VARIANTS)}")
    variants += [f"x{a}" for a in scales]
    for variant, ks in (("trellis2", (2,)), ("trellis", (2, 3))):
        if variant in variants and any(args.trellis_L % k or args.trellis_L <= k for k in ks):
            raise SystemExit(f"--trellis-L {args.trellis_L}: the {variant} variant needs a state of more bits "
                             f"than, and a multiple of, each of k = {', '.join(map(str, ks))}")
    if args.block not in ("full", "group") and not (args.block.isdigit() and int(args.block) > 0
                                                    and int(args.block) & (int(args.block) - 1) == 0):
        raise SystemExit(f"--block takes full, group or a power of two, got {args.block!r}")

    import torch

    from thin.compiler.config import CompileConfig
    from thin.compiler.corpus import heldout_text
    from thin.compiler.evaluate import make_evaluator
    from thin.compiler.hf import load_checkpoint
    from thin.compiler.inputs import evaluation_texts
    from thin.ir import formats
    from thin.passes import (
        PassContext,
        Scratch,
        calibrate_inputs,
        check_budget,
        plan_precision,
        quantize_weights,
        score_formats,
    )
    from thin.runtime.quality import compare

    torch.manual_seed(0)
    budgets = [float(b) for b in args.bpw.split(",")]
    configs = [CompileConfig.from_options(bpw=b, method="gptq", expert_formats=args.expert_formats, device="cpu")
               for b in budgets]
    source = load_checkpoint(args.model_dir)
    evaluator = make_evaluator("cpu", dict(source.tokenizer_files))
    calibration, _ = evaluation_texts(configs[0])
    ctx = PassContext(config=configs[0], evaluator=evaluator, source=source.program, calibration_text=calibration,
                      scratch=Scratch(), device="cpu")
    t0 = time.perf_counter()
    scored = score_formats(calibrate_inputs(source.program, ctx), ctx)
    print(f"calibration and scoring {time.perf_counter() - t0:.1f}s", flush=True)
    reference = evaluator.session(source.program)
    ids = evaluator.tokenizer.encode(heldout_text())[:args.tokens]
    parameters = sum(torch.Size(t.shape).numel() for t in source.program.model.tensors)
    rows = []
    for budget, config in zip(budgets, configs):
        each = dataclasses.replace(ctx, config=config)
        quantized = quantize_weights(plan_precision(check_budget(scored, each), each), each)
        stored = sum(formats.nbytes(t.encoding.format, t.shape, t.encoding.params) for t in quantized.model.tensors)
        experts = [t for t in quantized.model.tensors
                   if t.expert is not None and not formats.get(t.encoding.format).dense]
        expert_bytes = sum(formats.nbytes(t.encoding.format, t.shape, t.encoding.params) for t in experts)
        expert_weights = sum(torch.Size(t.shape).numel() for t in experts)
        session = evaluator.session(quantized)
        for variant in variants:
            t1 = time.perf_counter()
            delta = 0
            if variant == "exact":
                weights, err_rot, err_plain = source_experts(scored, quantized), 0.0, 1.0
            elif variant.startswith("trellis"):
                weights, err_rot, err_plain, delta = trellis_weights(scored, each, quantized, args.seed,
                                                                     args.trellis_L, args.trellis_codebook,
                                                                     variant == "trellis")
            elif variant not in VARIANTS:  # "x<scale>", from --error-scales
                scale = float(variant[1:])
                weights, err_rot, err_plain = scaled_errors(scored, quantized, scale), scale ** 2, 1.0
            else:
                weights, err_rot, err_plain = rotated_weights(scored, each, quantized, VARIANTS[variant], args.seed,
                                                             args.block)
            with session.overriding(weights):
                result = compare(reference, session, ids, context=args.context, stride=args.stride)
            rows.append({"bpw_budget": budget, "variant": variant, "bits_per_weight": 8 * (stored + delta) / parameters,
                         "expert_bits_per_weight": 8 * (expert_bytes + delta) / max(expert_weights, 1),
                         "rotated": len(weights), "layer_error": err_rot / err_plain if err_plain else 1.0,
                         **result.to_plain()})
            print(f"--bpw {budget} {variant}: {rows[-1]['bits_per_weight']:.3f} bpw (quantized experts "
                  f"{rows[-1]['expert_bits_per_weight']:.3f}), {len(weights)} replaced, layer "
                  f"error x{rows[-1]['layer_error']:.3f}, {result.summary()} ({time.perf_counter() - t1:.0f}s)",
                  flush=True)
    print()
    print("| --bpw | variant (experts replaced) | bits per weight (quantized experts) | mean KLD | top-1 "
          "| ppl (source) | layer error |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['bpw_budget']} | {r['variant']} ({r['rotated']}) | {r['bits_per_weight']:.3f} "
              f"({r['expert_bits_per_weight']:.3f}) | "
              f"{r['mean_kld']:.5f} | {100 * r['top1_agreement']:.1f}% | {r['perplexity_candidate']:.3f} "
              f"({r['perplexity_reference']:.3f}) | {r['layer_error']:.3f} |")
    groups = (by_group_size(scored, ctx, args.expert_formats.split(",")[0], args.seed, args.block)
              if args.group_sizes else [])
    if groups:
        print()
        print("| role | group size | bits per weight | layer error | rotated | ratio | max/rms W (rotated) "
              "| max/mean diag S (rotated) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for g in groups:
            e, mw, ms = g["error"], g["mu_w"], g["mu_s"]
            print(f"| {g['role']} | {g['group_size']} | {g['bits_per_weight']:.3f} | {e[0]:.4g} | {e[1]:.4g} | "
                  f"{e[1] / e[0]:.3f} | {mw[0]:.2f} ({mw[1]:.2f}) | {ms[0]:.2f} ({ms[1]:.2f}) |")
    if args.json:
        print(json.dumps({"rows": rows, "group_sizes": groups}, indent=1, default=str))


if __name__ == "__main__":
    main()
