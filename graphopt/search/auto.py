"""`auto` (the default): every solver's plan, then a local search on the one cost model.

The solvers optimize their papers' objectives, each adapted to measured bytes and seconds
(see their modules); none of them is the runtime's exact accounting (checkpoints freed after
their last reader, gradients of different sizes, the order). So `auto` runs Feng & Huang,
Kusumoto (time-centric under a budget, memory-centric without), Chen's greedy, the chain
solver, Chen √n and store-all, scores each plan with the one cost model on the order the
runtime will execute, and hands the best ones to `greedy`'s local search as seeds, once per
recomputation schedule (each op recomputed once; recomputed tensors dropped across long gaps
and recomputed again: more time, less memory); a second local search per schedule starts
from keeping nothing (the least peak sometimes keeps less than every solver's plan). The result's peak is never above, under
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

Work, not time. Every limit inside `auto` is counted in work, so a plan does not depend on
the machine's speed: a solver is run only on graphs with at most its `Seed.max_candidates`
candidate checkpoints (the exact DPs grow too fast beyond); Feng & Huang gets
FENG_HUANG_LABELS and FENG_HUANG_COMPARISONS of work (then the best so far); Chen's greedy a grid of CHEN_GREEDY_GRID
budgets; the chain solver CHAIN_BOUNDS model bounds; Kusumoto's exact DP KUSUMOTO_LOWER_SETS
lower sets;
the local searches EVALUATED_STEPS schedule steps of plan evaluations (fewer above
LARGE_GRAPH_OPS ops; about 25 evaluations per schedule on a 3,000-op graph, about 10 on
10,000 ops; an evaluation is one `make_plan`: schedule, runtime order and simulation, linear
in the schedule's length): a third per schedule, of which 70% for the search from the best
seeds and 30% for the one from keeping nothing. A schedule whose search reaches the floor
gets three quarters of its third again for time at that peak (two value prefixes of an eighth,
a search of a half) and the later schedules are not searched; seeds already at the floor leave
the whole work to that (an eighth, an eighth, a half). The plan's notes["local_searches"] say
what each search was handed (work, budget, schedule, time) and what it spent and found. Measured with
`python benchmarks/solver_timing.py` (families and `--corpus`). A wall-clock limit remains
only as a safety net (`time_limit_seconds`, default 60 s), never reached on the benchmarks.
"""
from __future__ import annotations

import dataclasses
import time
import weakref

from typing import Callable

from ..costgraph import CostGraph
from .chain import chain
from .chen_greedy import chen_greedy
from .chen_sqrt import chen_sqrt
from .feng_huang import feng_huang
from .greedy import greedy, objective, value_prefix
from .kusumoto import kusumoto, kusumoto_approx
from .plan import Plan, make_plan, peak_floor_bytes
from .store_all import store_all


@dataclasses.dataclass(frozen=True)
class Seed:
    """A solver whose plan seeds the local search: run on graphs with at most `max_candidates`
    candidate checkpoints (None: always; beyond, the exact DPs grow too fast: see
    benchmarks/solver_timing.py). Its name is its registry name."""
    name: str
    solve: Callable[..., Plan]
    takes_budget: bool
    max_candidates: int | None = None
    fast: bool = False       # run even when a plan is already at the peak floor


