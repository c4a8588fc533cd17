"""`thin-exec bench`: prefill and decode speed against the memory-bandwidth limit.

Batch-1 decode reads every weight once per token, so tokens/s can't exceed bandwidth / bytes read
per token. This measures both sides on the device at hand: the bytes from the artifact's tensor
table (the embedding counted as one row: a token reads one), the bandwidth from a large
device-to-device copy (bytes read plus bytes written), and decode tokens/s over a random prompt.
It also checks what a captured decode step can get wrong: the positions attended at every step
must equal the position (a graph that attends to a fixed length is the classic bug), and greedy
tokens with and without the CUDA graph must be the same.
"""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from .errors import RunError
from .sampling import GenerationOptions
from .step_profile import ProfileError, StepProfile, profile_step, render


class BenchCheckError(RunError, RuntimeError):
    """A correctness check of the benchmark failed."""


@dataclass
class BenchResult:
    model: str
    device: str
    formats: dict[str, int]
    prompt_tokens: int
    new_tokens: int
    runs: int
    prefill_tokens_per_second: float
    decode_tokens_per_second: float  # median over the runs
    decode_min: float
    decode_max: float
    bytes_per_token: int
    bandwidth_bytes_per_second: float
    roofline_tokens_per_second: float
    roofline_fraction: float
    peak_vram_bytes: int
    graph: bool
    ffn_keep: float = 1.0  # the elastic FFN level decoded (thin-exec bench --ffn-keep)
    expert_bytes_per_token: int = 0  # of bytes_per_token: the routed experts a token reads (top-k of each layer)
    # Experts in host memory (thinc compile --stream-experts): pages copied to the GPU per decoded token, their
    # bytes, and the cache's slots; None when every expert is resident.
    expert_transfers_per_token: float | None = None
    expert_transfer_bytes_per_token: float | None = None
    expert_slots: int = 0
    checks: dict[str, str] = field(default_factory=dict)
    # --profile (runtime/step_profile.py): the CUDA graph's replays by kernel name and by section, the
    # whole replay (step_profile), or the one-line reason the profiler gave nothing (profile_error).
    kernels: list[dict] = field(default_factory=list)
    sections: list[dict] = field(default_factory=list)
    step_profile: dict | None = None
    profile_error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        gb = 1e9
        lines = [
            f"model          {self.model} ({', '.join(f'{k} x{v}' for k, v in sorted(self.formats.items()))})",
            f"device         {self.device}, copy bandwidth {self.bandwidth_bytes_per_second / gb:.0f} GB/s",
            f"weights read   {self.bytes_per_token / gb:.3f} GB per token"
            + ("" if self.ffn_keep == 1.0 else f" (FFN level {self.ffn_keep:g})")
            + (f", {self.expert_bytes_per_token / gb:.3f} GB of it routed experts (top-k of each layer)"
               if self.expert_bytes_per_token else ""),
            f"prefill        {self.prompt_tokens} tokens: {self.prefill_tokens_per_second:.0f} tok/s",
            f"decode         {self.new_tokens} tokens x {self.runs} runs: {self.decode_tokens_per_second:.1f} tok/s "
            f"median ({self.decode_min:.1f}-{self.decode_max:.1f}){'' if self.graph else ', no CUDA graph'}",
            f"roofline       {self.roofline_tokens_per_second:.0f} tok/s: {100 * self.roofline_fraction:.1f}% of it",
            f"peak VRAM      {self.peak_vram_bytes / 2**30:.2f} GiB",
        ]
        if self.expert_transfers_per_token is not None:
            lines.insert(5, f"experts        {self.expert_transfers_per_token:.2f} transfers per token from host "
                            f"memory ({self.expert_transfer_bytes_per_token / gb:.4f} GB), {self.expert_slots} GPU "
                            "slots; decoded by the torch executor")
        lines += [f"check          {name}: {result}" for name, result in self.checks.items()]
        if self.profile_error:
            lines.append(f"profile        {self.profile_error}")
        if self.step_profile:
            lines += render(StepProfile(**self.step_profile, kernels=self.kernels, sections=self.sections))
        return "\n".join(lines)


