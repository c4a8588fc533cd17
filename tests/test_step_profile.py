"""bench --profile's arithmetic on synthetic profiler events: replays split by graph launch, sections from
the eager step, durations and the idle gaps before each launch, per kernel name and per section."""

import json

import pytest

from thin.runtime.bench import BenchResult
from thin.runtime.step_profile import (
    DeviceOp,
    HostRange,
    ProfileError,
    StepProfile,
    eager_sections,
    label_sections,
    render,
    split_replays,
    summarize,
)

# One step: matvec (qkv) 0-10, attention 12-20, matvec (o) 25-30 (ns offsets, x1000 below = us).
STEP = [("matvec", 0, 10), ("attention", 12, 20), ("matvec", 25, 30)]
EAGER = [("matvec", "qkv"), ("attention", "attention"), ("matvec", "o")]


def replay(launch: int, at: int, step=STEP, stretch: int = 1) -> list[DeviceOp]:
    return [DeviceOp(name, (at + stretch * s) * 1000, (at + stretch * e) * 1000, launch) for name, s, e in step]


def test_replays_are_the_ops_of_each_graph_launch_in_time_order():
    first, second = replay(7, 0), replay(9, 100)
    copy = DeviceOp("Memcpy DtoH (Device -> Pinned)", 40_000, 41_000, 8)  # the token read back: its own launch
    fill = DeviceOp("fill", 99_000, 99_500, 3)
    ops = [*second[::-1], copy, fill, *first[::-1]]
    assert split_replays(ops, {9, 7}) == [first, second]
    # Without the host's launch calls: every id shared by more than one op.
    assert split_replays(ops) == [first, second]
    # Launch calls recorded, but no op carries their ids: the shared ids again.
    assert split_replays(ops, {42}) == [first, second]
    assert split_replays([copy, fill], set()) == []


def test_eager_ops_take_the_innermost_section_around_their_launch_call():
    ops = [DeviceOp("matvec", 5000, 6000, 11), DeviceOp("attention", 7000, 8000, 12),
           DeviceOp("copy", 9000, 9500, 13), DeviceOp("orphan", 9600, 9700, 14)]
    calls = [HostRange("cuLaunchKernelEx", 100, 110, 11), HostRange("cuLaunchKernelEx", 300, 310, 12),
             HostRange("cudaMemcpyAsync", 350, 360, 13)]
    sections = [HostRange("qkv", 50, 200), HostRange("attention", 250, 400), HostRange("inner", 340, 380)]
    assert eager_sections(ops[::-1], calls, sections) == [
        ("matvec", "qkv"), ("attention", "attention"), ("copy", "inner"), ("orphan", "?")]
    # A launch call missing from the trace: the section whose device-side span holds the op.
    spans = [HostRange("qkv", 5000, 6000), HostRange("attention", 6500, 9650), HostRange("late", 9650, 9800)]
    assert eager_sections(ops, calls[:1], sections, spans) == [
        ("matvec", "qkv"), ("attention", "attention"), ("copy", "attention"), ("orphan", "?")]


def test_durations_and_gaps_per_kernel_and_section():
    # Two replays, the second twice as slow; gaps before attention 2 (4) and before the o matvec 5 (10).
    p = summarize([replay(1, 0), replay(2, 1000, stretch=2)], EAGER, step_us=50.0)
    assert p.replays == 2 and p.attribution == "position" and p.launches == 3
    assert p.wall_us == pytest.approx((30 + 60) / 2)
    assert p.gap_us == pytest.approx((7 + 14) / 2)
    assert p.busy_us == p.kernel_us == pytest.approx((23 + 46) / 2)
    assert p.wall_us == pytest.approx(p.busy_us + p.gap_us)
    assert p.between_us == pytest.approx(1000 - 30)
    kernels = {r["kernel"]: r for r in p.kernels}
    assert kernels["matvec"]["calls"] == 2 and kernels["matvec"]["sections"] == ["o", "qkv"]
    assert kernels["matvec"]["us"] == pytest.approx((15 + 30) / 2)
    assert kernels["matvec"]["mean_us"] == pytest.approx(45 / 4)
    assert kernels["matvec"]["gap_us"] == pytest.approx((5 + 10) / 2)
    assert kernels["attention"]["gap_us"] == pytest.approx(3)
    sections = {r["section"]: r for r in p.sections}
    assert sections["qkv"]["us"] == pytest.approx(15) and sections["qkv"]["gap_us"] == 0
    assert sections["o"]["us"] == pytest.approx(7.5) and sections["o"]["gap_us"] == pytest.approx(7.5)
    assert sum(r["us"] + r["gap_us"] for r in p.sections) == pytest.approx(p.wall_us)
    assert sum(r["share"] for r in p.kernels) == pytest.approx(p.kernel_us / p.wall_us)
    # Launch by launch in step order: which boundary each gap sits at.
    assert p.timeline == [{"kernel": "matvec", "section": "qkv", "us": pytest.approx(15), "gap_us": 0},
                          {"kernel": "attention", "section": "attention", "us": pytest.approx(12),
                           "gap_us": pytest.approx(3)},
                          {"kernel": "matvec", "section": "o", "us": pytest.approx(7.5), "gap_us": pytest.approx(7.5)}]
    # Replays that ran different launches have no timeline.
    assert summarize([replay(1, 0), replay(2, 100, STEP[:2])], EAGER).timeline == []


