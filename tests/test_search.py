"""Solvers on synthetic cost graphs: every plan is valid (no read before a write or after a
free, on the runtime's order), random ops are never recomputed, budgets are met; the peak
floor and auto at the floor against a brute force over every checkpoint subset. How good the
plans are is tested against independent oracles in tests/test_oracles.py (brute force) and
tests/test_kusumoto_milp.py (MILP)."""
import dataclasses
import random

import pytest
from hypothesis import given, settings, strategies as st

from graphopt.costgraph import CostGraph, Op
from graphopt.costmodel import check_schedule, priority_order, resolve_versions, simulate
from graphopt.search import STRATEGIES, auto, chen_sqrt, feng_huang, greedy, store_all
from graphopt.search.plan import Plan, make_plan

from graphopt_zoo.synthetic import branching_cost_graph, branching_stats, training_cost_graph

# solvers whose time grows fast with the graph: the property tests give them a time limit
TIME_LIMITED = {"auto": 2.0, "feng-huang": 2.0}


def run_strategy(name, graph, **kwargs):
    if name in TIME_LIMITED:
        kwargs.setdefault("time_limit_seconds", TIME_LIMITED[name])
    return STRATEGIES[name](graph, **kwargs)


def assert_no_read_after_free(graph, plan):
    """Run the order the runtime executes (`priority_order` of the file order) with the names
    the rewrite writes (versions resolved on the FILE order) under the cost model's freeing
    rule (versions resolved on the EXECUTED order, as the cost model does: a buffer is freed
    after its last reader; an alias shares its input's buffer; graph outputs (copy 0) and
    resident tensors are never freed; a buffer nobody reads stays, or costs nothing if
    droppable): every version a step reads was produced earlier and is not freed yet.
    Written apart from `simulate`, so that a disagreement between the schedule, the runtime's
    order and the cost model's accounting shows."""
    nodes = graph.ops
    schedule = plan.schedule
    assert len(set(schedule)) == len(schedule), "a step appears twice in the schedule"
    named = {(s.op, s.copy): s for s in resolve_versions(graph, schedule)}
    executed = priority_order(graph, schedule)
    assert sorted(executed) == sorted(s for s in schedule if not nodes[s[0]].folded)
    resident = set(graph.resident)
    for (op, _), s in named.items():
        if nodes[op].folded:        # initializers once loaded
            resident.update(t for t, _ in s.writes)
    kept = graph.kept
    droppable = graph.droppable
    # the cost model's accounting: buffers, where each is born and after which step it is freed
    buffer_of, born, last_read, never_freed = {}, {}, {}, set()
    for i, step in enumerate(resolve_versions(graph, executed)):
        for version in step.reads:
            if version in buffer_of:
                last_read[buffer_of[version]] = i
        attrs = nodes[step.op]
        for k, (t, v) in enumerate(step.writes):
            if k == 0 and attrs.alias and attrs.inputs:
                b = buffer_of.get(step.reads[0], "resident")
            else:
                b = (t, v)
                born[b] = i
            buffer_of[(t, v)] = b
            if v == 0 and t in kept:
                never_freed.add(b)
    freed_after = {}
    for b, i in born.items():
        if b in never_freed:
            continue
        if b in last_read:
            freed_after[b] = last_read[b]
        elif b[0] in droppable:           # never read and dropped: never allocated
            freed_after[b] = i - 1
    # the run, with the rewrite's names
    produced = set()
    for i, step in enumerate(executed):
        op, copy = step
        for t, v in named[step].reads:
            if v == -1 or t in resident:
                assert t in resident, (i, op, copy, t, "read before it exists")
                continue
            assert (t, v) in produced, (i, op, copy, t, v, "read before this version is produced")
            b = buffer_of[(t, v)]
            assert freed_after.get(b, i) >= i, (i, op, copy, t, v, "read after it was freed at step",
                                                freed_after.get(b))
        produced.update(named[step].writes)


