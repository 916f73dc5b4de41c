"""Peak and step time together: the memory-time front of a strategy, and the least peak
within a step-time limit. No ONNX here.

A strategy that takes budgets returns, for a budget, its least-time plan whose cost-model peak
fits (`registry.Strategy`). Over budgets from its least-peak plan's peak to store-all's, those
plans trace the front: each point is a plan no other plan found beats in both peak and
predicted step time (`Simulation.compute_seconds`: the measured seconds of every step, a
recomputed copy `graph.recompute_factor` times its op's).

`least_peak_within(graph, solve, seconds_limit)`: the least-peak plan whose predicted step time
is within the limit, by bisection on the budget (a tighter budget costs more time); the
least-peak plan itself when it fits, store-all (least time) when nothing does.
"""
from __future__ import annotations

from typing import Callable

from ..costgraph import CostGraph
from .plan import Plan
from .store_all import store_all

Solve = Callable[..., Plan]   # (graph, budget_bytes=None) -> Plan

# Bisection steps between the least-peak plan's peak and store-all's: the budget found is
# within (store-all - least peak) / 2**BISECTION_STEPS of the tightest that fits the limit,
# or within BISECTION_TOLERANCE of the peak found, whichever is reached first (a narrow range
# needs fewer solves: each is a whole `auto` search).
BISECTION_STEPS = 6
BISECTION_TOLERANCE = 0.01


def _seconds(plan: Plan) -> float:
    return plan.simulation.compute_seconds


def pareto(plans: list[Plan]) -> list[Plan]:
    """The plans no other beats in both peak and predicted step time, by increasing peak
    (one plan per distinct checkpoint set)."""
    seen, unique = set(), []
    for p in sorted(plans, key=lambda p: (p.peak_bytes, _seconds(p))):
        key = (p.checkpoints, p.refresh_gap)
        if key not in seen:
            seen.add(key)
            unique.append(p)
    front: list[Plan] = []
    for p in unique:
        if not front or _seconds(p) < _seconds(front[-1]):
            front.append(p)
    return front


def front(graph: CostGraph, solve: Solve, points: int = 8, least_peak: Plan | None = None) -> list[Plan]:
    """The strategy's memory-time front: its least-peak plan, store-all, and its least-time plan
    for `points` - 2 budgets evenly spaced between their peaks (Pareto-filtered)."""
    low = least_peak or solve(graph)
    high = store_all(graph)
    plans = [low, high]
    span = high.peak_bytes - low.peak_bytes
    inner = max(0, points - 2)
    for i in range(1, inner + 1):
        budget = low.peak_bytes + span * i // (inner + 1)
        plan = solve(graph, budget_bytes=budget)
        if plan.peak_bytes <= budget:
            plans.append(plan)
    return pareto(plans)


def least_peak_within(graph: CostGraph, solve: Solve, seconds_limit: float,
                      least_peak: Plan | None = None, *,
                      refine: Callable[[CostGraph, list[Plan], float], Plan] | None = None) -> Plan:
    """The least-peak plan the strategy finds whose predicted step time is at most
    `seconds_limit` (see the module docstring); then, where given, `refine(graph, the plans
    tried, seconds_limit)` searches on from them, and its plan is kept where it has a lower
    peak within the limit. `notes["seconds_limit"]` records the limit and
    `notes["front_tried"]` the plans' (peak, seconds) pairs."""
    low = least_peak or solve(graph)
    tried = [low]
    best: Plan | None = low if _seconds(low) <= seconds_limit else None
    if best is None:
        high = store_all(graph)
        tried.append(high)
        if _seconds(high) <= seconds_limit:
            best = high
            lo, hi = low.peak_bytes, high.peak_bytes   # lo: too slow; hi: fits
            for _ in range(BISECTION_STEPS):
                if hi - lo <= max(1, BISECTION_TOLERANCE * hi):
                    break
                budget = (lo + hi) // 2
                plan = solve(graph, budget_bytes=budget)
                tried.append(plan)
                fits_budget = plan.peak_bytes <= budget
                if fits_budget and _seconds(plan) <= seconds_limit:
                    hi = plan.peak_bytes
                    if plan.peak_bytes < best.peak_bytes or (plan.peak_bytes == best.peak_bytes
                                                             and _seconds(plan) < _seconds(best)):
                        best = plan
                else:
                    lo = budget
            if refine is not None:
                refined = refine(graph, list(tried), seconds_limit)
                tried.append(refined)
                if _seconds(refined) <= seconds_limit and (refined.peak_bytes, _seconds(refined)) < (
                        best.peak_bytes, _seconds(best)):
                    best = refined
        else:
            best = min(tried, key=_seconds)
    best.notes["seconds_limit"] = seconds_limit
    best.notes["front_tried"] = [(p.peak_bytes, _seconds(p)) for p in tried]
    return best


__all__ = ["front", "least_peak_within", "pareto", "BISECTION_STEPS"]