def test_overlapping_launches_have_no_gap_and_count_busy_time_once():
    # A dependent launch starting before the previous kernel ends (PDL): its wait is in its duration.
    step = [("a", 0, 10), ("b", 5, 15), ("c", 14, 16), ("d", 20, 21)]
    p = summarize([replay(1, 0, step)], None)
    assert p.wall_us == pytest.approx(21) and p.busy_us == pytest.approx(17) and p.gap_us == pytest.approx(4)
    assert p.kernel_us == pytest.approx(23)
    assert {r["kernel"]: r["gap_us"] for r in p.kernels} == pytest.approx({"a": 0, "b": 0, "c": 0, "d": 4})
    assert p.attribution == "none" and p.between_us is None and {r["section"] for r in p.sections} == {"?"}


def test_sections_aligned_by_name_where_the_eager_step_launched_differently():
    p = summarize([replay(1, 0)], [*EAGER, ("memset", "sample")])  # an eager op the graph lacks
    assert p.attribution == "aligned" and [r["section"] for r in p.sections] == ["qkv", "attention", "o"]
    names = ["embed", "matvec", "gemm_b", "attention", "fill", "matvec", "gemm_b", "head"]
    eager = [("embed", "embed"), ("matvec", "qkv"), ("gemm_a", "qkv"), ("attention", "attention"), ("matvec", "o"),
             ("gemm_c", "o"), ("norm", "norm"), ("head", "lm head")]
    # gemm_b replaces gemm_a (qkv), then gemm_c and norm (o, norm); fill is the graph's own.
    assert label_sections(names, eager) == (
        ["embed", "qkv", "qkv", "attention", "?", "o", "norm/o", "lm head"], "aligned")
    assert label_sections(names, None) == (["?"] * 8, "none")
    assert label_sections(["a", "b"], [("a", "x"), ("b", "y")]) == (["x", "y"], "position")


def test_nothing_recorded_is_an_error_not_an_empty_table():
    with pytest.raises(ProfileError, match="no kernels"):
        summarize([], EAGER)


def test_bench_result_carries_the_profile_through_json_and_its_table():
    p = summarize([replay(1, 0), replay(2, 100)], EAGER, step_us=120.0)
    summary = {k: v for k, v in p.to_dict().items() if k not in ("kernels", "sections")}
    result = BenchResult(model="m.thin", device="H200", formats={"int4": 3}, prompt_tokens=8, new_tokens=4, runs=1,
                         prefill_tokens_per_second=1.0, decode_tokens_per_second=1.0, decode_min=1.0, decode_max=1.0,
                         bytes_per_token=1, bandwidth_bytes_per_second=1.0, roofline_tokens_per_second=1.0,
                         roofline_fraction=1.0, peak_vram_bytes=1, graph=True, kernels=p.kernels,
                         sections=p.sections, step_profile=summary)
    loaded = json.loads(json.dumps(result.to_dict()))
    assert [k["kernel"] for k in loaded["kernels"]] == ["matvec", "attention"]
    text = result.render()
    assert "CUDA graph replayed x2" in text and "measured step 120.0 us" in text
    assert render(StepProfile(**loaded["step_profile"], kernels=loaded["kernels"], sections=loaded["sections"])) \
        == text.splitlines()[-len(render(p)):]
    failed = BenchResult(**{**result.to_dict(), "kernels": [], "sections": [], "step_profile": None,
                            "profile_error": "torch.profiler recorded 0 device ops"})
    lines = failed.render().splitlines()
    assert lines[-1] == "profile        torch.profiler recorded 0 device ops" and "kernel" not in lines[-1]


