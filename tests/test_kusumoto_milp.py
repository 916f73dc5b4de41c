"""Kusumoto's lower-set DP against a brute force over all strategies and the HiGHS MILP of the
same model (two oracles that share nothing with the DP but the model's definition, on branching
DAGs); the approximate DP against the exact one; plans valid under the cost model."""
import math

import pytest

from graphopt.search.kusumoto import (build_model, closure_lower_sets, evaluate_chain, kusumoto,
                                      kusumoto_approx, lower_sets, solve_dp)
from graphopt.search.milp import milp
from graphopt.search.plan import make_plan

from graphopt_zoo.synthetic import branching_cost_graph, branching_stats, training_cost_graph
from test_search import assert_valid

# (n_forward, seed, random_ops): branching DAGs of 3-7 forward ops (see test_cases_branch)
CASES = [(n, 100 * n + k, (0.0, 0.0, 0.2)[k]) for n in (3, 4, 5, 6, 7) for k in range(3)]


def case_graph(n, seed, random_ops):
    return branching_cost_graph(n, seed=seed, random_ops=random_ops)


def test_cases_branch():
    """Most cases are real DAGs (parallel branches, fan-out, joins), several are too wide for
    the brute force over chains (the MILP is their oracle)."""
    graphs = [case_graph(*case) for case in CASES]
    assert sum(branching_stats(g).branching for g in graphs) >= 0.6 * len(CASES)
    widths = [len(lower_sets(build_model(g))) for g in graphs]
    assert max(widths) >= 20, widths

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


@pytest.mark.parametrize("n,seed,random_ops", CASES)
def test_exact_dp_equals_brute_force_and_milp(n, seed, random_ops):
    graph = case_graph(n, seed, random_ops)
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


# Chains with skips (up to `max_fanin` inputs per op) where a tighter budget costs recompute
# time at several steps: the branching CASES above mostly have least peak == store-all's, so
# their budgets never trade time and cannot tell the time-centric DP's choices apart.
TRADE_CASES = [(8, 0, 1), (8, 1, 1), (9, 2, 1), (8, 3, 2), (10, 4, 2), (9, 5, 2), (10, 7, 3)]


@pytest.mark.parametrize("n,seed,max_fanin", TRADE_CASES)
def test_time_centric_dp_equals_brute_force_where_budgets_trade_time(n, seed, max_fanin):
    graph = training_cost_graph(n, seed=seed, max_fanin=max_fanin)
    model = build_model(graph)
    family = lower_sets(model)
    least = solve_dp(model, family, None)[0]
    store = evaluate_chain(model, [])[0]
    chains = all_chains(model, family)
    assert chains is not None, "small enough for the brute force"
    evaluated = [evaluate_chain(model, c)[:2] for c in chains]
    bs = sorted({least + (store - least) * k // 8 for k in range(9)})
    optimum = []
    for budget in bs:
        peak, seconds, chain = solve_dp(model, family, budget)
        assert peak <= budget
        assert evaluate_chain(model, chain)[:2] == (peak, pytest.approx(seconds, rel=1e-12))
        best = min(t for p, t in evaluated if p <= budget)
        assert close(seconds, best), (budget, seconds, best)
        # of the chains at the least time, the DP's peak is the least
        assert peak == min(p for p, t in evaluated if p <= budget and close(t, best))
        optimum.append(seconds)
        approx = solve_dp(model, closure_lower_sets(model), budget)
        assert approx is not None and approx[0] <= budget and approx[1] >= seconds - 1e-12
    # the case is worth its name: the least time falls at least three times across the budgets
    assert sum(a > b + 1e-9 for a, b in zip(optimum, optimum[1:])) >= 3, optimum
    middle = bs[len(bs) // 2]
    oracle = milp(graph, middle)
    assert oracle.notes["status"].startswith("Optimal")
    assert close(oracle.notes["objective"], optimum[len(bs) // 2])


@pytest.mark.parametrize("n,seed,random_ops", CASES[::2])
def test_model_time_is_the_plans_recompute_time(n, seed, random_ops):
    graph = case_graph(n, seed, random_ops)
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


@pytest.mark.parametrize("n,seed", [(12, 1), (16, 2), (20, 3), (30, 4)])
def test_strategies_valid_and_budgets(n, seed):
    graph = branching_cost_graph(n, seed=seed, random_ops=0.1)
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
    graph = branching_cost_graph(10, seed=5)
    assert kusumoto(graph).notes["exact"] is True
    plan = kusumoto(graph, max_lower_sets=3)
    assert plan.notes["exact"] is False
    assert plan.checkpoints == kusumoto_approx(graph).checkpoints
