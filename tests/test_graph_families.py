"""The benchmark graph families: exact size, deterministic, realistic features, and store-all
and Chen's plans on them are valid."""
import pytest

from graphopt.search import chen_sqrt, store_all
from graphopt.search.plan import peak_floor_bytes

from test_costmodel import reference_live_bytes, reference_order
from test_search import assert_valid
from graphopt_zoo.graph_families import FAMILIES, make_graph


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("n_total", [200, 201])
def test_family_graph_is_valid_for_store_all_and_chen(family, n_total):
    graph = make_graph(family, n_total, seed=3)
    assert len(graph) == n_total
    full, chen = store_all(graph), chen_sqrt(graph)
    assert_valid(graph, full)
    assert_valid(graph, chen)
    assert full.recompute_ops == 0
    assert chen.recompute_ops > 0
    # the plans' peaks are those of the step-by-step references (tests/test_costmodel.py) on the
    # runtime's order (runs-first ops hoisted), never below the floor no plan goes below
    for plan in (full, chen):
        executed = reference_order(graph, plan.schedule)
        assert plan.peak_bytes == max(reference_live_bytes(graph, executed), default=0)
    assert 0 < peak_floor_bytes(graph) <= min(chen.peak_bytes, full.peak_bytes)
    if family != "random":
        # on layered graphs Chen's recomputation saves memory; on random DAGs its segments
        # can hold more than they free (seed 3, 200 ops: 296.7 MB vs store-all's 286.8 MB)
        assert chen.peak_bytes < full.peak_bytes


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_has_training_graph_features(family):
    graph = make_graph(family, 300, seed=1)
    nodes = graph.ops
    kinds = {(nodes[op].op_type, graph.phase(op)) for op in graph}
    kept = graph.kept
    # parameter gradients are graph outputs, produced by the backward pass
    weight_grads = [t for op in graph.backward_order if nodes[op].op_type == "Transpose"
                    for t in nodes[op].outputs]
    assert weight_grads and set(weight_grads) <= kept
    assert any(nodes[op].alias for op in graph.backward_order)
    assert ("Size", "backward") in kinds and any(nodes[op].runs_first for op in graph)
    assert max(len(nodes[op].inputs) for op in graph.backward_order) >= 2
    if family != "chains":
        # gradients arriving along several paths are accumulated
        assert ("Sum", "backward") in kinds
    if family == "dense":
        assert max(len(nodes[op].inputs) for op in graph.forward_order
                   if nodes[op].op_type == "Concat") >= 4
        # many-way gradient accumulation, with the work buffer of a Sum of 3+ inputs
        sums = [op for op in graph.backward_order if nodes[op].op_type == "Sum"]
        assert any(len(nodes[op].inputs) >= 3 and nodes[op].workspace_bytes > 0 for op in sums)
    # every forward activation is read by the backward pass or a later forward op: all reach the loss
    readers = {t for op in graph for t in nodes[op].inputs}
    for t in graph.forward_tensors:
        assert t in readers or t in kept, t
    activations = [graph.tensor_bytes[t] for op in graph.forward_order
                   if nodes[op].op_type == "Conv" for t in nodes[op].outputs]
    assert max(activations) <= 16 * 2 ** 20 and sorted(activations)[len(activations) // 2] >= 2 ** 19
    # every tensor an op reads is resident or produced by an earlier op
    position = {op: i for i, op in enumerate(graph)}
    for op in graph:
        for t in nodes[op].inputs:
            assert t in graph.resident or position[graph.producer[t]] < position[op], (op, t)

def test_families_are_deterministic_and_seeded():
    for family in FAMILIES:
        a, b = make_graph(family, 150, seed=7), make_graph(family, 150, seed=7)
        assert list(a.ops.values()) == list(b.ops.values())
        assert (a.tensor_bytes, a.resident, a.kept) == (b.tensor_bytes, b.resident, b.kept)
    assert list(make_graph("random", 150, seed=1).ops.values()) != list(make_graph("random", 150, seed=2).ops.values())


def test_too_small_a_size_is_refused():
    with pytest.raises(ValueError):
        make_graph("dense", 5)
    with pytest.raises(KeyError):
        make_graph("mesh", 100)
