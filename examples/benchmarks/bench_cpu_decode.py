"""CPU decode speed: thin against transformers' generate on the same random checkpoint, same process.

    python examples/benchmarks/bench_cpu_decode.py --layers 4 --hidden 256 --new-tokens 128 --runs 5

Both run greedy decoding of the same prompt for exactly --new-tokens tokens in float32 with the same
torch thread count; the table shows the median of --runs runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def make_model(path: Path, layers: int, hidden: int, vocab: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(path, safe_serialization=True)
    return model


def median_seconds(fn, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    from thin.compiler import compile_model
    from thin.runtime import load

    with tempfile.TemporaryDirectory() as tmp:
        ref = make_model(Path(tmp) / "ckpt", args.layers, args.hidden, args.vocab)
        ours = load(compile_model(Path(tmp) / "ckpt", Path(tmp) / "m.thin"))
        prompt = torch.randint(0, args.vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
        n = args.new_tokens

        def run_thin():
            out = list(ours.generate(prompt.tolist(), max_new_tokens=n, temperature=0.0, stop_token_ids=()))
            assert len(out) == n

        def run_hf():
            with torch.no_grad():
                out = ref.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False)
            assert out.shape[1] == args.prompt_tokens + n

        t_thin = median_seconds(run_thin, args.runs)
        t_hf = median_seconds(run_hf, args.runs)
    params = sum(p.numel() for p in ref.parameters())
    print(f"model: llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {params / 1e6:.1f}M params, "
          f"float32, torch threads {torch.get_num_threads()}")
    print(f"work: {args.prompt_tokens}-token prompt, {n} greedy tokens, median of {args.runs} runs")
    print(f"{'system':<14} {'seconds':>8} {'tok/s':>8}")
    print(f"{'thin':<14} {t_thin:>8.3f} {n / t_thin:>8.1f}")
    print(f"{'transformers':<14} {t_hf:>8.3f} {n / t_hf:>8.1f}")
    print(f"thin / transformers: {t_hf / t_thin:.2f}x")


if __name__ == "__main__":
    main()
