"""The one registry of checkpoint strategies: name, solve function, description, and what each
supports. The CLI's `--strategy` and `strategies` listing, the service's ListStrategies, the
options check and `auto` all read it.

A strategy is called like its solve function, ``STRATEGIES[name](graph, budget_bytes=None)``,
and keeps its contract: asked for a budget it cannot honour, it refuses with
`InvalidOptionError` naming the strategies that can (it never ignores the budget). Each plan
says whether it is optimal under its solver's model (`Plan.exact`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..costgraph import CostGraph
from ..errors import InvalidOptionError
from .auto import auto
from .chain import chain
from .chen_greedy import chen_greedy
from .chen_sqrt import chen_sqrt
from .feng_huang import feng_huang
from .greedy import greedy
from .kusumoto import kusumoto, kusumoto_approx
from .milp import milp
from .plan import Plan
from .store_all import store_all


@dataclass(frozen=True)
class Strategy:
    name: str
    solve: Callable[..., Plan]
    description: str
    takes_budget: bool      # with a budget: the least recompute time whose cost-model peak fits
    exact_for: str = ""     # the model under which its plans can be optimal ("" : a heuristic)
    def check(self, budget_bytes: int | None) -> None:
        """Refuse what this strategy cannot do (before any work is spent)."""
        if budget_bytes is not None and not self.takes_budget:
            able = ", ".join(s.name for s in STRATEGIES.values() if s.takes_budget)
            raise InvalidOptionError(
                f"strategy {self.name!r} takes no memory budget ({self.description}); "
                f"strategies that plan for a budget: {able}")

    def __call__(self, graph: CostGraph, budget_bytes: int | None = None, **options) -> Plan:
        self.check(budget_bytes)
        if self.takes_budget:
            return self.solve(graph, budget_bytes=budget_bytes, **options)
        return self.solve(graph, **options)


_LIST = [
    Strategy("auto", auto,
             "every solver below within a fixed amount of work, scored by the cost model, then a local "
             "search from the best (default)", takes_budget=True,
             exact_for="the cost model, when its peak reaches the peak floor (a lower bound on every plan)"),
    Strategy("feng-huang", feng_huang,
             "Feng & Huang 2021: least peak on arbitrary graphs (exact for its segment model)",
             takes_budget=False, exact_for="the segment model, unless its effort limit was reached"),
    Strategy("kusumoto", kusumoto,
             "Kusumoto et al. 2019: least recompute time under a budget, exact lower-set DP (approximate "
             "above a width guard)", takes_budget=True,
             exact_for="its lower-set model, below the width guard"),
    Strategy("kusumoto-approx", kusumoto_approx,
             "Kusumoto et al. 2019: approximate DP over ancestor-closure lower sets", takes_budget=True),
    Strategy("chain", chain,
             "arXiv 2502.12499: exact DP / linear algorithm on layer chains (branches kept)",
             takes_budget=True, exact_for="its layer-chain model"),
    Strategy("greedy", greedy,
             "local search over checkpoint sets on the cost model, seeded with Chen and segmentations",
             takes_budget=True),
    Strategy("chen-greedy", chen_greedy,
             "Chen et al. 2016: greedy segments under a swept size budget", takes_budget=True),
    Strategy("chen-sqrt", chen_sqrt, "Chen et al. 2016: sqrt(n) equal-bytes segments", takes_budget=False),
    Strategy("store-all", store_all, "keep every forward tensor (no recomputation)", takes_budget=False),
    Strategy("milp", milp, "exact MILP of Kusumoto's model with HiGHS (small graphs; an oracle)",
             takes_budget=True, exact_for="Kusumoto's model, when HiGHS proves optimality"),
]
STRATEGIES: dict[str, Strategy] = {s.name: s for s in _LIST}
DEFAULT_STRATEGY = "auto"


def get_strategy(name: str) -> Strategy:
    """The registered strategy `name`, or InvalidOptionError naming the known ones."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise InvalidOptionError(f"unknown strategy {name!r} (known: {', '.join(STRATEGIES)})") from None
