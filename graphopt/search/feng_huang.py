"""`feng-huang`: the optimal least-peak checkpoint search of Feng & Huang (CVPR 2021) on
arbitrary graphs, on measured bytes.

The paper's objective: peak = Σ bytes of the checkpoints + the largest re-forward between
checkpoints ("max term"). On a chain the segments are the runs between consecutive
checkpoints; on an arbitrary graph they are what the checkpoints cut the graph into. Here
that is made exact for any checkpoint set C:

    cost(C) = Σ_{t ∈ C} bytes(t) + max over connected components K of (tensors not kept) of Σ_{t ∈ K} bytes(t)

over the forward tensor graph (an edge joins a tensor and each forward tensor its producer
reads, and the outputs of one op), where tensors that must be kept (outputs of random ops,
graph outputs) are cut points like checkpoints and are left out of the sum (a constant).
A component is a piece that the backward pass re-forwards as a whole; it is the paper's
"segment", and on an independent segment (a subgraph touching the rest only at its source
and target) it is exactly the paper's segment cost.

Adapted to the runtime: bytes are the measured sizes of the tensors as ONNX Runtime holds
them (not element counts: mixed precision counts right); an aliasing op's output (Reshape,
Identity, ...) shares its input's buffer, so it weighs nothing, is never a checkpoint on its
own and joins its input's component; random ops are never recomputed. The plan is then the
project's schedule (lazy recomputation before the first backward reader, memory-aware order)
evaluated by the one cost model, which frees checkpoints after their last reader and so is
never above this objective's accounting of the checkpoints.

The algorithm. Feng & Huang enumerate every candidate max term m (O(n²) segment costs on a
chain), solve a shortest path in an "accessibility graph" for each, and split arbitrary
graphs into a division tree of independent segments: about O(n⁴) on chains. Here:
- the linear solver for one max term m (`least_kept_bytes`) is one pass over the tensors in
  topological order (a path decomposition) that carries, for every state of the frontier
  (which tensors not kept still have later neighbours, how they are grouped into open
  components), the Pareto set of (bytes of each open component, Σ checkpoint bytes), with
  components over m cut off and labels that cannot beat the best plan pruned. Where the
  graph splits into independent segments the frontier is one tensor, so runs of independent
  segments and chains cost O(n · P), P the labels per state; a branch widens the frontier
  for its length and a "complicated" node is solved exactly inside (the division tree is
  the frontier structure itself);
- the max terms are not all enumerated: `solve` runs a branch and bound over m, probing only
  where a cheaper plan can still be (see its docstring).
Exactness holds while the labels per step stay under `max_states` and the effort (labels
expanded, or a deadline) is not spent;
otherwise the labels with the least Σ checkpoint bytes are kept (a beam), or past the work limit the
search stops with the best plan so far, and ``notes["exact"]`` is False.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..costgraph import CostGraph

from .plan import Plan, make_plan


@dataclass
class SegmentModel:
    """The forward tensor graph as Feng & Huang see it (indices in forward order)."""
    tensors: list[str]          # every forward tensor that is not forced
    bytes_: list[int]           # its weight (0 for aliases)
    candidate: list[bool]       # may be a checkpoint
    earlier: list[list[int]]    # neighbours earlier in the order
    last_neighbour: list[int]   # index of its last later neighbour (itself if none)


def segment_model(graph: CostGraph) -> SegmentModel:
    producer = graph.forward_tensors
    forced = graph.forced_checkpoints
    candidates = set(graph.candidate_checkpoints)
    tensor_bytes = graph.tensor_bytes
    nodes = graph.ops
    tensors, weights, is_candidate = [], [], []
    index: dict[str, int] = {}
    for t, op in producer.items():
        if t in forced:
            continue
        alias = bool(nodes[op].alias) and nodes[op].outputs[0] == t and nodes[op].inputs
        index[t] = len(tensors)
        tensors.append(t)
        weights.append(0 if alias else int(tensor_bytes.get(t, 0)))
        is_candidate.append(not alias and t in candidates)
    earlier: list[list[int]] = [[] for _ in tensors]
    for i, t in enumerate(tensors):
        attrs = nodes[producer[t]]
        linked = {index[u] for u in attrs.inputs if u in index}
        linked |= {index[u] for u in attrs.outputs if u in index and index[u] < i}
        earlier[i] = sorted(j for j in linked if j < i)
    last = list(range(len(tensors)))
    for i, js in enumerate(earlier):
        for j in js:
            last[j] = max(last[j], i)
    return SegmentModel(tensors, weights, is_candidate, earlier, last)


def segment_cost(model: SegmentModel, kept: set[int]) -> tuple[int, int]:
    """(Σ checkpoint bytes, largest component bytes) of keeping the tensors `kept` (indices)."""
    n = len(model.tensors)
    parent = list(range(n))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for i in range(n):
        if i in kept:
            continue
        for j in model.earlier[i]:
            if j not in kept:
                parent[find(i)] = find(j)
    size: dict[int, int] = {}
    for i in range(n):
        if i not in kept:
            r = find(i)
            size[r] = size.get(r, 0) + model.bytes_[i]
    return sum(model.bytes_[i] for i in kept), max(size.values(), default=0)


def brute_force(model: SegmentModel) -> tuple[int, frozenset[int]]:
    """Least cost(C) over every subset of the candidates (exponential: tests only)."""
    cands = [i for i in range(len(model.tensors)) if model.candidate[i]]
    best = None
    for mask in range(1 << len(cands)):
        kept = {cands[k] for k in range(len(cands)) if mask >> k & 1}
        total = sum(segment_cost(model, kept))
        if best is None or total < best[0]:
            best = (total, frozenset(kept))
    return best


def _canonical(frontier_labels: dict[int, int], weights: dict[int, int]):
    """State key (frontier members with labels renumbered by first appearance) + weights."""
    relabel: dict[int, int] = {}
    key = []
    for member in sorted(frontier_labels):
        label = frontier_labels[member]
        if label not in relabel:
            relabel[label] = len(relabel)
        key.append((member, relabel[label]))
    w = [0] * len(relabel)
    for label, new in relabel.items():
        w[new] = weights[label]
    return tuple(key), tuple(w)


def threshold_bound(model: SegmentModel) -> tuple[int, frozenset[int]]:
    """An upper bound on the optimum: for a series of max terms m, walk the order and keep a
    candidate whenever its open run would pass m; the best cost(C) of those sets."""
    n = len(model.tensors)
    total = sum(model.bytes_) or 1
    everything = frozenset(i for i in range(n) if model.candidate[i])
    best = min((sum(segment_cost(model, set())), frozenset()), (sum(segment_cost(model, set(everything))), everything),
               key=lambda x: x[0])
    m = max(model.bytes_, default=1) or 1
    while m <= total:
        kept, run = set(), 0
        for i in range(n):
            if model.candidate[i] and run + model.bytes_[i] > m:
                kept.add(i)
                run = 0
            else:
                run += model.bytes_[i]
        best = min(best, (sum(segment_cost(model, kept)), frozenset(kept)), key=lambda x: x[0])
        m = int(m * 1.15) + 1
    return best


class Effort:
    """The search's limit: work, the same count on every machine — label expansions weighted
    by the frontier they carry, and the dominance checks of new labels against the labels of
    their state — and, optionally, a wall-clock deadline. Past either work limit the running
    probe is abandoned and no new one starts (the best plan so far is returned); past the
    deadline the running probe finishes as a narrow beam. The checks need their own limit: on
    a 3D-convolution video network (torchvision's r3d_18, 132 tensors in its segment model)
    150,000 labels came with 3.1-5.9 million checks (2.9-5.8 s per base order one label at a
    time; 0.6-1.1 s against a state's labels at once, `_Front`); on the six examples with at
    most 1.13 million."""

    def __init__(self, max_labels: int | None = None, time_limit_seconds: float | None = None,
                 max_comparisons: int | None = None):
        self.max_labels = max_labels
        self.labels = 0
        self.max_comparisons = max_comparisons
        self.comparisons = 0          # dominance checks of a new label against its state's labels
        self.deadline = None if time_limit_seconds is None else time.perf_counter() + time_limit_seconds

    def spent(self) -> bool:
        return self.out_of_work() or (self.deadline is not None and time.perf_counter() > self.deadline)

    def out_of_work(self) -> bool:
        return ((self.max_labels is not None and self.labels > self.max_labels)
                or (self.max_comparisons is not None and self.comparisons > self.max_comparisons))


class _Front:
    """The Pareto labels of one state, in the order they came: (open weights, Σ kept, mask),
    none at or above another in Σ kept and every weight. Past ARRAY_FROM labels their (Σ kept,
    weights) are also the rows of an array, so that a new label is checked against all of them
    at once (the checks were most of the search's seconds on wide graphs: `Effort`)."""
    __slots__ = ("labels", "rows")
    ARRAY_FROM = 24

    def __init__(self):
        self.labels: list[tuple[tuple[int, ...], int, int]] = []
        self.rows = None

    def add(self, weights: tuple[int, ...], total: int, mask: int) -> None:
        if self.rows is None and len(self.labels) < self.ARRAY_FROM:
            if any(o[1] <= total and all(a <= b for a, b in zip(o[0], weights)) for o in self.labels):
                return
            self.labels = [o for o in self.labels
                           if not (total <= o[1] and all(a <= b for a, b in zip(weights, o[0])))]
            self.labels.append((weights, total, mask))
            return
        if self.rows is None:
            self.rows = np.array([(o[1], *o[0]) for o in self.labels], dtype=np.int64)
        row = np.array((total, *weights), dtype=np.int64)
        if (self.rows <= row).all(axis=1).any():          # a label as good in every respect
            return
        beaten = (row <= self.rows).all(axis=1)
        if beaten.any():
            keep = ~beaten
            self.rows = self.rows[keep]
            self.labels = [label for label, kept in zip(self.labels, keep.tolist()) if kept]
        self.rows = np.vstack((self.rows, row))
        self.labels.append((weights, total, mask))


def least_kept_bytes(model: SegmentModel, max_term: int, below: int, max_states: int,
                     effort: Effort | None = None):
    """The linear solver for one max term: least Σ checkpoint bytes such that every component
    is at most `max_term` bytes, among sets whose cost could be below `below`.
    Returns ((Σ kept bytes, kept mask) or None when no such set exists, exact)."""
    n = len(model.tensors)
    exact = True
    # state: frontier members with their component labels -> Pareto labels (open weights, Σ kept, mask)
    states: dict[tuple, list[tuple[tuple[int, ...], int, int]]] = {(): [((), 0, 0)]}
    for i in range(n):
        w_i = model.bytes_[i]
        nxt: dict[tuple, _Front] = {}
        if effort is not None:
            effort.labels += sum(len(labels) * (1 + len(key)) for key, labels in states.items())
            if effort.out_of_work():
                return None, False
        for key, labels in states.items():
            members = dict(key)
            for weights, total, mask in labels:
                for keep in ((False, True) if model.candidate[i] else (False,)):
                    frontier = dict(members)
                    wdict = dict(enumerate(weights))
                    if keep:
                        new_total, new_mask = total + w_i, mask | (1 << i)
                    else:
                        new_total, new_mask = total, mask
                        joined = {frontier[j] for j in model.earlier[i] if j in frontier}
                        label = min(joined) if joined else max(wdict, default=-1) + 1
                        merged = w_i + sum(wdict.pop(l) for l in joined)
                        if merged > max_term:
                            continue
                        for m, l in frontier.items():
                            if l in joined:
                                frontier[m] = label
                        frontier[i] = label
                        wdict[label] = merged
                    for m in [m for m in frontier if model.last_neighbour[m] <= i]:
                        label = frontier.pop(m)
                        if label not in frontier.values():
                            del wdict[label]
                    if new_total + max(wdict.values(), default=0) >= below:
                        continue
                    k2, w2 = _canonical(frontier, wdict)
                    bucket = nxt.get(k2)
                    if bucket is None:
                        bucket = nxt[k2] = _Front()
                    if effort is not None:
                        effort.comparisons += len(bucket.labels)
                    bucket.add(w2, new_total, new_mask)
        if effort is not None and max_states > SMALL_BEAM and effort.spent():
            max_states = SMALL_BEAM          # out of effort: finish this probe as a narrow beam
        states = {k: front.labels for k, front in nxt.items()}
        if sum(len(v) for v in states.values()) > max_states:
            exact = False
            flat = sorted(((lab[1], k, lab) for k, labs in states.items() for lab in labs),
                          key=lambda x: x[0])[:max_states]
            states = {}
            for _, k, lab in flat:
                states.setdefault(k, []).append(lab)
        if not states:
            return None, exact
    best = min((lab for labs in states.values() for lab in labs), key=lambda lab: lab[1], default=None)
    return (None if best is None else (best[1], best[2])), exact


SMALL_BEAM = 64


def solve(model: SegmentModel, max_states: int = 20_000, time_limit_seconds: float | None = None,
          max_labels: int | None = None, max_comparisons: int | None = None):
    """Least cost(C) by Feng & Huang's max-term enumeration, as a branch and bound over the
    max term instead of a loop over all O(n²) candidate values.

    f(m) = least Σ checkpoint bytes with every component ≤ m is non-increasing in m. An
    interval [a, b] of max terms holds no plan cheaper than f(b) + a, so it is dropped when
    that reaches the best cost found. A probe at m (the linear solver, pruned by the best
    cost) returns a set whose largest component m' ≤ m: max terms in (m', m] cannot beat it,
    [a, m'-1] is bounded by f(m') + a and (m, b] by f(b) + m + 1. The first probe is the max
    term of a threshold heuristic, which usually lands next to the optimum.
    Past `max_labels` labels expanded or `max_comparisons` dominance checks (`Effort`) the
    running probe is abandoned, past `time_limit_seconds` it finishes as a narrow beam; no new
    probe starts: the best set so far is returned, not exact.
    Returns (cost, kept indices, exact, probes)."""
    n = len(model.tensors)
    effort = Effort(max_labels, time_limit_seconds, max_comparisons)
    best_cost, best_kept = threshold_bound(model)
    floor = max((model.bytes_[i] for i in range(n) if not model.candidate[i]), default=0)
    guess = segment_cost(model, set(best_kept))[1]
    exact = True
    probes = []
    intervals = [(floor, sum(model.bytes_), 0)]     # (a, b, lower bound of f on [a, b])
    while intervals:
        intervals.sort(key=lambda iv: iv[2] + iv[0])
        a, b, f_low = intervals.pop(0)
        if a > b or f_low + a >= best_cost:
            continue
        if effort.spent():
            exact = False
            break
        m = guess if a <= guess <= b else (a + b) // 2
        guess = -1
        found, exact_here = least_kept_bytes(model, m, best_cost, max_states, effort)
        exact = exact and exact_here
        if effort.out_of_work():          # the probe was abandoned: keep the best so far
            exact = False
            break
        if m < b:
            intervals.append((m + 1, b, f_low))
        if found is None:                 # nothing with max term <= m beats the best
            continue
        kept_bytes, mask = found
        kept = frozenset(i for i in range(n) if mask >> i & 1)
        largest = segment_cost(model, set(kept))[1]
        probes.append((m, largest, kept_bytes))
        if kept_bytes + largest < best_cost:
            best_cost, best_kept = kept_bytes + largest, kept
        intervals.append((a, largest - 1, kept_bytes))
    return best_cost, best_kept, exact, probes


def feng_huang(graph: CostGraph, *, max_states: int = 20_000, time_limit_seconds: float | None = 120.0,
               max_labels: int | None = 150_000, max_comparisons: int | None = 10_000_000) -> Plan:
    """The least-cost plan of the segment model (the paper has no budget or time objective:
    the registry refuses a budget for it; `auto` and `kusumoto` serve budgets). `max_labels`
    and `max_comparisons` bound the work (`Effort`: the same plan on every machine);
    `time_limit_seconds` is only a safety net."""
    started = time.perf_counter()
    model = segment_model(graph)
    cost, kept, exact, front = solve(model, max_states=max_states, time_limit_seconds=time_limit_seconds,
                                     max_labels=max_labels, max_comparisons=max_comparisons)
    checkpoints = {model.tensors[i] for i in kept}
    return make_plan(graph, "feng-huang", checkpoints, model_cost_bytes=cost, exact=exact,
                     probes=len(front), search_seconds=time.perf_counter() - started)
