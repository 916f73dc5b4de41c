"""Feng & Huang's least-peak search (graphopt/search/feng_huang.py) against independent oracles.

The segment model's objective, cost(C) = Σ kept bytes + the largest connected component of
the tensors not kept, is brute-forced here over every subset of the candidates with numpy
(the module's own `brute_force` is plain Python and too slow for 2^20 subsets), and on chains
it is computed by Feng & Huang's linear-graph algorithm written out below.
"""
import random
from collections import Counter

import numpy as np
import pytest

from graphopt.costmodel import check_schedule
from graphopt.search.feng_huang import brute_force, feng_huang, segment_cost, segment_model, solve

from graphopt_zoo.synthetic import branching_cost_graph, branching_stats, training_cost_graph


def fast_brute_force(model, chunk=1 << 16):
    """(least cost, a kept set reaching it) over every subset of the candidates, vectorized.

    Every row of a chunk is one subset. Components: each tensor starts with its own index as
    label; over the edges of the model (a tensor and each earlier neighbour) whose ends are both
    not kept, the smaller label spreads (forward then backward sweeps) until nothing changes,
    so each component ends labelled by its least index. Component bytes are then summed per
    label."""
    n = len(model.tensors)
    if n == 0:
        return 0, frozenset()
    assert n < 127
    w = np.asarray(model.bytes_, dtype=np.int64)
    cands = np.flatnonzero(np.asarray(model.candidate, dtype=bool))
    edges = [(j, i) for i in range(n) for j in model.earlier[i]]
    total = 1 << len(cands)
    best_cost, best_mask = None, None
    for start in range(0, total, chunk):
        masks = np.arange(start, min(total, start + chunk), dtype=np.int64)
        size = len(masks)
        kept = np.zeros((n, size), dtype=bool)
        for b, c in enumerate(cands):
            kept[c] = (masks >> b) & 1
        labels = np.repeat(np.arange(n, dtype=np.int8)[:, None], size, axis=1)
        # an edge with a kept end is blocked: max(label, 127) lowers no label
        block = {e: np.where(kept[e[0]] | kept[e[1]], np.int8(127), np.int8(0)) for e in edges}
        tmp = np.empty(size, dtype=np.int8)
        while True:
            before = labels.copy()
            for j, i in edges:
                np.maximum(labels[j], block[(j, i)], out=tmp)
                np.minimum(labels[i], tmp, out=labels[i])
            for j, i in reversed(edges):
                np.maximum(labels[i], block[(j, i)], out=tmp)
                np.minimum(labels[j], tmp, out=labels[j])
            if np.array_equal(before, labels):
                break
        component = np.zeros((n, size), dtype=np.int64)
        columns = np.arange(size)
        free_bytes = np.where(kept, 0, w[:, None])
        for i in range(n):
            component[labels[i], columns] += free_bytes[i]
        cost = w @ kept + component.max(axis=0)
        a = int(cost.argmin())
        if best_cost is None or cost[a] < best_cost:
            best_cost, best_mask = int(cost[a]), int(masks[a])
    return best_cost, frozenset(int(cands[b]) for b in range(len(cands)) if best_mask >> b & 1)


def random_graph_params(i):
    """Seeded parameters of the i-th acceptance graph (a branching DAG): skewed toward small
    graphs (the brute force doubles per candidate), with a tail of 19-24 forward ops."""
    rng = random.Random(i)
    r = rng.random()
    n = rng.randint(2, 12) if r < 0.6 else rng.randint(13, 18) if r < 0.9 else rng.randint(19, 24)
    return n, rng.choice([0.0, 0.2]), rng.randrange(1 << 30)


def test_fast_brute_force_matches_the_module_brute_force_on_small_graphs():
    checked = 0
    for seed in range(80):
        n, random_ops, s = random_graph_params(1000 + seed)
        graph = branching_cost_graph(min(n, 10), seed=s, random_ops=random_ops)
        model = segment_model(graph)
        slow_cost, slow_kept = brute_force(model)
        # tiny chunks: the chunking and the best-so-far across chunks are exercised too
        fast_cost, fast_kept = fast_brute_force(model, chunk=7)
        assert fast_cost == slow_cost, (seed, fast_cost, slow_cost)
        assert sum(segment_cost(model, set(fast_kept))) == fast_cost
        assert sum(segment_cost(model, set(slow_kept))) == slow_cost
        checked += sum(model.candidate) >= 6
    assert checked >= 20