def test_profiler_events_come_back_as_host_ranges_on_the_cpu():
    """The torch.profiler glue against the installed torch: a marked range is a section, CPU ops are not
    device ops, and a profile without a GPU has no device ops (so bench would say so in one line)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from thin.runtime.step_profile import _events

    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("qkv"):
        torch.ones(4).add_(1)
    ops, calls, ranges, spans = _events(prof, {"qkv"})
    assert ops == spans == [] and [r.name for r in ranges] == ["qkv"] and ranges[0].end_ns > ranges[0].start_ns
    assert all(c.name.startswith("cu") for c in calls)


class _FakeEvent:
    def __init__(self, name, device, start_us, end_us, id):
        from types import SimpleNamespace

        self.name, self.device_type, self.id = name, device, id
        self.time_range = SimpleNamespace(start=start_us, end=end_us)


def test_profile_step_wires_the_eager_marks_and_the_graph_launches(monkeypatch):
    """profile_step against a fake torch.profiler and engine: the eager step's marked sections label the
    replays, the first decode step (eager, capturing) is not a replay, the marks are undone."""
    import contextlib
    from types import SimpleNamespace

    import torch
    import torch.profiler
    from torch.autograd import DeviceType

    from thin.runtime.step_profile import profile_step

    events, clock, ids = [], [0.0], [100]

    def tick(us=1.0):
        clock[0] += us
        return clock[0]

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            events.clear()
            return self

        def __exit__(self, *exc):
            self.recorded = list(events)

        def events(self):
            return self.recorded

    class Mark:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            self.start = tick()

        def __exit__(self, *exc):
            events.append(_FakeEvent(self.name, DeviceType.CPU, self.start, tick(), 0))

    class Engine:
        use_graphs, device = True, "cpu"

        def __init__(self):
            self.pos, self.step = torch.zeros(1), torch.zeros(1)
            self._mark = lambda name: contextlib.nullcontext()

        def decode_one_token(self, cache, sampler):
            for section, kernel in (("qkv", "_matvec"), ("attention", "_attend"), ("o", "_matvec")):
                with self._mark(section):
                    ids[0] += 1
                    at = tick()
                    events.append(_FakeEvent("cuLaunchKernelEx", DeviceType.CPU, at, at + 0.5, ids[0]))
                    events.append(_FakeEvent(kernel, DeviceType.CUDA, 1e4 + at, 1e4 + at + 3, ids[0]))

        def decode_n_tokens(self, cache, n, sampler, graph):
            assert graph and cache.graphs == {}  # captured again inside the profile
            self.decode_one_token(cache, sampler)
            yield 0
            for i in range(n - 1):
                ids[0] += 1
                events.append(_FakeEvent("cudaGraphLaunch", DeviceType.CPU, tick(), tick(), ids[0]))
                for j, kernel in enumerate(("_matvec", "_attend", "_matvec")):
                    start = 2e4 + 100 * i + 10 * j
                    events.append(_FakeEvent(kernel, DeviceType.CUDA, start, start + 8, ids[0]))
                yield 0

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.profiler, "record_function", Mark)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    engine, cache = Engine(), SimpleNamespace(length=5, graphs={"old": None})
    p = profile_step(engine, cache, None, replays=3, step_us=120.0)
    assert p.replays == 3 and p.attribution == "position" and p.wall_us == pytest.approx(28)
    assert p.gap_us == pytest.approx(4) and p.between_us == pytest.approx(72)
    assert {r["section"]: r["us"] for r in p.sections} == pytest.approx({"qkv": 8, "attention": 8, "o": 8})
    assert isinstance(engine._mark("qkv"), contextlib.nullcontext) and engine.pos.item() == 5
