"""Where a captured decode step's time goes: each kernel's time inside the CUDA graph's replays and
the idle gap before it, by kernel name and by section (qkv, attention, ...).

`thin-exec bench --profile` replays the captured step under torch.profiler (CUPTI reports every
kernel of a graph launch with device timestamps, all carrying the launch's correlation id) and
profiles one eager step with the engine's sections marked, which says which section launched each
kernel: the graph holds the same launches in the same order, so the eager step's sections map onto
the replays by position (aligned by kernel name where the two differ). Everything here but
`profile_step` is pure, so it is tested on synthetic events.
"""

from __future__ import annotations

import difflib
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field


class ProfileError(RuntimeError):
    """The profiler recorded nothing usable (no kernels of the graph replays)."""


@dataclass(frozen=True)
class DeviceOp:
    """A kernel, copy or fill the device ran; `launch` is the correlation id of the host call that
    launched it (every kernel of one graph launch carries the graph launch's)."""
    name: str
    start_ns: int
    end_ns: int
    launch: int


@dataclass(frozen=True)
class HostRange:
    """A host-side event: a marked section, or a launch call (correlation id `id`)."""
    name: str
    start_ns: int
    end_ns: int
    id: int = 0


def split_replays(ops: list[DeviceOp], graph_launches: set[int] | None = None) -> list[list[DeviceOp]]:
    """The device ops of each graph replay, replays in time order, each by start time. A replay is the
    ops sharing a correlation id in `graph_launches` (the host's graph-launch calls); where none does,
    every id that more than one op shares (a kernel launch or copy has one op to its id)."""
    groups: dict[int, list[DeviceOp]] = defaultdict(list)
    for op in ops:
        groups[op.launch].append(op)
    keep = [g for launch, g in groups.items() if launch in (graph_launches or ())]
    keep = keep or [g for g in groups.values() if len(g) > 1]
    replays = [sorted(g, key=lambda op: (op.start_ns, op.end_ns)) for g in keep]
    return sorted(replays, key=lambda r: r[0].start_ns)


def eager_sections(ops: list[DeviceOp], launches: list[HostRange], sections: list[HostRange],
                   spans: list[HostRange] = ()) -> list[tuple[str, str]]:
    """(kernel name, section) of each op of an eager step, in device order: the section is the
    innermost marked host range around the call that launched the op; where that call was not
    recorded, the innermost of the sections' device-side `spans` (first kernel's start to the last
    one's end) holding the whole op; else "?"."""
    launched_at = {call.id: call.start_ns for call in launches}
    out = []
    for op in sorted(ops, key=lambda op: (op.start_ns, op.end_ns)):
        at = launched_at.get(op.launch)
        if at is not None:
            around = [s for s in sections if s.start_ns <= at <= s.end_ns]
        else:
            around = [s for s in spans if s.start_ns <= op.start_ns and op.end_ns <= s.end_ns]
        out.append((op.name, max(around, key=lambda s: s.start_ns).name if around else "?"))
    return out


@dataclass
class StepProfile:
    replays: int
    launches: float  # device ops per step
    wall_us: float  # first op's start to the last one's end, mean over the replays
    busy_us: float  # time some op runs (wall = busy + gap)
    gap_us: float  # time no op runs, between the first op and the last
    kernel_us: float  # the ops' durations summed (above busy where ops overlap: a dependent launch waiting)
    between_us: float | None  # from one replay's last op to the next replay's first
    step_us: float | None  # the measured decode step (1 / decode tok/s)
    attribution: str  # how ops got sections: "position", "aligned" (label_sections) or "none"
    kernels: list[dict] = field(default_factory=list)
    sections: list[dict] = field(default_factory=list)
    # Each launch of the step in order (kernel, section, us, gap us before it; means over the replays), where
    # every replay ran the same launches: which boundary of a layer the idle gaps sit at.
    timeline: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def label_sections(names: list[str], eager: list[tuple[str, str]] | None) -> tuple[list[str], str]:
    """The section of each of a replay's ops (kernel `names`, in order) from the eager step's (name,
    section) list, and how: "position" where the two name lists are equal; else "aligned": matched by
    a diff of the names, a run of the replay's ops that replaces a run of the eager step's taking the
    sections of that run (joined by "/" if several), an op the eager step lacks taking the sections its
    name has there (or "?"); "none" without an eager step."""
    if eager is None:
        return ["?"] * len(names), "none"
    eager_names = [name for name, _ in eager]
    if names == eager_names:
        return [section for _, section in eager], "position"
    by_name: dict[str, set[str]] = defaultdict(set)
    for name, section in eager:
        by_name[name].add(section)
    labels: list[str] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, eager_names, names, autojunk=False).get_opcodes():
        if tag == "equal":
            labels += [section for _, section in eager[i1:i2]]
        elif tag == "replace":
            labels += ["/".join(sorted({section for _, section in eager[i1:i2]}))] * (j2 - j1)
        elif tag == "insert":
            labels += ["/".join(sorted(by_name[name])) or "?" for name in names[j1:j2]]
    return labels, "aligned"


