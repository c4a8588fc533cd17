"""Experts beyond VRAM: host-resident experts, and a fixed set of device slots holding the hot ones.

An artifact compiled with `thinc compile --stream-experts` carries a residency plan in its memory
ledger (memory.residency, written by passes/plan_residency.py): which routed experts stay in host
memory and how many device slots cache them. The executor builds every other expert as usual; a
host-resident expert's page (its gate/up, down and biases: one contiguous byte range of the file,
see thin.artifacts.pages) stays in host memory, a view of the mapped artifact on the CPU and a
pinned copy on CUDA (so a copy to the device is a real asynchronous DMA). When a token routes to
it, `ExpertCache` copies the page into a free or least recently used slot (on a side stream on
CUDA, the compute stream waiting only for that copy) and builds the expert's LinearOps on the
slot's bytes, exactly as the executor builds a resident expert's: the numbers are the same.
Transfers and their bytes are counted, so the runtime reports them per token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .errors import RunError

# build(layer, expert, get_raw) -> the expert's MLPPlan, its tensors read through get_raw(name).
Builder = Callable[[int, int, Callable[[str], torch.Tensor]], object]


class ResidencyError(RunError, ValueError):
    """An artifact's residency plan that this runtime cannot follow."""


@dataclass(frozen=True)
class Residency:
    """The residency plan as the runtime follows it: the (layer, expert) pairs kept in host memory and
    the number of device slots that cache them."""

    host: frozenset[tuple[int, int]]
    slots: int

    @classmethod
    def from_artifact(cls, artifact) -> Residency | None:
        """The plan in the artifact's memory ledger, or None when every expert is resident."""
        memory = artifact.section("memory")
        plan = (memory or {}).get("residency")
        if not plan or not plan.get("host"):
            return None
        return cls(frozenset((int(layer), int(expert)) for layer, expert in plan["host"]), int(plan["slots"]))


class HostPages:
    """The bytes of each host-resident expert's page, and where each of its tensors lies in it."""

    def __init__(self, artifact, host: frozenset[tuple[int, int]], device: torch.device):
        from thin.artifacts.pages import expert_pages

        pages = expert_pages(artifact)
        missing = sorted(host - set(pages))
        if missing:
            raise ResidencyError(f"{artifact.path}: the residency plan names experts the file lacks "
                                 f"(layer, expert) {missing[:4]}")
        # {(layer, expert): {tensor name: (offset in the page, size)}}
        self.tensors: dict[tuple[int, int], dict[str, tuple[int, int]]] = {key: {} for key in host}
        for name in artifact.tensor_names():
            e = artifact.tensor_entry(name)
            key = (e.layer, e.expert)
            if e.expert is not None and key in self.tensors:
                self.tensors[key][name] = (e.offset - pages[key][0], e.size)
        self.sizes = {key: pages[key][1] for key in host}
        self.slot_bytes = max(self.sizes.values())
        views = {key: torch.frombuffer(artifact.span(*pages[key]), dtype=torch.uint8) for key in sorted(host)}
        if device.type == "cuda":
            # One pinned buffer for every host page: the copies to the device are then asynchronous DMA.
            # (Registering the file mapping itself would pin a private copy-on-write map of the file.)
            pinned = torch.empty(sum(self.sizes.values()), dtype=torch.uint8, pin_memory=True)
            at = 0
            for key, view in views.items():
                pinned[at:at + view.numel()].copy_(view)
                views[key] = pinned[at:at + view.numel()]
                at += view.numel()
        self.bytes = views

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())


