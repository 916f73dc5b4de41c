"""Checkpoint search: solvers over the abstract cost graph (no ONNX here).

Each strategy is ``f(graph, budget_bytes=None) -> Plan``: without a budget the least peak
it can find, with one the least recompute time whose cost-model peak fits (its least-peak
plan when none does). The strategies, what each supports and its description are in one
registry (`registry.STRATEGIES`)."""
from .auto import auto
from .chain import chain
from .chen_greedy import chen_greedy
from .chen_sqrt import chen_sqrt
from .feng_huang import feng_huang
from .front import front, least_peak_within, pareto
from .greedy import greedy
from .kusumoto import kusumoto, kusumoto_approx
from .milp import milp
from .plan import Plan, make_plan, schedule_for
from .registry import DEFAULT_STRATEGY, STRATEGIES, Strategy, get_strategy
from .store_all import store_all

__all__ = ["STRATEGIES", "DEFAULT_STRATEGY", "Strategy", "get_strategy", "Plan", "make_plan", "schedule_for",
           "auto", "chain", "chen_greedy", "chen_sqrt", "feng_huang", "greedy", "kusumoto",
           "kusumoto_approx", "milp", "store_all", "front", "least_peak_within", "pareto"]
