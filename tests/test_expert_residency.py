"""Experts beyond VRAM: the residency plan (thinc compile --stream-experts) and the runtime's expert cache,
with host and device both the CPU: the same numbers as every expert resident, transfers counted, least
recently used slots evicted, and budgets that force streaming or cannot stream at all."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from thin.artifacts import ArtifactWriteError, describe, open_artifact, render_description
from thin.artifacts.pages import expert_pages
from thin.artifacts.sections import encode_sections
from thin.compiler import compile_model
from thin.compiler.config import CompileOptionError
from thin.ir import MoE
from thin.passes import PassError
from thin.runtime import cli, load
from thin.runtime.executor import Executor
from thin.runtime.expert_cache import ExpertCache, HostPages, device_weight_bytes
from thin.runtime.loader import _raw_getter

from hf_tiny import make_checkpoint
from tiny_tokenizer import write_tokenizer

CPU = torch.device("cpu")
OPTIONS = {"quant": "int8", "stream_experts": True, "device": "cpu", "calib_tokens": 512}


def _expert_bytes(art) -> int:
    return sum(art.tensor_entry(n).size for n in art.tensor_names() if art.tensor_entry(n).expert is not None)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A tiny Qwen3-MoE compiled twice with --stream-experts: under a budget that holds everything (every
    expert resident), and under one that holds the rest of the model, 3 pages of experts and a little."""
    root = tmp_path_factory.mktemp("residency")
    ckpt = make_checkpoint("qwen3_moe", root / "ckpt", vocab_size=320)
    write_tokenizer(ckpt)
    roomy = compile_model(ckpt, root / "roomy.thin", vram="2G", **OPTIONS)
    with open_artifact(roomy) as art:
        largest = max(length for _, length in expert_pages(art).values())
        tight_budget = art.section("memory")["total"] - _expert_bytes(art) + 3 * largest + 4096
    tight = compile_model(ckpt, root / "tight.thin", vram=tight_budget, **OPTIONS)
    return ckpt, roomy, tight, tight_budget


def test_a_budget_that_holds_everything_streams_nothing(compiled):
    _, roomy, _, _ = compiled
    with open_artifact(roomy) as art:
        residency = art.section("memory")["residency"]
        assert residency["host"] == [] and residency["slots"] == 0
        assert art.section("memory")["lines"]["expert_cache"] == 0
    assert load(roomy).executor.expert_cache is None


def test_a_tight_budget_keeps_the_least_routed_experts_in_host_memory(compiled):
    _, _, tight, budget = compiled
    with open_artifact(tight) as art:
        memory = art.section("memory")
        residency = memory["residency"]
        top_k = max(layer.ffn.top_k for layer in art.model.layers if isinstance(layer.ffn, MoE))
        assert residency["host"] and residency["slots"] >= top_k
        assert memory["total"] <= budget == memory["budget"]
        assert memory["lines"]["expert_cache"] == residency["slots"] * residency["slot_bytes"]
        pages = expert_pages(art)
        host = [tuple(key) for key in residency["host"]]
        assert residency["slot_bytes"] == max(pages[key][1] for key in host)
        assert residency["resident_experts"] + len(host) == len(pages)
        # Least routed first: the calibration counts never rise along the host list, and no resident
        # expert was routed fewer tokens than a host-resident one.
        counts = art.section("precision_plan")["calibration"]["expert_tokens"]
        routed = [counts[f"layers.{layer}"][e] for layer, e in host]
        assert routed == sorted(routed)
        resident = [counts[f"layers.{layer}"][e] for layer, e in pages if (layer, e) not in set(host)]
        assert min(resident) >= max(routed)
        # The runtime's --vram check counts the slots in place of the host-resident experts.
        on_device = sum(art.tensor_entry(n).size for n in art.tensor_names()
                        if (art.tensor_entry(n).layer, art.tensor_entry(n).expert) not in set(host))
        assert device_weight_bytes(art) == on_device + residency["slots"] * residency["slot_bytes"]
        assert memory["lines"]["weights"] == on_device
    text = render_description(describe(tight))
    assert f"{residency['resident_experts']} routed experts resident, {len(host)} in host memory" in text
    assert f"streamed through {residency['slots']} GPU slots" in text


