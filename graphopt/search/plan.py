"""A plan (checkpoints + schedule) and the schedule that a checkpoint set implies.

Given checkpoints C, the schedule runs the forward ops in order, then the backward ops in
order; right before a backward op that reads a forward tensor which is neither resident,
a checkpoint, nor already recomputed, it recomputes that tensor from what is available
(checkpoints, resident tensors, earlier recomputations), the recomputed ops in forward
order. A recomputed tensor stays until its last reader, so no op is recomputed twice:
the overhead is at most one extra forward pass. Imports no ONNX.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import bisect
import weakref

from ..costgraph import CostGraph
from ..costmodel import Simulation, Step, priority_order, simulate


@dataclass
class Plan:
    strategy: str
    checkpoints: frozenset[str]
    schedule: list[Step]                 # the order written to the file
    simulation: Simulation | None = None  # of the order the runtime will execute
    notes: dict = field(default_factory=dict)
    refresh_gap: int | None = None       # see schedule_for

    @property
    def peak_bytes(self) -> int:
        return self.simulation.peak_bytes

    @property
    def recompute_seconds(self) -> float:
        return self.simulation.recompute_seconds

    @property
    def exact(self) -> bool:
        """Optimal under its solver's model (the solver says so in ``notes["exact"]``)."""
        return bool(self.notes.get("exact", False))

    @property
    def recompute_ops(self) -> int:
        return sum(1 for _, copy in self.schedule if copy)


# facts a solver derives from a graph once (the graph itself never changes)
_SUNK_BACKWARD: "weakref.WeakKeyDictionary[CostGraph, tuple[str, ...]]" = weakref.WeakKeyDictionary()
_FORWARD_READS: "weakref.WeakKeyDictionary[CostGraph, dict]" = weakref.WeakKeyDictionary()
_PEAK_FLOOR: "weakref.WeakKeyDictionary[CostGraph, int]" = weakref.WeakKeyDictionary()


def sunk_backward_order(graph: CostGraph) -> tuple[str, ...]:
    """The backward order with each op that only adds memory moved to right before its first
    reader (as late as possible): an op whose inputs are resident, computed from resident
    tensors only (e.g. the split and transpose of a weight for a gradient MatMul, which move
    with it) or still read by a later op holds its output from where the
    training graph puts it (often the start of the backward pass) to its reader; moved, it holds
    it only there, and it extends no input's life. Ops whose outputs nobody in the backward
    reads (gradients: graph outputs) stay. Computed once per cost graph."""
    cached = _SUNK_BACKWARD.get(graph)
    if cached is not None:
        return cached
    ops = graph.ops
    order = graph.backward_order
    resident = graph.resident
    position = {op: i for i, op in enumerate(order)}
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(order):
        for t in ops[op].inputs:
            readers.setdefault(t, []).append(i)
    # ops computed from resident tensors only (a weight's Split, Transpose, Reshape, ...)
    derived: set[str] = set()
    for op in order:
        if all(t in resident or t in derived for t in ops[op].inputs):
            derived.update(ops[op].outputs)
    key: dict[str, tuple] = {}
    for i in range(len(order) - 1, -1, -1):
        op = order[i]
        consumers = sorted({j for t in ops[op].outputs for j in readers.get(t, ()) if j > i})
        key[op] = (i, 0)
        if not consumers or ops[op].runs_first:
            continue
        target = min(key[order[j]] for j in consumers)
        safe = all(t in resident or t in derived or any(j >= target[0] for j in readers.get(t, ()) if j != i)
                   for t in ops[op].inputs)
        if safe and target[0] > i:
            key[op] = (target[0], target[1] - 1)
    sunk = tuple(sorted(order, key=lambda op: (key[op], position[op])))
    _SUNK_BACKWARD[graph] = sunk
    return sunk


