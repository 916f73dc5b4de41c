"""Solvers against an independent oracle: brute force over every checkpoint subset.

The oracle is `make_plan` (the one cost model on the runtime's order) applied to every subset
of a graph's candidate checkpoints, under every recomputation schedule `auto` searches
(`REFRESH_GAPS`). It runs no solver, so it does not share their search, their seeds or their
models: the least peak it finds is the least peak of the plan space the solvers return plans
from. The graphs are small branching DAGs (zoo/synthetic.py `branching_cost_graph`: fan-out,
joins, two-output ops, aliases, random ops, several losses, accumulated gradients).

What the tests prove (on the graphs drawn here, all with at most MAX_CANDIDATES candidates):
- the brute force is a lower bound every solver's plan respects (a plan reporting a lower peak
  than every subset would be mis-scored), and the floor (`peak_floor_bytes`) is below it;
- `auto` is within QUALITY[...] of the least peak; `greedy` and `chen-greedy` too (stated
  factors: these are heuristics, the factors are what they reach today, so that a regression
  shows); the share of graphs each solves exactly is printed;
- `auto` reaching the least peak (within its PEAK_TOLERANCE) on the small graphs here; beyond
  single toggles not yet (xfail, strict: the failing graph is in the reason);
- `greedy` ends at a local optimum: no single toggle of a candidate improves its objective
  (what its docstring claims, checked by trying every toggle, not by its own loop).
"""
import itertools
import statistics

import pytest
from hypothesis import given, settings, strategies as st

from graphopt.search import auto, chen_greedy, greedy
from graphopt.search.auto import PEAK_TOLERANCE, REFRESH_GAPS
from graphopt.search.chen_greedy import greedy_cuts
from graphopt.search.greedy import objective
from graphopt.search.plan import make_plan, peak_floor_bytes

from graphopt_zoo.synthetic import branching_cost_graph, branching_stats
from test_search import assert_valid

MAX_CANDIDATES = 9
# the largest ratio peak / brute-force least peak allowed, per solver (measured on the graphs
# below: auto 1.17, greedy 1.33, chen-greedy 1.26 at most on 400 graphs of 3-8 forward ops)
QUALITY = {"auto": 1.25, "greedy": 1.5, "chen-greedy": 1.5}


def brute_force(graph, gaps=(None,)):
    """Every plan of every subset of the candidate checkpoints, under each refresh gap."""
    candidates = graph.candidate_checkpoints
    for r in range(len(candidates) + 1):
        for subset in itertools.combinations(candidates, r):
            for gap in gaps:
                yield make_plan(graph, "brute", subset, gap)


def small_graphs(count, sizes=(4, 5, 6, 7, 8), base=0):
    """`count` seeded branching graphs with at most MAX_CANDIDATES candidates."""
    graphs = []
    seed = base
    while len(graphs) < count:
        n = sizes[seed % len(sizes)]
        graph = branching_cost_graph(n, seed=seed)
        if len(graph.candidate_checkpoints) <= MAX_CANDIDATES:
            graphs.append((n, seed, graph))
        seed += 1
    return graphs


GRAPHS = small_graphs(36)


# ----------------------------------------------------------------------- the generator --

def test_generator_makes_branching_graphs():
    """Most drawn graphs really branch (two forward ops independent of each other, a tensor
    read by two ops not only as the next step, a join of two producers); many have two-output
    ops, several losses and accumulated gradients; and they are well formed."""
    stats = []
    for seed in range(200):
        n = 3 + seed % 28
        graph = branching_cost_graph(n, seed=seed, random_ops=0.15)
        stats.append(branching_stats(graph))
        assert len(graph.forward_order) >= n + 1 and graph.backward_order
        position = {op: i for i, op in enumerate(graph)}
        for op in graph:
            for t in graph.ops[op].inputs:      # read after it is made
                assert t in graph.resident or position[graph.producer[t]] < position[op], (seed, op, t)
        readers = {t for op in graph for t in graph.ops[op].inputs}
        for t in graph.forward_tensors:         # every activation is used (or an output, or dropped)
            assert t in readers or t in graph.kept or t in graph.droppable, (seed, t)
    share = lambda key: sum(getattr(s, key) for s in stats) / len(stats)   # noqa: E731
    print(f"branching {share('branching'):.2f}, two outputs {share('multi_output'):.2f}, "
          f"several losses {sum(s.losses > 1 for s in stats) / len(stats):.2f}, "
          f"accumulations {sum(s.accumulations > 0 for s in stats) / len(stats):.2f}")
    assert share("branching") >= 0.9
    assert share("multi_output") >= 0.5
    assert sum(s.losses > 1 for s in stats) >= 0.3 * len(stats)
    assert sum(s.accumulations > 0 for s in stats) >= 0.8 * len(stats)
    kinds = {graph.ops[op].op_type for graph in (branching_cost_graph(30, seed=s) for s in range(10))
             for op in graph.forward_order}
    assert {"MatMul", "Add", "Concat", "Mul", "Split", "Reshape", "Dropout", "Loss"} <= kinds