def assert_valid(graph, plan):
    check_schedule(graph, plan.schedule)
    executed = priority_order(graph, plan.schedule)
    check_schedule(graph, executed)
    assert_no_read_after_free(graph, plan)
    forward = graph.forward_tensors
    available_forward = set(plan.checkpoints) | graph.forced_checkpoints
    for step in resolve_versions(graph, executed):
        if graph.phase(step.op) != "backward":
            continue
        for tensor, version in step.reads:
            # a backward op reads a forward tensor only if it was kept or recomputed
            if tensor in forward and version == 0:
                assert tensor in available_forward, (step.op, tensor)
    # every op of the training graph runs once as itself
    originals = [op for op, copy in plan.schedule if copy == 0]
    assert sorted(originals) == sorted(graph.ops)


def _hazard_graph():
    """x -> a -> t -> s (runs first, like Shape) -> shp, read by d (forward), b1 and b2
    (backward); c is an unrelated forward op."""
    ops = {"forward": [], "backward": []}

    def op(name, inputs, outputs, phase, runs_first=False):
        ops[phase].append(Op(name, "X", inputs, outputs, seconds=1.0, runs_first=runs_first))
    op("a", ("x",), ("t",), "forward")
    op("s", ("t",), ("shp",), "forward", runs_first=True)
    op("d", ("shp",), ("dd",), "forward")
    op("c", ("x",), ("u",), "forward")
    op("b1", ("shp", "u", "dd"), ("g1",), "backward")
    op("b2", ("shp", "g1"), ("g2",), "backward")
    return CostGraph(ops["forward"], ops["backward"],
                     {"t": 10, "shp": 1, "dd": 1, "u": 10, "g1": 5, "g2": 5}, resident={"x"}, kept={"g2"})


def test_read_after_free_check_catches_a_stale_version():
    """The file recomputes t and shp after b1's position... except that shp's copy runs first:
    the runtime runs (s, 1) before b1, so the cost model resolves b1's read of shp to the copy
    and frees the original after d, while the file has b1 read the original."""
    g = _hazard_graph()
    good = [("a", 0), ("s", 0), ("d", 0), ("c", 0), ("b1", 0), ("a", 1), ("s", 1), ("b2", 0)]
    assert_no_read_after_free(g, Plan("test", frozenset(), good))
    stale = [("a", 0), ("s", 0), ("d", 0), ("a", 1), ("c", 0), ("b1", 0), ("s", 1), ("b2", 0)]
    check_schedule(g, stale)                     # name-level: nothing wrong
    assert priority_order(g, stale).index(("s", 1)) < priority_order(g, stale).index(("b1", 0))
    with pytest.raises(AssertionError, match="read after it was freed"):
        assert_no_read_after_free(g, Plan("test", frozenset(), stale))


def test_chain_store_all_counts_every_activation():
    graph = training_cost_graph(10, seed=1, max_fanin=1)
    plan = store_all(graph)
    assert plan.recompute_ops == 0
    assert_valid(graph, plan)
    stashed = graph.stashed_tensors
    assert plan.peak_bytes >= sum(graph.tensor_bytes[t] for t in stashed if t != "x")


def test_chen_recomputes_and_saves_on_a_chain():
    graph = training_cost_graph(36, seed=2, max_fanin=1)
    chen, full = chen_sqrt(graph), store_all(graph)
    assert_valid(graph, chen)
    assert chen.recompute_ops > 0
    assert chen.peak_bytes < full.peak_bytes


def random_graph(n, seed, shape, random_ops):
    """Mostly branching DAGs (zoo/synthetic.py), sometimes a chain with skips of fan-in 1-3."""
    if shape == "branching":
        return branching_cost_graph(n, seed=seed, random_ops=random_ops)
    return training_cost_graph(n, seed=seed, max_fanin=int(shape[-1]), random_ops=random_ops)


SHAPES = st.sampled_from(["branching"] * 4 + ["skips1", "skips3"])


def assert_recomputes_no_random_op(graph, plan):
    for op, copy in plan.schedule:
        if copy:
            assert graph.ops[op].recomputable, op


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 24), seed=st.integers(0, 10_000), shape=SHAPES,
       random_ops=st.sampled_from([0.0, 0.2]))