def test_streamed_experts_give_the_numbers_of_resident_ones(compiled):
    _, roomy, tight, _ = compiled
    resident, streamed = load(roomy), load(tight)
    cache = streamed.executor.expert_cache
    assert cache is not None and "experts streamed" in streamed.describe_implementations()
    ids = [1, 5, 7, 9, 3, 2, 11, 4, 8, 6]
    assert torch.equal(resident.forward(ids), streamed.forward(ids))
    assert cache.transfers > 0 and cache.transfer_bytes > 0
    want = list(resident.generate(ids, max_new_tokens=10))
    assert list(streamed.generate(ids, max_new_tokens=10)) == want
    stats = streamed.last_stats
    assert stats.expert_transfers is not None and stats.expert_transfers <= cache.transfers
    assert "expert transfers/token" in stats.summary()
    assert resident.last_stats.expert_transfers is None and "transfers" not in resident.last_stats.summary()


def test_thin_exec_reports_transfers_per_token(compiled):
    _, _, tight, _ = compiled
    result = CliRunner().invoke(cli.app, [str(tight), "--raw", "--prompt", "def f", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert re.search(r"decode: 4 tokens, [0-9.]+ tok/s, [0-9.]+ expert transfers/token", result.stderr), result.stderr


def test_bench_measures_a_streamed_model_on_the_executor(compiled, monkeypatch):
    """thin-exec bench's path for streamed experts, with the CUDA-only measurements stubbed (host and
    device are the CPU here): transfers per token from the cache, the slots, the render's row."""
    from thin.runtime import bench

    _, _, tight, _ = compiled
    model = load(tight)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e9)
    for name, value in (("reset_peak_memory_stats", None), ("max_memory_allocated", 0), ("get_device_name", "cpu")):
        monkeypatch.setattr(torch.cuda, name, lambda *args, value=value: value)
    with pytest.raises(bench.BenchCheckError, match="--profile"):
        bench.run(model, prompt_len=8, new_tokens=6, runs=2, profile=True)
    before = model.executor.expert_cache.transfers
    result = bench.run(model, prompt_len=8, new_tokens=6, runs=2)
    assert result.expert_slots == model.executor.expert_cache.slots and result.graph is False
    reads = sum(layer.ffn.top_k for layer in model.ir.layers if isinstance(layer.ffn, MoE))  # experts a token reads
    assert 0 < result.expert_transfers_per_token <= reads
    assert model.executor.expert_cache.transfers > before
    assert "transfers per token from host memory" in result.render()


def test_the_cache_counts_transfers_and_evicts_the_least_recently_used(compiled):
    _, roomy, _, _ = compiled
    with open_artifact(roomy) as art:
        layer = next(layer.index for layer in art.model.layers if isinstance(layer.ffn, MoE))
        host = frozenset((layer, e) for e in range(4))
        pages = HostPages(art, host, CPU)
        built = []

        def build(layer, expert, get_raw):
            names = sorted(pages.tensors[(layer, expert)])
            # The slot holds exactly the expert's bytes as the artifact stores them.
            assert all(torch.equal(get_raw(n), torch.frombuffer(art.buffer(n), dtype=torch.uint8)) for n in names)
            built.append(expert)
            return f"plan {expert}"

        cache = ExpertCache(pages, 2, CPU, build)
        resident = [None] * 4 + ["plan resident"] * 4

        def ask(*experts):
            before = cache.transfers
            got = list(cache.experts(layer, list(experts), resident))
            assert got == [(e, resident[e] or f"plan {e}") for e in experts]
            return cache.transfers - before

        assert ask(0, 1) == 2
        assert ask(1, 0, 5) == 0  # hits, and a resident expert never touches the cache
        assert ask(2) == 1  # evicts 1, the least recently used
        assert ask(0) == 0
        assert ask(1) == 1  # 1 was evicted; now 2 goes
        assert ask(2, 3, 0) == 3  # three host experts, two slots: in two runs, in order
        assert built == [0, 1, 2, 1, 2, 3, 0]
        assert cache.transfer_bytes == sum(pages.sizes[(layer, e)] for e in built)
        assert cache.lookups == 2 + 2 + 1 + 1 + 1 + 3


def test_an_executor_with_one_slot_matches_the_resident_one(compiled):
    """Every expert of every layer but expert 0 streamed through a single slot: prefill (many experts per
    layer, taken one run at a time) and decode give the resident executor's logits exactly."""
    _, roomy, _, _ = compiled
    with open_artifact(roomy) as art:
        model = art.model
        host = frozenset((layer.index, e) for layer in model.layers if isinstance(layer.ffn, MoE)
                         for e in range(1, len(layer.ffn.experts)))
        reference = Executor(model, _raw_getter(art))
        streamed = Executor(model, _raw_getter(art), host_experts=HostPages(art, host, CPU), expert_slots=1)
        ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
        caches = reference.new_cache(16), streamed.new_cache(16)
        assert torch.equal(reference.forward(ids, caches[0]), streamed.forward(ids, caches[1]))
        for token in (7, 2, 8):
            step = torch.tensor([token])
            assert torch.equal(reference.forward(step, caches[0]), streamed.forward(step, caches[1]))
        assert streamed.expert_cache.transfers >= 3


def test_a_budget_below_the_smallest_cache_names_the_one_that_works(compiled, tmp_path):
    ckpt, roomy, _, _ = compiled
    with open_artifact(roomy) as art:
        largest = max(length for _, length in expert_pages(art).values())
        too_small = art.section("memory")["total"] - _expert_bytes(art) + largest
    with pytest.raises(PassError, match="cannot stream experts") as error:
        compile_model(ckpt, tmp_path / "small.thin", vram=too_small, **OPTIONS)
    need = int(re.search(r"smallest budget that streams is --vram (\d+)", str(error.value)).group(1))
    assert need > too_small
    with open_artifact(compile_model(ckpt, tmp_path / "least.thin", vram=need, **OPTIONS)) as art:
        residency = art.section("memory")["residency"]
        assert residency["resident_experts"] == 0 and residency["slots"] == 2
        assert art.section("memory")["total"] <= need


def test_stream_experts_needs_a_vram_budget():
    with pytest.raises(CompileOptionError, match="--stream-experts needs --vram"):
        compile_model("unused", "unused.thin", stream_experts=True, bpw=4)


def test_a_residency_plan_without_slots_is_refused():
    memory = {"lines": {"weights": 1}, "total": 1, "ctx": 1, "budget": None,
              "residency": {"host": [[0, 1]], "slots": 0, "slot_bytes": 0, "host_bytes": 9, "resident_experts": 1,
                            "policy": "least recently used", "ranked_by": "calibration routing counts"}}
    with pytest.raises(ArtifactWriteError, match="no GPU slots"):
        encode_sections({"memory": memory})
    memory["residency"].update(slots=2, slot_bytes=4096)
    with pytest.raises(ArtifactWriteError, match="more GPU slots than experts"):
        encode_sections({"memory": memory})
    memory["residency"]["host"] = [[0, "1"]]
    with pytest.raises(ArtifactWriteError, match="host has the wrong type"):
        encode_sections({"memory": memory})


@pytest.mark.gpu
def test_streamed_experts_on_cuda_give_the_resident_numbers(compiled):
    """On CUDA: pages pinned, slots on the device, copies on a side stream; the logits and greedy tokens
    of the resident executor (same LinearOps, same kernels) exactly."""
    from thin.runtime.generate import generate
    from thin.runtime.sampling import GenerationOptions

    _, roomy, tight, _ = compiled
    resident, streamed = load(roomy, device="cuda"), load(tight, device="cuda")
    cache = streamed.executor.expert_cache
    assert streamed.engine is None and cache.buffers[0].is_cuda
    assert all(page.is_pinned() for page in cache.pages.bytes.values())
    ids = [1, 5, 7, 9, 3, 2, 11, 4, 8, 6]
    assert torch.equal(resident.forward(ids), streamed.forward(ids))
    options = GenerationOptions(max_new_tokens=12, stop_token_ids=())
    want = list(generate(resident.executor, ids, options))
    assert list(streamed.generate(ids, max_new_tokens=12, stop_token_ids=())) == want
    assert streamed.last_stats.expert_transfers > 0