def test_fast_brute_force_sees_components_not_runs():
    """A hand-made model where the components are not runs of the order: 0-2 and 1-3 are
    joined, 0 and 1 are not (a run-based count would see 0..3 as one piece)."""
    from graphopt.search.feng_huang import SegmentModel
    model = SegmentModel(tensors=list("abcd"), bytes_=[10, 10, 10, 10], candidate=[True] * 4,
                         earlier=[[], [], [0], [1]], last_neighbour=[2, 3, 2, 3])
    # keeping nothing: two components of 20 -> 20; keeping one tensor leaves a 20 component
    assert segment_cost(model, set()) == (0, 20)
    assert fast_brute_force(model)[0] == brute_force(model)[0] == 20
    assert solve(model)[0] == 20


def test_solve_is_exact_and_optimal_on_300_random_graphs():
    """On 300 branching DAGs with at most 20 candidates (larger draws are skipped: the brute
    force doubles per candidate), most of them really branching."""
    counts = Counter()
    branching = 0
    for i in range(330):
        n, random_ops, seed = random_graph_params(i)
        graph = branching_cost_graph(n, seed=seed, random_ops=random_ops)
        model = segment_model(graph)
        k = sum(model.candidate)
        aliases = {graph.ops[op].outputs[0] for op in graph.forward_order if graph.ops[op].alias}
        assert k == len(set(graph.candidate_checkpoints) - aliases)   # an alias is its input's buffer
        if k > 20 or sum(counts.values()) == 300:
            continue
        counts[k] += 1
        branching += branching_stats(graph).branching
        cost, kept, exact, probes = solve(model)
        optimum, _ = fast_brute_force(model)
        where = dict(i=i, n_forward=n, random_ops=random_ops, seed=seed)
        assert exact, where
        assert cost == optimum, (where, cost, optimum)
        assert all(model.candidate[j] for j in kept), where
        assert sum(segment_cost(model, set(kept))) == cost, where
    assert sum(counts.values()) == 300
    assert branching >= 0.8 * 300, branching
    assert set(range(2, 21)) <= set(counts), sorted(counts.items())
    assert sum(counts[k] for k in range(17, 21)) >= 8, sorted(counts.items())


def linear_graph_optimum(graph):
    """Feng & Huang's algorithm for a linear graph, from the cost graph of a chain: for every
    candidate max term m (each sum of a run of consecutive tensors), the least bytes of
    checkpoints such that every run between consecutive checkpoints sums to at most m is a
    shortest path over the positions (an edge p -> q when the tensors strictly between p and q
    weigh at most m in all and none of them must be kept; entering q costs its bytes, nothing
    for tensors that must be kept anyway or for the end); the optimum is the least path + m."""
    nodes = graph.ops
    ops = [op for op in graph.forward_order if op != "loss_op"]
    for k, op in enumerate(ops):           # it is a chain
        assert nodes[op].inputs == (("x",) if k == 0 else nodes[ops[k - 1]].outputs)
    sizes = [graph.tensor_bytes[nodes[op].outputs[0]] for op in ops]
    forced = [not nodes[op].recomputable for op in ops]
    n = len(sizes)
    terms = {0}
    for s in range(n):
        run = 0
        for e in range(s, n):
            if forced[e]:
                break
            run += sizes[e]
            terms.add(run)
    best = None
    inf = float("inf")
    for m in sorted(terms):
        # position 0 is the start, 1..n the tensors, n+1 the end
        dist = [0] + [inf] * (n + 1)
        for q in range(1, n + 2):
            enter = 0 if q == n + 1 or forced[q - 1] else sizes[q - 1]
            between = 0
            for p in range(q - 1, -1, -1):
                if dist[p] + enter < dist[q]:
                    dist[q] = dist[p] + enter
                if p == 0:
                    break
                if forced[p - 1]:           # a tensor that must be kept cannot be recomputed
                    break
                between += sizes[p - 1]
                if between > m:
                    break
        if best is None or dist[n + 1] + m < best:
            best = dist[n + 1] + m
    return best


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 33, 50])
@pytest.mark.parametrize("random_ops", [0.0, 0.25])
def test_chain_matches_feng_huang_linear_algorithm(n, random_ops):
    for seed in range(3):
        graph = training_cost_graph(n, seed=100 * n + seed, max_fanin=1, random_ops=random_ops)
        expected = linear_graph_optimum(graph)
        model = segment_model(graph)
        cost, kept, exact, _ = solve(model)
        assert exact
        assert cost == expected, (n, seed, cost, expected)
        assert sum(segment_cost(model, set(kept))) == cost
        if sum(model.candidate) <= 16:
            assert fast_brute_force(model)[0] == expected
        plan = feng_huang(graph)
        assert plan.notes["model_cost_bytes"] == expected
        assert plan.notes["exact"] is True


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_time_limit_on_a_wide_graph_is_inexact_but_valid(seed):
    graph = branching_cost_graph(40, seed=seed)
    model = segment_model(graph)
    nothing = sum(segment_cost(model, set()))
    cost, kept, exact, _ = solve(model, time_limit_seconds=1e-3)
    assert exact is False
    assert all(model.candidate[j] for j in kept)
    assert sum(segment_cost(model, set(kept))) == cost <= nothing
    plan = feng_huang(graph, time_limit_seconds=1e-3)
    assert plan.notes["exact"] is False
    check_schedule(graph, plan.schedule)
    assert sorted(op for op, copy in plan.schedule if copy == 0) == sorted(graph.ops)
    assert plan.checkpoints <= set(graph.candidate_checkpoints)
    index = {t: j for j, t in enumerate(model.tensors)}
    plan_kept = {index[t] for t in plan.checkpoints}
    assert sum(segment_cost(model, plan_kept)) == plan.notes["model_cost_bytes"] <= nothing


