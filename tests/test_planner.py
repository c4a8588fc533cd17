"""The planner: the knapsack solver, plan_precision on a hand-made score table, budgets and the ledger."""

from __future__ import annotations

import dataclasses
import itertools
import random
import types

import pytest

from thin.ir import MLP, Encoding, Linear, MoE, Program, Tensor, formats
from thin.passes import (
    BudgetError,
    PassContext,
    PlanOptions,
    ScoreOptions,
    check_budget,
    parse_size,
    plan_precision,
    solve,
)
from thin.passes.memory_ledger import kv_cache_bytes, ledger
from thin.passes.plan_precision import parameters, stored_bytes
from thin.passes.score_formats import candidates, plannable

from ir_fixtures import tiny_model


def _brute_force(items, budget):
    names = list(items)
    best = None
    for combo in itertools.product(*(range(len(items[n])) for n in names)):
        size = sum(items[n][i][0] for n, i in zip(names, combo))
        cost = sum(items[n][i][1] for n, i in zip(names, combo))
        if size <= budget and (best is None or cost < best):
            best = cost
    return best


def _cost(items, choice):
    return sum(items[n][i][1] for n, i in choice.items())


def _bytes(items, choice):
    return sum(items[n][i][0] for n, i in choice.items())


def test_solve_spends_bytes_where_they_buy_the_most_error():
    # Both tensors start at 1 byte; a has a large error that one more byte removes, b a small one.
    items = {"a": [(1, 10.0), (2, 1.0)], "b": [(1, 0.5), (2, 0.4)]}
    assert solve(items, 3) == {"a": 1, "b": 0}
    assert solve(items, 4) == {"a": 1, "b": 1}
    assert solve(items, 2) == {"a": 0, "b": 0}


def test_solve_meets_the_budget_and_nothing_cheaper_fits():
    rng = random.Random(0)
    for trial in range(200):
        items = {}
        for n in range(rng.randint(2, 4)):
            sizes = sorted(rng.sample(range(1, 40), 4))
            costs = sorted((rng.random() * 10 for _ in sizes), reverse=True)
            items[f"t{n}"] = list(zip(sizes, costs))
        smallest = sum(o[0][0] for o in items.values())
        budget = smallest + rng.randint(0, 60)
        choice = solve(items, budget)
        used = _bytes(items, choice)
        assert used <= budget
        # No single change to a better option still fits: the budget is spent.
        for n, i in choice.items():
            for j, (b, c) in enumerate(items[n]):
                if c < items[n][i][1]:
                    assert used - items[n][i][0] + b > budget, (trial, n, j)
        optimum = _brute_force(items, budget)
        assert _cost(items, choice) <= optimum + 1e-9, (trial, items, budget)


def test_solve_is_optimal_on_convex_tables():
    # Each option halves the error for one more byte: the greedy along the hulls is exact here.
    items = {f"t{k}": [(b, (k + 1) * 8.0 / 2**b) for b in range(1, 6)] for k in range(4)}
    for budget in range(4, 21):
        assert _cost(items, solve(items, budget)) == pytest.approx(_brute_force(items, budget))


def test_solve_refuses_a_budget_below_the_smallest_options():
    with pytest.raises(BudgetError, match="smallest formats need 5 bytes"):
        solve({"a": [(2, 1.0), (3, 0.0)], "b": [(3, 1.0)]}, 4)


def _scored(model, sensitivity, options: ScoreOptions | None = None):
    """A program whose scores say: error of a candidate = sensitivity x 2^-bits per weight."""
    records = model.tensor_map()
    tensors = {}
    for name in plannable(model):
        r = records[name]
        rows = []
        for enc in candidates(r, *(options or ScoreOptions()).allowed(r)):
            size = formats.nbytes(enc.format, r.shape, enc.params)
            bits = 8 * size / (r.shape[0] * r.shape[1])
            error = 0.0 if enc == r.encoding else 2.0 ** -bits
            rows.append([enc.format, [list(p) for p in enc.params], size, error, sensitivity(name) * error])
        tensors[name] = {"candidates": rows, "sensitivity": sensitivity(name)}
    return Program(model, {}, {"scores": {"tensors": tensors}})


