"""Chain solver (arXiv 2502.12499 as derived in graphopt.search.chain) and Chen's greedy."""
import itertools
import random

import pytest

from graphopt.search import chen_sqrt, store_all
from graphopt.search.chain import (ChainCosts, chain, chain_brute_force, chain_budget, chain_costs,
                                   chain_dp, chain_linear, chain_objective,
                                   chain_recompute_seconds, chain_segments, segment_cost)
from graphopt.search.chen_greedy import chen_greedy, greedy_cuts

from graphopt_zoo.synthetic import branching_cost_graph, training_cost_graph
from test_search import assert_valid


def random_costs(n, seed, forced_share=0.1):
    rng = random.Random(seed)
    a = [rng.choice([0, 1, 3, 8, 20, 50, 100]) for _ in range(n + 1)]
    need = [rng.random() < 0.6 for _ in range(n + 1)]   # which data the backward needs
    f = [rng.choice([0, 0, 0, 5, 30]) for _ in range(n + 1)]
    g = [rng.choice([0, 2, 10, 40]) for _ in range(n + 1)]
    t = [rng.uniform(0.1, 2.0) for _ in range(n + 1)]
    forced = [rng.random() < forced_share for _ in range(n + 1)]
    return ChainCosts(a, need, f, g, t, forced)


@pytest.mark.parametrize("n", range(1, 15))
def test_linear_equals_dp_equals_brute_force(n):
    for seed in range(12 if n <= 10 else 3):
        costs = random_costs(n, seed * 100 + n)
        best, _ = chain_brute_force(costs)
        dp_value, dp_set = chain_dp(costs)
        lin_value, lin_set = chain_linear(costs)
        assert dp_value == best == lin_value, (n, seed)
        # the returned sets achieve the value and keep the forced positions
        assert chain_objective(costs, dp_set) == best
        assert chain_objective(costs, lin_set) == best


def test_segment_cost_is_monotone():
    # the property the linear algorithm's exactness rests on
    for seed in range(30):
        costs = random_costs(9, seed, forced_share=0.0)
        for s in range(costs.n):
            for e in range(s + 1, costs.n):
                assert segment_cost(costs, s, e) <= segment_cost(costs, s, e + 1)
                if s + 1 < e:
                    assert segment_cost(costs, s + 1, e) <= segment_cost(costs, s, e)


def test_objective_by_hand():
    # 3 layers, every activation needed, no work buffers or gradients:
    # keep nothing -> backward of the one segment holds x1, x2 and x3
    costs = ChainCosts(a=[0, 10, 20, 30], need=[False, True, True, True], f=[0] * 4, g=[0] * 4)
    assert chain_objective(costs, ()) == 60
    # keep x1: first segment (0,1] holds x1 (10); second: x1 kept + x2 + x3 = 60
    assert chain_objective(costs, (1,)) == 60
    # keep x2: segment (0,2] = x1 + x2 = 30; (2,3] = x2 kept + x3 = 50
    assert chain_objective(costs, (2,)) == 50
    assert chain_dp(costs) == (50, (2,))


def test_need_changes_the_answer():
    # when the backward needs no activations (only shapes), nothing is recomputed
    costs = ChainCosts(a=[0, 10, 20, 30], need=[False] * 4, f=[0] * 4, g=[0] * 4,
                       t=[0, 1.0, 1.0, 1.0])
    assert chain_recompute_seconds(costs, ()) == 0.0
    assert chain_dp(costs)[0] == chain_objective(costs, ()) == 50   # forward: x2 + x3


@pytest.mark.parametrize("n", range(1, 10))
def test_budget_dp_is_least_recompute_that_fits(n):
    for seed in range(6):
        costs = random_costs(n, seed + 1000 * n)
        least = chain_brute_force(costs)[0]
        for bound in (least, least + 20, least + 200):
            found = chain_budget(costs, bound)
            assert found is not None
            seconds, positions = found
            assert chain_objective(costs, positions) <= bound
            forced = [i for i in range(1, n) if costs.forced[i]]
            free = [i for i in range(1, n) if not costs.forced[i]]
            brute = min(chain_recompute_seconds(costs, tuple(sorted(forced + list(sub))))
                        for r in range(len(free) + 1) for sub in itertools.combinations(free, r)
                        if chain_objective(costs, tuple(sorted(forced + list(sub)))) <= bound)
            assert seconds == pytest.approx(brute)
        assert chain_budget(costs, least - 1) is None


def test_chain_segments_of_a_chain_graph_is_one_run():
    graph = training_cost_graph(12, seed=3, max_fanin=1)
    runs = chain_segments(graph)
    assert [op for run in runs for op in run] == list(graph.forward_order)
    assert len(runs) == 1


def test_chain_segments_split_at_a_skip_connection():
    graph = training_cost_graph(30, seed=4, max_fanin=3)
    runs = chain_segments(graph)
    assert [op for run in runs for op in run] == list(graph.forward_order)
    assert len(runs) > 1
    nodes = graph.ops
    for run in runs:
        for prev, op in zip(run, run[1:]):
            assert set(nodes[op].inputs) - {"x"} <= set(nodes[prev].outputs)


def test_chain_costs_of_a_synthetic_chain():
    graph = training_cost_graph(8, seed=5, max_fanin=1)
    costs, tensors = chain_costs(graph)
    assert costs.n == 9                     # 8 layers and the loss
    assert not any(costs.forced[1:costs.n])
    assert all(costs.need[1:9])             # every layer's backward reads its input and output
    assert costs.a[3] == graph.tensor_bytes["a2"]
    assert tensors[3] == ["a2"]


