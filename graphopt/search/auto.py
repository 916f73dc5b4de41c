"""`auto` (the default): every solver's plan, then a local search on the one cost model.

The solvers optimize their papers' objectives, each adapted to measured bytes and seconds
(see their modules); none of them is the runtime's exact accounting (checkpoints freed after
their last reader, gradients of different sizes, the order). So `auto` runs Feng & Huang,
Kusumoto (time-centric under a budget, memory-centric without), Chen's greedy, the chain
solver, Chen √n and store-all, scores each plan with the one cost model on the order the
runtime will execute, and hands the best ones to `greedy`'s local search as seeds, once per
recomputation schedule (each op recomputed once; recomputed tensors dropped across long gaps
and recomputed again: more time, less memory). The result's peak is never above, under
the cost model, the best of those solvers' plans (the tolerance below never crosses it).

The floor. `peak_floor_bytes` is a lower bound on every plan's peak: what the backward
holds whatever is recomputed (gradients kept as graph outputs, a large loss gradient, kernel
work buffers). On transformers at training-like sizes the least-peak plans sit on it (GPT-2
6 layers at 4x256 tokens: at the end of the backward, where the tied embedding's gradient is
assembled beside every other gradient). The fast solvers run first; once a plan is within
PEAK_TOLERANCE of the floor no solver or local search can lower the peak, so the slow solvers
are skipped and the search spends its evaluations on recomputation time at that peak instead:
`value_prefix` (keep the tensors that cost the most seconds per byte to recompute, as many as
fit) from nothing and from the best plan, then `greedy` under that peak as a budget. The same
switch happens when a local search reaches the floor.

Objective: least peak bytes; among plans within 1% of it, least recompute seconds (a plan
that recomputes several times more for a 0.5% lower peak is not what users want). With a
budget, least recompute seconds among plans whose peak fits (the least peak when none fits).

Time: the exact solvers are skipped on graphs too large for them (their own guards make
them approximate first); each local search gets EVALUATIONS_PER_SCHEDULE plan evaluations,
so the plan does not depend on the machine's speed (except when Feng & Huang reaches its
FENG_HUANG_SECONDS cap). A wall-clock limit is only a safety net (60 s; 8 s above
LARGE_GRAPH_OPS ops, where it decides: 10,000 ops are planned in < 10 s).
"""
from __future__ import annotations

import time

from ..costgraph import CostGraph

from .chain import chain
from .chen_greedy import chen_greedy
from .chen_sqrt import chen_sqrt
from .feng_huang import feng_huang
from .greedy import greedy, objective, value_prefix
from .kusumoto import kusumoto, kusumoto_approx
from .plan import Plan, peak_floor_bytes
from .store_all import store_all

# candidate tensors above which a solver is left out (its time grows too fast to pay off
# within the default time limit on a 2-core machine; see benchmarks/solver_timing.py)
SOLVER_LIMITS = {
    "store-all": None,
    "chen-sqrt": None,
    "chen-greedy": 20_000,
    "feng-huang": 2_000,      # has its own deadline (then a beam)
    "kusumoto-approx": 400,
    "kusumoto": 120,          # exact below its width guard, else approximate
    "chain": 1_000,
}
SOLVERS = {
    "store-all": store_all,
    "chen-sqrt": chen_sqrt,
    "chen-greedy": chen_greedy,
    "feng-huang": lambda graph, budget_bytes=None, time_limit_seconds=None:
        feng_huang(graph, budget_bytes, time_limit_seconds=time_limit_seconds),
    "kusumoto-approx": kusumoto_approx,
    "kusumoto": kusumoto,
    "chain": chain,
}


# Schedules searched: each recomputed op once (None), and recomputed tensors dropped across
# gaps of more than 8 backward ops or after every reader (0), recomputed again when needed.
REFRESH_GAPS = (None, 8, 0)
# Without a budget, a plan within this fraction of the least peak that recomputes less wins.
PEAK_TOLERANCE = 0.01


def choose(plans: list[Plan], budget_bytes: int | None, cap_bytes: int | None = None) -> Plan:
    """With a budget: least recompute seconds among plans that fit (least peak if none fits).
    Without: least recompute seconds among plans within PEAK_TOLERANCE of the least peak and
    not above `cap_bytes` (the best solver's plan: the tolerance never makes auto worse)."""
    if budget_bytes is not None:
        return min(plans, key=lambda p: objective(p, budget_bytes))
    least = min(p.peak_bytes for p in plans)
    limit = least * (1 + PEAK_TOLERANCE)
    if cap_bytes is not None:
        limit = min(limit, max(cap_bytes, least))
    near = [p for p in plans if p.peak_bytes <= limit]
    return min(near, key=lambda p: (p.recompute_seconds, p.peak_bytes))


def default_time_limit_seconds(graph: CostGraph) -> float:
    """A safety net: below it the evaluation budget decides, so plans do not depend on the
    machine's speed; large graphs (over LARGE_GRAPH_OPS ops) are cut at 8 s (10,000 ops
    planned in under 10 s on 2 cores)."""
    return 8.0 if len(graph) > LARGE_GRAPH_OPS else 60.0