def test_every_strategy_gives_a_valid_plan(n, seed, shape, random_ops):
    graph = random_graph(n, seed, shape, random_ops)
    for name in STRATEGIES:
        if name == "milp" and n > 5:   # exact MILP: small graphs only (tests/test_kusumoto_milp.py)
            continue
        plan = run_strategy(name, graph)
        assert_valid(graph, plan)
        assert_recomputes_no_random_op(graph, plan)   # random ops are never recomputed


FAST = ["chain", "greedy", "chen-greedy", "chen-sqrt", "store-all", "kusumoto-approx"]


@settings(max_examples=15, deadline=None)
@given(n=st.integers(25, 70), seed=st.integers(0, 10_000), shape=SHAPES,
       random_ops=st.sampled_from([0.0, 0.2]))
def test_fast_strategies_give_valid_plans_on_larger_graphs(n, seed, shape, random_ops):
    graph = random_graph(n, seed, shape, random_ops)
    for name in FAST:
        plan = run_strategy(name, graph)
        assert_valid(graph, plan)
        assert_recomputes_no_random_op(graph, plan)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 40), seed=st.integers(0, 10_000), shape=SHAPES,
       random_ops=st.sampled_from([0.0, 0.2]), gap=st.sampled_from([0, 1, 2, 5]),
       keep=st.floats(0.0, 0.6))
def test_refresh_gap_schedules_are_valid(n, seed, shape, random_ops, gap, keep):
    """Dropping a recomputed tensor across a backward gap and recomputing it again (copies
    2, 3, ...): every read still finds its version produced and not freed."""
    graph = random_graph(n, seed, shape, random_ops)
    rng = random.Random(seed)
    checkpoints = {t for t in graph.candidate_checkpoints if rng.random() < keep}
    plan = make_plan(graph, "test", checkpoints, refresh_gap=gap)
    assert_valid(graph, plan)
    assert_recomputes_no_random_op(graph, plan)


def test_recompute_runs_each_op_at_most_once_more():
    graph = branching_cost_graph(50, seed=5)
    plan = make_plan(graph, "test", set())  # keep nothing optional: recompute all
    assert_valid(graph, plan)
    copies = [c for _, c in plan.schedule]
    assert max(copies) <= 1


def test_budget_objective_prefers_less_recomputation_when_budget_is_loose():
    graph = branching_cost_graph(40, seed=7)
    full = store_all(graph)
    loose = greedy(graph, budget_bytes=full.peak_bytes)
    assert loose.peak_bytes <= full.peak_bytes
    assert loose.recompute_seconds == pytest.approx(0.0)
    tight = greedy(graph)
    mid = (tight.peak_bytes + full.peak_bytes) // 2
    planned = greedy(graph, budget_bytes=mid)
    assert planned.peak_bytes <= mid
    assert planned.recompute_seconds <= tight.recompute_seconds + 1e-9


def test_simulate_frees_after_last_reader_and_keeps_outputs():
    forward = []

    def op(name, inputs, outputs, alias=False):
        forward.append(Op(name, "X", inputs, outputs, seconds=1.0, alias=alias))
    op("a", ("x",), ("t1",))
    op("b", ("t1",), ("t2",))
    op("r", ("t2",), ("t2r",), alias=True)
    op("c", ("t2r",), ("t3",))
    op("d", ("t3", "t1"), ("out",))
    op("e", ("t3",), ("unread",))
    g = CostGraph(forward, [], {"t1": 10, "t2": 20, "t2r": 20, "t3": 30, "out": 5, "unread": 7},
                  resident={"x"}, kept={"out"})
    sim = simulate(g, [(o, 0) for o in ["a", "b", "r", "c", "d", "e"]])
    # live: a:10; b:30; r:30 (alias); c:60 -> t2 freed; d: 10+30+5=45 -> t1 freed;
    # e: 30+5+7=42 -> t3 freed, unread stays
    assert sim.live_bytes.tolist() == [10, 30, 30, 60, 45, 42]
    assert sim.peak_bytes == 60


# ------------------------------------------------ the peak floor and the search at the floor --

def _subset_plans(graph, gaps=(None, 0)):
    """Every plan of every subset of the candidate checkpoints (brute force, small graphs)."""
    import itertools
    candidates = graph.candidate_checkpoints
    for r in range(len(candidates) + 1):
        for subset in itertools.combinations(candidates, r):
            for gap in gaps:
                yield make_plan(graph, "brute", subset, gap)