def test_generator_is_deterministic_and_seeded():
    a, b = branching_cost_graph(20, seed=5), branching_cost_graph(20, seed=5)
    assert list(a.ops.values()) == list(b.ops.values())
    assert (dict(a.tensor_bytes), a.resident, a.kept, a.droppable) == \
        (dict(b.tensor_bytes), b.resident, b.kept, b.droppable)
    assert list(branching_cost_graph(20, seed=6).ops.values()) != list(a.ops.values())
    with pytest.raises(ValueError, match="n_forward"):
        branching_cost_graph(0)


def test_branching_stats_tells_a_chain_with_skips_from_a_dag():
    from graphopt_zoo.synthetic import training_cost_graph
    chain = branching_stats(training_cost_graph(20, seed=1, max_fanin=3))
    assert not chain.parallel and not chain.branching
    assert branching_stats(branching_cost_graph(20, seed=1)).branching


def test_the_oracle_graphs_branch():
    stats = [branching_stats(graph) for _, _, graph in GRAPHS]
    assert sum(s.branching for s in stats) >= 0.75 * len(stats)
    assert sum(len(graph.candidate_checkpoints) >= 6 for _, _, graph in GRAPHS) >= len(GRAPHS) // 3


# --------------------------------------------------------------- solvers vs brute force --

def test_solvers_against_the_brute_force_least_peak():
    """Every solver's plan is a plan of the brute force's space (re-scored, same peak), never
    below its least peak nor the floor below that; auto, greedy and chen-greedy within their
    QUALITY factor of it. Prints each solver's exact share and worst ratio."""
    ratios = {name: [] for name in QUALITY}
    for n, seed, graph in GRAPHS:
        plans = list(brute_force(graph, REFRESH_GAPS))
        least = {gap: min(p.peak_bytes for p in plans if p.refresh_gap == gap) for gap in REFRESH_GAPS}
        overall = min(least.values())
        assert peak_floor_bytes(graph) <= overall, (n, seed)
        found = {"auto": auto(graph, time_limit_seconds=60), "greedy": greedy(graph),
                 "chen-greedy": chen_greedy(graph)}
        for name, plan in found.items():
            assert_valid(graph, plan)
            again = make_plan(graph, "again", plan.checkpoints, plan.refresh_gap)
            assert again.peak_bytes == plan.peak_bytes, (name, n, seed)
            # greedy and chen-greedy schedule each op once: their space is the gap-None one
            reference = overall if name == "auto" else least[None]
            assert plan.peak_bytes >= reference, (name, n, seed)
            ratio = plan.peak_bytes / reference
            ratios[name].append(ratio)
            assert ratio <= QUALITY[name], (name, f"branching_cost_graph({n}, seed={seed})",
                                            plan.peak_bytes, reference)
    for name, r in ratios.items():
        print(f"{name}: exact on {sum(x <= 1 for x in r)}/{len(r)}, within 1% on "
              f"{sum(x <= 1 + PEAK_TOLERANCE for x in r)}/{len(r)}, "
              f"mean ratio {statistics.mean(r):.3f}, worst {max(r):.3f}")


def test_a_plan_said_exact_has_the_brute_force_least_peak():
    """`solver_exact` (the report's claim that the returned plan is optimal under its solver's
    model) is True only for a plan at the brute force's least peak, and the claim is made: on
    these graphs auto proves some plans optimal (its peak meets the floor) and leaves others
    unproven, one of them above the least peak (so a claim made always would be caught)."""
    from graphopt.pipeline import solver_exact
    said, above = [], []
    for n, seed, graph in GRAPHS:
        least = min(p.peak_bytes for p in brute_force(graph, REFRESH_GAPS))
        plan = auto(graph, time_limit_seconds=60)
        if solver_exact(plan):
            said.append((n, seed))
            assert plan.peak_bytes == least, (f"branching_cost_graph({n}, seed={seed})", plan.peak_bytes, least)
        if plan.peak_bytes > least:
            above.append((n, seed))
    assert said and len(said) < len(GRAPHS) and above, (said, above)


