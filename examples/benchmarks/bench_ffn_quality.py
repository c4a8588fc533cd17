"""Quality of elastic FFN levels, one row per way of making them, through the quality harness.

    python examples/benchmarks/bench_ffn_quality.py examples/models/tiny-coder --levels 5/6,4/6,1/2 \\
        --config magnitude:uniform:none --config magnitude:uniform:shift --config energy:uniform:none \\
        --config output:uniform:none --config output:per-layer:none --config output:per-layer:shift \\
        --config output:per-layer:scale

Each --config is `IMPORTANCE:LAYERS:CORRECTION[:FORMAT]`: the channel order (magnitude = mean |h| x the
down column's norm; energy = the column's squared norm x E[h^2]; output = backward elimination on the
layer's output error from the second moments), `uniform` (the same share of every layer) or `per-layer`
(the compiler's knapsack on measured sensitivity), the correction (none, shift = the dropped channels'
mean output, scale = least-squares scale of the kept channels plus the shift) and optionally a --quant
format (`int4`, `int4g32`). Every config compiles the model once with --ffn-levels and runs each level
on the CPU against the source model, as bench_quality.py does: the first --tokens held-out tokens,
windows of --context, each scoring --stride new positions (4223 positions by default).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from fractions import Fraction
from pathlib import Path


def parse_config(text: str) -> dict:
    """`output:per-layer:scale:int4g32` -> compile_model options."""
    fields = text.split(":")
    if len(fields) not in (3, 4) or fields[1] not in ("uniform", "per-layer"):
        raise SystemExit(f"--config is IMPORTANCE:uniform|per-layer:CORRECTION[:FORMAT], got {text!r}")
    options = {"ffn_importance": fields[0], "ffn_per_layer": fields[1] == "per-layer", "ffn_correction": fields[2]}
    if len(fields) == 4:
        fmt, _, group = fields[3].partition("g")
        options.update(quant=fmt, **({"group_size": int(group)} if group else {}))
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--levels", default="5/6,4/6,1/2", help="keep fractions (default 5/6,4/6,1/2)")
    parser.add_argument("--config", action="append", required=True, help="see above; repeat for several")
    parser.add_argument("--tokens", type=int, default=4224)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--stride", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args()

    import torch

    from thin.compiler import compile_model
    from thin.compiler.corpus import heldout_text
    from thin.compiler.hf import load_checkpoint
    from thin.runtime import load
    from thin.runtime.executor import Executor
    from thin.runtime.quality import compare

    torch.manual_seed(0)
    keeps = [float(Fraction(k)) for k in args.levels.split(",")]
    source = load_checkpoint(args.model_dir)
    reference = Executor(source.program.model, source.program.load)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(args.config):
            path = Path(tmp) / f"{i}.thin"
            started = time.perf_counter()
            compile_model(args.model_dir, path, ffn_levels=tuple(keeps), device="cpu", **parse_config(text))
            seconds = time.perf_counter() - started
            model = load(path)
            ids = model.encode(heldout_text())[:args.tokens]
            levels = {lv["keep"]: lv for lv in model.artifact.section("certificate")["ffn_levels"]["levels"]}
            row = {"config": text, "compile_s": seconds, "levels": []}
            for keep in [1.0, *keeps]:
                model.set_ffn_keep(keep)
                result = compare(reference, model, ids, context=args.context, stride=args.stride)
                level = levels[min(levels, key=lambda k: abs(k - keep))]
                row["levels"].append({"keep": keep, "channels": level["channels"],
                                      "ffn_share": level["ffn_bytes"] / level["ffn_bytes_full"],
                                      "certificate_kld": level["measured"]["mean_kld"], **result.to_plain()})
                print(f"{text:<28} keep {keep:.4f} ({row['levels'][-1]['ffn_share']:.3f} of FFN bytes, channels "
                      f"{level['channels']}): {result.summary()}", flush=True)
            rows.append(row)
    print()
    head = " | ".join(f"keep {Fraction(k).limit_denominator(16)}" for k in keeps)
    print(f"| importance | layers | correction | {head} |")
    print("| --- | --- | --- |" + " ---: |" * len(keeps))
    for row in rows:
        importance, layers, correction = row["config"].split(":")[:3]
        cells = " | ".join(f"{lv['mean_kld']:.3f} ({100 * lv['top1_agreement']:.1f}%)" for lv in row["levels"][1:])
        print(f"| {importance} | {layers} | {correction} | {cells} |")
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
