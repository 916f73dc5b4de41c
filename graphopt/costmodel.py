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
- an output written into a buffer the caller provides ("bound": the state a training step
  returns, bound with IOBinding by a trainer) costs 0 when its copy 0 is written: the
  buffer exists before the step, like a resident;
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
import operator
from dataclasses import dataclass

import numpy as np

from .costgraph import CostGraph

Step = tuple[str, int]


@dataclass
class Simulation:
    peak_bytes: int
    peak_step: int                 # index in the schedule where the peak occurs
    compute_seconds: float         # predicted step seconds: the steps' seconds, copies >= 1 times
                                   # the graph's recompute_factor
    recompute_seconds: float       # seconds spent in copies >= 1
    live_bytes: np.ndarray         # bytes live while each step runs (int64; an array, not a list:
                                   # solvers keep many plans, and a list costs 4x more per step)


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


def _gather(ptr: np.ndarray, flat: np.ndarray, ops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For steps running `ops`: (step, tensor, position in the op's list) of every entry of
    the CSR rows (`ptr`, `flat`) of those ops, in step order."""
    starts = ptr[ops]
    counts = ptr[ops + 1] - starts
    total = int(counts.sum())
    step = np.repeat(np.arange(len(ops), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts                 # where each step's entries begin
    position = np.arange(total, dtype=np.int64) - np.repeat(first, counts)
    return step, flat[np.repeat(starts, counts) + position], position


_NAME, _COPY = operator.itemgetter(0), operator.itemgetter(1)


@dataclass
class Liveness:
    """The buffers ("storages") a schedule allocates: per storage its bytes, the step that makes it,
    the step of its last read, and whether it is counted from then on (allocated) and freed after
    its last read (else kept to the end); the tensor and copy that made it; per step the bytes
    live while it runs (its work buffer included), and the bytes live after it, once it has
    freed what it read last (`resting`)."""
    ops: np.ndarray
    copies: np.ndarray
    storage_tensor: np.ndarray
    storage_bytes: np.ndarray
    storage_born: np.ndarray
    storage_last: np.ndarray
    storage_allocated: np.ndarray
    storage_freed: np.ndarray
    storage_output: np.ndarray
    running: np.ndarray
    resting: np.ndarray


def liveness(graph: CostGraph, schedule: list[Step], tensor_bytes_by_id: np.ndarray | None = None) -> Liveness:
    """Vectorized over the schedule's reads and writes: a read resolves to the latest write of its
    tensor at an earlier step (a step's reads come before its writes); every write makes a
    buffer ("storage"), except an aliasing op's output 0, which shares the storage its input 0
    resolved to (a resident input: none), and a folded op's outputs (resident)."""
    n = len(schedule)
    ops = np.fromiter(map(graph.op_id.__getitem__, map(_NAME, schedule)), np.int64, n)
    copies = np.fromiter(map(_COPY, schedule), np.int64, n)

    r_step, r_tensor, r_position = _gather(graph.op_input_ptr, graph.op_input_tensor, ops)
    w_step, w_tensor, w_position = _gather(graph.op_output_ptr, graph.op_output_tensor, ops)
    # the write each read resolves to: the last write of the tensor at an earlier step
    w_key = w_tensor * (n + 1) + w_step
    w_order = np.argsort(w_key, kind="stable")
    sorted_key = w_key[w_order]
    r_at = np.searchsorted(sorted_key, r_tensor * (n + 1) + r_step, side="left") - 1
    r_found = r_at >= 0
    r_found[r_found] = w_tensor[w_order[r_at[r_found]]] == r_tensor[r_found]
    r_write = np.full(len(r_step), -1, dtype=np.int64)
    r_write[r_found] = w_order[r_at[r_found]]

    # storages: RESIDENT (-1) for folded and bound outputs, shared for alias outputs, else new
    RESIDENT = -1
    w_folded = graph.op_folded[ops][w_step] | (graph.tensor_bound[w_tensor] & (copies[w_step] == 0))
    w_alias = graph.op_alias[ops][w_step] & (w_position == 0)
    w_storage = np.full(len(w_step), RESIDENT, dtype=np.int64)
    creates = ~w_folded & ~w_alias
    alias_writes = np.flatnonzero(w_alias & ~w_folded)
    if len(alias_writes):
        # input 0 of an aliasing step: the read at the step's first input position
        r_first = np.flatnonzero(r_position == 0)       # one per step with inputs, in step order
        first_read_of_step = np.full(n, -1, dtype=np.int64)
        first_read_of_step[r_step[r_first]] = r_first
        source_reads = first_read_of_step[w_step[alias_writes]]
        source_writes = r_write[source_reads]
        source_resident = graph.tensor_resident[r_tensor[source_reads]]
        # an alias whose input 0 was never produced and is not resident gets its own storage
        creates[alias_writes[(source_writes < 0) & ~source_resident]] = True
    creating = np.flatnonzero(creates)
    w_storage[creating] = np.arange(len(creating), dtype=np.int64)
    if len(alias_writes):
        # an alias shares its source write's storage, that source perhaps an alias itself (its
        # source an earlier write): each write's chain followed to its root by pointer jumping
        sourced = source_writes >= 0
        root = np.arange(len(w_step), dtype=np.int64)
        root[alias_writes[sourced]] = source_writes[sourced]
        while True:
            further = root[root]
            if np.array_equal(further, root):
                break
            root = further
        w_storage[alias_writes[sourced]] = w_storage[root[alias_writes[sourced]]]

    n_storages = len(creating)
    sizes = graph.tensor_bytes_by_id if tensor_bytes_by_id is None else tensor_bytes_by_id
    storage_bytes = sizes[w_tensor[creating]]
    storage_born = w_step[creating]
    storage_last = storage_born.copy()
    read_storage = np.where(r_write >= 0, w_storage[np.maximum(r_write, 0)], RESIDENT)
    counted = read_storage >= 0
    np.maximum.at(storage_last, read_storage[counted], r_step[counted])
    storage_kept = np.zeros(n_storages, dtype=bool)
    w_kept = (copies[w_step] == 0) & graph.tensor_kept[w_tensor] & (w_storage >= 0)
    storage_kept[w_storage[w_kept]] = True
    storage_droppable = graph.tensor_droppable[w_tensor[creating]]

    read = storage_last > storage_born
    allocated_mask = read | ~storage_droppable      # never read and droppable: never allocated
    allocated = np.bincount(storage_born[allocated_mask], weights=storage_bytes[allocated_mask], minlength=n)
    freeing = read & ~storage_kept                  # graph outputs (and unread buffers) are kept to the end
    freed = np.bincount(storage_last[freeing], weights=storage_bytes[freeing], minlength=n)
    live_before_free = np.cumsum(allocated) - np.concatenate(([0.0], np.cumsum(freed)[:-1]))
    running = live_before_free.astype(np.int64) + graph.op_workspace_bytes[ops]
    resting = (np.cumsum(allocated) - np.cumsum(freed)).astype(np.int64)
    return Liveness(ops, copies, w_tensor[creating], storage_bytes, storage_born, storage_last, allocated_mask,
                     freeing, storage_kept, running, resting)


def simulate(graph: CostGraph, schedule: list[Step], tensor_bytes_by_id: np.ndarray | None = None) -> Simulation:
    """Peak live bytes of running `schedule` (see the module docstring for the rules);
    `tensor_bytes_by_id` replaces the graph's tensor sizes (by tensor id) when given."""
    n = len(schedule)
    if n == 0:
        return Simulation(0, 0, 0.0, 0.0, np.zeros(0, dtype=np.int64))
    live = liveness(graph, schedule, tensor_bytes_by_id)
    seconds = graph.op_seconds[live.ops]
    recompute = float(seconds[live.copies != 0].sum()) * graph.recompute_factor
    compute = float(seconds[live.copies == 0].sum()) + recompute
    running = live.running
    peak_step = int(np.argmax(running))
    peak = int(running[peak_step])
    if peak <= 0:
        peak, peak_step = 0, 0
    return Simulation(peak, peak_step, compute, recompute, running)


@dataclass
class LiveBuffer:
    """A buffer live while a step runs (`live_at`)."""
    tensor: str
    copy: int            # the copy of its producer that wrote it (0: the op itself)
    bytes: int
    producer: str
    born: int            # the step that wrote it
    last_read: int       # the step of its last read (its birth when nobody reads it)
    output: bool         # a graph output is written in it (copy 0; perhaps through a view): kept to the end


def live_at(graph: CostGraph, schedule: list[Step], step: int,
            tensor_bytes_by_id: np.ndarray | None = None) -> tuple[list[LiveBuffer], int]:
    """The buffers live while `schedule[step]` runs, largest first, and that step's work-buffer
    bytes: together, exactly what `simulate` counts at that step."""
    live = liveness(graph, schedule, tensor_bytes_by_id)
    alive = (live.storage_allocated & (live.storage_born <= step)
             & ~(live.storage_freed & (live.storage_last < step)))
    buffers = []
    for k in np.flatnonzero(alive):
        born = int(live.storage_born[k])
        tensor = graph.tensor_names[int(live.storage_tensor[k])]
        buffers.append(LiveBuffer(tensor, int(live.copies[born]), int(live.storage_bytes[k]), schedule[born][0],
                                  born, int(live.storage_last[k]), bool(live.storage_output[k])))
    buffers.sort(key=lambda b: -b.bytes)
    return buffers, int(graph.op_workspace_bytes[live.ops[step]])


def priority_order(graph: CostGraph, schedule: list[Step], *, distinct_steps: bool = False) -> list[Step]:
    """The order ONNX Runtime's PRIORITY_BASED execution runs a file written as `schedule`.

    Kahn's algorithm over the steps' data dependencies; among ready steps, ``runs_first``
    ops (Shape, Size) first, then the lowest position in the file. ``folded`` steps
    (Constant nodes: initializers once loaded) do not run and are left out.
    `distinct_steps`: the caller knows no step appears twice and no copy is negative (a
    schedule of `search.plan.schedule_for`), so that is not checked again.
    """
    ops = graph.ops
    if graph.folded_ops:
        folded = graph.folded_ops
        schedule = [step for step in schedule if step[0] not in folded]
    else:
        schedule = list(schedule)
    if not schedule:
        return schedule
    # Fast path. A tensor has one producer (CostGraph checks it), so when no step appears twice
    # and no copy is negative, no (tensor, version) is written twice: a read depends on the
    # step that last wrote the tensor BEFORE it, so the file order is a topological order;
    # Kahn's algorithm with "lowest position first" then returns the file order itself, except
    # that a runs_first step is hoisted to the moment it is ready (and, ready together,
    # runs_first steps go by position). Only the runs_first steps' dependencies are tracked.
    # Otherwise: the general rule, `_priority_order_general`.
    if not distinct_steps and (len(set(schedule)) != len(schedule) or min(copy for _, copy in schedule) < 0):
        return _priority_order_general(ops, schedule)
    if not graph.runs_first_ops:
        return schedule
    runs_first, watched = graph.runs_first_ops, graph.runs_first_inputs
    relevant = runs_first | {graph.producer[t] for t in watched if t in graph.producer}
    latest_step: dict[str, int] = {}
    first_deps: dict[int, set[int]] = {}     # runs_first step -> steps it waits for
    for i in [i for i, step in enumerate(schedule) if step[0] in relevant]:
        name = schedule[i][0]
        op = ops[name]
        if name in runs_first:
            first_deps[i] = {latest_step[t] for t in op.inputs if t in latest_step}
        for t in op.outputs:
            if t in watched:
                latest_step[t] = i
    if not first_deps:
        return schedule
    # a runs_first step that waits only for other steps is emitted right after the last of them
    # (ready steps together: by position); one that waits for another runs_first step: Kahn
    ready_after: dict[int, list[int]] = {}
    for r, deps in first_deps.items():
        if any(d in first_deps for d in deps):
            return _hoist_runs_first(schedule, first_deps)
        ready_after.setdefault(max(deps, default=-1), []).append(r)
    order = [schedule[r] for r in sorted(ready_after.pop(-1, ()))]
    # the file order between the steps taken out (first_deps) and those that others follow
    # (ready_after), copied a slice at a time
    start = 0
    for j in sorted(first_deps.keys() | ready_after.keys()):
        order.extend(schedule[start:j])
        start = j + 1
        if j in first_deps:
            continue
        order.append(schedule[j])
        order.extend(schedule[r] for r in sorted(ready_after[j]))
    order.extend(schedule[start:])
    assert len(order) == len(schedule)
    return order


def _hoist_runs_first(schedule: list[Step], first_deps: dict[int, set[int]]) -> list[Step]:
    """The file order with each runs_first step hoisted to the moment it is ready (Kahn's
    algorithm on the runs_first steps' dependencies; ready together: by position)."""
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