def _ctx(score: ScoreOptions | None = None, **plan):
    config = types.SimpleNamespace(plan=PlanOptions(**plan), fuse_projections=True, score=score or ScoreOptions(),
                                   quantize=types.SimpleNamespace(method="gptq"))
    return PassContext(config=config)


def _moe_model(experts: int = 4, hidden: int = 64, inter: int = 64):
    """tiny_model with every layer's FFN a mixture of `experts` routed experts (top-2)."""
    base = tiny_model(num_layers=2, hidden=hidden, vocab=64, inter=inter)
    tensors = [t for t in base.tensors if not t.role.startswith("ffn.")]
    layers = []
    for layer in base.layers:
        def t(name, role, shape, e=None, i=layer.index):
            tensors.append(Tensor(name, role, i, shape, Encoding("f32"), "f32", expert=e))
            return Linear(name)

        p = f"layers.{layer.index}.moe."
        mlps = tuple(MLP("silu", down=t(f"{p}{e}.down.weight", "moe.expert.down", (hidden, inter), e),
                         gate=t(f"{p}{e}.gate.weight", "moe.expert.gate", (inter, hidden), e),
                         up=t(f"{p}{e}.up.weight", "moe.expert.up", (inter, hidden), e)) for e in range(experts))
        router = t(f"{p}router.weight", "moe.router", (experts, hidden))
        layers.append(dataclasses.replace(layer, ffn=MoE(experts, 2, router, mlps)))
    return dataclasses.replace(base, layers=tuple(layers), tensors=tuple(tensors))


def _bits(model, choice):
    r = model.tensor(choice[0])
    return 8 * formats.nbytes(choice[1].format, r.shape, choice[1].params) / (r.shape[0] * r.shape[1])


def test_plan_meets_bpw_exactly_and_gives_sensitive_tensors_more_bits():
    model = tiny_model(num_layers=2, hidden=64, vocab=64, inter=128)
    # Layer 0 is 100x more sensitive than layer 1.
    program = _scored(model, lambda name: 100.0 if name.startswith("layers.0.") else 1.0)
    for bpw in (2.5, 4.0, 5.5, 8.0):
        planned = plan_precision(program, _ctx(bpw=bpw))
        plan = planned.annotations["precision_plan"]
        enc = {n: Encoding(c["format"], tuple(tuple(p) for p in c["params"])) for n, c in plan["choices"].items()}
        total = stored_bytes(model, enc, True)
        assert total == plan["weight_bytes"] <= int(bpw * parameters(model) / 8)
        for role in ("attn.q", "attn.o", "ffn.down"):
            n0, n1 = f"layers.0.{role}.weight", f"layers.1.{role}.weight"
            assert _bits(model, (n0, enc[n0])) >= _bits(model, (n1, enc[n1])), (bpw, role)
        assert planned.annotations["memory"]["lines"]["weights"] == total


def test_plan_with_tied_fusion_gives_qkv_and_gate_up_one_format():
    model = tiny_model(num_layers=2, hidden=64, vocab=64, inter=128)
    program = _scored(model, lambda name: 1.0 + hash(name) % 7)
    plan = plan_precision(program, _ctx(bpw=4.5, tie_fused=True)).annotations["precision_plan"]["choices"]
    for i in range(2):
        p = f"layers.{i}."
        assert len({(plan[p + f"attn.{x}.weight"]["format"], str(plan[p + f"attn.{x}.weight"]["params"]))
                    for x in "qkv"}) == 1
        assert plan[p + "ffn.gate.weight"]["format"] == plan[p + "ffn.up.weight"]["format"]


def test_a_budget_below_the_smallest_model_fails_naming_the_smallest_that_works():
    model = tiny_model(num_layers=2, hidden=64, vocab=64, inter=128)
    program = _scored(model, lambda name: 1.0)
    with pytest.raises(BudgetError, match=r"smallest budget that works is --bpw (\d+\.\d+)") as e:
        check_budget(program, _ctx(bpw=0.5))
    smallest = float(e.value.args[0].split("--bpw ")[1].split()[0])
    planned = plan_precision(check_budget(program, _ctx(bpw=smallest)), _ctx(bpw=smallest))
    assert planned.annotations["precision_plan"]["bits_per_weight"] <= smallest
    with pytest.raises(BudgetError, match=r"--vram (\d+)M at --ctx 4096") as e:
        check_budget(program, _ctx(vram=10 * 2**20))
    need = int(e.value.args[0].split("--vram ")[1].split("M")[0]) * 2**20
    planned = plan_precision(check_budget(program, _ctx(vram=need)), _ctx(vram=need))
    assert planned.annotations["memory"]["total"] <= need


