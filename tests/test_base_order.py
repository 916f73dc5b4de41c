"""Plans start from the best order there is (issue 24, item 1): the cost graph in another base
order (`CostGraph.in_order`, forward and backward ops interleaved as ONNX Runtime may run them),
plans on it checked against brute force, and on a real example the order ONNX Runtime runs
the original in, chosen and measured in ONNX Runtime against the file's."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from graphopt.costmodel import check_schedule, priority_order
from graphopt.search import STRATEGIES
from graphopt.search.plan import make_plan, peak_floor_bytes, schedule_for, sunk_order
from graphopt_zoo.synthetic import branching_cost_graph, training_cost_graph
from test_search import _subset_plans, assert_no_read_after_free


def random_topological_order(graph, seed: int) -> list[str]:
    """A random topological order of all of `graph`'s ops: backward ops may come before the
    forward pass is over wherever their inputs exist."""
    rng = random.Random(seed)
    ops = graph.ops
    waiting = {name: {graph.producer[t] for t in op.inputs if t in graph.producer} for name, op in ops.items()}
    ready = sorted(name for name, deps in waiting.items() if not deps)
    order: list[str] = []
    while ready:
        name = ready.pop(rng.randrange(len(ready)))
        order.append(name)
        for other, deps in waiting.items():
            if name in deps:
                deps.discard(name)
                if not deps and other not in order and other not in ready:
                    ready.append(other)
    assert len(order) == len(ops)
    return order


def interleaves(graph) -> bool:
    """Some backward op comes before some forward op in the graph's base order."""
    first_backward = min(i for i, op in enumerate(graph.order) if graph.phase(op) == "backward")
    return any(graph.phase(op) == "forward" for op in graph.order[first_backward:])


def assert_runs(graph, plan) -> None:
    """The plan's schedule and the order ONNX Runtime runs it in read nothing before it exists
    or after it was freed, and every op of the graph runs once as itself."""
    check_schedule(graph, plan.schedule)
    check_schedule(graph, priority_order(graph, plan.schedule))
    assert_no_read_after_free(graph, plan)
    originals = [op for op, copy in plan.schedule if copy == 0]
    assert sorted(originals) == sorted(graph.ops)


def test_a_base_order_that_is_not_topological_is_refused():
    graph = training_cost_graph(4, seed=1)
    order = list(graph.order)
    order[0], order[1] = order[1], order[0]          # f1 reads a0, which f0 writes
    with pytest.raises(ValueError, match="not topological"):
        graph.in_order(order)


def test_in_order_keeps_the_ops_and_their_split():
    graph = branching_cost_graph(8, seed=3)
    reordered = graph.in_order(random_topological_order(graph, 5))
    assert sorted(reordered.ops) == sorted(graph.ops)
    assert set(reordered.forward_order) == set(graph.forward_order)
    assert reordered.candidate_checkpoints and set(reordered.candidate_checkpoints) == set(graph.candidate_checkpoints)


def test_store_all_runs_the_base_order_and_a_live_forward_tensor_is_not_recomputed():
    """Keeping every candidate, the schedule is the sunk base order itself. Keeping none, a
    backward op the base order runs while a later forward op still reads one of its inputs
    reads that tensor as it is (its buffer is alive anyway): nothing recomputes it first."""
    for seed in range(40):
        graph = training_cost_graph(6, seed=seed)
        reordered = graph.in_order(random_topological_order(graph, seed))
        if not interleaves(reordered):
            continue
        assert schedule_for(reordered, reordered.candidate_checkpoints) == [(op, 0) for op in sunk_order(reordered)]
        schedule = schedule_for(reordered, ())
        position = {op: i for i, (op, copy) in enumerate(schedule) if copy == 0}
        checked = 0
        for i, (op, copy) in enumerate(schedule):
            if copy or reordered.phase(op) != "backward":
                continue
            for t in reordered.ops[op].inputs:
                later_forward = [r for r in reordered.readers(t)
                                 if reordered.phase(r) == "forward" and position[r] > i]
                if t in reordered.forward_tensors and later_forward:
                    producer = reordered.forward_tensors[t]
                    assert (producer, 1) not in schedule[:i], (seed, op, t)
                    checked += 1
        if checked:
            return
    pytest.fail("no random order ran a backward op while the forward still read its input")