def test_auto_reaches_the_least_peak_on_small_branching_graphs():
    """auto's objective: the least peak (within PEAK_TOLERANCE, for less recomputation). The
    first graph's least peak keeps nothing (refresh gap 0) while every solver's plan keeps all:
    found since auto also starts its local searches from keeping nothing."""
    misses = []
    for n, seed, graph in [(4, 4047, branching_cost_graph(4, seed=4047))] + GRAPHS[:12]:
        least = min(p.peak_bytes for p in brute_force(graph, REFRESH_GAPS))
        plan = auto(graph, time_limit_seconds=60)
        if plan.peak_bytes > least * (1 + PEAK_TOLERANCE):
            misses.append((n, seed, plan.peak_bytes, least))
    assert not misses, misses


@pytest.mark.xfail(strict=True, reason=(
    "a local optimum of auto's 1-opt moves: on branching_cost_graph(8, seed=8026) the least peak "
    "keeps t2_0, t3, t5_0, t5_1, t7 (1892, refresh gap 0); auto keeps t2_0, t3, t7 (1972, +4.2%), "
    "and no single toggle from there helps"))
def test_auto_reaches_the_least_peak_beyond_single_toggles():
    graph = branching_cost_graph(8, seed=8026)
    least = min(p.peak_bytes for p in brute_force(graph, REFRESH_GAPS))
    assert auto(graph).peak_bytes <= least * (1 + PEAK_TOLERANCE)


# --------------------------------------------------------------------------- greedy --

@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 40), seed=st.integers(0, 10_000), random_ops=st.sampled_from([0.0, 0.2]),
       gap=st.sampled_from([None, 0]), budget_share=st.sampled_from([None, 0.3, 0.8]))
def test_greedy_ends_at_a_local_optimum(n, seed, random_ops, gap, budget_share):
    """No single toggle of a candidate checkpoint improves greedy's objective (checked by
    trying every toggle through make_plan), with and without a budget."""
    graph = branching_cost_graph(n, seed=seed, random_ops=random_ops)
    budget = None
    if budget_share is not None:
        low = make_plan(graph, "x", (), gap).peak_bytes
        high = make_plan(graph, "x", graph.candidate_checkpoints, gap).peak_bytes
        budget = int(min(low, high) + budget_share * abs(high - low))
    plan = greedy(graph, budget, refresh_gap=gap, time_limit_seconds=60)
    assert not plan.notes["stopped_by_time"]
    assert_valid(graph, plan)
    best = objective(plan, budget)
    for t in graph.candidate_checkpoints:
        trial = make_plan(graph, "toggle", set(plan.checkpoints) ^ {t}, gap)
        assert objective(trial, budget) >= best, (t, objective(trial, budget), best)


# ---------------------------------------------------------------------- chen-greedy --

def chen_crossing(graph, cuts):
    """Chen's checkpoints for cuts after forward positions `cuts`: the activations made at or
    before a cut and read by a forward op after it (written here from the definition)."""
    order = graph.forward_order
    position = {op: i for i, op in enumerate(order)}
    kept = set()
    for t, producer in graph.forward_tensors.items():
        born = position[producer]
        reads = [position[r] for r in graph.readers(t) if r in position]
        if any(born <= c < r for c in cuts for r in reads):
            kept.add(t)
    return kept


@pytest.mark.parametrize("n,seed", [(10, 1), (15, 2), (20, 3), (30, 4), (40, 5), (25, 6)])
def test_chen_greedy_is_chens_segmentation_for_its_b(n, seed):
    """chen-greedy's plan is Chen's greedy segmentation for the b it reports (cut when the
    running bytes exceed b, keep what crosses a cut), or one of its two base plans."""
    graph = branching_cost_graph(n, seed=seed, random_ops=0.1)
    plan = chen_greedy(graph)
    assert_valid(graph, plan)
    if "b" not in plan.notes:
        return
    sizes = []
    for op in graph.forward_order:
        node = graph.ops[op]
        outputs = node.outputs[1:] if node.alias and node.inputs else node.outputs
        sizes.append(sum(graph.tensor_bytes.get(t, 0) for t in outputs))
    cuts = greedy_cuts(sizes, plan.notes["b"])
    assert plan.notes["segments"] == len(cuts) + 1
    assert set(plan.checkpoints) == chen_crossing(graph, cuts) - graph.clobbered


