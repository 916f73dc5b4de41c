"""The one cost model: peak bytes of a schedule from tensor liveness.

A schedule is a list of steps ``(op, copy)``: ``copy == 0`` is the op as it stands in the
training graph, ``copy >= 1`` its k-th recomputation. A step reads, for each input tensor,
the most recently produced version of it; the rewrite resolves names by the same rule
(`resolve_versions`), so the model and the rewritten ONNX graph cannot disagree.

Memory rules (those of ONNX Runtime's allocation planner, see shared/docs/ort-facts.md):
- graph inputs and initializers ("resident") exist before the step and are not counted;
- a buffer is allocated when its producer runs and freed after its last reader;
- graph outputs (copy 0 only) are kept to the end; an output nobody reads is never freed,
  unless the rewrite may drop it ("droppable": an unused optional output) — then it costs 0;
- an aliasing op (Reshape, Identity, ...) shares its input's buffer: the buffer is freed at
  the last read of any alias;
- an op ONNX Runtime folds at load (``folded``: a Constant node becomes an initializer) never
  runs: its outputs are resident, and the runtime's order (`priority_order`) leaves it out;
- a kernel's own work buffer (``workspace`` bytes: the column buffer of ConvTranspose, the
  im2col matrix of some Convs, the temporary of a Sum of 3+ inputs) lives while its step runs.
The peak is taken while a step runs: its inputs still live, its outputs and work buffer
allocated.

These rules are the allocation planner's with ``enable_mem_reuse`` OFF (the settings the
rewrite and the unoptimized baseline run with). With reuse on, ORT's planner
(allocation_planner.cc, FindReusableTensor) hands a dead buffer to the next output of the
same dtype and static shape, and the deallocation plan then frees it only after the last
reader of every value that shares it: a dead buffer stays allocated from its last read until
its reuser is dead, which is not modelled here. Measured on 1.32 (rewritten models, reuse on
vs off): unet 48.6 vs 20.2 MiB, densenet 96.9 vs 45.2 MiB, transformer 84.3 vs 39.5 MiB.
Not modelled either (it only lowers the real peak): in-place outputs of kernels registered
``MayInplace`` that take over an input's buffer at its last read.

The cost graph is `costgraph.CostGraph` (ops with inputs, outputs, measured seconds,
alias/recomputable/runs_first/folded flags and work-buffer bytes; tensor bytes; the resident,
kept and droppable tensors; the forward and backward orders). This module imports no ONNX.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from .costgraph import CostGraph

Step = tuple[str, int]


@dataclass
class Simulation:
    peak_bytes: int
    peak_step: int                 # index in the schedule where the peak occurs
    compute_seconds: float         # sum of the steps' measured seconds
    recompute_seconds: float       # seconds spent in copies >= 1
    live_bytes: list[int]          # bytes live while each step runs


@dataclass
class VersionedStep:
    op: str
    copy: int
    reads: list[tuple[str, int]]   # (tensor, version) per input, version -1 = resident/absent
    writes: list[tuple[str, int]]  # (tensor, version) per output


def resolve_versions(graph: CostGraph, schedule: list[Step]) -> list[VersionedStep]:
    """Which version of each tensor every step reads and writes (latest produced wins)."""
    ops = graph.ops
    latest: dict[str, int] = {}
    get = latest.get
    resolved = []
    for name, copy in schedule:
        op = ops[name]
        reads = [(t, get(t, -1)) for t in op.inputs]
        writes = []
        for t in op.outputs:
            writes.append((t, copy))
            latest[t] = copy
        resolved.append(VersionedStep(name, copy, reads, writes))
    return resolved


def check_schedule(graph: CostGraph, schedule: list[Step]) -> None:
    """Raise ValueError unless every non-resident input is produced before it is read."""
    resident = graph.resident
    ops = graph.ops
    produced: set[str] = set()
    for i, (name, copy) in enumerate(schedule):
        op = ops[name]
        for tensor in op.inputs:
            if tensor not in produced and tensor not in resident:
                raise ValueError(f"step {i} ({name}, copy {copy}) reads {tensor!r} before it exists")
        produced.update(op.outputs)


def simulate(graph: CostGraph, schedule: list[Step]) -> Simulation:
    """Peak live bytes of running `schedule` (see the module docstring for the rules)."""
    op_id = graph.op_id
    op_inputs, op_outputs = graph.op_input_ids, graph.op_output_ids
    of, tf = graph.op_facts, graph.tensor_facts
    op_seconds, op_workspace, op_alias, op_folded = of.seconds, of.workspace_bytes, of.alias, of.folded
    t_bytes, t_resident, t_kept, t_droppable = tf.nbytes, tf.resident, tf.kept, tf.droppable

    # storage of the latest version of each tensor (a read resolves to the latest version):
    # RESIDENT, or an index into the storage_* lists; aliases share their input's storage.
    # None: the tensor was never produced (resident or not yet available).
    # A storage was read iff its last use comes after its birth (a step's reads come before
    # its writes, and an alias extends its input's storage only at a step that reads it).
    RESIDENT = -1
    current: list[int | None] = [None] * len(t_bytes)
    storage_bytes: list[int] = []
    storage_born: list[int] = []
    storage_last: list[int] = []
    storage_kept: list[bool] = []
    storage_droppable: list[bool] = []
    step_workspace: list[int] = []
    compute = 0.0
    recompute = 0.0

    for i, (name, copy) in enumerate(schedule):
        k = op_id[name]
        inputs = op_inputs[k]
        for t in inputs:
            s = current[t]
            if s is not None and s >= 0:
                storage_last[s] = i
        step_workspace.append(op_workspace[k])
        seconds = op_seconds[k]
        compute += seconds
        if copy:
            recompute += seconds
        if op_folded[k]:                     # an initializer by the time the run starts
            for t in op_outputs[k]:
                current[t] = RESIDENT
            continue
        first_output = op_alias[k]
        for t in op_outputs[k]:
            if first_output:
                first_output = False
                # the storage of the version input 0 resolved to before this step's writes
                source = inputs[0]
                s = current[source]
                if s is None and t_resident[source]:
                    s = RESIDENT
                if s is not None:
                    current[t] = s
                    if s != RESIDENT and copy == 0 and t_kept[t]:
                        storage_kept[s] = True
                    continue
            current[t] = len(storage_bytes)
            storage_bytes.append(t_bytes[t])
            storage_born.append(i)
            storage_last.append(i)
            storage_kept.append(copy == 0 and t_kept[t])
            storage_droppable.append(t_droppable[t])

    n = len(schedule)
    allocated = [0] * n
    freed = [0] * n
    for s, nbytes in enumerate(storage_bytes):
        born, last = storage_born[s], storage_last[s]
        if last == born:                     # never read
            if not storage_droppable[s]:     # kept to the end (unless the rewrite drops it)
                allocated[born] += nbytes
            continue
        allocated[born] += nbytes
        if not storage_kept[s]:              # graph outputs are kept to the end
            freed[last] += nbytes

    live = 0
    peak = 0
    peak_step = 0
    live_bytes = []
    for i in range(n):
        live += allocated[i]
        running = live + step_workspace[i]
        live_bytes.append(running)
        if running > peak:
            peak, peak_step = running, i
        live -= freed[i]
    return Simulation(peak, peak_step, compute, recompute, live_bytes)


def priority_order(graph: CostGraph, schedule: list[Step]) -> list[Step]:
    """The order ONNX Runtime's PRIORITY_BASED execution runs a file written as `schedule`.

    Kahn's algorithm over the steps' data dependencies; among ready steps, ``runs_first``
    ops (Shape, Size) first, then the lowest position in the file. ``folded`` steps
    (Constant nodes: initializers once loaded) do not run and are left out.
    """
    ops = graph.ops
    schedule = [step for step in schedule if not ops[step[0]].folded]
    # Fast path. When no (tensor, version) is written twice (and no copy is negative), a read
    # depends on the step that last wrote the tensor BEFORE it, so the file order is a
    # topological order; Kahn's algorithm with "lowest position first" then returns the file
    # order itself, except that a runs_first step is hoisted to the moment it is ready
    # (and, ready together, runs_first steps go by position). Only the runs_first steps'
    # dependencies are tracked. Otherwise: the general rule, `_priority_order_general`.
    latest_step: dict[str, int] = {}
    first_copy: dict[str, int] = {}
    more_copies: dict[str, set[int]] = {}
    first_deps: dict[int, set[int]] = {}     # runs_first step -> steps it waits for
    for i, (name, copy) in enumerate(schedule):
        op = ops[name]
        if op.runs_first:
            first_deps[i] = {latest_step[t] for t in op.inputs if t in latest_step}
        for t in op.outputs:
            c0 = first_copy.get(t)
            if c0 is None:
                if copy < 0:
                    return _priority_order_general(ops, schedule)
                first_copy[t] = copy
            else:
                seen = more_copies.setdefault(t, set())
                if copy == c0 or copy in seen or copy < 0:
                    return _priority_order_general(ops, schedule)
                seen.add(copy)
            latest_step[t] = i
    if not first_deps:
        return schedule
    waiting: dict[int, int] = {}
    unblocks: dict[int, list[int]] = {}
    ready = []
    for r, deps in first_deps.items():
        waiting[r] = len(deps)
        if not deps:
            ready.append(r)
        for d in deps:
            unblocks.setdefault(d, []).append(r)
    heapq.heapify(ready)
    push, pop = heapq.heappush, heapq.heappop
    order = []

    def emit(i):
        order.append(schedule[i])
        for r in unblocks.get(i, ()):
            waiting[r] -= 1
            if waiting[r] == 0:
                push(ready, r)

    for j in range(len(schedule)):
        while ready:
            emit(pop(ready))
        if j not in first_deps:
            emit(j)
    while ready:
        emit(pop(ready))
    assert len(order) == len(schedule)
    return order


def _priority_order_general(ops, schedule: list[Step]) -> list[Step]:
    """`priority_order` by the letter: a read of version v of t depends on the LAST step of
    the schedule that writes (t, v) (which may come later, making a cycle)."""
    m = len(schedule)
    latest: dict[str, int] = {}
    latest_get = latest.get
    producer: dict[tuple[str, int], int] = {}
    step_reads = []
    first = [False] * m
    for i, (name, copy) in enumerate(schedule):
        op = ops[name]
        step_reads.append([(t, latest_get(t, -1)) for t in op.inputs])
        for t in op.outputs:
            latest[t] = copy
            producer[(t, copy)] = i
        if op.runs_first:
            first[i] = True
    producer_get = producer.get
    indegree = [0] * m
    consumers: list[list[int]] = [[] for _ in range(m)]
    for i, reads in enumerate(step_reads):
        if not reads:
            continue
        deps = {producer_get(r) for r in reads}
        deps.discard(None)
        indegree[i] = len(deps)
        for d in deps:
            consumers[d].append(i)
    return _kahn(schedule, first, indegree, consumers)


def _kahn(schedule: list[Step], first: list[bool], indegree: list[int],
          consumers: list[list[int]]) -> list[Step]:
    """Kahn's algorithm; among ready steps runs_first ones, then the lowest index."""
    m = len(schedule)
    # heap keys: runs_first steps before the others (key i - m < 0), then position in the file
    ready = [i - m if first[i] else i for i in range(m) if indegree[i] == 0]
    heapq.heapify(ready)
    order = []
    push, pop = heapq.heappush, heapq.heappop
    while ready:
        key = pop(ready)
        i = key + m if key < 0 else key
        order.append(schedule[i])
        for j in consumers[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                push(ready, j - m if first[j] else j)
    if len(order) != m:
        raise ValueError("schedule has a dependency cycle")
    return order
