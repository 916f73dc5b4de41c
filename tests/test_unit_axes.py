"""Broadcasts and reductions without the axes of extent 1 that cut ONNX Runtime's spans
(graphopt/builder/unit_axes.py, issue 48): each rewritten broadcast gives ONNX Runtime's own
result of the node as written, bit for bit, each reduction numpy's in float64 within float32's
rounding, and computes with no axis of extent 1; nodes the rule leaves are left."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.builder import unit_axes
from graphopt.builder.deterministic import static_shapes
from graphopt.builder.graph_util import infer_shapes

OPSET = 17


def _model(nodes, inputs, initializers=(), outputs=("y",)):
    """The nodes, what they write as `y` read by an Identity that writes the graph's output (a node
    that writes a graph output itself is left: a Reshape there would be a copy)."""
    nodes = [_renamed_output(node) for node in nodes] + [helper.make_node("Identity", ["y_"], ["y"])]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(name, dtype, shape) for name, dtype, shape in inputs],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def _renamed_output(node):
    if list(node.output) == ["y"]:
        del node.output[:]
        node.output.append("y_")
    return node


def _run(model, feeds):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _feeds(inputs, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, dtype, shape in inputs:
        concrete = [3 if isinstance(d, str) else d for d in shape]
        if dtype == TensorProto.BOOL:
            feeds[name] = rng.random(concrete) < 0.5
        else:
            feeds[name] = (rng.standard_normal(concrete) + 2.0).astype(np.float32)
    return feeds


def _rewritten(model):
    model = onnx.ModelProto.FromString(model.SerializeToString())
    count = unit_axes.unit_axes_dropped(model, static_shapes(model))
    return model, count


def _shapes(model):
    """Every value's shape by onnx's own inference of `model`."""
    inferred = infer_shapes(model, strict_mode=True)
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
              for v in list(inferred.graph.value_info) + list(inferred.graph.input)}
    shapes.update({t.name: list(t.dims) for t in model.graph.initializer})
    return shapes


def _output_shapes(model, op_type):
    shapes = _shapes(model)
    return [shapes[node.output[0]] for node in model.graph.node if node.op_type == op_type]


def _input_shapes(model, op_type):
    shapes = _shapes(model)
    return [shapes[node.input[0]] for node in model.graph.node if node.op_type == op_type]


F = TensorProto.FLOAT
BROADCASTS = {
    # the attention scale's gradient: a [.., 1] tensor over a scalar of lower rank
    "div_by_scalar": ("Div", [("x", F, [4, 4, 32, 32, 1])], {"b": np.float32(8.0)}),
    "div_by_one_element": ("Div", [("x", F, [4, 4, 32, 32, 1])], {"b": np.array([8.0], np.float32)}),
    "mul_by_row": ("Mul", [("x", F, [4, 4, 32, 32, 1]), ("b", F, [4, 4, 32, 1, 1])], {}),
    "sub_of_columns": ("Sub", [("x", F, [4, 32, 1, 32, 1]), ("b", F, [32, 1, 1, 1])], {}),
    "where": ("Where", [("c", TensorProto.BOOL, [4, 4, 32, 32, 1]), ("x", F, [4, 4, 32, 32, 1])],
              {"b": np.float32(0.0)}),
    "sum_of_three": ("Sum", [("x", F, [8, 256, 1]), ("b", F, [8, 256, 1]), ("c", F, [1])], {}),
    "unknown_batch": ("Mul", [("x", F, ["batch", 64, 32, 1])], {"b": np.array([0.5], np.float32)}),
}


@pytest.mark.parametrize("name", sorted(BROADCASTS))
def test_a_broadcast_runs_without_its_unit_axes_and_gives_the_same_bits(name):
    op, inputs, constants = BROADCASTS[name]
    operands = [n for n, _, _ in inputs] + list(constants)
    if op == "Where":
        operands = ["c", "x", "b"]
    model = _model([helper.make_node(op, operands, ["y"])], inputs,
                   [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    feeds = _feeds(inputs)
    expected = _run(model, feeds)[0]
    rewritten, count = _rewritten(model)
    assert count == 1
    (got,) = _run(rewritten, feeds)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)
    # what the node computes has no axis of extent 1 (its operands keep theirs where they broadcast)
    for shape in _output_shapes(rewritten, op):
        assert 1 not in shape, shape


REDUCTIONS = {
    # the softmax's backward: a sum over the key axis, followed by the seed axis
    "sum_axes_input": ("ReduceSum", [4, 4, 32, 32, 1], [-2], 1, True),
    "sum_dropped_axes": ("ReduceSum", [4, 4, 32, 32, 1], [3], 0, True),
    "sum_of_two_axes": ("ReduceSum", [8, 1, 32, 16, 1], [0, 3], 1, True),
    "mean_axes_attribute": ("ReduceMean", [4, 32, 1, 32, 1], [1, 3], 1, False),
    "max_axes_attribute": ("ReduceMax", [4, 32, 1, 32, 1], [-2], 0, False),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_a_reduction_runs_without_its_unit_axes_and_gives_the_same_bits(name):
    op, shape, axes, keepdims, axes_as_input = REDUCTIONS[name]
    inputs = [("x", F, shape)]
    if axes_as_input:
        nodes = [helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims)]
        initializers = [numpy_helper.from_array(np.array(axes, np.int64), "axes")]
    else:
        nodes = [helper.make_node(op, ["x"], ["y"], axes=axes, keepdims=keepdims)]
        initializers = []
    model = _model(nodes, inputs, initializers)
    feeds = _feeds(inputs)
    expected = getattr(np, {"ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "max"}[op])(
        feeds["x"].astype(np.float64), axis=tuple(axes), keepdims=bool(keepdims))
    rewritten, count = _rewritten(model)
    assert count == 1
    (got,) = _run(rewritten, feeds)
    assert got.shape == expected.shape
    # a sum over the innermost axis adds in another order than over a strided one: float32 rounding
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    for read in _input_shapes(rewritten, op):
        assert 1 not in read, read


TRANSPOSES = {
    # a whole-map weight gradient's bank: the unit axis moved
    "unit_axis_moved": ([4, 8, 16, 16, 1], [1, 4, 0, 2, 3], "Transpose"),
    "default_perm": ([4, 1, 16, 32], None, "Transpose"),
    # the unit axis alone moves: the same elements in the same order, a Reshape
    "only_the_unit_axis_moves": ([4, 8, 16, 16, 1], [0, 4, 1, 2, 3], "Reshape"),
    "unknown_batch": (["batch", 16, 1, 128], [2, 1, 0, 3], "Transpose"),
}


@pytest.mark.parametrize("name", sorted(TRANSPOSES))
def test_a_transpose_moves_no_unit_axis_and_gives_the_same_bits(name):
    shape, perm, op_left = TRANSPOSES[name]
    inputs = [("x", F, shape)]
    attributes = {} if perm is None else {"perm": perm}
    model = _model([helper.make_node("Transpose", ["x"], ["y"], **attributes)], inputs)
    feeds = _feeds(inputs)
    expected = np.transpose(feeds["x"], perm)
    rewritten, count = _rewritten(model)
    assert count == 1
    (got,) = _run(rewritten, feeds)
    np.testing.assert_array_equal(got, expected)
    assert [n.op_type for n in rewritten.graph.node if n.op_type not in ("Reshape", "Identity")] == \
        ([] if op_left == "Reshape" else ["Transpose"])
    for read in _input_shapes(rewritten, "Transpose"):
        assert 1 not in read, read


LEFT = {
    # no axis of extent 1 after a wide one: ONNX Runtime's spans are long already
    "no_unit_axis": ("Mul", [("x", F, [16, 64, 64]), ("b", F, [64])]),
    "leading_unit_axes": ("Add", [("x", F, [1, 1, 64, 64]), ("b", F, [64, 64])]),
    # too small to gain
    "small": ("Div", [("x", F, [4, 64, 1]), ("b", F, [1])]),
    # two unknown extents: no Reshape can say them
    "two_unknown": ("Mul", [("x", F, ["a", "b", 64, 1]), ("b", F, [1])]),
    "transpose_without_unit_axes": ("Transpose", [("x", F, [16, 8, 64])]),
    # operands of the output's shape: no broadcast, one span already (measured as fast)
    "same_shapes": ("Mul", [("x", F, [64, 32, 1]), ("b", F, [64, 32, 1])]),
    "small_transpose": ("Transpose", [("x", F, [4, 1, 64])]),
}


@pytest.mark.parametrize("name", sorted(LEFT))
def test_nodes_the_rule_does_not_name_are_left(name):
    op, inputs = LEFT[name]
    model = _model([helper.make_node(op, [n for n, _, _ in inputs], ["y"])], inputs)
    rewritten, count = _rewritten(model)
    assert count == 0
    assert [n.op_type for n in rewritten.graph.node] == [op, "Identity"]


def test_a_node_that_writes_a_graph_output_is_left():
    inputs = [("x", F, [4, 4, 32, 32, 1])]
    graph = helper.make_graph([helper.make_node("Div", ["x", "b"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", F, [4, 4, 32, 32, 1])],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(np.float32(8.0), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    assert _rewritten(model)[1] == 0
    assert _rewritten(_model([helper.make_node("Div", ["x", "b"], ["y"])], inputs,
                             [numpy_helper.from_array(np.float32(8.0), "b")]))[1] == 1


def test_a_reduction_over_unit_axes_alone_or_not_over_the_innermost_axis_and_one_of_every_axis_are_left():
    """Summing [65536, 32, 1] over axis 0 took 0.238 ms, [65536, 32] 0.241: only a sum over the
    innermost axis with a unit axis after it is slow (6.6 against 0.15 ms over axis 1)."""
    inputs = [("x", F, [8, 64, 1, 32, 1])]
    for axes in ([2, 4], [], [0], [1, 2]):
        model = _model([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)], inputs,
                       [numpy_helper.from_array(np.array(axes, np.int64), "axes")])
        assert _rewritten(model)[1] == 0


def test_the_inner_unit_axes():
    assert unit_axes._inner_unit_axes([1, 1, 4, 1, 3, 1]) == [3, 5]
    assert unit_axes._inner_unit_axes([1, 1]) == []
    assert unit_axes._inner_unit_axes([2, 3]) == []


def test_a_built_training_graph_has_no_broadcast_or_reduction_cut_by_unit_axes():
    """The transformer example as built (attention scale, softmax, GELU backward over the seed
    axis): by onnx's own inference of the final graph, no broadcast of at least MIN_ELEMENTS
    elements writes an axis of extent 1 after a wide one, no reduction sums its innermost axis
    with one after it, no Transpose reads one; before the pass, some did."""
    from graphopt import examples
    from graphopt.builder import train_graph

    def cut(model):
        inferred = infer_shapes(model, strict_mode=False)
        shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None
                           for d in v.type.tensor_type.shape.dim]
                  for v in list(inferred.graph.value_info) + list(inferred.graph.input)
                  + list(inferred.graph.output)}
        shapes.update({t.name: list(t.dims) for t in model.graph.initializer})
        constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        found = []
        for node in model.graph.node:
            x, out = shapes.get(node.input[0]) if node.input else None, shapes.get(node.output[0])
            if x is None or out is None or None in x or None in out or np.prod(x if node.op_type.startswith("Reduce")
                                                                                else out) < unit_axes.MIN_ELEMENTS:
                continue
            if node.op_type in unit_axes.BROADCASTING:
                broadcast = any(shapes.get(name) != out for name in node.input)
                inner_unit = 1 in out[next(i for i, d in enumerate(out) if d != 1):]
                if broadcast and inner_unit:
                    found.append(node.name)
            elif node.op_type in unit_axes.REDUCTIONS:
                axes = (constants[node.input[1]].tolist() if len(node.input) > 1
                        else next(list(a.ints) for a in node.attribute if a.name == "axes"))
                innermost = max(i for i, d in enumerate(x) if d != 1)
                if innermost % len(x) in [a % len(x) for a in axes] and innermost < len(x) - 1:
                    found.append(node.name)
            elif node.op_type == "Transpose" and 1 in x:
                found.append(node.name)
        return found

    forward = examples.forward_example("transformer", batch=2, seq=32, d_model=32, heads=2, layers=1, d_ff=64,
                                       vocab=50)
    saved = train_graph.UNIT_AXES_DROPPED
    try:
        train_graph.UNIT_AXES_DROPPED = False
        before = train_graph.build_training_graph(forward)
    finally:
        train_graph.UNIT_AXES_DROPPED = saved
    after = train_graph.build_training_graph(forward)
    assert cut(before), "the example no longer has such nodes: the test proves nothing"
    assert cut(after) == []
    read = {name for node in after.graph.node for name in node.input}
    assert [t.name for t in after.graph.initializer if t.name not in read] == []
    # a sum over the innermost axis adds in another order than over a strided one: float32 rounding
    feeds = examples.example_inputs(forward)
    outputs_before, outputs_after = _run(before, feeds), _run(after, feeds)
    largest = max(float(np.abs(a).max()) for a in outputs_before)
    for a, b in zip(outputs_before, outputs_after):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * largest)


def test_a_reshape_of_a_rewritten_nodes_output_reads_what_it_computed():
    """ReduceSum -> Reshape, and the reduction's result read by a second rewritten node: no two
    Reshapes in a row (ONNX Runtime's level BASIC fuses them into a new node, which moves its
    default order), and the values as before."""
    inputs = [("x", F, [8, 16, 32, 1])]
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=1),
             helper.make_node("Reshape", ["s", "flat"], ["y_flat"]),
             helper.make_node("Div", ["x", "s"], ["q"]),
             helper.make_node("Mul", ["q", "half"], ["r"]),
             helper.make_node("Add", ["r", "y_flat_again"], ["y"]),
             helper.make_node("Reshape", ["y_flat", "back"], ["y_flat_again"])]
    nodes = [nodes[0], nodes[1], nodes[5], nodes[2], nodes[3], nodes[4]]
    initializers = [numpy_helper.from_array(np.array([2], np.int64), "axes"),
                    numpy_helper.from_array(np.array([8, 16], np.int64), "flat"),
                    numpy_helper.from_array(np.array([8, 16, 1, 1], np.int64), "back"),
                    numpy_helper.from_array(np.array([0.5], np.float32), "half")]
    model = _model(nodes, inputs, initializers)
    feeds = _feeds(inputs)
    expected = _run(model, feeds)[0]
    rewritten, count = _rewritten(model)
    assert count == 4   # the reduction, the Div (x over its sums), the Mul by a scalar, the Add of the sums
    np.testing.assert_allclose(_run(rewritten, feeds)[0], expected, rtol=1e-6)
    # what the rewritten nodes wrote before ("s", "q", "r": now Reshapes back) no Reshape reads
    assert [n.name for n in rewritten.graph.node if n.op_type == "Reshape" and n.input[0] in ("s", "q", "r")] == []
    read = {name for n in rewritten.graph.node for name in n.input}
    assert [t.name for t in rewritten.graph.initializer if t.name not in read] == []
    # a new constant per use: no two rewritten nodes read one by name (common-subexpression
    # elimination would merge what the builder keeps apart)
    made = [name for n in rewritten.graph.node for name in n.input[1:] if name.startswith("unit_axes")]
    assert len(made) == len(set(made))