# ------------------------------------------------------------- peak and time together --

def _seconds(plan):
    return plan.simulation.compute_seconds


@pytest.mark.parametrize("share", [0.25, 0.6])
def test_least_peak_within_a_step_time_against_brute_force(share):
    """`least_peak_within` keeps the predicted step time within the limit, and its peak is
    within QUALITY["auto"] of the least peak of every subset whose time fits (the brute force,
    no solver). The limit: `share` of the way from store-all's time to the least-peak plan's.
    Both as the bisection alone and as `plan` runs it for `auto`, followed by the local search
    within the limit (`auto.least_peak_local`)."""
    from graphopt.search import least_peak_within, store_all
    from graphopt.search.auto import least_peak_local
    ratios = {"bisection": [], "bisection and local search": []}
    for n, seed, graph in GRAPHS:
        plans = list(brute_force(graph, REFRESH_GAPS))
        slowest = max(_seconds(p) for p in plans if p.peak_bytes == min(q.peak_bytes for q in plans))
        fastest = _seconds(store_all(graph))
        limit = fastest + share * (slowest - fastest)
        best = min(p.peak_bytes for p in plans if _seconds(p) <= limit + 1e-12)
        for how, found in (("bisection", least_peak_within(graph, auto, limit)),
                           ("bisection and local search", least_peak_within(
                               graph, auto, limit, refine=least_peak_local))):
            assert _seconds(found) <= limit + 1e-12, (how, n, seed, _seconds(found), limit)
            assert found.peak_bytes >= best, (how, n, seed)     # the oracle is a lower bound
            ratios[how].append(found.peak_bytes / best)
            assert found.peak_bytes <= QUALITY["auto"] * best, (how, n, seed, found.peak_bytes, best)
    exact = {how: sum(r == 1 for r in rs) for how, rs in ratios.items()}
    for how, rs in ratios.items():
        print(f"least peak within the time, {how}: exact on {exact[how]}/{len(rs)}, worst {max(rs):.3f}, "
              f"mean {statistics.mean(rs):.4f}")


def test_the_local_search_within_a_step_time_lowers_the_bisections_peak():
    """Beyond the brute force (branching graphs of 20 forward ops, 16-22 candidates), at limits
    10% and 30% of the way from store-all's time to the least-peak plan's: after the bisection
    on the budget, the local search within the limit (`auto.least_peak_local`, as `plan` runs it
    for `auto`) keeps the step within the limit and finds a lower peak than the bisection alone
    on at least 3 of the 12 (4 when this test was written, by up to 3%). Oracle: the bisection
    alone, a search over budgets that never sees the limit."""
    from graphopt.search import least_peak_within, store_all
    from graphopt.search.auto import least_peak_local
    lower = []
    for seed in range(6):
        graph = branching_cost_graph(20, seed=seed)
        fastest, slowest = _seconds(store_all(graph)), _seconds(auto(graph))
        for share in (0.1, 0.3):
            limit = fastest + share * (slowest - fastest)
            alone = least_peak_within(graph, auto, limit)
            refined = least_peak_within(graph, auto, limit, refine=least_peak_local)
            assert_valid(graph, refined)
            assert _seconds(refined) <= limit + 1e-12 and refined.peak_bytes <= alone.peak_bytes, (seed, share)
            if refined.peak_bytes < alone.peak_bytes:
                lower.append((seed, share, round(refined.peak_bytes / alone.peak_bytes, 4)))
    print(f"lower than the bisection's peak: {lower}")
    assert len(lower) >= 3, lower


def test_front_is_a_front():
    """`front`: no point beats another in both peak and predicted time; it runs from the
    least-peak plan to store-all's time; every point is a plan of the graph (its peak and time
    recomputed by the one cost model from its checkpoints)."""
    from graphopt.search import front, store_all
    for n, seed, graph in GRAPHS[:12]:
        points = front(graph, auto, points=6)
        assert points, (n, seed)
        for a, b in zip(points, points[1:]):
            assert a.peak_bytes < b.peak_bytes and _seconds(a) > _seconds(b), (n, seed)
        assert _seconds(points[-1]) <= _seconds(store_all(graph)) + 1e-12
        for p in points:
            again = make_plan(graph, "again", p.checkpoints, p.refresh_gap)
            assert again.peak_bytes == p.peak_bytes, (n, seed)