def summarize(replays: list[list[DeviceOp]], eager: list[tuple[str, str]] | None = None,
              step_us: float | None = None) -> StepProfile:
    """Per kernel name and per section: launches, device time and the gap before each launch, per step
    (means over `replays`); `eager` is eager_sections' list of one step (None: sections unknown)."""
    if not replays:
        raise ProfileError("the profiler recorded no kernels of the CUDA graph's replays")
    kernels: dict[str, dict] = {}
    sections: dict[str, dict] = {}
    totals = defaultdict(float)
    used = set()
    same = len({tuple(op.name for op in replay) for replay in replays}) == 1
    timeline = [{"kernel": op.name, "section": "", "ns": 0, "gap_ns": 0} for op in replays[0]] if same else []
    for replay in replays:
        labels, how = label_sections([op.name for op in replay], eager)
        used.add(how)
        reach = replay[0].start_ns
        for i, (op, section) in enumerate(zip(replay, labels)):
            gap = max(0, op.start_ns - reach) if i else 0
            busy = max(0, op.end_ns - max(op.start_ns, reach))
            reach = max(reach, op.end_ns)
            if timeline:
                timeline[i]["section"] = section
                timeline[i]["ns"] += op.end_ns - op.start_ns
                timeline[i]["gap_ns"] += gap
            for table, key in ((kernels, op.name), (sections, section)):
                row = table.setdefault(key, {"calls": 0, "ns": 0, "gap_ns": 0, "sections": set()})
                row["calls"] += 1
                row["ns"] += op.end_ns - op.start_ns
                row["gap_ns"] += gap
                row["sections"].add(section)
            totals["busy"] += busy
            totals["gap"] += gap
            totals["kernel"] += op.end_ns - op.start_ns
        totals["wall"] += reach - replay[0].start_ns
    n = len(replays)
    wall = totals["wall"] / n / 1e3
    between = [b[0].start_ns - max(op.end_ns for op in a) for a, b in zip(replays, replays[1:])]

    def rows(table: dict, label: str) -> list[dict]:
        out = []
        for key, row in table.items():
            entry = {label: key, "calls": row["calls"] / n, "us": row["ns"] / n / 1e3,
                     "mean_us": row["ns"] / row["calls"] / 1e3, "gap_us": row["gap_ns"] / n / 1e3,
                     "share": row["ns"] / n / 1e3 / wall if wall else 0.0}
            if label == "kernel":
                entry["sections"] = sorted(row["sections"])
            out.append(entry)
        return sorted(out, key=lambda r: -(r["us"] + r["gap_us"]))

    return StepProfile(
        replays=n, launches=sum(map(len, replays)) / n, wall_us=wall, busy_us=totals["busy"] / n / 1e3,
        gap_us=totals["gap"] / n / 1e3, kernel_us=totals["kernel"] / n / 1e3,
        between_us=statistics.median(between) / 1e3 if between else None, step_us=step_us,
        attribution=min(used, key=["none", "aligned", "position"].index),
        kernels=rows(kernels, "kernel"), sections=rows(sections, "section"),
        timeline=[{"kernel": t["kernel"], "section": t["section"], "us": t["ns"] / n / 1e3,
                   "gap_us": t["gap_ns"] / n / 1e3} for t in timeline])


