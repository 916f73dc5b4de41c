"""Where a peak falls and what is alive there, from the one cost model (`costmodel.live_at`).

`explain_peak` names the node running at a schedule's predicted peak (and the module path its
name carries: exporters name nodes after the module that made them, `/layer1/layer1.0/conv2/Conv`
-> `layer1.0.conv2`), the bytes alive there by kind (`report.PEAK_KINDS`: they add up to the
peak) and the largest buffers with their producers. `explain_floor` does the same for the least
peak the search can reach (`search.plan.peak_floor_bytes`: what no plan's recomputation
shortens) and says what bounds it in words a user can act on.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .costgraph import FORWARD, CostGraph
from .costmodel import Step, liveness, live_at, priority_order, simulate
from .report import PEAK_KINDS, LiveTensor, PeakExplained, PeakFloor, PeaksExplained
from .search.plan import floor_schedule_and_sizes

LARGEST = 5          # the largest buffers named at a peak
MIB = 1 << 20


def module_path(node_name: str) -> str | None:
    """The module path an exporter's node name carries: its components but the last (the op),
    each dropped where the next extends it (`layer1` before `layer1.0`), joined by dots."""
    parts = [p for p in node_name.split("/") if p]
    if len(parts) < 2:
        return None
    parts = parts[:-1]
    kept = [p for i, p in enumerate(parts) if not (i + 1 < len(parts) and parts[i + 1].startswith(p + "."))]
    return ".".join(kept) or None


def _held_kind(graph: CostGraph, copy: int, output: bool, unread: bool, producer: str) -> str:
    """The kind of a buffer held after the step that made it (`report.PEAK_KINDS`; while that step
    runs, it is "running")."""
    if copy > 0:
        return "recomputed"
    if output:
        return "outputs"
    if unread:               # kept to the end though no output: nothing reads it
        return "unread"
    return "activations" if graph.phase(producer) == FORWARD else "backward"


def _kind(graph: CostGraph, buffer, step: int) -> str:
    if buffer.born == step:
        return "running"
    return _held_kind(graph, buffer.copy, buffer.output, buffer.last_read == buffer.born, buffer.producer)


def _at(graph: CostGraph, schedule: list[Step], step: int, sizes=None) -> tuple[dict[str, int], list[LiveTensor]]:
    buffers, workspace = live_at(graph, schedule, step, sizes)
    by_kind = dict.fromkeys(PEAK_KINDS, 0)
    by_kind["running"] += workspace
    largest = []
    for buffer in buffers:
        kind = _kind(graph, buffer, step)
        by_kind[kind] += buffer.bytes
        if len(largest) < LARGEST and buffer.bytes > 0:
            largest.append(LiveTensor(buffer.tensor, buffer.bytes, kind, buffer.producer,
                                      module_path(buffer.producer)))
    return by_kind, largest


def explain_peak(graph: CostGraph, executed: list[Step]) -> PeakExplained:
    """The predicted peak of running `executed` (the order the runtime runs: each step once)."""
    simulation = simulate(graph, executed)
    step = simulation.peak_step
    by_kind, largest = _at(graph, executed, step)
    node = executed[step][0] if executed else ""
    op = graph.ops[node] if node else None
    return PeakExplained(peak_bytes=simulation.peak_bytes, step=step, steps=len(executed), node=node,
                         op_type=op.op_type if op else "", module=module_path(node), bytes_by_kind=by_kind,
                         largest=largest)


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def _advice(graph: CostGraph, kind: str, by_kind: dict[str, int], floor: int, largest: list[LiveTensor]) -> str:
    share = f"{_mib(by_kind[kind])} of {_mib(floor)}"
    if kind == "outputs":
        if graph.bound:
            return (f"the parameters and state the step writes back: {share}; they are the step's own "
                    "result, no plan can lower them")
        return (f"the gradients (and other outputs) the graph returns: {share}, held to the end of the step; "
                "fuse the optimizer step with `graphopt train-graph --optimizer` to free each gradient as it is used")
    if kind == "backward":
        summed = [t for t in largest if t.kind == "backward"
                  and any(graph.ops[r].op_type == "Sum" and len(graph.ops[r].inputs) > 2
                          for r in graph.readers(t.name))]
        if summed:
            return (f"the backward's own tensors: {share}, among them contributions to one gradient held until "
                    f"one Sum adds them at the end (e.g. {summed[0].name}, {_mib(summed[0].bytes)}); added as "
                    "each is produced, they would not be held together")
        own = [t for t in largest if t.kind == "backward"]
        name = f" (the largest: {own[0].name}, {_mib(own[0].bytes)}, from {own[0].producer})" if own else ""
        return f"the backward's own tensors, which no recomputation shortens: {share}{name}"
    if kind == "activations":
        return (f"forward tensors no plan can recompute (random ops, ops with subgraphs, inputs an op "
                f"overwrites): {share}")
    if kind == "unread":
        return f"outputs nothing reads, which ONNX Runtime keeps to the end of the step: {share}"
    return f"one node's own buffers (its inputs, outputs and work buffer): {share}"


def explain_floor(graph: CostGraph) -> PeakFloor:
    """The least peak the search can reach and what bounds it (module docstring)."""
    schedule, sizes = floor_schedule_and_sizes(graph)
    executed = priority_order(graph, schedule)
    simulation = simulate(graph, executed, sizes)
    by_kind, largest = _at(graph, executed, simulation.peak_step, sizes)
    # the running node's buffers belong to what they are (its outputs: backward or outputs)
    ranked = {k: v for k, v in by_kind.items() if k != "running"}
    bound_by = max(ranked, key=ranked.get) if any(ranked.values()) else "running"
    if by_kind["running"] > ranked.get(bound_by, 0):
        bound_by = "running"
    return PeakFloor(floor_bytes=simulation.peak_bytes, bound_by=bound_by, bytes_by_kind=by_kind,
                     advice=_advice(graph, bound_by, by_kind, simulation.peak_bytes, largest))


def explain_peaks(graph: CostGraph, original_order: list[str], base_graphs=()) -> PeaksExplained:
    """The original's peak in the order ONNX Runtime ran it (`original_order`, the annotation's
    execution order), and the floor: the least of `graph`'s and `base_graphs`'s (the same graph in
    each order plans start from); the returned model's is added once it is known."""
    executed = [(name, 0) for name in original_order if name in graph]
    floors = [explain_floor(g) for g in [graph, *base_graphs]]
    return PeaksExplained(original=explain_peak(graph, executed), floor=min(floors, key=lambda f: f.floor_bytes))


