"""`greedy`: the first search for arbitrary DAGs — seeded local search over checkpoint sets.

Seeds: store-all, Chen's sqrt(n) plan and equal-bytes segmentations with 2..K segments.
From the best seed, toggle one candidate tensor at a time (largest first) and keep a toggle
when it lowers the objective, until a pass changes nothing or the time limit is reached.
Every candidate is evaluated by the one cost model on the order the runtime will execute,
so the result is never worse than Chen's sqrt(n) plan under that model.

Objective: least peak bytes, ties broken by recompute seconds; with a budget, first the
excess over the budget, then recompute seconds (least time that fits).
"""
from __future__ import annotations

import math
import time

from ..costgraph import CostGraph

from .chen_sqrt import chen_sqrt, segment_checkpoints
from .plan import Plan, make_plan
from .store_all import store_all


def objective(plan: Plan, budget_bytes: int | None, seconds_limit: float | None = None):
    """What the local search lowers (lexicographically). Without a budget or a limit: the peak,
    then the recompute seconds; with a budget: the excess over it, then the recompute seconds;
    with a step-time limit (`seconds_limit`, the predicted step's seconds): the excess over it,
    then the peak, then the step's seconds."""
    if seconds_limit is not None:
        seconds = plan.simulation.compute_seconds
        return (max(0.0, seconds - seconds_limit), plan.peak_bytes, seconds)
    if budget_bytes is None:
        return (plan.peak_bytes, plan.recompute_seconds)
    return (max(0, plan.peak_bytes - budget_bytes), plan.recompute_seconds, plan.peak_bytes)


def by_value(graph: CostGraph) -> list[str]:
    """Candidate checkpoints, those whose recomputation costs the most seconds per byte kept
    first (the order of a knapsack's greedy: what to keep when time matters)."""
    tensor_bytes = graph.tensor_bytes
    producer_seconds = {t: float(graph.ops[op].seconds)
                        for t, op in graph.forward_tensors.items()}
    return sorted(graph.candidate_checkpoints,
                  key=lambda t: -producer_seconds[t] / max(1, tensor_bytes.get(t, 0)))


def value_prefix(graph: CostGraph, budget_bytes: int, base=(), refresh_gap: int | None = None,
                 max_steps: int | None = None) -> Plan | None:
    """Keep `base` (a checkpoint set that fits, e.g. the least-peak plan's) plus the longest
    prefix of the other candidates in `by_value` order whose plan's peak fits `budget_bytes`:
    bisection on the prefix length, about log2(candidates) plan evaluations (the peak grows,
    though not strictly monotonically, with what is kept). `base` alone when no addition fits.
    `max_steps` bounds the work (schedule steps evaluated): the bisection stops there with the
    longest prefix found to fit; None if `base`'s own schedule is longer."""
    base = frozenset(base)
    ranked = [t for t in by_value(graph) if t not in base]
    lo, hi = 0, len(ranked)
    best = make_plan(graph, "value-prefix", base, refresh_gap, max_steps)
    if best is None:
        return None
    evaluated = 1
    steps = len(best.schedule)
    while lo < hi and (max_steps is None or steps < max_steps):
        mid = (lo + hi + 1) // 2
        plan = make_plan(graph, "value-prefix", base | frozenset(ranked[:mid]), refresh_gap, max_steps)
        evaluated += 1
        steps += max_steps if plan is None else len(plan.schedule)
        if plan is not None and plan.peak_bytes <= budget_bytes:
            lo, best = mid, plan
        else:
            hi = mid - 1
    # what it was handed and spent (auto's notes["local_searches"])
    best.notes.update(seed="value-prefix", added=lo, evaluated_plans=evaluated, evaluated_steps=steps,
                      handed={"base_checkpoints": len(base), "budget_bytes": budget_bytes, "max_steps": max_steps})
    return best


