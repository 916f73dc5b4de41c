"""`chen-greedy`: Chen et al. 2016 (arXiv 1604.06174), the memory-planning greedy with a
segment budget b, generalized to our DAG cost graphs.

Walk the forward order accumulating the bytes each op writes (aliases add none); when the
running total exceeds b, cut after that op and restart the count. The tensors that cross a
cut (produced at or before it, read by a forward op after it) are the checkpoints; each
segment is recomputed during the backward pass. Chen searches b (the memory of a plan is
roughly b + bytes kept at cuts); here b sweeps a geometric grid between the largest op's
bytes and the total, then refines between the best grid neighbours. Every distinct
checkpoint set is evaluated by the cost model; store-all (no recomputation) and Chen's
sqrt(n) plan are candidates too. Returned: the least cost-model peak (ties: least recompute
seconds), or with a budget the least recompute seconds whose peak fits (else least peak).
"""
from __future__ import annotations

import bisect
import time

from ..costgraph import CostGraph

from .chen_sqrt import chen_sqrt
from .plan import Plan, make_plan
from .store_all import store_all


def _op_bytes(graph: CostGraph, op: str) -> int:
    attrs = graph.ops[op]
    tensor_bytes = graph.tensor_bytes
    total = 0
    for k, t in enumerate(attrs.outputs):
        if k == 0 and attrs.alias and attrs.inputs:
            continue
        total += int(tensor_bytes.get(t, 0))
    return total


def greedy_cuts(sizes: list[int], b: float) -> list[int]:
    """Chen's greedy: positions i after which to cut, cutting when the running sum exceeds b."""
    cuts, acc = [], 0
    for i, size in enumerate(sizes[:-1]):
        acc += size
        if acc > b:
            cuts.append(i)
            acc = 0
    return cuts


class _Crossing:
    """Tensors crossing a cut after position i of the forward order."""

    def __init__(self, graph: CostGraph):
        order = graph.forward_order
        nodes = graph.ops
        producer = graph.forward_tensors
        position = {op: i for i, op in enumerate(order)}
        last_read: dict[str, int] = {}
        for i, op in enumerate(order):
            for t in nodes[op].inputs:
                if t in producer:
                    last_read[t] = i
        self.spans = [(position[producer[t]], last, t) for t, last in last_read.items()]

    def checkpoints(self, cuts) -> frozenset[str]:
        cuts = sorted(cuts)
        kept = set()
        for born, last, t in self.spans:
            k = bisect.bisect_left(cuts, born)        # first cut >= born
            if k < len(cuts) and cuts[k] < last:
                kept.add(t)
        return frozenset(kept)


def _objective(plan: Plan, budget_bytes):
    if budget_bytes is None:
        return (plan.peak_bytes, plan.recompute_seconds)
    return (max(0, plan.peak_bytes - budget_bytes), plan.recompute_seconds, plan.peak_bytes)


def chen_greedy(graph: CostGraph, budget_bytes: int | None = None, *, grid: int = 40,
                refine: int = 12) -> Plan:
    started = time.perf_counter()
    order = graph.forward_order
    sizes = [_op_bytes(graph, op) for op in order]
    crossing = _Crossing(graph)
    plans: dict[frozenset, Plan] = {}
    tried: dict[float, tuple] = {}

    def try_b(b):
        cuts = greedy_cuts(sizes, b)
        keep = crossing.checkpoints(cuts)
        if keep not in plans:
            plans[keep] = make_plan(graph, "chen-greedy", keep, b=b, segments=len(cuts) + 1)
        tried[b] = _objective(plans[keep], budget_bytes)

    base = [store_all(graph), chen_sqrt(graph)]
    for plan in base:
        plans.setdefault(plan.checkpoints, plan)
    total = sum(sizes)
    if total > 0 and len(order) > 1:
        low = max(1, min(s for s in sizes if s > 0) if any(sizes) else 1)
        for k in range(grid + 1):
            try_b(low * (total / low) ** (k / grid))
        # Chen's search: refine b between the neighbours of the best b on the grid
        values = sorted(tried)
        best_i = min(range(len(values)), key=lambda i: tried[values[i]])
        lo = values[max(0, best_i - 1)]
        hi = values[min(len(values) - 1, best_i + 1)]
        for k in range(1, refine + 1):
            try_b(lo + (hi - lo) * k / (refine + 1))
    best = min(plans.values(), key=lambda p: _objective(p, budget_bytes))
    best.strategy = "chen-greedy"
    best.notes.update(evaluated_plans=len(plans), search_seconds=time.perf_counter() - started)
    return best
