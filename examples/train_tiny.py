"""Train the two small code models that ship with thin, from scratch.

    python examples/train_tiny.py --model both --out examples/models

Data: the ``.py`` files of the running Python's standard library, read at run
time through ``thin.compiler.corpus`` (no text is stored in the repository);
the modules in ``corpus.HELDOUT_MODULES`` are held out and scored at the end.

Steps: train a byte-level BPE tokenizer (or reuse one with ``--tokenizer``),
then each model with AdamW and a warmup + cosine schedule on random windows of
the tokenized training files, bf16 autocast on CUDA. Training stops at
``--max-tokens`` or after ``--minutes`` of wall time, whichever comes first
(the schedule is planned for the one that binds). Each model directory gets the
bf16 safetensors weights, config.json, generation_config.json (greedy),
tokenizer.json, tokenizer_config.json (ChatML template) and training_log.json.

Seeded; bit-exact reproduction on a GPU is not guaranteed (atomics in kernels),
and the step count of a time-capped run depends on the machine: the log records
it, and ``--steps`` replays a fixed count.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import platform
import sys
import time
from pathlib import Path

try:
    from thin.compiler import corpus
except ImportError:
    # thin is not installed (e.g. a bare GPU machine holding a copy of the
    # repository): load compiler/corpus.py by path. It needs only the stdlib.
    _path = Path(__file__).resolve().parents[1] / "compiler" / "corpus.py"
    _spec = importlib.util.spec_from_file_location("thin_corpus_fallback", _path)
    corpus = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(corpus)

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]  # ids 0, 1, 2
VOCAB_SIZE = 4096
# Pre-split text like Qwen-family tokenizers (letters, single digits, punctuation
# runs, newline runs, whitespace runs) before byte-level BPE, except that a
# newline never joins the punctuation before it: "):" and "\n" stay separate
# tokens, so a prompt ending in "def f(n):" ends on a token boundary the model
# has seen before a newline.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Architecture of each model; values not named take the transformers defaults.
_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
ARCHS = {
    "tiny-coder": ("Qwen3Config", "Qwen3ForCausalLM", {"intermediate_size": 768}),
    "tiny-coder-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "intermediate_size": 768,
            "moe_intermediate_size": 128,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
        },
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=[*ARCHS, "both"], default="both")
    p.add_argument("--minutes", type=float, default=3.5, help="wall-time cap on training, per model")
    # 16M tokens is about 5.5 epochs of the 3.12 stdlib: the best held-out perplexity of a 4/8/16/32M
    # sweep (see examples/models/README.md); longer runs memorise the small corpus.
    p.add_argument("--max-tokens", type=float, default=16e6, help="training tokens cap, per model")
    p.add_argument("--steps", type=int, default=None, help="train exactly this many steps (overrides caps)")
    p.add_argument("--out", type=Path, default=Path("examples/models"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tokenizer", type=Path, default=None, help="reuse this tokenizer.json instead of training one"
    )
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument(
        "--evals", type=int, default=8, help="held-out evaluations during training (0: only at the end)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def log(msg: str) -> None:
    """Print a timestamped line."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_training_texts() -> list[str]:
    """Return the text of every training file, in corpus order."""
    return [p.read_text(encoding="utf-8") for p in corpus.training_files()]


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Train a byte-level BPE tokenizer of VOCAB_SIZE on ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config() -> dict:
    """Return tokenizer_config.json's contents (a PreTrainedTokenizerFast, ChatML)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _COMMON["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }


def encode_corpus(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Tokenize ``texts`` and concatenate them, each followed by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


def build_model(name: str, seed: int):
    """Build the untrained model ``name`` (fp32 weights) with a fixed seed."""
    import transformers

    cfg_cls, model_cls, extra = ARCHS[name]
    config = getattr(transformers, cfg_cls)(**_COMMON, **extra)
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config)


def count_params(model) -> tuple[int, int]:
    """Return (total, active-per-token) parameter counts; tied weights once."""
    total = sum(p.numel() for p in model.parameters())
    cfg = model.config
    experts = getattr(cfg, "num_experts", 0) or 0
    if not experts:
        return total, total
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    inactive = expert_params * (experts - cfg.num_experts_per_tok) // experts
    return total, total - inactive


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to ``peak``, then cosine decay to 10% of it at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def forward_loss(model, batch: torch.Tensor, device: str, moe: bool):
    """Return (cross-entropy, total loss) for a [B, L+1] token batch."""
    x, y = batch[:, :-1].long(), batch[:, 1:].long()
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
        out = model(input_ids=x, output_router_logits=True) if moe else model(input_ids=x)
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())
    aux = getattr(out, "aux_loss", None) if moe else None
    return ce, (ce if aux is None else ce + model.config.router_aux_loss_coef * aux)


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, seq_len: int, device: str, batch: int = 64) -> dict:
    """Teacher-forced loss on ``ids`` in non-overlapping windows of ``seq_len``.

    Window i feeds tokens [i*L, i*L+L) and scores the next token at each
    position, so every token after the first is scored once, with context
    from its window's start only.
    """
    model.eval()
    starts = list(range(0, len(ids) - 1, seq_len))
    nll, count = 0.0, 0
    for b in range(0, len(starts), batch):
        chunk = [ids[s : s + seq_len + 1] for s in starts[b : b + batch]]
        full = [w for w in chunk if len(w) == seq_len + 1]
        short = [w for w in chunk if len(w) != seq_len + 1]  # the last window: scored alone
        for group in ([torch.stack(full)] if full else []) + [w[None] for w in short]:
            x, y = group[:, :-1].to(device).long(), group[:, 1:].to(device).long()
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
                logits = model(input_ids=x).logits
            nll += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    model.train()
    loss = nll / count
    return {"loss": loss, "ppl": math.exp(loss), "tokens_scored": count}


def plan_steps(args, tokens_per_step: int, step_seconds: float, steps_done: int, elapsed: float) -> int:
    """Return the planned total step count under the token and time caps."""
    if args.steps is not None:
        return args.steps
    by_tokens = int(args.max_tokens // tokens_per_step)
    by_time = steps_done + int(max(0.0, args.minutes * 60 - elapsed) / max(step_seconds, 1e-6))
    return max(steps_done + 1, min(by_tokens, by_time))


def _sync(device: str) -> None:
    """Wait for queued GPU work, so host clocks read true times."""
    if device == "cuda":
        torch.cuda.synchronize()


def make_optimizer(model, args) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms)."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=args.device == "cuda")


def train_step(model, opt, batch: torch.Tensor, lr: float, args, moe: bool) -> torch.Tensor:
    """One optimizer step on a [B, L+1] token batch; return its cross-entropy."""
    for group in opt.param_groups:
        group["lr"] = lr
    ce, loss = forward_loss(model, batch, args.device, moe)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return ce.detach()


def loss_summary(losses: list[torch.Tensor]) -> dict:
    """Final training loss (mean of the last 100 steps) and the per-100-step means."""
    all_losses = torch.stack(losses).float().cpu()
    blocks = all_losses[: len(all_losses) // 100 * 100].view(-1, 100).mean(1)
    return {
        "final_train_loss": round(all_losses[-100:].mean().item(), 5),
        "train_loss_per_100_steps": [round(v, 4) for v in blocks.tolist()],
    }


def train_loop(model, data: torch.Tensor, held_ids: torch.Tensor, args) -> dict:
    """Train ``model`` in place on random windows of ``data``; return the log."""
    device, seq, moe = args.device, args.seq_len, hasattr(model.config, "num_experts")
    opt = make_optimizer(model, args)
    gen = torch.Generator().manual_seed(args.seed)
    data, span = data.to(device), torch.arange(seq + 1, device=device)
    per_step = args.batch * seq
    total = plan_steps(args, per_step, 1e-9, 0, 0.0)  # token cap only, until timed
    eval_every = max(1, total // args.evals) if args.evals else 0
    losses, curve, done, t0, t_mark = [], [], 0, time.perf_counter(), None
    stopped_by = "steps" if args.steps is not None else "tokens"
    while done < total:
        starts = torch.randint(0, len(data) - seq - 1, (args.batch,), generator=gen).to(device)
        lr = lr_at(done, total, args.lr, args.warmup)
        losses.append(train_step(model, opt, data[starts[:, None] + span], lr, args, moe))
        done += 1
        if done in (10, 30) and args.steps is None:  # time steps 10..30, then plan the rest
            _sync(device)
            now = time.perf_counter()
            if done == 10:
                t_mark = now
            else:
                total = plan_steps(args, per_step, (now - t_mark) / 20, done, now - t0)
                eval_every = max(1, total // args.evals) if args.evals else 0
                stopped_by = "tokens" if total == int(args.max_tokens // per_step) else "time"
                log(f"planned {total} steps ({stopped_by} cap), {(now - t_mark) / 20 * 1e3:.1f} ms/step")
        if done % 100 == 0 or done == total:
            recent = torch.stack(losses[-100:]).mean().item()
            elapsed = time.perf_counter() - t0
            log(
                f"step {done}/{total} tokens {done * per_step / 1e6:.1f}M loss {recent:.4f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {elapsed:.0f}s {done * per_step / elapsed / 1e6:.2f}M tok/s"
            )
        if eval_every and (done % eval_every == 0 or done == total):
            ev = evaluate(model, held_ids, seq, device)
            curve.append({"step": done, "tokens": done * per_step, "heldout_loss": round(ev["loss"], 5)})
            log(f"  held-out loss {ev['loss']:.4f} ppl {ev['ppl']:.2f}")
        if args.steps is None and done < total and time.perf_counter() - t0 > args.minutes * 60:
            stopped_by, total = "time (hard stop)", done
    _sync(device)
    wall = round(time.perf_counter() - t0, 1)
    return {
        "steps": done,
        "tokens_seen": done * per_step,
        "train_seconds": wall,
        "stopped_by": stopped_by,
        **loss_summary(losses),
        "heldout_curve": curve,
    }


def add_legacy_config_keys(out_dir: Path) -> None:
    """Add the transformers-4 names of fields transformers 5 renamed to config.json.

    ``rope_theta`` (now inside ``rope_parameters``) and, for MoE, ``num_experts``
    (now ``num_local_experts``), so that older readers load the same model.
    """
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    if "rope_theta" not in cfg and "rope_theta" in cfg.get("rope_parameters", {}):
        cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    if "num_experts" not in cfg and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg["num_local_experts"]
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_model(model, tok: Tokenizer, out_dir: Path, record: dict) -> None:
    """Write the bf16 weights, configs, tokenizer and training log to ``out_dir``."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu", torch.bfloat16)
    # transformers 4.x takes safe_serialization; 5.x always writes safetensors.
    extra = (
        {"safe_serialization": True}
        if "safe_serialization" in inspect.signature(model.save_pretrained).parameters
        else {}
    )
    model.save_pretrained(out_dir, **extra)
    add_legacy_config_keys(out_dir)
    eot, im_end = tok.token_to_id(EOT), tok.token_to_id(IM_END)
    # Greedy decoding by default: deterministic, so runtimes can be compared token for token.
    GenerationConfig(
        bos_token_id=eot, eos_token_id=[eot, im_end], pad_token_id=eot, do_sample=False
    ).save_pretrained(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (out_dir / "training_log.json").write_text(json.dumps(record, indent=2) + "\n")


def run_one(name: str, tok: Tokenizer, data: torch.Tensor, held_ids: torch.Tensor, args, meta: dict) -> dict:
    """Build, train, score and save one model; return its training record."""
    model = build_model(name, args.seed).to(args.device)
    total, active = count_params(model)
    log(f"{name}: {type(model).__name__} params {total:,} (active {active:,})")
    record = {
        "model": name,
        "architecture": type(model).__name__,
        "params_total": total,
        "params_active": active,
        **meta,
        **train_loop(model, data, held_ids, args),
    }
    record["epochs"] = round(record["tokens_seen"] / len(data), 2)
    model = model.to(torch.bfloat16)  # score the weights exactly as shipped
    ev = evaluate(model, held_ids, args.seq_len, args.device)
    record["heldout"] = {
        "loss": round(ev["loss"], 5),
        "ppl": round(ev["ppl"], 3),
        "tokens_scored": ev["tokens_scored"],
        "bits_per_byte": round(ev["loss"] * ev["tokens_scored"] / math.log(2) / meta["heldout_bytes"], 4),
        "method": f"bf16 weights, teacher-forced, non-overlapping {args.seq_len}-token windows",
    }
    log(
        f"{name}: {record['steps']} steps, {record['tokens_seen'] / 1e6:.1f}M tokens, "
        f"{record['train_seconds']:.0f}s, train loss {record['final_train_loss']:.4f}, "
        f"held-out ppl {ev['ppl']:.3f}"
    )
    save_model(model, tok, args.out / name, record)
    size = sum(f.stat().st_size for f in (args.out / name).iterdir())
    log(f"{name}: saved to {args.out / name} ({size / 2**20:.2f} MiB)")
    return record


def get_tokenizer(args, texts: list[str]) -> Tokenizer:
    """Load ``--tokenizer`` or train one on ``texts``; check its special ids."""
    if args.tokenizer:
        tok = Tokenizer.from_file(str(args.tokenizer))
    else:
        t = time.perf_counter()
        tok = train_tokenizer(texts)
        log(f"tokenizer trained in {time.perf_counter() - t:.1f}s")
    if tok.get_vocab_size() != VOCAB_SIZE or tok.token_to_id(EOT) != 0:
        raise SystemExit(f"tokenizer must have {VOCAB_SIZE} tokens with {EOT} as id 0")
    return tok


def run_metadata(args, tok: Tokenizer, texts: list[str], data: torch.Tensor, held_ids: torch.Tensor) -> dict:
    """The settings, data sizes and versions that every model's training log records."""
    import hashlib

    import transformers

    return {
        "seed": args.seed,
        "seq_len": args.seq_len,
        "batch_sequences": args.batch,
        "peak_lr": args.lr,
        "warmup_steps": args.warmup,
        "schedule": "linear warmup, cosine to 10%",
        "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0.1 on matrices), grad clip 1.0",
        "minutes_cap": args.minutes,
        "max_tokens_cap": args.max_tokens,
        "steps_arg": args.steps,
        "python": platform.python_version(),
        "stdlib_dir": str(corpus.stdlib_dir()),
        "training_files": len(texts),
        "training_tokens_per_epoch": len(data),
        "heldout_modules": list(corpus.HELDOUT_MODULES),
        "heldout_tokens": len(held_ids),
        "heldout_bytes": len(corpus.heldout_text().encode()),
        "vocab_size": tok.get_vocab_size(),
        "tokenizer_sha256": hashlib.sha256(tok.to_str().encode()).hexdigest(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
    }


def main(argv=None) -> int:
    """Train the tokenizer (or load it) and the chosen models."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    texts = read_training_texts()
    log(f"{len(texts)} training files, {sum(map(len, texts)) / 1e6:.2f}M chars from {corpus.stdlib_dir()}")
    tok = get_tokenizer(args, texts)
    data = encode_corpus(tok, texts)
    held_ids = torch.tensor(tok.encode(corpus.heldout_text()).ids, dtype=torch.int32)
    meta = run_metadata(args, tok, texts, data, held_ids)
    log(
        f"training tokens per epoch {len(data):,}; held-out tokens {len(held_ids):,}; "
        f"tokenizer {meta['tokenizer_sha256'][:16]}"
    )
    names = list(ARCHS) if args.model == "both" else [args.model]
    for name in names:
        run_one(name, tok, data, held_ids, args, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
