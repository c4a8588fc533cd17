"""Quality of compiled models against their source, teacher-forced on held-out text.

    python examples/benchmarks/bench_quality.py examples/models/tiny-coder \
        --config int8 --config fp8_e4m3 --config int4:g32 --config int4:g128:asym

Each --config is compiler options in short form: `FORMAT[:gN][:asym][:keep-head]` for `--quant`
(`exact` compiles without quantization); or any `key=value` pairs of `compile_model` options joined
by commas (`bpw=5.06`, `bpw=3.6,method=rtn`, `quant=int4,group_size=32,method=gptq`). For a planned
compile the table adds the planner's predicted KLD and the certificate's own measurement (8 held-out
prompts of 256 positions, a different sample than this harness's windows). The source model runs in
float32 through thin's executor (the same numbers as transformers, see the parity tests); each
artifact runs on the CPU.
--int8-o adds, for each config, a row with o's input rounded to int8 a head (scale max |head| / 127, round to
nearest even), in torch: what the GPU decode step's o on the int8 tensor cores multiplies (kernels/int8_heads.py,
where o is symmetric int4 with groups of 128 over heads of 128; here over the model's own heads, emulated at every
position).
Text: the first N tokens of the held-out stdlib modules (thin.compiler.corpus.heldout_text),
scored in windows of --context tokens, each scoring --stride new positions.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def parse_config(text: str) -> dict:
    """`int4:g32:asym` -> {"quant": "int4", "group_size": 32, "asymmetric": True}; `k=v,...` as is, a
    piece without `=` continuing the value before it (`expert_formats=q2,trellis`)."""
    if "=" in text:
        out: dict = {}
        key = None
        for pair in text.split(","):
            if "=" not in pair and key is not None and isinstance(out[key], str):
                out[key] += "," + pair
                continue
            key, value = pair.split("=", 1)
            out[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
        return out
    fields = text.split(":")
    if fields[0] == "exact":
        return {}
    options = {"quant": fields[0]}
    for f in fields[1:]:
        if f.startswith("g"):
            options["group_size"] = int(f[1:])
        elif f == "asym":
            options["asymmetric"] = True
        elif f == "keep-head":
            options["keep_lm_head"] = True
        else:
            raise SystemExit(f"unknown config field {f!r} in {text!r}")
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--config", action="append", required=True, help="see above; repeat for several")
    parser.add_argument("--tokens", type=int, default=4224, help="held-out tokens to score (default 4224)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--stride", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument("--int8-o", action="store_true", help="add each config with o's input rounded to int8 a head")
    args = parser.parse_args()

    import torch

    from thin.compiler import compile_model
    from thin.compiler.corpus import heldout_text
    from thin.compiler.hf import load_checkpoint
    from thin.runtime import load
    from thin.runtime.executor import Executor
    from thin.runtime.quality import compare

    torch.manual_seed(0)
    source = load_checkpoint(args.model_dir)
    reference = Executor(source.program.model, source.program.load)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(args.config):
            options = parse_config(text)
            path = Path(tmp) / f"{i}.thin"
            t0 = time.perf_counter()
            compile_model(args.model_dir, path, **options)
            seconds = time.perf_counter() - t0
            for int8_o in (False, True) if args.int8_o else (False,):
                model = load(path)
                if int8_o:
                    round_o_inputs(model.executor)
                ids = model.encode(heldout_text())[:args.tokens]
                result = compare(reference, model, ids, context=args.context, stride=args.stride)
                tensor_bytes = sum(model.artifact.tensor_entry(n)["size"] for n in model.artifact.tensor_names())
                parameters = sum(_numel(t.shape) for t in model.ir.tensors)
                plan = (model.artifact.section("precision_plan") or {}).get("plan") or {}
                certificate = model.artifact.section("certificate") or {}
                label = text + (" + int8 o input" if int8_o else "")
                rows.append({"config": label, "bits_per_weight": 8 * tensor_bytes / parameters,
                             "file_bytes": path.stat().st_size, "compile_s": seconds, **result.to_plain(),
                             "predicted_kld": plan.get("predicted_kld"),
                             "certificate_kld": certificate.get("measured", {}).get("mean_kld")})
                print(f"{label:<24} {rows[-1]['bits_per_weight']:6.3f} bpw  {result.summary()}  "
                      f"compile {seconds:.0f}s", flush=True)
    print()
    print("| config | bits per weight | file | mean KLD | KLD p99 | top-1 | ppl (source) | positions | predicted KLD "
          "| certificate KLD |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        extra = " | ".join("-" if r[k] is None else f"{r[k]:.5f}" for k in ("predicted_kld", "certificate_kld"))
        print(f"| {r['config']} | {r['bits_per_weight']:.2f} | {r['file_bytes'] / 2**20:.2f} MiB | "
              f"{r['mean_kld']:.5f} | {r['kld_p99']:.4f} | {100 * r['top1_agreement']:.1f}% | "
              f"{r['perplexity_candidate']:.3f} ({r['perplexity_reference']:.3f}) | {r['positions']} | {extra} |")
    if args.json:
        print(json.dumps(rows, indent=1))


def round_o_inputs(executor) -> None:
    """Every layer's o multiplies its input rounded to int8 a head as int8_heads' merge rounds it
    (int8_heads.quantize_heads over the layer's heads) times the scale."""
    from thin.runtime.kernels.int8_heads import quantize_heads

    def rounded(o, head_dim):
        def call(x, *args, **kwargs):
            codes, scales = quantize_heads(x, head_dim)
            return o((codes * scales[:, None]).reshape(x.shape).to(x.dtype), *args, **kwargs)
        return call

    for layer in executor.layers:
        layer.attention.o = rounded(layer.attention.o, layer.attention.head_dim)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