LARGE_GRAPH_OPS = 3_000
FENG_HUANG_SECONDS = 5.0         # then its beam: exact Feng & Huang explodes on wide graphs
EVALUATIONS_PER_SCHEDULE = 600   # local-search plan evaluations per refresh gap


# Solvers in the order auto runs them: the fast ones first, so that on graphs where they
# already reach the peak floor (`peak_floor_bytes`) the slow ones are not run at all.
FAST_SOLVERS = ("store-all", "chen-sqrt", "chen-greedy", "chain")
# local-search plan evaluations spent on recomputation time once a plan is at the floor
EVALUATIONS_AT_FLOOR = 400


def auto(graph: CostGraph, budget_bytes: int | None = None, *,
         time_limit_seconds: float | None = None) -> Plan:
    started = time.perf_counter()
    if time_limit_seconds is None:
        time_limit_seconds = default_time_limit_seconds(graph)
    deadline = started + time_limit_seconds
    candidates = len(graph.candidate_checkpoints)
    floor_bytes = peak_floor_bytes(graph)
    seeds: list[Plan] = []
    seed_seconds = {}

    def at_floor() -> bool:
        """Without a budget: a seed within PEAK_TOLERANCE of the floor (no plan is lower)."""
        return (budget_bytes is None and bool(seeds)
                and min(p.peak_bytes for p in seeds) <= floor_bytes * (1 + PEAK_TOLERANCE))

    names = list(FAST_SOLVERS) + [name for name in SOLVERS if name not in FAST_SOLVERS]
    for name in names:
        solve, limit = SOLVERS[name], SOLVER_LIMITS[name]
        remaining = deadline - time.perf_counter()
        if (limit is not None and candidates > limit) or (seeds and remaining < 0.5 * time_limit_seconds):
            continue
        if name not in FAST_SOLVERS and at_floor():
            continue
        t = time.perf_counter()
        if name == "feng-huang":
            plan = solve(graph, budget_bytes, time_limit_seconds=min(FENG_HUANG_SECONDS, 0.3 * remaining))
        else:
            plan = solve(graph, budget_bytes=budget_bytes)
        seed_seconds[name] = time.perf_counter() - t
        plan.notes["seed"] = name
        seeds.append(plan)
    seeds.sort(key=lambda p: objective(p, budget_bytes))
    found = [seeds[0]]
    reached_floor = at_floor()
    if reached_floor:
        # no plan has a lower peak: spend the search on recomputation time at this peak
        # (least recompute seconds whose peak fits the best seed's)
        target = seeds[0].peak_bytes
        prefixes = [value_prefix(graph, target, base) for base in ((), seeds[0].checkpoints)]
        for prefix in prefixes:
            prefix.notes["seed"] = "value-prefix"
        fitting = sorted([p for p in seeds + prefixes if p.peak_bytes <= target],
                         key=lambda p: p.recompute_seconds)
        found.extend(prefixes)
        found.append(greedy(graph, target, time_limit_seconds=max(0.3, deadline - time.perf_counter()),
                            seeds=fitting[:3], max_seeds=0, max_evaluations=EVALUATIONS_AT_FLOOR))
    else:
        for k, gap in enumerate(REFRESH_GAPS):
            share = (deadline - time.perf_counter()) / (len(REFRESH_GAPS) - k)
            plan = greedy(graph, budget_bytes, time_limit_seconds=max(0.3, share), seeds=seeds[:3],
                          max_seeds=0, refresh_gap=gap, max_evaluations=EVALUATIONS_PER_SCHEDULE)
            found.append(plan)
            if budget_bytes is None and plan.peak_bytes <= floor_bytes * (1 + PEAK_TOLERANCE):
                # at the floor with this schedule: the remaining effort goes to its time
                reached_floor = True
                prefixes = [value_prefix(graph, plan.peak_bytes, base, gap) for base in ((), plan.checkpoints)]
                found.extend(prefixes)
                fitting = sorted([q for q in [plan] + prefixes if q.peak_bytes <= plan.peak_bytes],
                                 key=lambda q: q.recompute_seconds)
                found.append(greedy(graph, plan.peak_bytes, refresh_gap=gap, seeds=fitting, max_seeds=0,
                                    time_limit_seconds=max(0.3, deadline - time.perf_counter()),
                                    max_evaluations=EVALUATIONS_AT_FLOOR))
                break
    best = choose(found, budget_bytes, cap_bytes=seeds[0].peak_bytes)
    best.notes.update(
        seed=best.notes.get("seed", best.strategy),
        seeds={p.notes["seed"]: {"peak_bytes": p.peak_bytes, "recompute_seconds": p.recompute_seconds}
               for p in seeds},
        seed_seconds=seed_seconds,
        peak_floor_bytes=floor_bytes,
        reached_floor=reached_floor,
        search_seconds=time.perf_counter() - started)
    best.strategy = "auto"
    return best
