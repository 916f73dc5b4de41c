"""A plan (checkpoints + schedule) and the schedule that a checkpoint set implies.

Given checkpoints C, the schedule runs the ops in the graph's base order (`CostGraph.order`:
the forward ops, then the backward ops, or an order ONNX Runtime ran, where the two may
interleave), backward ops that only add memory sunk to their first reader (`sunk_order`);
right before a backward op that reads a forward tensor which is neither resident, a
checkpoint, already recomputed, nor still read by a later forward op, it recomputes that
tensor from what is available (the same, and resident tensors), the recomputed ops in
forward order. A recomputed tensor stays until its last reader, so no op is recomputed twice:
the overhead is at most one extra forward pass. Imports no ONNX.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import bisect
import weakref
from collections import OrderedDict

from ..costgraph import FORWARD, CostGraph
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
_SUNK: "weakref.WeakKeyDictionary[CostGraph, tuple[str, ...]]" = weakref.WeakKeyDictionary()
_SCHEDULE_FACTS: "weakref.WeakKeyDictionary[CostGraph, _ScheduleFacts]" = weakref.WeakKeyDictionary()
_EVALUATED: "weakref.WeakKeyDictionary[CostGraph, OrderedDict]" = weakref.WeakKeyDictionary()
EVALUATIONS_REMEMBERED = 32
_PEAK_FLOOR: "weakref.WeakKeyDictionary[CostGraph, int]" = weakref.WeakKeyDictionary()


def sunk_order(graph: CostGraph) -> tuple[str, ...]:
    """The graph's base order (`CostGraph.order`) with each backward op that only adds memory
    moved to right before its first reader (as late as possible): an op whose inputs are
    resident, computed from resident tensors only (e.g. the split and transpose of a weight for
    a gradient MatMul, which move with it) or still read by a later op holds its output from
    where the training graph puts it (often the start of the backward pass) to its reader;
    moved, it holds it only there, and it extends no input's life. Ops whose outputs nobody
    reads (gradients: graph outputs) stay; forward ops stay. Computed once per cost graph."""
    cached = _SUNK.get(graph)
    if cached is not None:
        return cached
    ops = graph.ops
    order = graph.order
    resident = graph.resident
    position = {op: i for i, op in enumerate(order)}
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(order):
        for t in ops[op].inputs:
            readers.setdefault(t, []).append(i)
    # backward ops computed from resident tensors only (a weight's Split, Transpose, Reshape, ...)
    derived: set[str] = set()
    for op in order:
        if graph.phase(op) != "forward" and all(t in resident or t in derived for t in ops[op].inputs):
            derived.update(ops[op].outputs)
    key: dict[str, tuple] = {}
    for i in range(len(order) - 1, -1, -1):
        op = order[i]
        key[op] = (i, 0)
        if ops[op].runs_first or graph.phase(op) == FORWARD:
            continue
        consumers = sorted({j for t in ops[op].outputs for j in readers.get(t, ()) if j > i})
        if not consumers:
            continue
        target = min(key[order[j]] for j in consumers)
        safe = all(t in resident or t in derived or any(j >= target[0] for j in readers.get(t, ()) if j != i)
                   for t in ops[op].inputs)
        if safe and target[0] > i:
            key[op] = (target[0], target[1] - 1)
    sunk = tuple(sorted(order, key=lambda op: (key[op], position[op])))
    _SUNK[graph] = sunk
    return sunk


def schedule_for(graph: CostGraph, checkpoints: set[str] | frozenset[str],
                 refresh_gap: int | None = None, max_steps: int | None = None) -> list[Step] | None:
    """The schedule implied by keeping `checkpoints` (see the module docstring).

    `refresh_gap`: a recomputed tensor whose next backward reader is more than this many
    backward ops away is dropped after its reader and recomputed again when needed (a copy
    2, 3, ...), instead of being held across the gap. None: each op is recomputed at most
    once (the tensor is held until its last reader).

    Tensors an op overwrites in place (`graph.clobbered`: a training-mode
    BatchNormalization's statistics inputs) are never kept: every run of that op, a
    recomputed clone included, reads a fresh copy (the checkpoints named are ignored).

    `max_steps`: None (no schedule) as soon as the schedule would be longer (a bound on the
    work of evaluating it: recomputing across every gap can make it many times the graph)."""
    facts = _schedule_facts(graph)
    inputs_of, outputs_of, clobbers_of = facts.inputs_of, facts.outputs_of, facts.clobbers_of
    position = graph.op_id.__getitem__
    producer = graph.forward_tensors
    forced = graph.forced_checkpoints
    available = (set(checkpoints) - graph.clobbered) | forced
    schedule: list[Step] = []
    copies: dict[str, int] = {}
    forward_reads = facts.forward_reads
    forward_last_read = facts.forward_last_read
    reads_at = facts.reads_at
    gap = refresh_gap
    recomputed: set[str] = set()
    for forward_steps, i, op, step, late_reads in facts.walk:
        if forward_steps:                       # the forward ops before this backward one
            schedule.extend(forward_steps)
            if op is None:
                continue
        # a forward tensor a later forward op still reads is alive anyway (the base order may
        # run backward ops before the forward pass is over): read as it is (`late_reads`: the
        # others)
        made: list[str] = []
        if late_reads and not available.issuperset(late_reads):
            stack = [t for t in late_reads if t not in available]
            # the forward ops that recompute what this op reads, from what is available
            todo: set[str] = set()
            while stack:
                t = stack.pop()
                if t in available or forward_last_read.get(t, -1) > i:
                    continue
                o = producer.get(t)
                if o is None or o in todo:
                    continue
                todo.add(o)
                stack.extend(inputs_of[o])
            for r in sorted(todo, key=position):
                copy = copies[r] = copies.get(r, 0) + 1
                schedule.append((r, copy))
                made.extend(outputs_of[r])
            available.update(made)
            recomputed.update(made)
            for r in todo & clobbers_of.keys():
                available.difference_update(t for t in clobbers_of[r] if t not in forced)
            if max_steps is not None and len(schedule) >= max_steps:   # (checked where it grew past the base order)
                return None
        schedule.append(step)
        if gap is not None and recomputed:
            # a recomputed tensor is dropped after step i when its next backward reader is more
            # than refresh_gap steps away (or there is none); that can only change at a step
            # that made or read it, so only those are looked at
            for t in made + [t for t in forward_reads[op] if t in recomputed]:
                if t not in recomputed:
                    continue
                reads = reads_at.get(t, ())
                k = bisect.bisect_right(reads, i)
                if k == len(reads) or reads[k] - i > gap:
                    recomputed.discard(t)
                    available.discard(t)
    if max_steps is not None and len(schedule) > max_steps:
        return None
    return schedule


@dataclass(frozen=True)
class _ScheduleFacts:
    """What `schedule_for` reads of a graph, as plain dicts (computed once per graph)."""
    inputs_of: dict[str, tuple[str, ...]]
    outputs_of: dict[str, tuple[str, ...]]
    clobbers_of: dict[str, tuple[str, ...]]      # only ops that clobber something
    forward_reads: dict[str, tuple[str, ...]]    # backward op -> the forward tensors it reads
    reads_at: dict[str, list[int]]               # forward tensor -> its backward readers' positions in the sunk order
    forward_last_read: dict[str, int]            # forward tensor -> its last forward reader's position there
    # the sunk order as `schedule_for` walks it: (the forward ops' steps (op, 0) since the last
    # backward op, then the backward op's position, name, step and the forward tensors it reads
    # that no later forward op reads), the last entry's op None when forward ops end the order.
    # Each step (op, 0) is one tuple shared by every schedule: solvers keep many plans, and a
    # tuple of its own per step made their schedules 8x larger
    walk: tuple[tuple[tuple[Step, ...], int, str | None, Step | None, tuple[str, ...]], ...]


def _schedule_facts(graph: CostGraph) -> _ScheduleFacts:
    cached = _SCHEDULE_FACTS.get(graph)
    if cached is None:
        producer = graph.forward_tensors
        forward_reads = {op: tuple(t for t in graph.ops[op].inputs if t in producer) for op in graph.backward_order}
        reads_at: dict[str, list[int]] = {}
        forward_last_read: dict[str, int] = {}
        for i, op in enumerate(sunk_order(graph)):
            if op in forward_reads:
                for t in forward_reads[op]:
                    reads_at.setdefault(t, []).append(i)
            else:
                for t in graph.ops[op].inputs:
                    forward_last_read[t] = i
        walk, pending = [], []
        for i, op in enumerate(sunk_order(graph)):
            if op not in forward_reads:
                pending.append((op, 0))
                continue
            late = tuple(t for t in forward_reads[op] if forward_last_read.get(t, -1) < i)
            walk.append((tuple(pending), i, op, (op, 0), late))
            pending = []
        if pending:
            walk.append((tuple(pending), -1, None, None, ()))
        cached = _ScheduleFacts(
            inputs_of={name: op.inputs for name, op in graph.ops.items()},
            outputs_of={name: op.outputs for name, op in graph.ops.items()},
            clobbers_of={name: op.clobbers for name, op in graph.ops.items() if op.clobbers},
            forward_reads=forward_reads, reads_at=reads_at, forward_last_read=forward_last_read,
            walk=tuple(walk))
        _SCHEDULE_FACTS[graph] = cached
    return cached


def peak_floor_bytes(graph: CostGraph) -> int:
    """A lower bound on every plan's cost-model peak: the peak of the buffers whose lifetime no
    plan shortens, on the store-all schedule (the sunk base order).

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
    schedule, zeroed = floor_schedule_and_sizes(graph)
    floor = simulate(graph, priority_order(graph, schedule), zeroed).peak_bytes
    _PEAK_FLOOR[graph] = floor
    return floor


def floor_schedule_and_sizes(graph: CostGraph):
    """What `peak_floor_bytes` simulates: store-all's schedule, and the tensor sizes (by id) with
    the candidate checkpoints' zeroed."""
    zeroed = graph.tensor_bytes_by_id.copy()
    zeroed[[graph.tensor_id[t] for t in graph.candidate_checkpoints]] = 0
    return schedule_for(graph, graph.candidate_checkpoints), zeroed


def make_plan(graph: CostGraph, strategy: str, checkpoints, refresh_gap: int | None = None,
              max_steps: int | None = None, **notes) -> Plan | None:
    """Plan for a checkpoint set, evaluated by the cost model on the runtime's order (None when
    its schedule is longer than `max_steps`)."""
    checkpoints = frozenset(checkpoints) - graph.clobbered
    # solvers evaluate the same sets again (store-all, Chen's plan, the best seed under each
    # schedule): the last few evaluations of each graph are remembered
    cache = _EVALUATED.get(graph)
    if cache is None:
        cache = _EVALUATED[graph] = OrderedDict()
    key = (checkpoints, refresh_gap)
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
        schedule, simulation = hit
        if max_steps is not None and len(schedule) > max_steps:
            return None
        plan = Plan(strategy, checkpoints, schedule, simulation, dict(notes))
        plan.refresh_gap = refresh_gap
        return plan
    schedule = schedule_for(graph, checkpoints, refresh_gap, max_steps)
    if schedule is None:
        return None
    executed = priority_order(graph, schedule, distinct_steps=True)   # (each step once, copies counted up)
    plan = Plan(strategy, checkpoints, schedule, simulate(graph, executed), dict(notes))
    cache[key] = (schedule, plan.simulation)
    if len(cache) > EVALUATIONS_REMEMBERED:
        cache.popitem(last=False)
    plan.refresh_gap = refresh_gap
    return plan