def render(p: StepProfile) -> list[str]:
    """The profile as text lines (thin-exec bench's table)."""
    lines = [f"decode step, CUDA graph replayed x{p.replays} under torch.profiler (device timestamps, means per step):",
             f"  replay {p.wall_us:.1f} us first start to last end = {p.busy_us:.1f} us busy + {p.gap_us:.1f} us idle "
             f"gaps; {p.launches:g} launches, their durations sum to {p.kernel_us:.1f} us"]
    if p.between_us is not None:
        lines.append(f"  {p.between_us:.1f} us from one replay's last end to the next one's first start")
    if p.step_us is not None:
        lines.append(f"  measured step {p.step_us:.1f} us (1 / decode tok/s)")
    if p.attribution != "position":
        lines.append("  sections " + ("unknown (no eager step)" if p.attribution == "none" else
                                      "aligned by kernel name: the eager step's launches differ from the graph's"))
    lines.append(f"  {'section':<26} {'calls':>6} {'us/step':>9} {'gap us':>8} {'share':>6}")
    for r in p.sections:
        lines.append(f"  {r['section'][:26]:<26} {r['calls']:>6g} {r['us']:>9.1f} {r['gap_us']:>8.1f} "
                     f"{100 * r['share']:>5.1f}%")
    lines.append(f"  {'kernel':<40} {'calls':>6} {'us/step':>9} {'us/call':>8} {'gap us':>8} {'share':>6}  sections")
    for r in p.kernels:
        lines.append(f"  {r['kernel'][:40]:<40} {r['calls']:>6g} {r['us']:>9.1f} {r['mean_us']:>8.2f} "
                     f"{r['gap_us']:>8.1f} {100 * r['share']:>5.1f}%  {', '.join(r['sections'])}")
    return lines


def profile_step(engine, cache, sampler, replays: int = 20, step_us: float | None = None) -> StepProfile:
    """Profile one eager decode step of `engine` with its sections marked, then `replays` replays of the
    step captured against `cache` for `sampler` (decode_n_tokens, as bench runs it). The step is captured
    again inside that profile (its first step runs eagerly and captures; those kernels are no graph
    launch's): a graph captured before CUPTI starts may replay without kernel records. Both decode
    right after the prompt again, so `cache` must hold positions for `replays` + 1 more tokens. Time
    nothing in the same process afterwards: graphs captured after the profiler has run can replay slower
    (on the H200 ~0.4 us before every launch; bench_ffn_levels profiles each level in its own process)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    if not engine.use_graphs:
        raise ProfileError("--profile breaks down the CUDA graph's replays; this engine decodes without one")
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    marked: set[str] = set()

    def mark(name: str):
        marked.add(name)
        return record_function(name)

    def restart() -> None:  # decode steps move only the device position: back to just after the prompt
        engine.pos.fill_(cache.length)
        engine.step.fill_(1)

    restart()
    unmarked, engine._mark = engine._mark, mark
    try:
        with profile(activities=activities) as prof:
            engine.decode_one_token(cache, sampler)
            torch.cuda.synchronize(engine.device)
    finally:
        engine._mark = unmarked
    ops, calls, ranges, spans = _events(prof, marked)
    eager = eager_sections(ops, calls, ranges, spans)
    restart()
    cache.graphs.clear()
    with profile(activities=activities) as prof:
        for _ in engine.decode_n_tokens(cache, replays + 1, sampler, graph=True):
            pass
        torch.cuda.synchronize(engine.device)
    ops, calls, _, _ = _events(prof, set())
    graph_launches = {call.id for call in calls if "GraphLaunch" in call.name}
    found = split_replays(ops, graph_launches)
    if not found:
        raise ProfileError(f"torch.profiler recorded {len(ops)} device ops and {len(graph_launches)} graph launches "
                           "but no kernel of a graph replay (no CUPTI?)")
    return summarize(found, eager or None, step_us)


def _events(prof, marked: set[str]) -> tuple[list[DeviceOp], list[HostRange], list[HostRange], list[HostRange]]:
    """torch.profiler's events as (device ops, host launch calls, host ranges of the `marked` sections,
    the sections' device-side spans)."""
    from torch.autograd import DeviceType

    ops, calls, ranges, spans = [], [], [], []
    for e in prof.events():
        start, end = round(e.time_range.start * 1e3), round(e.time_range.end * 1e3)  # us -> ns
        if e.device_type == DeviceType.CUDA:
            if e.name in marked or getattr(e, "is_user_annotation", False):  # not a kernel: a section's span
                spans.append(HostRange(e.name, start, end))
            else:
                ops.append(DeviceOp(e.name, start, end, e.id))
        elif e.name in marked:
            ranges.append(HostRange(e.name, start, end))
        elif e.name.startswith("cu"):  # runtime and driver calls: cudaLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch
            calls.append(HostRange(e.name, start, end, e.id))
    return ops, calls, ranges, spans
