"""`chen-sqrt`: Chen et al. 2016 (arXiv 1604.06174), generalized to DAGs.

The forward ops, in topological order, are cut into about sqrt(n) segments holding equal
shares of the forward tensors' bytes (Chen balances memory, not op counts). The tensors that
cross a cut (produced before it, read by a forward op after it) are the checkpoints; the
rest is recomputed segment by segment during the backward pass.
"""
from __future__ import annotations

import math

from ..costgraph import CostGraph

from .plan import Plan, make_plan


def segment_checkpoints(graph: CostGraph, segments: int) -> set[str]:
    """Checkpoints of cutting the forward order into `segments` equal-bytes segments."""
    order = graph.forward_order
    nodes = graph.ops
    tensor_bytes = graph.tensor_bytes
    producer = graph.forward_tensors
    position = {op: i for i, op in enumerate(order)}
    last_forward_read: dict[str, int] = {}
    for i, op in enumerate(order):
        for t in nodes[op].inputs:
            if t in producer:
                last_forward_read[t] = i
    total = sum(tensor_bytes.get(t, 0) for t in producer) or 1
    share = total / max(1, segments)
    cuts, acc = [], 0
    for i, op in enumerate(order[:-1]):
        acc += sum(tensor_bytes.get(t, 0) for t in nodes[op].outputs)
        if acc >= share:
            cuts.append(i)
            acc = 0
    checkpoints = set()
    for cut in cuts:
        for t, last in last_forward_read.items():
            if position[producer[t]] <= cut < last:
                checkpoints.add(t)
    return checkpoints


def chen_sqrt(graph: CostGraph, budget_bytes: int | None = None) -> Plan:
    n = len(graph.forward_order)
    segments = max(1, round(math.sqrt(n)))
    return make_plan(graph, "chen-sqrt", segment_checkpoints(graph, segments), segments=segments)