def copy_bandwidth(device: torch.device, nbytes: int = 2**31, rounds: int = 3) -> float:
    """Bytes per second of a device-to-device copy (read + write) of up to `nbytes`: a third of what may be
    allocated (under a --vram cap, of what the cap leaves), at least 64 MiB, past the L2 cache. The best of
    `rounds` fresh pairs of buffers, each the median of 20 copies: one pair's median has read 2% under
    another's on an idle H200 (4143 against 4208-4250 GB/s in one session; on one machine single readings
    spread 4183-4221, the best of three 4201-4219, BENCHMARKS Round 10), and a low reading would flatter the
    fraction of the roofline by as much."""
    from .memory import allocatable

    nbytes = max(2**26, min(nbytes, allocatable(device) // 3)) // 4 * 4
    best = 0.0
    for _ in range(rounds):
        src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(20):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        del src, dst
        best = max(best, 2 * nbytes / statistics.median(times))
    return best


def bytes_per_token(artifact, level=None) -> int:
    """Bytes of weights one decoded token reads: every tensor once, the embedding one row (a tied
    LM head reads the whole table once more), and of a mixture of experts the k experts a token is
    routed to (expert_bytes_per_token); with elastic FFN levels, the FFN prefix and correction
    tensors of `level` (a thin.ir.FFNLevel; None: the whole model) instead."""
    model = artifact.model
    if model.ffn_levels:
        from thin.ir.elastic import bytes_per_token as elastic_bytes

        return elastic_bytes(model, level)
    embedding = model.embedding.weight
    experts = set(_expert_shares(model))
    total = 0
    for t in model.tensors:
        size = artifact.tensor_entry(t.name)["size"]
        if t.name == embedding:
            total += size // t.shape[0] + (size if model.lm_head.tied else 0)
        elif t.name not in experts:
            total += size
    return total + expert_bytes_per_token(artifact)


def expert_bytes_per_token(artifact) -> int:
    """Bytes of routed experts one decoded token reads: top_k / num_experts of each MoE layer's expert
    bytes (the k experts it picks, as an average over experts: formats may differ between them)."""
    shares = _expert_shares(artifact.model)
    return round(sum(artifact.tensor_entry(name)["size"] * share for name, share in shares.items()))


def _expert_shares(model) -> dict[str, float]:
    """{tensor name: top_k / num_experts} for every routed expert's weights and biases."""
    from thin.ir import MoE

    out = {}
    for layer in model.layers:
        if isinstance(layer.ffn, MoE):
            share = layer.ffn.top_k / len(layer.ffn.experts)
            for expert in layer.ffn.experts:
                for lin in (expert.gate, expert.up, expert.gate_up, expert.down):
                    if lin is not None:
                        out.update({name: share for name in (lin.weight, lin.bias) if name is not None})
    return out


def run(model, *, prompt_len: int = 512, new_tokens: int = 128, runs: int = 5, profile: bool = False,
        seed: int = 0) -> BenchResult:
    """Benchmark a loaded ThinModel on CUDA (its decode engine must have taken the model)."""
    engine = model.engine
    if engine is None and model.executor.expert_cache is not None:
        if profile:
            raise BenchCheckError("--profile times the decode engine's kernels, and a model with experts in host "
                                  "memory decodes on the torch executor")
        return run_streamed(model, prompt_len=prompt_len, new_tokens=new_tokens, runs=runs, seed=seed)
    if engine is None:
        raise BenchCheckError("bench needs the CUDA decode engine (a CUDA device, Triton, and a model it runs)")
    if new_tokens < 2:
        raise ValueError("bench needs --gen of at least 2 tokens")
    if profile and not engine.use_graphs:
        raise BenchCheckError("--profile breaks down the captured decode step's replays: drop --no-graph")
    device = engine.device
    prompt = torch.randint(0, model.ir.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    options = GenerationOptions(max_new_tokens=new_tokens, stop_token_ids=())
    sampler = engine.sampler(options)
    cache = engine.new_cache(prompt_len + new_tokens)

    def once(graph: bool) -> tuple[float, float, list[int]]:
        cache.reset()
        cache.reserve(prompt_len + new_tokens)
        engine.start(cache, prompt.tolist(), options)
        torch.cuda.synchronize(device)
        begin = time.perf_counter()
        engine.prefill(cache, prompt, sampler)
        first = int(engine.token)  # synchronises
        middle = time.perf_counter()
        tokens = [first, *engine.decode_n_tokens(cache, new_tokens - 1, sampler, graph=graph)]
        end = time.perf_counter()
        return middle - begin, end - middle, tokens

    torch.cuda.reset_peak_memory_stats(device)
    once(engine.use_graphs)  # compile, tune, capture
    prefill_times, decode_times, tokens = [], [], None
    for _ in range(runs):
        p, d, tokens = once(engine.use_graphs)
        prefill_times.append(p)
        decode_times.append(d)
    checks = {}
    attended = cache.attended[1:new_tokens].tolist()
    window = model.executor.layers[0].attention.sliding_window
    expected = [min(prompt_len + i, window or prompt_len + i) for i in range(1, new_tokens)]
    if attended != expected:
        bad = next(i for i, (a, b) in enumerate(zip(attended, expected)) if a != b)
        raise BenchCheckError(f"decode step {bad + 1} attended {attended[bad]} positions, expected {expected[bad]}")
    checks["positions attended == position, every step"] = "ok"
    if engine.use_graphs:
        eager = once(False)[2]
        if eager != tokens:
            bad = next(i for i, (a, b) in enumerate(zip(eager, tokens)) if a != b)
            raise BenchCheckError(f"greedy tokens with and without the CUDA graph differ from token {bad}")
        checks["greedy tokens with CUDA graph == without"] = "ok"
    peak = torch.cuda.max_memory_allocated(device)
    steps = new_tokens - 1
    rates = sorted(steps / d for d in decode_times)
    median = statistics.median(rates)
    found: dict = {}
    if profile:
        try:  # after the measurement (CUPTI must not slow it), within the positions the runs reserved
            p = profile_step(engine, cache, sampler, replays=min(20, steps), step_us=1e6 / median)
            found = {"kernels": p.kernels, "sections": p.sections,
                     "step_profile": {k: v for k, v in p.to_dict().items() if k not in ("kernels", "sections")}}
        except ProfileError as e:
            found = {"profile_error": str(e)}
        except Exception as e:  # the profile is an addition: keep the measurement, name the failure in one line
            where = traceback.extract_tb(e.__traceback__)[-1]
            first = (str(e).splitlines() or [""])[0]
            found = {"profile_error": f"failed: {type(e).__name__}: {first} ({where.filename}:{where.lineno})"}
    bandwidth = copy_bandwidth(device)
    weight_bytes = bytes_per_token(model.artifact, model.ffn_level)
    counts: dict[str, int] = {}
    for t in model.ir.tensors:
        counts[t.encoding.format] = counts.get(t.encoding.format, 0) + 1
    roofline = bandwidth / weight_bytes
    return BenchResult(
        model=str(model.artifact.path.name), device=torch.cuda.get_device_name(device), formats=counts,
        prompt_tokens=prompt_len, new_tokens=new_tokens, runs=runs,
        prefill_tokens_per_second=prompt_len / statistics.median(prefill_times), decode_tokens_per_second=median,
        decode_min=rates[0], decode_max=rates[-1], bytes_per_token=weight_bytes, bandwidth_bytes_per_second=bandwidth,
        roofline_tokens_per_second=roofline, roofline_fraction=median / roofline, peak_vram_bytes=peak,
        graph=engine.use_graphs, ffn_keep=model.ffn_keep, checks=checks,
        expert_bytes_per_token=expert_bytes_per_token(model.artifact), **found)


def run_streamed(model, *, prompt_len: int = 512, new_tokens: int = 128, runs: int = 5, seed: int = 0) -> BenchResult:
    """Benchmark a loaded ThinModel whose experts stream from host memory: the torch executor generates
    (greedy, no stop token), and the expert cache's transfers per decoded token are counted. The greedy
    tokens of every run must agree (the cache's state differs between runs, the numbers must not)."""
    from .generate import GenerationStats, generate

    if new_tokens < 2:
        raise ValueError("bench needs --gen of at least 2 tokens")
    executor, device = model.executor, model.device
    prompt = torch.randint(0, model.ir.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    options = GenerationOptions(max_new_tokens=new_tokens, stop_token_ids=())

    def once() -> tuple[GenerationStats, list[int]]:
        stats = GenerationStats()
        tokens = list(generate(executor, prompt.tolist(), options, stats=stats))
        return stats, tokens

    torch.cuda.reset_peak_memory_stats(device)
    _, first = once()  # warm-up
    results = [once() for _ in range(runs)]
    if any(tokens != first for _, tokens in results):
        raise BenchCheckError("greedy tokens differ between runs with streamed experts")
    peak = torch.cuda.max_memory_allocated(device)
    bandwidth = copy_bandwidth(device)
    rates = sorted(s.decode_tokens_per_second for s, _ in results)
    steps = sum(s.new_tokens - 1 for s, _ in results)
    weight_bytes = bytes_per_token(model.artifact, model.ffn_level)
    counts: dict[str, int] = {}
    for t in model.ir.tensors:
        counts[t.encoding.format] = counts.get(t.encoding.format, 0) + 1
    median = statistics.median(rates)
    roofline = bandwidth / weight_bytes
    return BenchResult(
        model=str(model.artifact.path.name), device=torch.cuda.get_device_name(device), formats=counts,
        prompt_tokens=prompt_len, new_tokens=new_tokens, runs=runs,
        prefill_tokens_per_second=statistics.median(s.prefill_tokens_per_second for s, _ in results),
        decode_tokens_per_second=median, decode_min=rates[0], decode_max=rates[-1], bytes_per_token=weight_bytes,
        bandwidth_bytes_per_second=bandwidth, roofline_tokens_per_second=roofline, roofline_fraction=median / roofline,
        peak_vram_bytes=peak, graph=False, ffn_keep=model.ffn_keep,
        checks={"greedy tokens equal in every run": "ok"},
        expert_bytes_per_token=expert_bytes_per_token(model.artifact),
        expert_transfers_per_token=sum(s.expert_transfers for s, _ in results) / steps,
        expert_transfer_bytes_per_token=sum(s.expert_transfer_bytes for s, _ in results) / steps,
        expert_slots=executor.expert_cache.slots)
