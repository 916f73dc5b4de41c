"""`store-all`: keep every forward tensor (no recomputation); only the order is ours."""
from __future__ import annotations

from ..costgraph import CostGraph

from .plan import Plan, make_plan


def store_all(graph: CostGraph, budget_bytes: int | None = None) -> Plan:
    return make_plan(graph, "store-all", graph.candidate_checkpoints)