def _with_backward_workspace(graph, op_index, workspace_bytes):
    """The graph with a kernel work buffer on one backward op (a plan-independent peak, like a
    transformer's embedding gradient at the end of the backward)."""
    name = graph.backward_order[op_index]
    backward = [dataclasses.replace(graph.ops[n], workspace_bytes=workspace_bytes) if n == name else graph.ops[n]
                for n in graph.backward_order]
    return CostGraph([graph.ops[n] for n in graph.forward_order], backward, graph.tensor_bytes,
                     graph.resident, graph.kept, graph.droppable)


@pytest.mark.parametrize("n,seed", [(6, 1), (7, 3), (8, 1), (8, 15), (9, 1), (9, 3), (9, 15), (9, 18)])
def test_peak_floor_is_below_every_plan_brute_force(n, seed):
    """No checkpoint subset (each op recomputed once, or recomputed at every reader) has a
    cost-model peak below `peak_floor_bytes`, with or without a large backward work buffer."""
    from graphopt.search.plan import peak_floor_bytes
    graph = branching_cost_graph(n, seed=seed)
    floor = peak_floor_bytes(graph)
    peaks = [p.peak_bytes for p in _subset_plans(graph)]
    assert floor <= min(peaks)
    heavy = _with_backward_workspace(graph, -1, 10 * max(peaks))
    floor = peak_floor_bytes(heavy)
    assert floor <= min(p.peak_bytes for p in _subset_plans(heavy))


