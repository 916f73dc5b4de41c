"""Kusumoto's lower-set DP against a brute force over all strategies and the HiGHS MILP of the
same model; the approximate DP against the exact one; plans valid under the cost model."""
import math

import pytest

from graphopt.search.kusumoto import (build_model, closure_lower_sets, evaluate_chain, kusumoto,
                                      kusumoto_approx, lower_sets, solve_dp)
from graphopt.search.milp import milp
from graphopt.search.plan import make_plan

from synthetic import training_cost_graph
from test_search import assert_valid

# (n_forward, seed, max_fanin, random_ops)
CASES = [(3, 0, 1, 0.0), (3, 1, 3, 0.0), (4, 2, 2, 0.0), (4, 3, 3, 0.3), (5, 4, 1, 0.0),
         (5, 5, 2, 0.0), (5, 6, 3, 0.2), (6, 7, 2, 0.0), (6, 8, 3, 0.0), (7, 9, 1, 0.0),
         (7, 10, 2, 0.2), (7, 11, 3, 0.0), (8, 12, 2, 0.0), (9, 13, 2, 0.0), (9, 14, 3, 0.0)]


def all_chains(model, family, limit=5000):
    """Every strictly increasing chain of non-empty lower sets (None beyond `limit`)."""
    nonempty = [m for m in family if m]
    out = []

    def extend(last, chain):
        if len(out) > limit:
            return
        out.append(list(chain))
        for m in nonempty:
            if m & last == last and m != last:
                chain.append(m)
                extend(m, chain)
                chain.pop()

    extend(0, [])
    return out if len(out) <= limit else None


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def budgets(model, family):
    least = solve_dp(model, family, None)[0]
    store = evaluate_chain(model, [])[0]
    return least, store, sorted({least, least + (store - least) // 3, (least + store) // 2, store})


@pytest.mark.parametrize("n,seed,fanin,random_ops", CASES)
def test_exact_dp_equals_brute_force_and_milp(n, seed, fanin, random_ops):
    graph = training_cost_graph(n, seed=seed, max_fanin=fanin, random_ops=random_ops)
    model = build_model(graph)
    family = lower_sets(model)
    least, store, bs = budgets(model, family)
    chains = all_chains(model, family)
    evaluated = [evaluate_chain(model, c)[:2] for c in chains] if chains is not None else None

    # memory-centric: least model peak, then least time at that peak
    peak, seconds, chain = solve_dp(model, family, None)
    assert evaluate_chain(model, chain)[:2] == (peak, pytest.approx(seconds, rel=1e-12))
    if evaluated is not None:
        assert peak == min(p for p, _ in evaluated)
        assert close(seconds, min(t for p, t in evaluated if p == peak))
    oracle = milp(graph)
    assert oracle.notes["status"].startswith("Optimal")
    assert oracle.notes["model_least_peak_bytes"] == peak
    assert close(oracle.notes["objective"], seconds)
    assert oracle.notes["model_peak_bytes"] == peak

    # time-centric under budgets from the least peak to store-all
    for budget in bs:
        result = solve_dp(model, family, budget)
        assert result is not None and result[0] <= budget
        if evaluated is not None:
            assert close(result[1], min(t for p, t in evaluated if p <= budget))
        if budget in (bs[0], bs[len(bs) // 2]):
            oracle = milp(graph, budget)
            assert oracle.notes["status"].startswith("Optimal")
            assert close(oracle.notes["objective"], result[1])
            assert oracle.notes["model_peak_bytes"] <= budget
            assert_valid(graph, oracle)
        # the approximate DP: never better, feasible whenever the exact one is
        approx = solve_dp(model, closure_lower_sets(model), budget)
        assert approx is not None and approx[0] <= budget
        assert approx[1] >= result[1] - 1e-12
    # below the least peak nothing fits
    assert solve_dp(model, family, least - 1) is None


@pytest.mark.parametrize("n,seed,fanin,random_ops", CASES[::2])
def test_model_time_is_the_plans_recompute_time(n, seed, fanin, random_ops):
    graph = training_cost_graph(n, seed=seed, max_fanin=fanin, random_ops=random_ops)
    model = build_model(graph)
    chains = all_chains(model, lower_sets(model), limit=400) or []
    for chain in chains:
        _, seconds, kept = evaluate_chain(model, chain)
        plan = make_plan(graph, "check", kept)
        assert close(plan.recompute_seconds, seconds)


def test_store_all_chain_is_exact_on_a_chain_graph():
    graph = training_cost_graph(12, seed=3, max_fanin=1)
    model = build_model(graph)
    peak, seconds, kept = evaluate_chain(model, [])
    plan = make_plan(graph, "check", kept)
    assert seconds == 0 and plan.recompute_ops == 0
    assert plan.peak_bytes == peak


@pytest.mark.parametrize("n,seed,fanin", [(20, 1, 1), (25, 2, 2), (30, 3, 3), (40, 4, 2)])
def test_strategies_valid_and_budgets(n, seed, fanin):
    graph = training_cost_graph(n, seed=seed, max_fanin=fanin, random_ops=0.1)
    least = kusumoto(graph)
    approx = kusumoto_approx(graph)
    for plan in (least, approx):
        assert_valid(graph, plan)
        for op, copy in plan.schedule:
            if copy:
                assert graph.ops[op].recomputable, op
    assert least.notes["model_peak_bytes"] <= approx.notes["model_peak_bytes"]
    # a loose budget recomputes nothing
    model = build_model(graph)
    store_peak = evaluate_chain(model, [])[0]
    loose = kusumoto(graph, budget_bytes=max(store_peak, make_plan(graph, "x", evaluate_chain(model, [])[2]).peak_bytes))
    assert loose.recompute_seconds == 0 and loose.recompute_ops == 0
    # a budget between least and store-all is met by the real cost model
    full = make_plan(graph, "x", evaluate_chain(model, [])[2]).peak_bytes
    budget = (least.peak_bytes + full) // 2
    mid = kusumoto(graph, budget_bytes=budget)
    assert_valid(graph, mid)
    assert mid.peak_bytes <= budget
    assert mid.recompute_seconds <= least.recompute_seconds + 1e-9


def test_width_guard_falls_back_to_the_approximate_dp():
    graph = training_cost_graph(12, seed=5, max_fanin=3)
    assert kusumoto(graph).notes["exact"] is True
    plan = kusumoto(graph, max_lower_sets=3)
    assert plan.notes["exact"] is False
    assert plan.checkpoints == kusumoto_approx(graph).checkpoints
