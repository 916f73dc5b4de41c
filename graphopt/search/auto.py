"""`auto` (the default): every solver's plan, then a local search on the one cost model.

The solvers optimize their papers' objectives, each adapted to measured bytes and seconds
(see their modules); none of them is the runtime's exact accounting (checkpoints freed after
their last reader, gradients of different sizes, the order). So `auto` runs Feng & Huang,
Kusumoto (time-centric under a budget, memory-centric without), Chen's greedy, the chain
solver, Chen √n and store-all, scores each plan with the one cost model on the order the
runtime will execute, and hands the best ones to `greedy`'s local search as seeds. The
result is never worse, under the cost model, than any of those solvers' plans.

Objective: least peak bytes, then least recompute seconds; with a budget, least recompute
seconds among plans whose peak fits (the least peak when none fits).

Time: the exact solvers are skipped on graphs too large for them (their own guards make
them approximate first) and the local search gets what is left of `time_limit_seconds`.
"""
from __future__ import annotations

import time

import networkx as nx

from .chain import chain
from .chen_greedy import chen_greedy
from .chen_sqrt import chen_sqrt
from .feng_huang import feng_huang
from .greedy import greedy, objective
from .kusumoto import kusumoto, kusumoto_approx
from .plan import Plan, candidate_checkpoints
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


def auto(graph: nx.DiGraph, budget_bytes: int | None = None, *,
         time_limit_seconds: float = 8.0) -> Plan:
    started = time.perf_counter()
    deadline = started + time_limit_seconds
    candidates = len(candidate_checkpoints(graph))
    seeds: list[Plan] = []
    seed_seconds = {}
    for name, solve in SOLVERS.items():
        limit = SOLVER_LIMITS[name]
        remaining = deadline - time.perf_counter()
        if (limit is not None and candidates > limit) or (seeds and remaining < 0.4 * time_limit_seconds):
            continue
        t = time.perf_counter()
        if name == "feng-huang":
            plan = solve(graph, budget_bytes, time_limit_seconds=0.3 * remaining)
        else:
            plan = solve(graph, budget_bytes=budget_bytes)
        seed_seconds[name] = time.perf_counter() - t
        plan.notes["seed"] = name
        seeds.append(plan)
    seeds.sort(key=lambda p: objective(p, budget_bytes))
    remaining = max(0.5, deadline - time.perf_counter())
    best = greedy(graph, budget_bytes, time_limit_seconds=remaining, seeds=seeds[:3], max_seeds=0)
    if objective(seeds[0], budget_bytes) <= objective(best, budget_bytes):
        best = seeds[0]
    best.notes.update(
        seed=best.notes.get("seed", best.strategy),
        seeds={p.notes["seed"]: {"peak_bytes": p.peak_bytes, "recompute_seconds": p.recompute_seconds}
               for p in seeds},
        seed_seconds=seed_seconds,
        search_seconds=time.perf_counter() - started)
    best.strategy = "auto"
    return best
