"""Experts beyond VRAM: expert transfers per decoded token, and decode speed, as the budget keeps fewer
experts resident (`thinc compile --stream-experts`).

    python examples/benchmarks/bench_residency.py examples/models/tiny-coder-moe --resident 1,0.5,0.25,0
    python examples/benchmarks/bench_residency.py /tmp/moe-a3b --resident 1,0.5,0 --quant int4 --device cuda

A first compile under a budget that holds everything gives the ledger; each row then compiles with
`--vram` = that ledger less the routed experts' bytes, plus the smallest expert cache (top-k slots of
the largest page) and the share F of the experts' bytes, so F = 0 streams every expert through top-k
slots and F = 1 keeps every expert resident. Each artifact generates --gen greedy tokens after a
held-out prompt of --prompt-len tokens; the table gives the plan (resident / host experts, slots) and
the decode: tokens/s, expert pages copied per token, MiB per token. On CUDA an all-resident artifact
decodes on the decode engine, the others on the torch executor.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--resident", default="1,0.5,0", help="comma-separated shares of the experts' bytes")
    parser.add_argument("--quant", default=None, help="one format for every linear weight (default: as stored)")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--calib-tokens", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from thin.artifacts import open_artifact
    from thin.artifacts.pages import expert_pages
    from thin.compiler import compile_model
    from thin.compiler.corpus import heldout_text
    from thin.ir import MoE
    from thin.runtime import load

    options = {"quant": args.quant, "stream_experts": True, "ctx": args.ctx, "calib_tokens": args.calib_tokens,
               "device": args.device}
    shares = [float(s) for s in args.resident.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="thin-residency-") as tmp:
        roomy = compile_model(args.model_dir, Path(tmp) / "roomy.thin", vram="1T", **options)
        with open_artifact(roomy) as art:
            experts = sum(art.tensor_entry(n).size for n in art.tensor_names()
                          if art.tensor_entry(n).expert is not None)
            largest = max(length for _, length in expert_pages(art).values())
            top_k = max(layer.ffn.top_k for layer in art.model.layers if isinstance(layer.ffn, MoE))
            floor = art.section("memory")["total"] - experts + top_k * largest
        for share in shares:
            path = compile_model(args.model_dir, Path(tmp) / f"r{share}.thin", vram=floor + int(share * experts),
                                 **options)
            model = load(path, device=args.device)
            ids = model.encode(heldout_text())[:args.prompt_len]
            list(model.generate(ids, max_new_tokens=args.gen, stop_token_ids=()))
            stats, plan = model.last_stats, model.artifact.section("memory")["residency"]
            steps = max(stats.new_tokens - 1, 1)
            rows.append((f"{share:g}", str(plan["resident_experts"]), str(len(plan["host"])), str(plan["slots"]),
                         f"{stats.decode_tokens_per_second:.1f}",
                         "-" if stats.expert_transfers is None else f"{stats.expert_transfers / steps:.2f}",
                         "-" if stats.expert_transfers is None else
                         f"{stats.expert_transfer_bytes / steps / 2**20:.2f}",
                         "engine" if model.engine is not None else "executor"))
            del model
    header = ("resident share", "resident", "host", "slots", "decode tok/s", "transfers/token", "MiB/token", "decoder")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    print(f"\n{args.model_dir}: {args.prompt_len}-token held-out prompt, {args.gen} greedy tokens on {args.device}; "
          f"experts {experts / 2**20:.1f} MiB, largest page {largest / 2**20:.2f} MiB, top-k {top_k}")


if __name__ == "__main__":
    main()
