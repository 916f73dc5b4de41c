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

The cost graph is a networkx DiGraph whose nodes are ops with attributes ``inputs``,
``outputs`` (tensor names), ``seconds``, ``phase`` ("forward"/"backward"), ``alias``
(output 0 shares input 0's buffer), ``recomputable``, ``runs_first`` (ONNX Runtime's
priority order runs it as soon as it is ready), ``folded`` (never runs; outputs resident)
and ``workspace`` (bytes); graph attributes ``tensor_bytes``,
``resident``, ``kept`` (graph outputs), ``droppable``, ``forward_order``, ``backward_order``.
This module imports no ONNX.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import networkx as nx

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


def resolve_versions(graph: nx.DiGraph, schedule: list[Step]) -> list[VersionedStep]:
    """Which version of each tensor every step reads and writes (latest produced wins)."""
    latest: dict[str, int] = {}
    resolved = []
    nodes = graph.nodes
    for op, copy in schedule:
        attrs = nodes[op]
        reads = [(t, latest.get(t, -1)) for t in attrs["inputs"]]
        writes = []
        for t in attrs["outputs"]:
            writes.append((t, copy))
            latest[t] = copy
        resolved.append(VersionedStep(op, copy, reads, writes))
    return resolved


def check_schedule(graph: nx.DiGraph, schedule: list[Step]) -> None:
    """Raise ValueError unless every non-resident input is produced before it is read."""
    resident = graph.graph["resident"]
    for i, step in enumerate(resolve_versions(graph, schedule)):
        for tensor, version in step.reads:
            if version < 0 and tensor not in resident:
                raise ValueError(f"step {i} ({step.op}, copy {step.copy}) reads {tensor!r} before it exists")


def simulate(graph: nx.DiGraph, schedule: list[Step]) -> Simulation:
    """Peak live bytes of running `schedule` (see the module docstring for the rules)."""
    tensor_bytes = graph.graph["tensor_bytes"]
    resident = graph.graph["resident"]
    kept = graph.graph["kept"]
    droppable = graph.graph.get("droppable", frozenset())
    nodes = graph.nodes
    steps = resolve_versions(graph, schedule)
    n = len(steps)

    # storage of each version: aliases share their input's storage
    storage_of: dict[tuple[str, int], int] = {}
    storage_bytes: list[int] = []
    storage_born: list[int] = []
    storage_last: list[int] = []
    storage_kept: list[bool] = []
    storage_read: list[bool] = []
    RESIDENT = -1

    def storage(version):
        tensor, v = version
        if v < 0:
            return RESIDENT if tensor in resident else None
        return storage_of.get(version)

    for i, step in enumerate(steps):
        attrs = nodes[step.op]
        for version in step.reads:
            s = storage(version)
            if s is not None and s != RESIDENT:
                storage_last[s] = i
                storage_read[s] = True
        if attrs.get("folded"):              # an initializer by the time the run starts
            for version in step.writes:
                storage_of[version] = RESIDENT
            continue
        for k, version in enumerate(step.writes):
            tensor = version[0]
            if k == 0 and attrs.get("alias") and step.reads:
                s = storage(step.reads[0])
                if s is not None:
                    storage_of[version] = s
                    if s != RESIDENT:
                        storage_last[s] = max(storage_last[s], i)
                        if step.copy == 0 and tensor in kept:
                            storage_kept[s] = True
                    continue
            s = len(storage_bytes)
            storage_of[version] = s
            storage_bytes.append(int(tensor_bytes.get(tensor, 0)))
            storage_born.append(i)
            storage_last.append(i)
            storage_kept.append(step.copy == 0 and tensor in kept)
            storage_read.append(False)
            if tensor in droppable:
                storage_read[s] = None  # decided below: dropped if never read

    born_at: list[list[int]] = [[] for _ in range(n)]
    freed_at: list[list[int]] = [[] for _ in range(n)]
    for s, nbytes in enumerate(storage_bytes):
        if storage_read[s] is None:          # droppable and never read: not allocated
            continue
        born_at[storage_born[s]].append(s)
        if storage_kept[s] or not storage_read[s]:
            continue                         # kept to the end (output, or never read)
        freed_at[storage_last[s]].append(s)

    live = 0
    peak = 0
    peak_step = 0
    live_bytes = []
    compute = 0.0
    recompute = 0.0
    for i, step in enumerate(steps):
        for s in born_at[i]:
            live += storage_bytes[s]
        running = live + int(nodes[step.op].get("workspace", 0) or 0)
        live_bytes.append(running)
        if running > peak:
            peak, peak_step = running, i
        for s in freed_at[i]:
            live -= storage_bytes[s]
        seconds = float(nodes[step.op].get("seconds", 0.0))
        compute += seconds
        if step.copy:
            recompute += seconds
    return Simulation(peak, peak_step, compute, recompute, live_bytes)


def priority_order(graph: nx.DiGraph, schedule: list[Step]) -> list[Step]:
    """The order ONNX Runtime's PRIORITY_BASED execution runs a file written as `schedule`.

    Kahn's algorithm over the steps' data dependencies; among ready steps, ``runs_first``
    ops (Shape, Size) first, then the lowest position in the file. ``folded`` steps
    (Constant nodes: initializers once loaded) do not run and are left out.
    """
    nodes = graph.nodes
    schedule = [step for step in schedule if not nodes[step[0]].get("folded")]
    steps = resolve_versions(graph, schedule)
    producer: dict[tuple[str, int], int] = {}
    for i, step in enumerate(steps):
        for w in step.writes:
            producer[w] = i
    indegree = [0] * len(steps)
    consumers: list[list[int]] = [[] for _ in steps]
    for i, step in enumerate(steps):
        deps = {producer[r] for r in step.reads if r in producer}
        indegree[i] = len(deps)
        for d in deps:
            consumers[d].append(i)

    def key(i):
        return (0 if nodes[steps[i].op].get("runs_first") else 1, i)

    ready = [key(i) for i in range(len(steps)) if indegree[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(schedule[i])
        for j in consumers[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, key(j))
    if len(order) != len(schedule):
        raise ValueError("schedule has a dependency cycle")
    return order
