"""A parameter used many times (ALBERT's shared layers, tied embeddings): its gradient's
contributions added as each is produced, by the builder and by `optimize` on a graph built
elsewhere (issue 46, item 3). Gradients against torch are checked with the builder's other
architectures (tests/test_builder_vs_torch.py, tests/test_real_models.py: `albert`)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.builder import lean
from graphopt.builder.train_graph import build_training_graph
from graphopt.optimize import OptimizeOptions, optimize
from graphopt.runtime.session import UNOPTIMIZED_SETTINGS, open_session

MIB = 1 << 20
USES = 10


def ten_uses(width: int = 1448, batch: int = 128) -> onnx.ModelProto:
    """h_i = tanh(h_{i-1} @ W), ten times, one W [width, width] (8 MiB at 1448): its gradient is the
    sum of ten 8 MiB contributions, one per use."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((rng.standard_normal([width, width]) / 40).astype(np.float32), "W")
    nodes, h = [], "x"
    for i in range(USES):
        nodes += [helper.make_node("MatMul", [h, "W"], [f"p{i}"]), helper.make_node("Tanh", [f"p{i}"], [f"h{i}"])]
        h = f"h{i}"
    nodes.append(helper.make_node("ReduceSum", [h], ["loss"], keepdims=0))
    graph = helper.make_graph(nodes, "ten_uses", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], initializer=[weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _built(chained: bool, **size) -> onnx.ModelProto:
    """Built with the gradient's Sum chained as produced, or left as onnx-ad writes it (no Sum
    written as Adds either: lean.SUMS_AS_ADDS)."""
    saved = lean.SUMS_AS_PRODUCED, lean.SUMS_AS_ADDS
    lean.SUMS_AS_PRODUCED = lean.SUMS_AS_ADDS = chained
    try:
        return build_training_graph(ten_uses(**size))
    finally:
        lean.SUMS_AS_PRODUCED, lean.SUMS_AS_ADDS = saved


def _sums(model: onnx.ModelProto) -> list[int]:
    return [len(n.input) for n in model.graph.node if n.op_type == "Sum"]


def test_the_builder_adds_each_contribution_as_it_is_produced():
    model = _built(True, width=64, batch=8)
    assert _sums(model) == []
    nodes = list(model.graph.node)
    position = {o: k for k, n in enumerate(nodes) for o in n.output}
    adds = [k for k, n in enumerate(nodes) if n.op_type == "Add" and "W_grad" in n.output[0]]
    assert len(adds) == USES - 1
    for k in adds:   # each Add right after the newer of its inputs
        assert k == max(position[i] for i in nodes[k].input) + 1, nodes[k].name
    # the same gradient as the n-ary Sum's
    x = np.random.default_rng(1).standard_normal([8, 64]).astype(np.float32)
    summed = _built(False, width=64, batch=8)
    assert _sums(summed) == [USES]
    got, expected = ({o.name: v for o, v in zip(open_session(m, UNOPTIMIZED_SETTINGS).get_outputs(),
                                                   open_session(m, UNOPTIMIZED_SETTINGS).run(None, {"x": x}))}
                     for m in (model, summed))
    np.testing.assert_allclose(got["W_grad"], expected["W_grad"], rtol=1e-5, atol=1e-6 * np.abs(expected["W_grad"]).max())


def test_optimize_chains_a_ten_way_sum_built_elsewhere():
    """The issue's bar: a graph with an n-ary Sum of ten 8 MiB contributions (as onnx-ad writes
    it); `optimize` at its default objective lowers the measured peak by at least 60 MiB, against
    the original with optimizations off and under the default session."""
    model = _built(False)
    assert _sums(model) == [USES]
    result = optimize(model, OptimizeOptions())
    report = result.report
    assert report.sums_chained == 1
    assert report.outputs_match and report.order_followed
    measured = report.measured
    returned = measured.optimized.peak_bytes
    assert report.outcome == "optimized"
    assert measured.original_optimizations_off.peak_bytes - returned >= 60 * MIB
    assert measured.original_default_session.peak_bytes - returned >= 60 * MIB
    assert _sums(result.model) == []


def _two_uses_built(as_add: bool) -> onnx.ModelProto:
    """ten_uses cut to two uses of W, and a three-way Sum of the forward (h1 + h0 + p1) read by
    the loss: two-way gradient sums (W's, h0's and p1's contributions)."""
    model = ten_uses(width=48, batch=6)
    graph = model.graph
    nodes = list(graph.node)[:4] + [helper.make_node("Sum", ["h1", "h0", "p1"], ["s"]),
                                    helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)]
    graph.ClearField("node")
    graph.node.extend(nodes)
    saved, lean.SUMS_AS_ADDS = lean.SUMS_AS_ADDS, as_add
    try:
        return build_training_graph(model)
    finally:
        lean.SUMS_AS_ADDS = saved


def test_sums_are_adds_to_the_bit():
    """lean.sums_as_adds: no Sum left, the forward's own or the backward's (ONNX Runtime's CPU Sum
    runs on one thread), and every output of the graph equal to the bit to that of the graph with
    its Sums."""
    added, summed = _two_uses_built(True), _two_uses_built(False)
    assert sorted(_sums(summed)) == [2, 2, 2, 3], "the oracle graph has its Sums"
    assert _sums(added) == []
    x = np.random.default_rng(2).standard_normal([6, 48]).astype(np.float32)
    outputs = []
    for model in (added, summed):
        session = open_session(model, UNOPTIMIZED_SETTINGS)
        outputs.append(dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x}))))
    assert set(outputs[0]) == set(outputs[1]) and {"loss", "W_grad"} <= set(outputs[0])
    for name, value in outputs[1].items():
        assert np.array_equal(outputs[0][name], value), name
