"""Checkpoint search: solvers over the abstract cost graph (no ONNX here).

Each strategy is ``f(graph, budget_bytes=None) -> Plan``: without a budget the least peak
it can find, with one the least recompute time whose cost-model peak fits (its least-peak
plan when none does)."""
from .auto import auto
from .chain import chain
from .chen_greedy import chen_greedy
from .chen_sqrt import chen_sqrt
from .feng_huang import feng_huang
from .greedy import greedy
from .kusumoto import kusumoto, kusumoto_approx
from .milp import milp
from .plan import Plan, make_plan, schedule_for
from .store_all import store_all

STRATEGIES = {
    "auto": auto,
    "feng-huang": feng_huang,
    "kusumoto": kusumoto,
    "kusumoto-approx": kusumoto_approx,
    "chain": chain,
    "greedy": greedy,
    "chen-greedy": chen_greedy,
    "chen-sqrt": chen_sqrt,
    "store-all": store_all,
    "milp": milp,
}
DESCRIPTIONS = {
    "auto": "every solver below, scored by the cost model, then a local search from the best (default)",
    "feng-huang": "Feng & Huang 2021: least peak on arbitrary graphs (exact for its segment model)",
    "kusumoto": "Kusumoto et al. 2019: least recompute time under a budget, exact lower-set DP (approximate above a width guard)",
    "kusumoto-approx": "Kusumoto et al. 2019: approximate DP over ancestor-closure lower sets",
    "chain": "arXiv 2502.12499: exact DP / linear algorithm on layer chains (branches kept)",
    "greedy": "local search over checkpoint sets on the cost model, seeded with Chen and segmentations",
    "chen-greedy": "Chen et al. 2016: greedy segments under a swept size budget",
    "chen-sqrt": "Chen et al. 2016: sqrt(n) equal-bytes segments",
    "store-all": "keep every forward tensor (no recomputation)",
    "milp": "exact MILP of Kusumoto's model with HiGHS (small graphs; an oracle)",
}
DEFAULT_STRATEGY = "auto"

__all__ = ["STRATEGIES", "DESCRIPTIONS", "DEFAULT_STRATEGY", "Plan", "make_plan", "schedule_for",
           "auto", "chain", "chen_greedy", "chen_sqrt", "feng_huang", "greedy", "kusumoto",
           "kusumoto_approx", "milp", "store_all"]