def test_vram_budget_counts_every_ledger_line():
    model = tiny_model(num_layers=2, hidden=64, vocab=64, inter=128)
    program = _scored(model, lambda name: 1.0)
    budget = 1 * 2**30
    planned = plan_precision(program, _ctx(vram=budget, ctx=2048))
    memory = planned.annotations["memory"]
    assert memory["total"] == sum(memory["lines"].values()) <= budget
    assert memory["budget"] == budget and memory["ctx"] == min(2048, model.max_position_embeddings)
    assert set(memory["lines"]) == {"weights", "kv_cache", "activations", "workspace", "cuda_context"}


def test_kv_cache_is_per_layer_and_a_sliding_window_bounds_it():
    import dataclasses

    model = tiny_model(num_layers=2, hidden=64, vocab=64, inter=128)
    per_token = 2 * 2 * (64 // 4) * 4  # k and v, 2 kv heads, head_dim 16, f32 source -> 4 bytes
    assert kv_cache_bytes(model, 100) == 2 * per_token * 100
    windowed = dataclasses.replace(model.layers[1], attention=dataclasses.replace(model.layers[1].attention,
                                                                                   sliding_window=8))
    model = dataclasses.replace(model, layers=(model.layers[0], windowed))
    assert kv_cache_bytes(model, 100) == per_token * 100 + per_token * 8
    # The context is capped at the model's positions (128 in the fixture).
    assert ledger(model, 0, ctx=10_000)["ctx"] == 128


@pytest.mark.parametrize("text,size", [("8G", 8 * 2**30), ("7.5GiB", int(7.5 * 2**30)), ("12000M", 12000 * 2**20),
                                       ("6GB", 6 * 2**30), ("512MiB", 512 * 2**20), ("1024", 1024)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "8X", "-1G", "G", "0M", "8 GiBs", "iB", "0.1", "1025T",
                                  "99999999999999999999T"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_expert_formats_confine_routed_experts_and_the_rest_takes_the_budget():
    """--expert-formats q2: every routed expert in a q2 variant (the hot expert at the finer groups),
    the rest of the model planned within what is left; a dense model refuses it."""
    model = _moe_model()
    score = ScoreOptions(expert_formats=("q2",))
    # Expert 0 of each layer is routed 8x as often as the others: its errors cost 8x as much.
    program = _scored(model, lambda name: 8.0 if ".moe.0." in name else 1.0, score)
    for bpw in (3.5, 4.5):
        ctx = _ctx(score, bpw=bpw)
        plan = plan_precision(check_budget(program, ctx), ctx).annotations["precision_plan"]
        assert plan["bits_per_weight"] <= bpw
        experts = {n: c for n, c in plan["choices"].items() if c["expert"] is not None}
        assert len(experts) == 2 * 4 * 3 and {c["format"] for c in experts.values()} == {"q2"}
        others = {c["format"] for c in plan["choices"].values() if c["expert"] is None}
        assert others - {"q2"}, "the rest of the model is not confined"
        expert_bits = 8 * sum(c["bytes"] for c in experts.values()) / sum(
            c["shape"][0] * c["shape"][1] for c in experts.values())
        assert plan["experts"]["tensors"] == len(experts)
        assert plan["experts"]["bits_per_weight"] == pytest.approx(expert_bits, abs=1e-4)
        assert expert_bits < bpw  # the q2 experts sit below the average the rest of the model raises
        hot = [c["bytes"] for n, c in experts.items() if ".moe.0." in n]
        cold = [c["bytes"] for n, c in experts.items() if ".moe.0." not in n]
        assert min(hot) >= max(cold)
    with pytest.raises(BudgetError, match="no routed experts|has none"):
        check_budget(_scored(tiny_model(num_layers=2, hidden=64, vocab=64, inter=128), lambda n: 1.0),
                     _ctx(score, bpw=4.0))
    with pytest.raises(ValueError, match="quantized formats"):
        ScoreOptions(expert_formats=("bf16",))


def test_each_routed_experts_gate_and_up_share_one_format():
    """The GPU's gate/up expert kernel reads one format for an expert's gate and up: they share it even
    when their sensitivities would pull them apart; down keeps its own (here finer) format."""
    model = _moe_model()
    # up 50x more sensitive than gate, down 50x too, expert 0 hotter.
    program = _scored(model, lambda name: (1.0 if ".gate." in name else 50.0) * (8.0 if ".moe.0." in name else 1.0))
    finer_down = 0
    for bpw in (3.0, 4.5, 6.0):
        plan = plan_precision(program, _ctx(bpw=bpw)).annotations["precision_plan"]
        assert plan["bits_per_weight"] <= bpw
        for layer in range(2):
            for e in range(4):
                p = f"layers.{layer}.moe.{e}."
                gate, up, down = (plan["choices"][p + f"{x}.weight"] for x in ("gate", "up", "down"))
                assert (gate["format"], gate["params"]) == (up["format"], up["params"]), (bpw, p)
                finer_down += down["bytes"] > up["bytes"]
    assert finer_down, "down never took more bits than gate/up: the test does not see the tie's scope"


def _expert_formats_per_slot(plan) -> dict:
    """{(layer, "gate_up" | "down"): {(format, params)}} of a plan's routed experts."""
    slots: dict = {}
    for c in plan["choices"].values():
        if c["expert"] is not None:
            kind = "down" if c["role"].endswith(".down") else "gate_up"
            slots.setdefault((c["layer"], kind), set()).add((c["format"], str(c["params"])))
    return slots


@pytest.mark.parametrize("cap", [1, 2])
def test_max_expert_formats_caps_each_layers_expert_launches_and_keeps_the_budget(cap):
    """--max-expert-formats N: at most N encodings among a layer's routed experts per projection (one GPU
    launch each), the plan solved again within the same budget, at a predicted error no better than the
    unconstrained plan's; the rest of the model is still planned. A dense model refuses it."""
    model = _moe_model(experts=6)
    # Experts routed unevenly (expert e's errors cost 2^e): unconstrained, a layer's experts spread over formats.
    program = _scored(model, lambda name: 2.0 ** int(name.split(".moe.")[1].split(".")[0])
                      if ".moe." in name and "router" not in name else 4.0)
    for bpw in (3.5, 5.0):
        free = plan_precision(program, _ctx(bpw=bpw)).annotations["precision_plan"]
        assert max(len(v) for v in _expert_formats_per_slot(free).values()) > cap, "nothing to cap here"
        capped = plan_precision(program, _ctx(bpw=bpw, max_expert_formats=cap)).annotations["precision_plan"]
        assert capped["max_expert_formats"] == cap
        assert max(len(v) for v in _expert_formats_per_slot(capped).values()) <= cap
        for plan in (free, capped):  # what `thinc plan` and the compile summary print
            slots = _expert_formats_per_slot(plan)
            assert plan["experts"]["most_formats_in_a_layer"] == max(len(v) for v in slots.values())
            assert plan["experts"]["launches_per_token"] == sum(len(v) for v in slots.values())
        assert capped["bits_per_weight"] <= bpw
        assert capped["predicted_kld"] >= free["predicted_kld"] - 1e-12
        # gate and up still share one format per expert
        for name, c in capped["choices"].items():
            if name.endswith(".gate.weight"):
                up = capped["choices"][name.replace(".gate.", ".up.")]
                assert (c["format"], c["params"]) == (up["format"], up["params"])
    with pytest.raises(BudgetError, match="has none"):
        check_budget(_scored(tiny_model(num_layers=2, hidden=64, vocab=64, inter=128), lambda n: 1.0),
                     _ctx(bpw=4.0, max_expert_formats=2))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(BudgetError, match="max-expert-formats"):
            PlanOptions(bpw=4.0, max_expert_formats=bad)