def schedule_for(graph: CostGraph, checkpoints: set[str] | frozenset[str],
                 refresh_gap: int | None = None) -> list[Step]:
    """The schedule implied by keeping `checkpoints` (see the module docstring).

    `refresh_gap`: a recomputed tensor whose next backward reader is more than this many
    backward ops away is dropped after its reader and recomputed again when needed (a copy
    2, 3, ...), instead of being held across the gap. None: each op is recomputed at most
    once (the tensor is held until its last reader).

    Tensors an op overwrites in place (`graph.clobbered`: a training-mode
    BatchNormalization's statistics inputs) are never kept: every run of that op, a
    recomputed clone included, reads a fresh copy (the checkpoints named are ignored)."""
    ops = graph.ops
    fwd_order = graph.forward_order
    position = graph.op_id
    producer = graph.forward_tensors
    clobbered = graph.clobbered
    forced = graph.forced_checkpoints
    available = (set(checkpoints) - clobbered) | forced
    schedule: list[Step] = [(op, 0) for op in fwd_order]
    copies: dict[str, int] = {}

    def missing_ops(tensor, into):
        stack = [tensor]
        while stack:
            t = stack.pop()
            if t in available or t not in producer:
                continue
            op = producer[t]
            if op in into:
                continue
            into.add(op)
            stack.extend(ops[op].inputs)

    backward = sunk_backward_order(graph)
    forward_reads = _forward_reads(graph)
    reads_at: dict[str, list[int]] = {}
    if refresh_gap is not None:
        for i, op in enumerate(backward):
            for t in forward_reads[op]:
                reads_at.setdefault(t, []).append(i)
    recomputed: set[str] = set()
    for i, op in enumerate(backward):
        todo: set[str] = set()
        for t in forward_reads[op]:
            if t not in available:
                missing_ops(t, todo)
        made: list[str] = []
        if todo:
            for r in sorted(todo, key=position.__getitem__):
                copies[r] = copies.get(r, 0) + 1
                schedule.append((r, copies[r]))
                made.extend(ops[r].outputs)
            available.update(made)
            recomputed.update(made)
            for r in todo:
                available.difference_update(t for t in ops[r].clobbers if t not in forced)
        schedule.append((op, 0))
        if refresh_gap is not None and recomputed:
            # a recomputed tensor is dropped after step i when its next backward reader is more
            # than refresh_gap steps away (or there is none); that can only change at a step
            # that made or read it, so only those are looked at
            for t in made + [t for t in forward_reads[op] if t in recomputed]:
                if t not in recomputed:
                    continue
                reads = reads_at.get(t, ())
                k = bisect.bisect_right(reads, i)
                if k == len(reads) or reads[k] - i > refresh_gap:
                    recomputed.discard(t)
                    available.discard(t)
    return schedule


def _forward_reads(graph: CostGraph) -> dict[str, tuple[str, ...]]:
    """Backward op -> the forward tensors it reads (computed once per graph)."""
    cached = _FORWARD_READS.get(graph)
    if cached is None:
        producer = graph.forward_tensors
        cached = {op: tuple(t for t in graph.ops[op].inputs if t in producer) for op in graph.backward_order}
        _FORWARD_READS[graph] = cached
    return cached


def peak_floor_bytes(graph: CostGraph) -> int:
    """A lower bound on every plan's cost-model peak: the peak of the buffers whose lifetime no
    plan shortens, on the store-all schedule (forward order, then the sunk backward order).

    Those buffers are everything but the candidate checkpoints (and their aliases): the
    backward's (gradients, graph outputs, kernel work buffers) and the forced forward ones.
    Every plan runs the same forward and backward steps in the same order, only with
    recomputation steps inserted, and a recomputation only makes a forced tensor live longer
    (it is read later); so at each step of store-all's schedule a plan holds at least these
    buffers. A plan at the floor cannot lower its peak: only its recomputation time is left to
    improve. Computed once per cost graph."""
    cached = _PEAK_FLOOR.get(graph)
    if cached is not None:
        return cached
    zeroed = graph.with_tensor_bytes({t: 0 for t in graph.candidate_checkpoints})
    schedule = schedule_for(zeroed, graph.candidate_checkpoints)
    floor = simulate(zeroed, priority_order(zeroed, schedule)).peak_bytes
    _PEAK_FLOOR[graph] = floor
    return floor


def make_plan(graph: CostGraph, strategy: str, checkpoints, refresh_gap: int | None = None, **notes) -> Plan:
    """Plan for a checkpoint set, evaluated by the cost model on the runtime's order."""
    checkpoints = frozenset(checkpoints) - graph.clobbered
    schedule = schedule_for(graph, checkpoints, refresh_gap)
    executed = priority_order(graph, schedule)
    plan = Plan(strategy, checkpoints, schedule, simulate(graph, executed), dict(notes))
    plan.refresh_gap = refresh_gap
    return plan