# The seeds in the order they run: the fast ones first, so that where they already reach the
# peak floor the slow ones are not run.
SEEDS = (
    Seed("store-all", store_all, takes_budget=False, fast=True),
    Seed("chen-sqrt", chen_sqrt, takes_budget=False, fast=True),
    Seed("chen-greedy", chen_greedy, takes_budget=True, fast=True),
    Seed("chain", chain, takes_budget=True, max_candidates=500, fast=True),
    Seed("feng-huang", feng_huang, takes_budget=False, max_candidates=150),
    Seed("kusumoto", kusumoto, takes_budget=True, max_candidates=120),
    Seed("kusumoto-approx", kusumoto_approx, takes_budget=True, max_candidates=40),
)
# work of its branch and bound (labels x frontier), then the best so far: at 30,000 instead of
# 150,000, the same least peaks within 1.1x, 1.25x and 1.5x store-all's step on the six examples'
# graphs (both base orders), 4 s less CPU on densenet's (by hand, this stop)
FENG_HUANG_LABELS = 30_000
FENG_HUANG_COMPARISONS = 2_000_000  # ... and its dominance checks (feng_huang.Effort)
CHEN_GREEDY_GRID = (16, 6)      # budgets on Chen's grid, then refined around the best (at least)
CHEN_GREEDY_GRID_LARGEST = (40, 12)   # (at most: its own default)
CHEN_GREEDY_STEPS = 60_000      # schedule steps of its evaluations, between those two
CHAIN_BOUNDS = 4                # model bounds the chain solver tries above its least peak
KUSUMOTO_LOWER_SETS = 300       # its exact DP (quadratic in them) up to this many, else approximate
EVALUATED_STEPS = 200_000       # schedule steps all local searches may evaluate together,
LARGE_GRAPH_OPS = 5_000         # scaled down by LARGE_GRAPH_OPS / ops above that many ops
MIN_EVALUATIONS = 4             # toggles of the first local search, however large the graph
EVALUATIONS_AT_FLOOR_SHARE = 0.5  # of the local-search work, once a plan is at the floor
FROM_NOTHING_SHARE = 0.3        # of each schedule's work, for the search from keeping nothing
# Schedules searched: each recomputed op once (None), and recomputed tensors dropped across
# gaps of more than 8 backward ops or after every reader (0), recomputed again when needed.
REFRESH_GAPS = (None, 8, 0)
# Without a budget, a plan within this fraction of the least peak that recomputes less wins.
PEAK_TOLERANCE = 0.01
# past the safety net's deadline, each local search still gets this long (its seeds' evaluation)
MIN_SEARCH_SECONDS = 0.3
LIMIT_SEARCH_SECONDS = 20.0     # least_peak_local's safety net per local search


# A seed that takes no budget gives the same plan for every budget (its work is counted, not
# timed): solved once per graph and reused by every later `auto` on it (a step-time limit is met
# by bisection on the budget: the unet example ran Feng & Huang's 1.3 s seven times per order).
_BUDGETLESS_SEEDS: "weakref.WeakKeyDictionary[CostGraph, dict[str, Plan]]" = weakref.WeakKeyDictionary()