def greedy(graph: CostGraph, budget_bytes: int | None = None, *,
           time_limit_seconds: float = 20.0, max_seeds: int = 24, seeds: list[Plan] = (),
           refresh_gap: int | None = None, max_steps: int | None = None,
           min_evaluations: int = 8, seconds_limit: float | None = None) -> Plan:
    """Local search from the best of the built-in seeds and `seeds` (plans of other solvers),
    every plan scheduled with `refresh_gap` (see `schedule_for`), for `objective` (a budget,
    or a step-time limit `seconds_limit`: the least peak within it). `max_steps` bounds the
    work: the schedule steps of the plans it evaluates (seeds included), at least
    `min_evaluations` toggles; the same plan on every machine."""
    started = time.perf_counter()
    n = len(graph.forward_order)
    # the seeds given, each under this schedule (re-evaluated only if made under another one),
    # then with `max_seeds`, the built-in ones: store-all, Chen's sqrt(n), segmentations
    def under_gap(p: Plan) -> Plan | None:
        """`p` under this schedule; None when that schedule alone is longer than max_steps."""
        return p if p.refresh_gap == refresh_gap else make_plan(graph, p.strategy, p.checkpoints, refresh_gap,
                                                                 max_steps, **p.notes)
    given = list(seeds)
    # the seeds, in the order given, while they use at most half of the work (at least one)
    seeds = []
    for p in given:
        if seeds and max_steps is not None and sum(len(q.schedule) for q in seeds) > max_steps // 2:
            break
        q = under_gap(p)
        if q is not None:
            seeds.append(q)
    if max_seeds or not given:
        seeds += [q for q in map(under_gap, (store_all(graph), chen_sqrt(graph))) if q is not None]
    if not seeds:          # every seed's schedule is over the work limit: nothing to search from
        best = min(given, key=lambda p: objective(p, budget_bytes, seconds_limit))
        best.notes.update(seed=best.notes.get("seed", best.strategy), evaluated_plans=0, evaluated_steps=0,
                          schedule_over_work_limit=True)
        return best
    counts = sorted({max(2, round(n ** (k / max_seeds))) for k in range(1, max_seeds + 1)} |
                    {max(1, round(math.sqrt(n)) // 2), 2 * round(math.sqrt(n))}) if max_seeds else []
    for segments in counts:
        if segments < n:
            seeds.append(make_plan(graph, "greedy", segment_checkpoints(graph, segments), refresh_gap))
    best = min(seeds, key=lambda p: objective(p, budget_bytes, seconds_limit))
    current = set(best.checkpoints)
    tensor_bytes = graph.tensor_bytes
    if budget_bytes is None and seconds_limit is None:
        candidates = sorted(graph.candidate_checkpoints, key=lambda t: -tensor_bytes.get(t, 0))
    else:
        candidates = by_value(graph)
    evaluated = 0                                   # toggles tried
    steps = sum(len(p.schedule) for p in seeds)     # work so far
    improved = True

    def out_of_budget():
        return (time.perf_counter() - started >= time_limit_seconds
                or (max_steps is not None and steps >= max_steps and evaluated >= min_evaluations))

    while improved and not out_of_budget():
        improved = False
        for t in candidates:
            if out_of_budget():
                break
            trial = current ^ {t}
            plan = make_plan(graph, "greedy", trial, refresh_gap, max_steps)
            evaluated += 1
            if plan is None:                        # its schedule alone is over the work limit
                steps += max_steps
                continue
            steps += len(plan.schedule)
            if objective(plan, budget_bytes, seconds_limit) < objective(best, budget_bytes, seconds_limit):
                best, current, improved = plan, trial, True
    best.notes["seed"] = best.notes.get("seed", best.strategy)
    best.strategy = "greedy"
    best.notes.update(evaluated_plans=evaluated, evaluated_steps=steps, search_seconds=time.perf_counter() - started,
                      stopped_by_time=time.perf_counter() - started >= time_limit_seconds,
                      # what it was handed (auto's notes["local_searches"]), apart from the plan's own notes
                      handed={"seeds_given": len(given), "budget_bytes": budget_bytes, "seconds_limit": seconds_limit,
                              "max_steps": max_steps, "min_evaluations": min_evaluations,
                              "time_limit_seconds": time_limit_seconds})
    return best
