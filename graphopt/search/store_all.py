"""`store-all`: keep every forward tensor (no recomputation); only the order is ours."""
from __future__ import annotations

import networkx as nx

from .plan import Plan, candidate_checkpoints, make_plan


def store_all(graph: nx.DiGraph, budget_bytes: int | None = None) -> Plan:
    return make_plan(graph, "store-all", candidate_checkpoints(graph))
