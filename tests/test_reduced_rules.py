"""The reduced twin's small parts against values worked out here from their docstrings: which
shapes are static, the shapes ONNX inference gives with data propagation, the small shape
computations `_fold` evaluates (and the ones it must leave), each dimension extrapolated affine
in the batch or scaled on the tracked axis, and the full-size annotations made from twins'
(their shapes checked, their errors naming the tensor, bytes from shape and dtype, node seconds
scaled by the largest ratio of full to twin bytes). Milliseconds each; tests/test_reduced.py runs
twins of the examples in ONNX Runtime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.annotate import Annotations
from graphopt.reduced import TwinError, _fold, _inferred, _static, extrapolate, full_size_annotations, scale_up
from graphopt.runtime.session import SessionSettings

n = helper.make_node
vi = helper.make_tensor_value_info


def test_a_static_shape_is_whole_dimensions_zero_included():
    assert _static([]) and _static([0, 3]) and _static([1])
    for shape in (None, [None], [2, None], [-1], [2.0], ["B"]):
        assert not _static(shape), shape


def _reshaped_by_a_computed_shape() -> onnx.ModelProto:
    """y = Reshape(x, Concat(Gather(Shape(x), 0), [-1])): its shape is known only with data
    propagation of the Shape."""
    nodes = [n("Shape", ["x"], ["s"], name="shape"),
             n("Gather", ["s", "zero"], ["b"], name="gather", axis=0),
             n("Unsqueeze", ["b", "axes"], ["b1"], name="unsqueeze"),
             n("Concat", ["b1", "minus_one"], ["target"], name="concat", axis=0),
             n("Reshape", ["x", "target"], ["y"], name="reshape")]
    graph = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [2, 3, 4])], [vi("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.array(0, np.int64), "zero"),
                               numpy_helper.from_array(np.array([0], np.int64), "axes"),
                               numpy_helper.from_array(np.array([-1], np.int64), "minus_one")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_inferred_shapes_propagate_shape_values():
    shapes = _inferred(_reshaped_by_a_computed_shape())
    assert shapes["y"] == [2, 12] and shapes["x"] == [2, 3, 4] and shapes["s"] == [3]
    assert shapes["axes"] == [1] and shapes["zero"] == []


def _fold_graph(opset: int = 17) -> onnx.ModelProto:
    """Nodes _fold must leave first (so that a stop there would lose the rest), then ones it folds."""
    nodes = [
        n("Relu", ["c"], ["relu"], name="relu"),                          # not a shape op
        n("Shape", ["unknown"], ["s_unknown"], name="shape_unknown"),     # of a shape not known
        n("Shape", ["x"], ["s_custom"], name="custom", domain="custom.domain"),
        n("Reshape", ["c", "bad"], ["bad_out"], name="bad_reshape"),     # fails to evaluate
        n("Add", ["c", "unknown"], ["u"], name="add_unknown"),           # an input not known
        n("Shape", ["x"], ["s"], name="shape"),                           # [2, 3, 4]
        n("Shape", ["x"], ["s_tail"], name="shape_tail", start=1),        # [3, 4]
        n("Shape", ["x"], ["s_head"], name="shape_head", end=-1),         # [2, 3]
        n("Shape", ["x"], ["s_none"], name="shape_none", start=2, end=1),  # []
        n("Size", ["x"], ["size"], name="size"),                          # 24
        n("Mul", ["size", "c"], ["size_c"], name="mul"),                  # 24 * [1, 2]
        n("Slice", ["s", "starts", "ends", "", "steps"], ["sliced"], name="slice"),   # an optional input left out
        n("Identity", ["big"], ["big_copy"], name="big"),                 # 65 values: too many
        n("Identity", ["edge"], ["edge_copy"], name="edge"),              # 64 values: kept
        n("Identity", ["c"], ["known"], name="known"),                    # already known: not counted
    ]
    if opset < 13:
        nodes.append(n("Squeeze", ["s_head1"], ["squeezed"], name="squeeze", axes=[0]))
        nodes.append(n("Slice", ["s"], ["s_head1"], name="head1", starts=[0], ends=[1]))
    graph = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [2, 3, 4])], [vi("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("custom.domain", 1)])


def _known() -> dict:
    return {"c": np.array([1, 2], np.int64), "bad": np.array([7], np.int64), "known": np.array([5], np.int64),
            "starts": np.array([1], np.int64), "ends": np.array([3], np.int64), "steps": np.array([1], np.int64),
            "big": np.arange(65, dtype=np.int64), "edge": np.arange(64, dtype=np.int64)}


def test_fold_evaluates_the_small_shape_computations_it_can_and_no_others():
    values = _known()
    before = dict(values)
    added = _fold(_fold_graph(), {"x": [2, 3, 4]}, values)
    folded = {k: v for k, v in values.items() if k not in before}
    assert sorted(folded) == ["edge_copy", "s", "s_head", "s_none", "s_tail", "size", "size_c", "sliced"]
    assert added == len(folded) == 8
    expected = {"s": [2, 3, 4], "s_tail": [3, 4], "s_head": [2, 3], "s_none": [], "size": 24, "size_c": [24, 48],
                "sliced": [3, 4], "edge_copy": list(range(64))}
    for name, value in expected.items():
        assert folded[name].dtype == np.int64 and folded[name].tolist() == value, name
    assert values["known"].tolist() == [5]


def test_fold_evaluates_in_the_models_own_operator_set():
    """Squeeze's axes are an attribute before opset 13 (an input since): evaluated in the model's
    opset 11 it folds; a later opset would refuse the attribute. A second pass folds what the
    first made possible (here the Squeeze of the Slice after it)."""
    values = _known()
    model = _fold_graph(opset=11)
    first = _fold(model, {"x": [2, 3, 4]}, values)
    assert values["s_head1"].tolist() == [2] and "squeezed" not in values
    assert first == 9                 # the eight above and the Slice
    assert _fold(model, {"x": [2, 3, 4]}, values) == 1 and values["squeezed"].tolist() == 2
    assert _fold(model, {"x": [2, 3, 4]}, values) == 0


def test_extrapolate_each_dimension_affine_in_the_batch():
    low = {"gone": [2], "rank": [2, 3], "odd": [3, 5], "a": [2, 7], "b": [4], "scalar": []}
    high = {"gone_too": [4], "rank": [4], "odd": [4, 5], "a": [4, 7], "b": [9], "scalar": []}
    # batch 2 -> 4 -> 10: a's first dimension 2b, b's 2.5b - 1 (5 at batch 2 is 4: 2.5*2-1 = 4, 2.5*4-1 = 9)
    out = extrapolate(low, high, 2, 4, 10)
    # odd: (4 - 3) * 6 / 2 = 3, whole: 7; b: (9 - 4) * 6 / 2 = 15, whole: 24
    assert out == {"odd": [7, 5], "a": [10, 7], "b": [24], "scalar": []}
    assert all(type(d) is int for dims in out.values() for d in dims)
    # not a whole number at the full batch: left out, the others kept
    out = extrapolate({"half": [1, 2], "a": [2]}, {"half": [2, 2], "a": [4]}, 2, 4, 7)
    assert out == {"a": [7]}


def test_scale_up_on_the_tracked_axis_alone():
    shapes = {"x": [6, 3], "y": [3, 7], "z": [5], "w": [4, 4]}
    positions = {"x": (0, 1), "y": (1, 1), "w": (2, 1)}          # w's axis 2 is past its rank: left
    out = scale_up(shapes, positions, 2, 8)
    assert out == {"x": [24, 3], "y": [3, 24], "z": [5], "w": [4, 4]}     # 7 // 2 * 8
    assert all(type(d) is int for dims in out.values() for d in dims)
    assert shapes["x"] == [6, 3]                                   # the input is not changed


def _annotations(shapes: dict, dtypes: dict, seconds: dict, order: list) -> Annotations:
    out = Annotations(provider="CPUExecutionProvider", settings=SessionSettings(execution_order="PRIORITY_BASED"))
    out.tensor_shapes = {k: list(v) for k, v in shapes.items()}
    out.tensor_dtypes = dict(dtypes)
    out.tensor_bytes = {k: int(np.prod(v, dtype=np.int64)) * np.dtype(dtypes[k]).itemsize for k, v in shapes.items()}
    out.node_seconds = dict(seconds)
    out.execution_order = list(order)
    return out


def _small_step() -> onnx.ModelProto:
    """h = Relu(x); y = MatMul(h, w); loss = ReduceSum(y): x [B, 8], w [8, 4]."""
    nodes = [n("Relu", ["x"], ["h"], name="relu"), n("MatMul", ["h", "w"], ["y"], name="mm"),
             n("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0)]
    graph = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, ["B", 8])], [vi("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(np.ones((8, 4), np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _twin_at(batch: int, seconds_scale: float = 1.0) -> Annotations:
    shapes = {"twin_only": [3], "x": [batch, 8], "w": [8, 4], "h": [batch, 8], "y": [batch, 4], "loss": []}
    dtypes = {k: "float32" for k in shapes} | {"twin_only": "int64"}
    return _annotations(shapes, dtypes, {"relu": 1e-3 * seconds_scale, "mm": 2e-3 * seconds_scale,
                                         "sum": 5e-4 * seconds_scale, "ort_made": 7e-4},
                        ["relu", "mm", "sum", "ort_made"])


def test_full_size_annotations_from_two_twins():
    model = _small_step()
    low, high = _twin_at(2), _twin_at(4, 2.0)
    inferred = {"x": [16, 8], "h": [16, 8], "w": [8, 4]}
    out = full_size_annotations(model, low, high, 2, 4, 16, inferred)
    assert (out.provider, out.settings) == (high.provider, high.settings)
    shapes = {"x": [16, 8], "w": [8, 4], "h": [16, 8], "y": [16, 4], "loss": []}
    assert out.tensor_shapes == shapes                          # the twin's own constant left out
    assert out.tensor_dtypes == {k: "float32" for k in shapes}
    assert out.tensor_bytes == {"x": 512, "w": 128, "h": 512, "y": 256, "loss": 4}
    assert out.execution_order == ["relu", "mm", "sum", "ort_made"] and out.execution_order is not high.execution_order
    # each node's seconds at batch 4 times the largest full-over-twin bytes among its tensors:
    # relu 4 (x, h), mm 4 (h, y; w 1), sum 4 (y; loss 1), a node the graph lacks 1
    assert out.node_seconds == pytest.approx({"relu": 8e-3, "mm": 16e-3, "sum": 4e-3, "ort_made": 7e-4}, rel=1e-12)


def test_full_size_annotations_from_batch_one_scale_the_tracked_axis():
    model = _small_step()
    high = _twin_at(1)
    positions = {"x": (0, 1), "h": (0, 1), "y": (0, 1)}
    out = full_size_annotations(model, None, high, None, 1, 16, {"y": [16, 4]}, positions)
    assert out.tensor_shapes == {"x": [16, 8], "w": [8, 4], "h": [16, 8], "y": [16, 4], "loss": []}
    assert out.node_seconds == pytest.approx({"relu": 16e-3, "mm": 32e-3, "sum": 8e-3, "ort_made": 7e-4}, rel=1e-12)
    with pytest.raises(TwinError) as refused:
        full_size_annotations(model, None, high, None, 1, 16, {"y": [16, 5]}, positions)
    assert str(refused.value) == ("tensor 'y' measured [1, 4] at batch 1, which does not extend to its full "
                                  "shape [16, 5] at batch 16")


def test_full_size_annotations_name_the_tensor_that_does_not_extend():
    model = _small_step()
    low, high = _twin_at(2), _twin_at(4)
    with pytest.raises(TwinError) as refused:
        full_size_annotations(model, low, high, 2, 4, 16, {"h": [16, 9]})
    assert str(refused.value) == ("tensor 'h' measured [2, 8] at batch 2 and [4, 8] at batch 4, which does not "
                                  "extend to its full shape [16, 9] at batch 16")
    # shapes that are no whole numbers at the full batch: the first of the graph's tensors named
    odd = _twin_at(4)
    odd.tensor_shapes["h"] = [5, 8]
    odd.tensor_shapes["y"] = [5, 4]
    with pytest.raises(TwinError) as refused:
        full_size_annotations(model, low, odd, 2, 4, 15, {})
    assert str(refused.value) == "the shapes of 2 tensors (first 'h') do not extend from batch 2 and 4 to 15"