@dataclass
class Timeline:
    """Bytes alive while each step of a schedule runs, by kind (`report.PEAK_KINDS`), and which
    steps are recomputations: what `plot.plot_timeline` draws."""
    by_kind: dict[str, np.ndarray]      # kind -> bytes per step (int64)
    recomputed: np.ndarray              # bool per step: a copy >= 1 runs there
    peak_bytes: int
    peak_step: int

    @property
    def total(self) -> np.ndarray:
        return sum(self.by_kind.values())


def timeline(graph: CostGraph, executed: list[Step]) -> Timeline:
    """The predicted bytes alive at every step of `executed`, by kind; their sum at each step is
    what `simulate` counts there."""
    n = len(executed)
    live = liveness(graph, executed)
    by_kind = {kind: np.zeros(n + 1, dtype=np.int64) for kind in PEAK_KINDS}
    end = np.where(live.storage_freed, live.storage_last, n - 1)
    for k in np.flatnonzero(live.storage_allocated):
        born, size = int(live.storage_born[k]), int(live.storage_bytes[k])
        kind = _held_kind(graph, int(live.copies[born]), bool(live.storage_output[k]),
                          int(live.storage_last[k]) == born, executed[born][0])
        by_kind["running"][born] += size
        by_kind["running"][born + 1] -= size
        by_kind[kind][born + 1] += size
        by_kind[kind][int(end[k]) + 1] -= size
    series = {kind: np.cumsum(values)[:n] for kind, values in by_kind.items()}
    series["running"] = series["running"] + graph.op_workspace_bytes[live.ops]
    total = sum(series.values())
    step = int(np.argmax(total)) if n else 0
    return Timeline(series, live.copies > 0, int(total[step]) if n else 0, step)