@pytest.mark.parametrize("n,seed", [(6, 1), (7, 3), (8, 1), (8, 15), (9, 3)])
def test_on_an_interleaved_order_the_floor_holds_and_auto_reaches_brute_force(n, seed):
    """On an order where backward ops run inside the forward pass: no checkpoint subset's plan
    (brute force) is below the peak floor, and auto's least peak is within its tolerance of the
    least of them."""
    from graphopt.search.auto import PEAK_TOLERANCE
    graph = branching_cost_graph(n, seed=seed)
    for k in range(20):
        reordered = graph.in_order(random_topological_order(graph, 100 * seed + k))
        if interleaves(reordered):
            break
    else:
        pytest.skip("no interleaving order drawn")     # (never seen for these graphs)
    plans = list(_subset_plans(reordered))
    for plan in plans[:: max(1, len(plans) // 20)]:
        assert_runs(reordered, plan)
    least = min(p.peak_bytes for p in plans)
    assert peak_floor_bytes(reordered) <= least
    best = STRATEGIES["auto"](reordered)
    assert_runs(reordered, best)
    assert best.peak_bytes <= least * (1 + PEAK_TOLERANCE)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 30), seed=st.integers(0, 10_000), order_seed=st.integers(0, 10_000))
def test_every_strategy_plans_validly_from_any_base_order(n, seed, order_seed):
    graph = training_cost_graph(n, seed=seed, max_fanin=3)
    reordered = graph.in_order(random_topological_order(graph, order_seed))
    for name in ("auto", "chen-sqrt", "chen-greedy", "chain", "store-all", "greedy"):
        assert_runs(reordered, STRATEGIES[name](reordered))
    # and every checkpoint set's plan, with recomputation at each reader too
    for gap in (None, 0):
        assert_runs(reordered, make_plan(reordered, "half", reordered.candidate_checkpoints[::2], gap))


# -- real ONNX Runtime ---------------------------------------------------------------------------
def test_the_leaner_order_is_chosen_and_measures_leaner_in_onnx_runtime(tmp_path):
    """The resnet example: ONNX Runtime runs the original in an order the cost model gives a
    lower peak than the file's (3.4% lower; the DenseNet example's was 8% lower until its input
    gradients became convolutions, now the file's is 1.3% lower). The plan without recomputation
    from each order, rewritten and measured in a fresh process: the chosen one measures lower,
    at most the original's own peak (optimizations off, ORT's order), and the least-peak plan
    is predicted below both."""
    from graphopt.examples import training_example
    from graphopt.inputs import save_inputs
    from graphopt.optimize import OptimizeOptions, save_model
    from graphopt.pipeline import ORIGINAL_UNOPTIMIZED, plan, prepare, rewrite_plan
    from graphopt.runtime.measure import measure
    from graphopt.search import store_all

    train, inputs = training_example("resnet")
    options = OptimizeOptions(inputs=inputs, threads=1, measure=False, verify=False, objective="least-peak")
    with prepare(train, options) as prepared:
        peaks = prepared.base_order_peaks
        assert prepared.base_order == "onnxruntime" and peaks["onnxruntime"] < 0.98 * peaks["file"], peaks
        assert peaks["onnxruntime"] <= prepared.predicted_original.peak_bytes
        chosen = plan(prepared, options)
        assert chosen.peak_bytes < peaks["onnxruntime"]
        inputs_path = tmp_path / "inputs.npz"
        save_inputs(inputs_path, inputs)
        measured = {}
        for label, graph in prepared.base_graphs.items():
            path = tmp_path / f"{label}.onnx"
            save_model(prepared.workspace.with_weights(rewrite_plan(prepared, store_all(graph))), path)
            measured[label] = measure(path, inputs_path, timing=False).peak_bytes
        original = tmp_path / "original.onnx"
        save_model(prepared.workspace.with_weights(prepared.training.model, copy=True), original)
        measured["original"] = measure(original, inputs_path, ORIGINAL_UNOPTIMIZED, timing=False).peak_bytes
    assert measured["onnxruntime"] < 0.985 * measured["file"], measured   # 0.967 in one run
    assert measured["onnxruntime"] <= 1.02 * measured["original"], measured


@pytest.mark.parametrize("name", ["densenet", "unet"])
def test_the_least_peak_plan_is_the_best_over_every_base_order(name):
    """The small densenet and unet examples: ONNX Runtime's order is the leaner with nothing
    recomputed, yet the least-peak plan comes from the file's (7-9% lower). Oracle: the default
    strategy run from each base order on its own; `plan` must return the least of their peaks,
    not that of the order leanest without recomputation."""
    from graphopt.examples import training_example
    from graphopt.optimize import OptimizeOptions
    from graphopt.pipeline import plan, prepare

    model, inputs = training_example(name, small=True)
    options = OptimizeOptions(inputs=inputs, threads=1, measure=False, verify=False, objective="least-peak")
    with prepare(model, options) as prepared:
        chosen = plan(prepared, options)
        each = {label: STRATEGIES[options.strategy](graph).peak_bytes
                for label, graph in prepared.base_graphs.items()}
        leanest_unplanned = prepared.base_order
    best = min(each, key=each.get)
    # what makes this case: the order leanest with nothing recomputed is not the one whose plan is leanest
    assert set(each) == {"file", "onnxruntime"} and each[best] < each[leanest_unplanned], (each, leanest_unplanned)
    assert chosen.peak_bytes == each[best], (chosen.peak_bytes, each)
    assert chosen.notes["base_order"] == best