@pytest.mark.parametrize("seed", range(8))
def test_chain_plans_are_valid_and_recompute_on_long_chains(seed):
    """(Never above store-all holds by construction: chain keeps every free position among its
    candidates. Against an independent floor: test_chain_against_the_brute_force_least_peak.)"""
    graph = training_cost_graph(5 + 4 * seed, seed=seed, max_fanin=1)
    plan = chain(graph)
    assert_valid(graph, plan)
    full = store_all(graph)
    if len(graph.forward_order) > 20:
        assert plan.peak_bytes < full.peak_bytes and plan.recompute_ops > 0


@pytest.mark.parametrize("seed", range(4))
def test_chain_on_dags_and_random_ops_is_valid(seed):
    graph = branching_cost_graph(25, seed=seed, random_ops=0.2)
    plan = chain(graph)
    assert_valid(graph, plan)
    for op, copy in plan.schedule:
        if copy:
            assert graph.ops[op].recomputable, op


def test_chain_against_the_brute_force_least_peak():
    """chain's plan against the least peak over every subset of the candidate checkpoints
    (tests/test_oracles.py's brute force: the cost model on each subset's plan, no solver): never
    below it (a plan scored lower than every subset would be mis-scored), at it on most small
    chains and within the factors it reaches today (chains: 36 of 40 at it, worst 1.077; small
    branching DAGs, where the chain model is a bound: worst 1.42)."""
    from test_oracles import GRAPHS, brute_force
    ratios = []
    for seed in range(40):
        graph = training_cost_graph(4 + seed % 6, seed=seed, max_fanin=1)
        least = min(p.peak_bytes for p in brute_force(graph))
        plan = chain(graph)
        assert least <= plan.peak_bytes <= 1.1 * least, (seed, plan.peak_bytes, least)
        ratios.append(plan.peak_bytes / least)
    assert sum(r == 1 for r in ratios) >= 0.8 * len(ratios), ratios
    for n, seed, graph in GRAPHS:
        least = min(p.peak_bytes for p in brute_force(graph))
        plan = chain(graph)
        assert least <= plan.peak_bytes <= 1.5 * least, (n, seed, plan.peak_bytes, least)


def test_chain_with_a_budget():
    """(A budget at store-all's peak met without recomputation holds by construction: the
    every-position plan is among chain's candidates.)"""
    graph = training_cost_graph(40, seed=11, max_fanin=1)
    full = store_all(graph)
    tight = chain(graph)
    mid = (tight.peak_bytes + full.peak_bytes) // 2
    planned = chain(graph, budget_bytes=mid)
    assert_valid(graph, planned)
    assert planned.peak_bytes <= mid
    assert planned.recompute_seconds <= tight.recompute_seconds + 1e-9


def test_greedy_cuts():
    assert greedy_cuts([5, 5, 5, 5, 5], 9) == [1, 3]
    assert greedy_cuts([5, 5, 5], 100) == []
    assert greedy_cuts([5, 5, 5], 0) == [0, 1]


@pytest.mark.parametrize("seed", range(6))
def test_chen_greedy_plans_are_valid_on_branching_graphs(seed):
    """Valid plans that recompute no random op (its plan is Chen's segmentation for the b it
    reports and within a stated factor of the brute-force least peak: tests/test_oracles.py)."""
    graph = branching_cost_graph(10 + 6 * seed, seed=seed, random_ops=0.2 if seed % 2 else 0.0)
    plan = chen_greedy(graph)
    assert plan.strategy == "chen-greedy"
    assert_valid(graph, plan)
    for op, copy in plan.schedule:
        if copy:
            assert graph.ops[op].recomputable, op


@pytest.mark.parametrize("seed", range(6))
def test_chain_model_optimum_on_real_chain_costs_is_the_brute_force_one(seed):
    """The DP and the linear algorithm reach the least J over every checkpoint subset of the
    chain costs of actual cost graphs (chains with random ops, and branching DAGs whose
    off-chain positions are forced), not only of random numbers."""
    for graph in (training_cost_graph(4 + 2 * seed, seed=seed, max_fanin=1, random_ops=0.2),
                  branching_cost_graph(5 + 2 * seed, seed=seed)):
        costs, _ = chain_costs(graph)
        free = [i for i in range(1, costs.n) if not costs.forced[i]]
        forced = [i for i in range(1, costs.n) if costs.forced[i]]
        least = min(chain_objective(costs, tuple(sorted(forced + list(sub))))
                    for r in range(len(free) + 1) for sub in itertools.combinations(free, r))
        assert chain_dp(costs)[0] == least == chain_linear(costs)[0]
        assert chain_brute_force(costs)[0] == least


@pytest.mark.parametrize("seed", range(4))
def test_chen_greedy_meets_budgets_between_its_least_peak_and_store_alls(seed):
    """(A budget at store-all's peak holds by construction: store-all is among its candidates.)"""
    graph = branching_cost_graph(30, seed=seed)
    full = store_all(graph)
    tight = chen_greedy(graph)
    mid = (tight.peak_bytes + full.peak_bytes) // 2
    planned = chen_greedy(graph, budget_bytes=mid)
    assert planned.peak_bytes <= mid
    assert planned.recompute_seconds <= tight.recompute_seconds + 1e-9