def test_the_dominance_checks_are_work_the_search_stops_at():
    """`Effort` counts each new label's dominance checks against its state's labels (on a wide
    3D-convolution network they outnumbered the label expansions 20-40 to 1, and were most of
    the seconds): a probe stops at the next tensor once past `max_comparisons`, and gives up its
    answer, while the same probe without that limit completes. Oracle: the counts themselves,
    and the unlimited probe's result."""
    from graphopt.search.feng_huang import Effort, least_kept_bytes
    graph = branching_cost_graph(60, seed=1)
    model = segment_model(graph)
    total = sum(model.bytes_)
    unlimited = Effort()
    found, exact = least_kept_bytes(model, total, total + 1, 20_000, unlimited)
    assert found is not None and exact
    assert unlimited.comparisons > 2_000, unlimited.comparisons       # the limit below binds
    limited = Effort(max_comparisons=1_000)
    assert least_kept_bytes(model, total, total + 1, 20_000, limited) == (None, False)
    assert 1_000 < limited.comparisons <= 1_000 + 20_000 and limited.labels < unlimited.labels
    cost, kept, exact, _ = solve(model, max_comparisons=1_000)
    assert exact is False and sum(segment_cost(model, set(kept))) == cost


@pytest.mark.parametrize("seed", range(5))
def test_a_states_labels_are_the_pareto_minimal_ones_in_the_order_they_came(seed):
    """`_Front` (a plain list up to ARRAY_FROM labels, an array after): after distinct random
    labels, exactly those no other label is at or below in Σ kept and every weight, in
    insertion order. Oracle: every pair compared; 300 labels, well past ARRAY_FROM."""
    from graphopt.search.feng_huang import _Front
    rng = random.Random(seed)
    labels = list({(tuple(rng.randrange(40) for _ in range(3)), rng.randrange(40)) for _ in range(300)})
    rng.shuffle(labels)
    front = _Front()
    for k, (weights, total) in enumerate(labels):
        front.add(weights, total, k)

    def at_or_below(a, b):
        return a[1] <= b[1] and all(x <= y for x, y in zip(a[0], b[0]))
    minimal = [(w, t, k) for k, (w, t) in enumerate(labels)
               if not any(o != (w, t) and at_or_below(o, (w, t)) for o in labels)]
    assert len(labels) > 2 * _Front.ARRAY_FROM and front.rows is not None
    assert front.labels == minimal
    assert front.rows.tolist() == [[t, *w] for w, t, _ in minimal]