class ExpertCache:
    """`slots` device buffers of `pages.slot_bytes` bytes, holding host-resident experts, least recently
    used evicted first. `build(layer, expert, get_raw)` makes an expert's MLPPlan from its bytes."""

    def __init__(self, pages: HostPages, slots: int, device: torch.device, build: Builder):
        if slots < 1:
            raise ResidencyError(f"an expert cache needs at least one slot, the plan gives {slots}")
        self.pages, self.slots, self.device, self._build = pages, slots, device, build
        self.buffers = [torch.empty(pages.slot_bytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self._where: OrderedDict[tuple[int, int], int] = OrderedDict()  # expert -> slot, least recent first
        self._plans: dict[int, object] = {}  # slot -> MLPPlan of the expert in it
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.transfers = 0  # pages copied into a slot
        self.transfer_bytes = 0
        self.lookups = 0  # host-resident experts a token asked for (hits + transfers)

    @property
    def slot_bytes(self) -> int:
        return self.pages.slot_bytes

    def counters(self) -> tuple[int, int]:
        """(transfers, bytes transferred) so far."""
        return self.transfers, self.transfer_bytes

    def experts(self, layer: int, wanted: list[int], resident: list) -> Iterator[tuple[int, object]]:
        """(expert, MLPPlan) for each expert of `layer` in `wanted`, in that order: resident[e] when the
        executor holds it, else from a slot. At most `slots` streamed experts are in use at once:
        `wanted` is taken in runs with at most that many distinct host-resident experts, each run's
        missing pages copied together before its first expert is handed out."""
        start = 0
        while start < len(wanted):
            stop, streamed = start, []
            while stop < len(wanted):
                e = wanted[stop]
                if resident[e] is None and e not in streamed:
                    if len(streamed) == self.slots:
                        break
                    streamed.append(e)
                stop += 1
            plans = self._fetch(layer, streamed)
            for e in wanted[start:stop]:
                yield e, (resident[e] if resident[e] is not None else plans[e])
            start = stop

    def _fetch(self, layer: int, experts: list[int]) -> dict[int, object]:
        """Every one of `experts` (at most `slots`) in a slot, copies issued together; their plans."""
        keys = [(layer, e) for e in experts]
        missing = [key for key in keys if key not in self._where]
        self.lookups += len(keys)
        for key in keys:
            if key in self._where:
                self._where.move_to_end(key)
        if missing:
            slots = []
            for key in missing:  # each slot taken at once, so the next key sees it used
                slots.append(self._free_slot(set(keys)))
                self._where[key] = slots[-1]
            self._copy(missing, slots)
            for key, slot in zip(missing, slots):
                self._plans[slot] = self._build(*key, self._getter(key, slot))
        return {key[1]: self._plans[self._where[key]] for key in keys}

    def _free_slot(self, keep: set) -> int:
        """A slot nobody holds, else the least recently used one outside `keep` (evicted)."""
        used = set(self._where.values())
        for slot in range(self.slots):
            if slot not in used:
                return slot
        victim = next(key for key in self._where if key not in keep)
        slot = self._where.pop(victim)
        del self._plans[slot]
        return slot

    def _copy(self, keys: list[tuple[int, int]], slots: list[int]) -> None:
        """Each page into its slot: on CUDA on the side stream, after the compute stream is done with the
        slots' old contents, and the compute stream waits for the copies; on the CPU a plain copy."""
        for key in keys:
            self.transfers += 1
            self.transfer_bytes += self.pages.sizes[key]
        if self._stream is None:
            for key, slot in zip(keys, slots):
                self.buffers[slot][:self.pages.sizes[key]].copy_(self.pages.bytes[key])
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            for key, slot in zip(keys, slots):
                self.buffers[slot][:self.pages.sizes[key]].copy_(self.pages.bytes[key], non_blocking=True)
        compute.wait_stream(self._stream)

    def _getter(self, key: tuple[int, int], slot: int) -> Callable[[str], torch.Tensor]:
        where, buffer = self.pages.tensors[key], self.buffers[slot]

        def get_raw(name: str) -> torch.Tensor:
            offset, size = where[name]
            return buffer[offset:offset + size]

        return get_raw

    def describe(self) -> str:
        """One line: what streams and how."""
        return (f"experts streamed: {len(self.pages.sizes)} in host memory "
                f"({self.pages.total_bytes / 2**20:.1f} MiB{', pinned' if self.device.type == 'cuda' else ''}), "
                f"{self.slots} device slots of {self.slot_bytes / 2**20:.2f} MiB (least recently used evicted)")


def device_weight_bytes(artifact) -> int | None:
    """Bytes of weights a model with streamed experts keeps on the device: every tensor but those of the
    host-resident experts, plus the slots; None when every expert is resident (all tensors are)."""
    from thin.artifacts.pages import expert_pages

    residency = Residency.from_artifact(artifact)
    if residency is None:
        return None
    pages = expert_pages(artifact)
    total = 0
    for name in artifact.tensor_names():
        e = artifact.tensor_entry(name)
        if (e.layer, e.expert) not in residency.host:
            total += e.size
    return total + residency.slots * max(pages[key][1] for key in residency.host)