def _seed_options(name: str, graph: CostGraph) -> dict:
    if name == "feng-huang":
        return {"max_labels": FENG_HUANG_LABELS, "max_comparisons": FENG_HUANG_COMPARISONS,
                "time_limit_seconds": None}
    if name == "chen-greedy":
        # its plan evaluations, as many as CHEN_GREEDY_STEPS buy (at least the smaller grid)
        evaluations = min(sum(CHEN_GREEDY_GRID_LARGEST), max(sum(CHEN_GREEDY_GRID),
                                                             CHEN_GREEDY_STEPS // max(1, len(graph))))
        refine = max(CHEN_GREEDY_GRID[1], evaluations // 4)
        return {"grid": evaluations - refine, "refine": refine}
    if name == "chain":
        return {"bounds": CHAIN_BOUNDS}
    if name == "kusumoto":
        return {"max_lower_sets": KUSUMOTO_LOWER_SETS}
    return {}


def _work_steps(graph: CostGraph) -> int:
    """The schedule steps all local searches of one `auto` (or `least_peak_local`) may evaluate:
    EVALUATED_STEPS, scaled down by LARGE_GRAPH_OPS / ops above that many ops."""
    return int(EVALUATED_STEPS * min(1.0, LARGE_GRAPH_OPS / max(1, len(graph))))


def _local_search(graph: CostGraph, searches: list[dict], start: str, gap: int | None, budget_bytes: int | None,
                  starts: list[Plan], max_steps: int, min_evaluations: int, time_limit_seconds: float,
                  seconds_limit: float | None = None) -> Plan:
    """`greedy` from `starts` alone (none of its built-in seeds) under schedule `gap`, with this
    much work; what it was handed and what it found appended to `searches`."""
    plan = greedy(graph, budget_bytes, time_limit_seconds=time_limit_seconds, seeds=starts, max_seeds=0,
                  refresh_gap=gap, max_steps=max_steps, min_evaluations=min_evaluations,
                  seconds_limit=seconds_limit)
    _searched(searches, start, plan)
    return plan


def _searched(searches: list[dict], start: str, plan: Plan) -> None:
    """One local search's (or value prefix's) record in the plan's notes["local_searches"] (where
    the work went): where it started, what it was handed and spent, by its own notes, and what it
    found."""
    handed = plan.notes.get("handed", {})
    searches.append({"from": start, "refresh_gap": plan.refresh_gap,
                     **{key: handed.get(key) for key in ("seeds_given", "base_checkpoints", "budget_bytes",
                                                         "seconds_limit", "max_steps", "min_evaluations",
                                                         "time_limit_seconds")},
                     "evaluated_steps": plan.notes.get("evaluated_steps"),
                     "evaluated_plans": plan.notes.get("evaluated_plans"),
                     "checkpoints": plan.checkpoints, "peak_bytes": plan.peak_bytes,
                     "recompute_seconds": plan.recompute_seconds})


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


def least_peak_local(graph: CostGraph, plans: list[Plan], seconds_limit: float) -> Plan:
    """The local search for the least peak whose predicted step time is within `seconds_limit`
    (`greedy.objective` with the limit), from the best of `plans` (a bisection's on the budget),
    once per recomputation schedule as in `auto`, each from the best plan so far, with `auto`'s
    work (EVALUATED_STEPS). The bisection's plans are each a least-time plan for a budget; the
    least peak within the time often lies between them (`pipeline.LIMIT_SEARCH_REFINE`)."""
    def key(p: Plan):
        return objective(p, None, seconds_limit)
    work = _work_steps(graph)
    found = list(plans)
    searches: list[dict] = []
    for gap in REFRESH_GAPS:
        found.append(_local_search(graph, searches, "best-so-far", gap, None, [min(found, key=key)],
                                   work // len(REFRESH_GAPS), MIN_EVALUATIONS, LIMIT_SEARCH_SECONDS, seconds_limit))
    best = min(found, key=key)
    if best.strategy == "greedy":        # found here: auto's plan, as the report names it
        best.notes.update(refined_within_seconds=True, local_searches=searches)
        best.strategy = "auto"
    return best


def auto(graph: CostGraph, budget_bytes: int | None = None, *,
         time_limit_seconds: float = 60.0) -> Plan:
    started = time.perf_counter()
    deadline = started + time_limit_seconds  # a safety net only: work limits decide
    candidates = len(graph.candidate_checkpoints)
    floor_bytes = peak_floor_bytes(graph)
    seeds: list[Plan] = []
    seed_seconds = {}

    def at_floor() -> bool:
        """Without a budget: a seed within PEAK_TOLERANCE of the floor (no plan is lower)."""
        return (budget_bytes is None and bool(seeds)
                and min(p.peak_bytes for p in seeds) <= floor_bytes * (1 + PEAK_TOLERANCE))

    for seed in SEEDS:
        name, limit = seed.name, seed.max_candidates
        if (limit is not None and candidates > limit) or (seeds and time.perf_counter() > deadline):
            continue
        if not seed.fast and at_floor():
            continue
        t = time.perf_counter()
        if seed.takes_budget:
            plan = seed.solve(graph, budget_bytes=budget_bytes, **_seed_options(name, graph))
        else:
            solved = _BUDGETLESS_SEEDS.setdefault(graph, {})
            if name not in solved:
                solved[name] = seed.solve(graph, **_seed_options(name, graph))
            plan = dataclasses.replace(solved[name], notes=dict(solved[name].notes))
        seed_seconds[name] = time.perf_counter() - t
        plan.notes["seed"] = name
        seeds.append(plan)
    seeds.sort(key=lambda p: objective(p, budget_bytes))
    found = [seeds[0]]
    work = _work_steps(graph)

    def remaining() -> float:
        return max(MIN_SEARCH_SECONDS, deadline - time.perf_counter())

    searches: list[dict] = []       # notes["local_searches"]

    def local(start: str, gap: int | None, budget: int | None, starts: list[Plan], max_steps: int,
              min_evaluations: int) -> Plan:
        return _local_search(graph, searches, start, gap, budget, starts, max_steps, min_evaluations, remaining())

    reached_floor = at_floor()
    if reached_floor:
        # no plan has a lower peak: spend the search on recomputation time at this peak
        # (least recompute seconds whose peak fits the best seed's)
        target = seeds[0].peak_bytes
        prefixes = [p for p in (value_prefix(graph, target, base, max_steps=work // 8)
                                for base in ((), seeds[0].checkpoints)) if p is not None]
        for prefix in prefixes:
            _searched(searches, "value-prefix", prefix)
        fitting = sorted([p for p in seeds + prefixes if p.peak_bytes <= target],
                         key=lambda p: p.recompute_seconds)
        found.extend(prefixes)
        found.append(local("at-floor", None, target, fitting[:3], work // 2, 0))
    else:
        # each recomputation schedule gets an equal share of the steps (a schedule that
        # recomputes more is longer, so it gets fewer evaluations); the first starts from the
        # best seeds, the others from the best plan so far and the best seed
        share = work // len(REFRESH_GAPS)
        for gap in REFRESH_GAPS:
            starts = seeds[:3] if gap is None else [min(found, key=lambda p: objective(p, budget_bytes))] + seeds[:3]
            plan = local("seeds", gap, budget_bytes, starts, int(share * (1 - FROM_NOTHING_SHARE)),
                         MIN_EVALUATIONS if gap is None else 0)
            found.append(plan)
            # and from the other end, keeping nothing (every seed may keep more than the best
            # plan): a second local search, its result beside the first (the objective then
            # prefers the one that recomputes less within PEAK_TOLERANCE)
            nothing = make_plan(graph, "recompute-all", (), gap, max_steps=int(share * FROM_NOTHING_SHARE))
            if nothing is not None:
                other = local("recompute-all", gap, budget_bytes, [nothing], int(share * FROM_NOTHING_SHARE), 0)
                found.append(other)
                plan = min((plan, other), key=lambda p: objective(p, budget_bytes))
            if budget_bytes is None and plan.peak_bytes <= floor_bytes * (1 + PEAK_TOLERANCE):
                # at the floor with this schedule: the rest of the effort goes to its time
                reached_floor = True
                prefixes = [p for p in (value_prefix(graph, plan.peak_bytes, base, gap, max_steps=share // 8)
                                        for base in ((), plan.checkpoints)) if p is not None]
                for prefix in prefixes:
                    _searched(searches, "value-prefix", prefix)
                found.extend(prefixes)
                fitting = sorted([q for q in [plan] + prefixes if q.peak_bytes <= plan.peak_bytes],
                                 key=lambda q: q.recompute_seconds)
                found.append(local("at-floor", gap, plan.peak_bytes, fitting, int(share * EVALUATIONS_AT_FLOOR_SHARE),
                                   MIN_EVALUATIONS))
                break
    best = choose(found, budget_bytes, cap_bytes=seeds[0].peak_bytes)
    best.notes.update(
        seeds={p.notes["seed"]: {"peak_bytes": p.peak_bytes, "recompute_seconds": p.recompute_seconds}
               for p in seeds},
        seed_seconds=seed_seconds,
        peak_floor_bytes=floor_bytes,
        reached_floor=reached_floor,
        local_searches=searches,
        # optimal under the cost model: no plan of any checkpoint set has a lower peak
        exact=budget_bytes is None and best.peak_bytes <= floor_bytes,
        stopped_by_time=time.perf_counter() > deadline,
        search_seconds=time.perf_counter() - started)
    best.strategy = "auto"
    return best
