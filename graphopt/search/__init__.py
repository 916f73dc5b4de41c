"""Checkpoint search: solvers over the abstract cost graph (no ONNX here).

Each strategy is ``f(graph, budget_bytes=None) -> Plan``."""
from .chen_sqrt import chen_sqrt
from .greedy import greedy
from .plan import Plan, make_plan, schedule_for
from .store_all import store_all

STRATEGIES = {
    "greedy": greedy,
    "chen-sqrt": chen_sqrt,
    "store-all": store_all,
}
DEFAULT_STRATEGY = "greedy"

__all__ = ["STRATEGIES", "DEFAULT_STRATEGY", "Plan", "make_plan", "schedule_for",
           "greedy", "chen_sqrt", "store_all"]