@pytest.mark.parametrize("n,seed", [(6, 12), (7, 2), (7, 12), (8, 8), (8, 13), (9, 1), (9, 15), (9, 18)])
def test_auto_at_the_floor_matches_brute_force(n, seed):
    """A work buffer three times the largest plan's peak on a gradient accumulation in the
    middle of the backward (it reads no forward tensor, so a plan that holds no activation
    across it sits on the floor): auto reaches the floor and the least peak of every
    checkpoint subset, and its recomputation time is the least of all subsets whose peak is
    that low under the same schedule (brute force)."""
    from graphopt.search.auto import PEAK_TOLERANCE
    from graphopt.search.plan import peak_floor_bytes
    graph = branching_cost_graph(n, seed=seed)
    assert branching_stats(graph).branching
    backward = graph.backward_order
    sums = [i for i, op in enumerate(backward) if op.startswith("sum_")]
    plain = [p.peak_bytes for p in _subset_plans(graph, (None,))]
    heavy = _with_backward_workspace(graph, sums[len(sums) // 2], 3 * max(plain))
    best = auto(heavy, time_limit_seconds=30)
    assert_valid(heavy, best)
    assert best.notes["reached_floor"]
    assert best.peak_bytes <= peak_floor_bytes(heavy) * (1 + PEAK_TOLERANCE)
    least = min(p.peak_bytes for p in _subset_plans(heavy, (None, 0)))
    assert best.peak_bytes <= least * (1 + PEAK_TOLERANCE)     # within auto's tolerance
    same_schedule = list(_subset_plans(heavy, (best.refresh_gap,)))
    fastest = min(p.recompute_seconds for p in same_schedule if p.peak_bytes <= best.peak_bytes)
    assert best.recompute_seconds == pytest.approx(fastest, abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 40), seed=st.integers(0, 10_000), shape=SHAPES, share=st.floats(0.0, 1.0))
def test_value_prefix_fits_its_budget(n, seed, shape, share):
    """`value_prefix` keeps the base checkpoints plus a prefix of the other candidates in the
    seconds-per-byte ranking, and its peak fits the budget whenever the base's does."""
    from graphopt.search.greedy import by_value, value_prefix
    graph = random_graph(n, seed, shape, 0.0)
    base = chen_sqrt(graph)
    high = store_all(graph).peak_bytes
    budget = int(base.peak_bytes + share * max(0, high - base.peak_bytes))
    plan = value_prefix(graph, budget, base.checkpoints)
    assert_valid(graph, plan)
    assert plan.peak_bytes <= max(budget, base.peak_bytes)
    added = [t for t in by_value(graph) if t not in base.checkpoints][:plan.notes["added"]]
    assert set(plan.checkpoints) == set(base.checkpoints) | set(added)


def test_every_strategy_plans_a_graph_whose_backward_reads_no_forward_tensor():
    """Nothing requires a gradient: no tensor is ever recomputed, so every strategy's plan has
    store-all's peak (kusumoto and milp used to index an empty backward table)."""
    g = CostGraph([Op("f1", "Neg", ("x0",), ("t1",), 1.0), Op("f2", "Tanh", ("t1",), ("t2",), 1.0),
                   Op("loss", "Loss", ("t2",), ("l",), 0.1)], [],
                  {"x0": 16, "t1": 100, "t2": 100, "l": 4}, resident={"x0"}, kept={"l"})
    expected = store_all(g).peak_bytes
    for name in STRATEGIES:
        plan = run_strategy(name, g)
        check_schedule(g, plan.schedule)
        assert plan.peak_bytes == expected, name
        assert plan.recompute_ops == 0, name


def test_a_budget_is_refused_by_a_strategy_that_cannot_honour_it():
    """The registry's contract: never a budget silently ignored."""
    from graphopt.errors import InvalidOptionError
    graph = training_cost_graph(8, seed=1)
    for name, strategy in STRATEGIES.items():
        if strategy.takes_budget:
            continue
        with pytest.raises(InvalidOptionError, match=name) as refused:
            strategy(graph, budget_bytes=10 ** 6)
        assert "auto" in str(refused.value)          # names the strategies that can
    assert {s.name for s in STRATEGIES.values() if not s.takes_budget} == {"feng-huang", "chen-sqrt", "store-all"}


def test_auto_says_exact_only_at_the_peak_floor():
    """auto's plan is `exact` exactly when its peak reaches the peak floor (a lower bound on every
    plan), and otherwise not; a plan's `exact` is never claimed by a heuristic."""
    from graphopt.search.plan import peak_floor_bytes
    from graphopt_zoo.synthetic import branching_cost_graph
    claims = []
    for seed in range(20):
        graph = branching_cost_graph(6, seed=seed) if seed % 2 else training_cost_graph(10, seed=seed, max_fanin=3)
        plan = auto(graph)
        assert plan.exact == (plan.peak_bytes <= peak_floor_bytes(graph))
        claims.append(plan.exact)
        for name in ("greedy", "chen-greedy", "chen-sqrt", "store-all", "kusumoto-approx"):
            assert not run_strategy(name, graph).exact, name
    assert any(claims) and not all(claims)      # both cases were seen


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["auto", "kusumoto"])
def test_what_no_budget_changes_is_reused_without_changing_plans(name, seed):
    """auto's seeds that take no budget, and Kusumoto's model, lower sets and least-peak chain,
    are made once per graph and reused for later budgets: every plan is the one a fresh copy of
    the graph gets (a cache keyed wrongly, or holding what a budget changes, gives another)."""
    solve = STRATEGIES[name]
    graph = branching_cost_graph(60, seed)
    least = solve(graph)
    budgets = [None] + [least.peak_bytes + (store_all(graph).peak_bytes - least.peak_bytes) * k // 4
                        for k in (1, 2, 3)]
    warm = [solve(graph, budget_bytes=budget) for budget in budgets]
    for budget, plan in zip(budgets, warm):
        cold = solve(CostGraph.from_dict(graph.to_dict()), budget_bytes=budget)
        assert (cold.checkpoints, cold.peak_bytes, cold.recompute_seconds) == \
            (plan.checkpoints, plan.peak_bytes, plan.recompute_seconds), budget


def test_auto_seeds_are_registered_strategies_called_as_registered():
    """`auto` keeps its own seed table (the registry lists auto, so auto cannot read the
    registry without a cycle): each seed is the registry's strategy of that name, with its
    solve function and its budget support, and every registered solver but the oracles and
    the local search is a seed."""
    from graphopt.search.auto import SEEDS
    for seed in SEEDS:
        registered = STRATEGIES[seed.name]
        assert seed.solve is registered.solve and seed.takes_budget == registered.takes_budget, seed.name
    assert {s.name for s in SEEDS} == set(STRATEGIES) - {"auto", "greedy", "milp"}
