"""The reduced twin's small parts against values worked out here from their docstrings: which
shapes are static, the shapes ONNX inference gives with data propagation, the small shape
computations `_fold` evaluates (and the ones it must leave), each dimension extrapolated affine
in the batch or scaled on the tracked axis, and the full-size annotations made from twins'
(their shapes checked, their errors naming the tensor, bytes from shape and dtype, node seconds
scaled by the largest ratio of full to twin bytes). Milliseconds each; tests/test_reduced.py runs
twins of the examples in ONNX Runtime."""
from __future__ import annotations

import sys

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
        nodes.append(n("Unsqueeze", ["s"], ["unsqueezed"], name="unsqueeze", axes=[0]))
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
    """Squeeze's and Unsqueeze's axes are an attribute before opset 13 (an input since):
    evaluated in the model's opset 11 they fold; ONNX's reference Unsqueeze of a later opset
    refuses the attribute. A second pass folds what the first made possible (here the Squeeze
    of the Slice after it)."""
    values = _known()
    model = _fold_graph(opset=11)
    first = _fold(model, {"x": [2, 3, 4]}, values)
    assert values["s_head1"].tolist() == [2] and "squeezed" not in values
    assert values["unsqueezed"].tolist() == [[2, 3, 4]]
    assert first == 10                # the eight above, the Slice and the Unsqueeze
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


# ---------------------------------------------------------------------------------------------
# The batch's tracking on small graphs. Oracle: ONNX Runtime runs each graph built at the full
# batch FULL and at SMALL (its shape constants written for that batch, a constant that holds the
# batch holding its first SMALL samples). A tensor holds the batch on the axis whose extent is
# FULL/SMALL times larger at FULL; its `outer` (the axis is outer * B * inner) is read from which
# elements change when sample 0 of every batch input changes: along that axis they come in
# runs of `inner`, once every B * inner. The twin (make_twin at SMALL) must compute what the graph
# built at SMALL computes on the first SMALL samples, every tensor of it.
# ---------------------------------------------------------------------------------------------
import onnxruntime as ort  # noqa: E402

from graphopt.builder.graph_util import small_constants  # noqa: E402
from graphopt.reduced import (_backward, _contraction, _cut, _forward, _linear, _reduced_axes,  # noqa: E402
                              full_shapes, make_twin, track)

FULL, SMALL = 6, 2
F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _c(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _model(nodes, inputs, constants, opset: int = 17, outputs=None) -> onnx.ModelProto:
    """inputs: name -> (element type, shape); constants: initializers."""
    produced = [o for node in nodes for o in node.output if o]
    outputs = outputs or produced[-1:]
    graph = helper.make_graph(nodes, "g", [vi(k, t, s) for k, (t, s) in inputs.items()],
                              [vi(o, 0, None) for o in outputs], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _exposed(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every tensor its nodes make as a graph output (types from ONNX inference)."""
    typed = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in list(typed.graph.value_info) + list(typed.graph.output)}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.output[:]
    out.graph.output.extend(vi(o, types[o], None) for node in model.graph.node for o in node.output if o)
    return out


def _ort(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(_exposed(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    fed = {i.name for i in session.get_inputs()}
    return dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in fed})))


def _feeds(model: onnx.ModelProto, high: dict[str, int]) -> dict[str, np.ndarray]:
    """Positive floats; integers in range(high[name])."""
    rng = np.random.default_rng(0)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == I64:
            feeds[i.name] = rng.integers(0, high[i.name], shape).astype(np.int64)
        else:
            feeds[i.name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
    return feeds


def _oracle(build, high: dict[str, int]) -> dict[str, tuple[int, int | None] | None]:
    """tensor -> (axis, outer) of the batch as ONNX Runtime's runs show it (outer None where no
    element depends on the samples: a tensor made from nothing), None where it holds no batch."""
    full_model, small_model = build(FULL), build(SMALL)
    feeds = _feeds(full_model, high)
    batch = {i.name for i in full_model.graph.input}
    small_feeds = {k: v[:SMALL] for k, v in feeds.items()}
    changed = {k: v.copy() for k, v in feeds.items()}
    for k, v in changed.items():
        v[0] = (v[0] + 1) % high[k] if v.dtype == np.int64 else v[0] + 0.25
    at_full, at_small, moved = _ort(full_model, feeds), _ort(small_model, small_feeds), _ort(full_model, changed)
    values = {t.name: numpy_helper.to_array(t) for t in full_model.graph.initializer}
    small_values = {t.name: numpy_helper.to_array(t) for t in small_model.graph.initializer}
    for node in full_model.graph.node:
        if node.op_type == "Constant":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    for node in small_model.graph.node:
        if node.op_type == "Constant":
            small_values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    out = {}
    for name in set(at_full) | set(values) | batch:
        big = at_full.get(name, values.get(name, feeds.get(name)))
        small = at_small.get(name, small_values.get(name, small_feeds.get(name)))
        axes = [j for j, (a, b) in enumerate(zip(big.shape, small.shape)) if a != b and a * SMALL == b * FULL]
        assert len(axes) <= 1 and big.ndim == small.ndim, (name, big.shape, small.shape)
        if not axes:
            out[name] = None
            continue
        axis = axes[0]
        outer = None
        if name in moved:
            mask = moved[name] != big
            along = mask.any(axis=tuple(j for j in range(big.ndim) if j != axis))
            if along.any() and not along.all():
                inner = int(np.argmin(along))          # the first run of sample 0
                outer = big.shape[axis] // (FULL * inner)
                assert np.array_equal(along, (np.arange(big.shape[axis]) // inner) % FULL == 0), name
        out[name] = (axis, outer)
    return out


def _positions(model: onnx.ModelProto, keep=frozenset()) -> dict:
    names = [i.name for i in model.graph.input]
    return track(model, full_shapes(model), names, FULL, small_constants(model), keep=keep)


def _check_tracking(build, high=None, keep=frozenset(), learned=False):
    """graphopt's batch positions in build(FULL) (`track`'s, or with `learned` the twin's, which
    adds what it learned from a first twin's inferred shapes) against the oracle's, tensor by
    tensor (the parameters `keep` excepted), and the twin at SMALL against build(SMALL) in ONNX
    Runtime."""
    high = dict(high or {})
    model = build(FULL)
    for i in model.graph.input:
        high.setdefault(i.name, 1)
    want = _oracle(build, high)
    feeds = _feeds(model, high)
    twin = make_twin(model, feeds, SMALL, keep=set(keep))
    got = twin.positions if learned else _positions(model, keep)
    for name, position in want.items():
        if name in keep:
            continue
        mine = got.get(name)
        if position is None:
            assert mine is None, (name, mine)
        else:
            assert mine is not None and mine[0] == position[0], (name, mine, position)
            if position[1] is not None:
                assert mine[1] == position[1], (name, mine, position)
    assert {k: v.shape for k, v in twin.inputs.items()} == {k: (SMALL, *v.shape[1:]) for k, v in feeds.items()}
    assert all(np.array_equal(twin.inputs[k], v[:SMALL]) for k, v in feeds.items())
    native = _ort(build(SMALL), {k: v[:SMALL] for k, v in feeds.items()})
    mine = _ort(twin.model, twin.inputs)
    for name, value in native.items():
        assert mine[name].shape == value.shape, (name, mine[name].shape, value.shape)
        np.testing.assert_allclose(mine[name], value, rtol=1e-6, err_msg=name)
    return twin, got


S, D = 3, 4


def _x(b, *rest):
    return {"x": (F, [b, *rest] if rest else [b, S, D])}


def test_reshapes_carry_the_batch_factor_where_its_elements_land():
    def build(b):
        nodes = [n("Reshape", ["x", "merged_shape"], ["merged"]),          # [B*S, D]: inner S
                 n("Relu", ["merged"], ["relu"]),
                 n("Reshape", ["relu", "split_shape"], ["split"]),          # [B, S, D]
                 n("Reshape", ["split", "rows_shape"], ["rows"]),           # [B, S*D] by -1
                 n("Transpose", ["x"], ["t"], perm=[1, 0, 2]),              # [S, B, D]
                 n("Reshape", ["t", "t_merged_shape"], ["t_merged"]),       # [S*B, D]: outer S
                 n("Reshape", ["t_merged", "t_split_shape"], ["t_split"]),  # [S, B, D]
                 n("Transpose", ["t_split"], ["back"]),                     # reversed: [D, B, S]
                 n("Transpose", ["x"], ["last"], perm=[2, 1, 0]),           # [D, S, B]
                 n("Reshape", ["last", "last_rows_shape"], ["last_rows"]),  # [D*S, B]
                 n("Reshape", ["last", "last_cols_shape"], ["last_cols"]),  # [D, S*B]: outer S
                 n("Transpose", ["x"], ["rolled"], perm=[1, 2, 0]),         # [S, D, B]
                 n("Transpose", ["x"], ["rolled_back"], perm=[2, 0, 1])]    # [D, B, S]
        constants = [_c("merged_shape", [b * S, D]), _c("split_shape", [b, S, D]), _c("rows_shape", [b, -1]),
                     _c("t_merged_shape", [S * b, D]), _c("t_split_shape", [S, b, D]),
                     _c("last_rows_shape", [D * S, b]), _c("last_cols_shape", [D, S * b])]
        return _model(nodes, _x(b), constants, outputs=["split", "rows", "back", "last_rows", "last_cols", "rolled",
                                                        "rolled_back"])
    twin, got = _check_tracking(build)
    assert got["merged"] == (0, 1) and got["t_merged"] == (0, S) and got["last_cols"] == (1, S)
    # every shape constant that held the batch was written for SMALL, none other
    assert twin.rewritten_constants == 7


def test_flatten_squeeze_unsqueeze_and_identity_keep_the_layout():
    def build(b):
        nodes = [n("Flatten", ["x"], ["f2"], axis=2),                      # [B*S, D]
                 n("Flatten", ["x"], ["f0"], axis=0),                      # [1, B*S*D]
                 n("Unsqueeze", ["x", "zero"], ["u0"]),                    # [1, B, S, D]
                 n("Unsqueeze", ["x", "one"], ["u1"]),                     # [B, 1, S, D]
                 n("Squeeze", ["u1", "one"], ["s1"]),                      # [B, S, D]
                 n("Squeeze", ["u0", "zero"], ["s0"]),
                 n("Identity", ["f2"], ["same"]),
                 n("Reshape", ["f0", "f0_shape"], ["f0_back"])]
        constants = [_c("zero", [0]), _c("one", [1]), _c("f0_shape", [b, S * D])]
        return _model(nodes, _x(b), constants, outputs=["f2", "u0", "s1", "s0", "same", "f0_back"])
    _check_tracking(build)


def test_gather_carries_the_batch_from_its_indices_and_past_its_axis_from_its_data():
    table = np.random.default_rng(3).standard_normal((5, D)).astype(np.float32)

    def build(b):
        nodes = [n("Gather", ["table", "tokens"], ["embedded"]),                     # [B, S, D]
                 n("Gather", ["table_t", "tokens"], ["embedded_t"], axis=-1),        # [D, B, S]
                 n("Gather", ["x", "two"], ["picked"], axis=1),                      # [B, 2, D]
                 n("Transpose", ["x"], ["t"], perm=[1, 0, 2]),                       # [S, B, D]
                 n("Gather", ["t", "square"], ["picked_t"], axis=0),                 # [2, 2, B, D]
                 n("Gather", ["t", "two"], ["picked_neg"], axis=-3),                 # [2, B, D]
                 n("Gather", ["x", "scalar"], ["sample"], axis=0),                   # [S, D]: no batch
                 n("Gather", ["t", "scalar"], ["row"], axis=-2),                     # [S, D]: no batch
                 n("Transpose", ["tokens"], ["tokens_t"]),                           # [S, B]
                 n("Gather", ["table", "tokens_t"], ["embedded_tt"]),                # [S, B, D]
                 n("Gather", ["table_t", "tokens_t"], ["embedded_t_t"], axis=1),     # [D, S, B]
                 n("Gather", ["x", "square"], ["picked_2d"], axis=1),                # [B, 2, 2, D]
                 n("Transpose", ["x"], ["x_last"], perm=[2, 1, 0]),                  # [D, S, B]
                 n("Gather", ["x_last", "square"], ["picked_last"], axis=0),         # [2, 2, S, B]
                 n("Gather", ["vector", "tokens"], ["scalars"], axis=-1)]            # [B, S]
        constants = [_c("table", table), _c("table_t", table.T.copy()), _c("two", np.array([0, 2])),
                     _c("square", np.array([[0, 1], [2, 0]])), _c("scalar", np.array(1)), _c("vector", table[:, 0].copy())]
        inputs = _x(b) | {"tokens": (I64, [b, S])}
        return _model(nodes, inputs, constants, outputs=["embedded", "embedded_t", "picked", "picked_t",
                                                         "picked_neg", "sample", "row", "embedded_tt", "embedded_t_t",
                                                         "picked_2d", "picked_last", "scalars"])
    _, got = _check_tracking(build, {"tokens": 5}, keep={"table", "table_t", "vector"})
    assert got["picked_t"] == (2, 1) and got["embedded_t"] == (1, 1) and got["picked_last"] == (3, 1)


def test_gathernd_carries_the_batch_from_its_indices_or_its_batch_dims():
    table = np.random.default_rng(3).standard_normal((5, D)).astype(np.float32)
    picks = np.random.default_rng(4).integers(0, S, (FULL, 1))

    def build(b):
        nodes = [n("GatherND", ["table", "tokens"], ["looked_up"]),                  # [B, D]
                 n("GatherND", ["x", "picks"], ["per_sample"], batch_dims=1),        # [B, D]
                 n("GatherND", ["vector", "tokens"], ["scalars"]),                   # [B]
                 n("Transpose", ["x"], ["t"], perm=[1, 0, 2]),                       # [S, B, D]
                 n("GatherND", ["t", "samples"], ["some_samples"], batch_dims=1),    # [S, D]: no batch
                 n("GatherND", ["x", "pairs"], ["pair_rows"])]                       # [2, D]: no batch
        constants = [_c("table", table), _c("picks", picks[:b]), _c("samples", [[1], [0], [1]]),
                     _c("pairs", [[0, 1], [1, 2]]),
                     _c("vector", table[:, 0].copy())]
        return _model(nodes, _x(b) | {"tokens": (I64, [b, 1])}, constants,
                      outputs=["looked_up", "per_sample", "scalars", "some_samples", "pair_rows"])
    twin, got = _check_tracking(build, {"tokens": 5}, keep={"table", "vector"})
    assert got["picks"] == (0, 1)                 # a constant holding the batch: cut with it


def test_matmul_follows_the_batch_and_drops_it_where_it_is_contracted():
    rng = np.random.default_rng(5)
    w, w_left, w3, w_sq = (rng.standard_normal(s).astype(np.float32) for s in ((D, 5), (5, D), (2, S * D, 5), (S, S)))

    def build(b):
        nodes = [n("MatMul", ["x", "w"], ["projected"]),                          # [B, S, 5]
                 n("Transpose", ["x"], ["t"], perm=[1, 2, 0]),                    # [S, D, B]
                 n("MatMul", ["w_left", "t"], ["left"]),                          # [S, 5, B]
                 n("Reshape", ["x", "rows_shape"], ["rows"]),                     # [B, S*D]
                 n("MatMul", ["rows", "w3"], ["stacked"]),                        # [2, B, 5]
                 n("Transpose", ["rows"], ["cols"]),                              # [S*D, B]
                 n("MatMul", ["cols", "rows"], ["gram"]),                         # [S*D, S*D]: no batch
                 n("MatMul", ["rows", "cols"], ["outer"]),                        # [B, B]? both axes
                 n("MatMul", ["w_sq", "x"], ["mixed"]),                           # [B, S, D]
                 n("MatMul", ["rows", "w_rows"], ["rows_out"]),                   # [B, 5]
                 n("MatMul", ["x", "v"], ["scores"]),                             # [B, S]: a vector's axis gone
                 n("MatMul", ["rows", "v_rows"], ["row_scores"]),                 # [B]
                 n("MatMul", ["v_left", "left"], ["left_scores"]),                # [S, B]
                 n("MatMul", ["v_d", "cols"], ["col_scores"])]                    # [S*D] x [S*D, B] -> [B]
        nodes.append(n("MatMul", ["v_s", "x"], ["per_sample"]))                   # [S] x [B, S, D] -> [B, D]
        constants = [_c("w", w), _c("w_left", w_left), _c("w3", w3), _c("w_sq", w_sq),
                     _c("rows_shape", [b, S * D]), _c("w_rows", w3[0]), _c("v", w[:, 0].copy()),
                     _c("v_rows", w3[0, :, 0].copy()), _c("v_left", w_left[:, 0].copy()),
                     _c("v_d", w3[1, :, 0].copy()), _c("v_s", w_sq[0])]
        return _model(nodes, _x(b), constants, outputs=["projected", "left", "stacked", "gram", "mixed", "rows_out",
                                                        "scores", "row_scores", "left_scores", "col_scores",
                                                        "per_sample"])
    # [B, B] holds the batch twice: no single axis; left out of the graph
    def without_outer(b):
        model = build(b)
        nodes = [node for node in model.graph.node if node.output[0] != "outer"]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        return model
    _, got = _check_tracking(without_outer, keep={"w", "w_left", "w3", "w_sq", "w_rows", "v", "v_rows", "v_left", "v_d",
                                                         "v_s"})
    assert got["scores"] == (0, 1) and got["left_scores"] == (1, 1) and got["col_scores"] == (0, 1)
    assert got["row_scores"] == (0, 1) and got["per_sample"] == (0, 1)


def test_gemm_follows_its_transposes():
    rng = np.random.default_rng(6)
    w, w_t = rng.standard_normal((S * D, 5)).astype(np.float32), rng.standard_normal((5, S * D)).astype(np.float32)

    def build(b):
        nodes = [n("Reshape", ["x", "rows_shape"], ["rows"]),                    # [B, 12]
                 n("Transpose", ["rows"], ["cols"]),                             # [12, B]
                 n("Gemm", ["rows", "w"], ["plain"]),                            # [B, 5]
                 n("Gemm", ["cols", "w"], ["trans_a"], transA=1),                # [B, 5]
                 n("Gemm", ["w_t", "rows"], ["trans_b"], transB=1),              # [5, B]
                 n("Gemm", ["w_t", "cols"], ["right"]),                          # [5, B]
                 n("Gemm", ["cols", "rows"], ["gram"]),                          # [12, 12]: no batch
                 n("Gemm", ["rows", "cols"], ["gram_t"], transA=1, transB=1),    # [12, 12]: no batch
                 n("Gemm", ["w_t", "w"], ["with_c"], alpha=1.0)]                 # no batch
        constants = [_c("w", w), _c("w_t", w_t), _c("rows_shape", [b, S * D])]
        return _model(nodes, _x(b), constants, outputs=["plain", "trans_a", "trans_b", "right", "gram", "gram_t",
                                                        "with_c"])
    _check_tracking(build, keep={"w", "w_t"})


def test_conv_and_conv_transpose_follow_their_data_and_weights():
    rng = np.random.default_rng(7)
    weight, weight_t = rng.standard_normal((3, 2, 3, 3)).astype(np.float32), rng.standard_normal((2, 3, 2, 2))
    image, image_c = rng.standard_normal((1, 2, 5, 5)).astype(np.float32), rng.standard_normal((1, 2, 3, 3))

    def build(b):
        nodes = [n("Conv", ["x", "weight"], ["conv"]),                                  # [B, 3, 3, 3]
                 n("ConvTranspose", ["x", "weight_t"], ["deconv"], strides=[2, 2]),     # [B, 3, 10, 10]
                 n("Conv", ["image", "x"], ["by_samples"]),                             # [1, B, 1, 1]
                 n("Transpose", ["x"], ["x_t"], perm=[1, 0, 2, 3]),                     # [2, B, 5, 5]
                 n("ConvTranspose", ["image_c", "x_t"], ["spread"]),                    # [1, B, 7, 7]
                 n("Conv", ["x_t", "weight"], ["mixed"], group=1)]                      # [2, 3, 3, 3]? see below
        constants = [_c("weight", weight), _c("weight_t", weight_t.astype(np.float32)), _c("image", image),
                     _c("image_c", image_c.astype(np.float32))]
        return _model(nodes[:5], _x(b, 2, 5, 5), constants, outputs=["conv", "deconv", "by_samples", "spread"])
    _check_tracking(build, keep={"weight", "weight_t", "image", "image_c"})


def test_reductions_keep_the_batch_unless_they_reduce_its_axis():
    def build(b):
        nodes = [n("ReduceMean", ["x"], ["mean"], axes=[1], keepdims=0),                 # [B, D]
                 n("ReduceMax", ["x"], ["max_kept"], axes=[-1]),                         # [B, S, 1]
                 n("ReduceSum", ["x", "zero"], ["over_batch"]),                          # [1, S, D]
                 n("ReduceMin", ["x"], ["everything"], keepdims=0),                      # []
                 n("Transpose", ["x"], ["t"], perm=[1, 0, 2]),                           # [S, B, D]
                 n("ReduceSum", ["t", "outer_axes"], ["inner"], keepdims=0),             # [B]
                 n("ReduceSum", ["t", "minus_three"], ["neg"], keepdims=0),              # [B, D]
                 n("ReduceL2", ["t"], ["last"], axes=[2], keepdims=0),                   # [S, B]
                 n("ReduceProd", ["t"], ["first"], axes=[0], keepdims=1),                # [1, B, D]
                 n("ReduceMean", ["t"], ["kept"], axes=[0]),                             # [1, B, D]: keepdims 1
                 n("Transpose", ["x"], ["x_last"], perm=[2, 1, 0]),                      # [D, S, B]
                 n("ReduceSum", ["x_last", "first_two"], ["from_last"], keepdims=0)]     # [B]
        constants = [_c("zero", [0]), _c("outer_axes", [0, 2]), _c("minus_three", [-3]), _c("first_two", [0, 1])]
        return _model(nodes, _x(b), constants, outputs=["mean", "max_kept", "over_batch", "everything", "inner",
                                                        "neg", "last", "first", "kept", "from_last"], opset=17)
    _, got = _check_tracking(build)
    assert got["inner"] == (0, 1) and got["last"] == (1, 1)


def test_reduced_axes_from_the_attribute_the_input_or_all():
    node = n("ReduceSum", ["x", "axes"], ["y"])
    assert _reduced_axes(node, 3, {"axes": np.array([-1, 0])}) == [2, 0]
    assert _reduced_axes(node, 3, {}) is None                                 # axes computed: unknown
    assert _reduced_axes(n("ReduceSum", ["x"], ["y"]), 3, {}) == [0, 1, 2]
    assert _reduced_axes(n("ReduceSum", ["x", ""], ["y"]), 2, {}) == [0, 1]
    assert _reduced_axes(n("ReduceMean", ["x"], ["y"], axes=[-2]), 4, {"axes": np.array([0])}) == [2]


def test_elementwise_and_broadcasting_ops_align_the_batch_from_the_right():
    rng = np.random.default_rng(8)

    def build(b):
        nodes = [n("Add", ["x", "bias"], ["biased"]),                                  # [B, S, D]
                 n("ReduceMean", ["x"], ["pooled"], axes=[1], keepdims=0),             # [B, D]
                 n("Mul", ["scale", "pooled"], ["spread"]),                            # [S, B, D]
                 n("Sub", ["pooled", "x"], ["centered"]),                              # [B, S, D]? rows
                 n("Where", ["keep", "x", "bias"], ["chosen"]),                        # [B, S, D]
                 n("Softmax", ["x"], ["soft"], axis=-1),
                 n("Split", ["x", "halves"], ["left", "right"], axis=2),               # [B, S, 2] twice
                 n("Pad", ["x", "pads"], ["padded"]),                                  # [B, S, D + 2]
                 n("Concat", ["left", "x"], ["joined"], axis=2),                       # [B, S, 6]
                 n("Equal", ["tokens", "three"], ["is_three"]),                        # [B, S]
                 n("Cast", ["is_three"], ["as_float"], to=F),
                 n("Pow", ["x", "two"], ["squared"]),
                 n("Sum", ["x", "biased", "bias"], ["total"]),
                 n("ReduceMean", ["x"], ["scores"], axes=[1], keepdims=0),             # [B, D]
                 n("ReduceMax", ["tokens"], ["labels"], axes=[1], keepdims=0),        # [B]
                 n("NegativeLogLikelihoodLoss", ["scores", "labels"], ["nll"], reduction="none")]  # [B]
        constants = [_c("bias", rng.standard_normal(D).astype(np.float32)),
                     _c("scale", rng.standard_normal((S, 1, 1)).astype(np.float32)),
                     _c("keep", np.array([True, False, True, True])), _c("halves", [2, 2]),
                     _c("pads", [0, 0, 1, 0, 0, 1]), _c("batch_pads", [1, 0, 0, 1, 0, 0]),
                     _c("three", np.array(3)), _c("two", np.array(2.0, np.float32))]
        nodes[3] = n("Sub", ["x", "pooled_3d"], ["centered"])
        nodes.insert(3, n("Unsqueeze", ["pooled", "one"], ["pooled_3d"]))
        constants.append(_c("one", [1]))
        return _model(nodes, _x(b) | {"tokens": (I64, [b, S])}, constants,
                      outputs=["biased", "spread", "centered", "chosen", "soft", "right", "padded", "joined", "as_float", "squared", "total", "nll"])
    rng_state = rng.bit_generator.state

    def fixed(b):
        rng.bit_generator.state = rng_state
        return build(b)
    _, got = _check_tracking(fixed, {"tokens": D}, keep={"bias", "scale", "keep"})
    assert got["spread"] == (1, 1) and got["nll"] == (0, 1)


def test_a_twin_whose_shapes_are_not_the_full_ones_scaled_is_refused_naming_the_tensor():
    """A Pad of the batch axis: [B + 2, S, D] is no multiple of the batch, so graphopt cannot
    tell where the batch goes. ONNX Runtime's shapes at SMALL are not FULL's scaled on any axis."""
    def build(b):
        nodes = [n("Pad", ["x", "batch_pads"], ["grown"], name="pad_rows"), n("Relu", ["grown"], ["out"])]
        return _model(nodes, _x(b), [_c("batch_pads", [1, 0, 0, 1, 0, 0])])
    assert _oracle(build, {"x": 1})["grown"] is None
    model = build(FULL)
    assert "grown" not in _positions(model)
    with pytest.raises(TwinError) as refused:
        make_twin(model, _feeds(model, {}), SMALL)
    message = str(refused.value)
    assert "'grown'" in message and "Pad node 'pad_rows'" in message and "[4, 3, 4]" in message, message
    for batch in (0, FULL, FULL + 1):
        with pytest.raises(TwinError, match=f"reduced batch must be in 1..{FULL - 1}, not {batch}"):
            make_twin(model, _feeds(model, {}), batch)


def test_tensors_made_from_nothing_take_the_batch_where_they_meet_a_tracked_one():
    """ConstantOfShape, Expand of a scalar, a Reshape of them, constants that are not parameters
    (a mask, a per-sample table, Gather's and GatherND's indices): tracked backward from the
    consumer that meets the batch, their shapes rewritten and their values cut in the twin."""
    rng = np.random.default_rng(9)
    table = rng.standard_normal((5, D)).astype(np.float32)
    mask = (rng.random((S * FULL, D)) > 0.4).astype(np.float32)         # [S*B, D], outer S
    per_sample = rng.standard_normal((FULL, 5)).astype(np.float32)
    per_sample_t = rng.standard_normal((5, FULL)).astype(np.float32)
    ids, id_rows = rng.integers(0, 5, FULL), rng.integers(0, 5, (FULL, 1))
    extra = rng.standard_normal((FULL, 2)).astype(np.float32)

    node_mask = (rng.random((FULL, S, D)) > 0.5).astype(np.float32)
    node_weights = rng.random(FULL).astype(np.float32)

    def build(b):
        nodes = [n("Constant", [], ["half"], value=_c("half", np.full(D, 0.5, np.float32))),
                 n("Constant", [], ["node_weights"], value=_c("node_weights", node_weights[:b])),   # [B]
                 n("Constant", [], ["node_mask"], value=_c("node_mask", node_mask[:b])),
                 n("Mul", ["x", "node_mask"], ["node_masked"]),
                 n("Add", ["node_masked", "half"], ["node_half"]),
                 n("ConstantOfShape", ["ones_shape"], ["ones"], value=_c("v", np.array([1.0], np.float32))),
                 n("Relu", ["ones"], ["late"]),                 # tracked in the second pass, after "ones"
                 n("Reshape", ["late", "late_shape"], ["late_flat"]),
                 n("Add", ["ones", "x"], ["plus_one"]),
                 n("Expand", ["two", "x_shape"], ["twos"]),
                 n("Mul", ["twos", "x"], ["doubled"]),
                 n("ConstantOfShape", ["flat_shape"], ["flat"], value=_c("v", np.array([0.5], np.float32))),
                 n("Reshape", ["flat", "x_shape"], ["unflat"]),
                 n("Sub", ["x", "unflat"], ["shifted"]),
                 n("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
                 n("Reshape", ["t", "merged_shape"], ["merged"]),                       # [S*B, D], outer S
                 n("Mul", ["merged", "mask"], ["masked"]),
                 n("ReduceMean", ["x"], ["pooled"], axes=[1], keepdims=0),              # [B, D]
                 n("Gather", ["table", "ids"], ["looked_up"]),                          # [B, D] from ids
                 n("Add", ["pooled", "looked_up"], ["with_ids"]),
                 n("GatherND", ["table", "id_rows"], ["nd"]),                           # [B, D]
                 n("Add", ["nd", "pooled"], ["with_rows"]),
                 n("ReduceMean", ["x"], ["per_x"], axes=[1, 2], keepdims=0),             # [B]
                 n("Gather", ["per_sample", "col"], ["column"], axis=1),                # [B] from the data
                 n("Add", ["per_x", "column"], ["with_column"]),
                 n("Mul", ["per_x", "node_weights"], ["weighted"]),
                 n("ReduceMean", ["x"], ["sums"], axes=[2], keepdims=0),                # [B, S]
                 n("Transpose", ["sums"], ["sums_t"]),                                  # [S, B]
                 n("Gather", ["per_sample_t", "rows"], ["picked"], axis=0),             # [S, B]
                 n("Add", ["sums_t", "picked"], ["with_picked"]),
                 n("Concat", ["extra", "pooled"], ["joined"], axis=1)]                  # [B, 2 + D]
        constants = [_c("ones_shape", [b, S, D]), _c("late_shape", [b * S * D]), _c("two", np.array(2.0, np.float32)),
                     _c("x_shape", [b, S, D]), _c("flat_shape", [b * S * D]), _c("merged_shape", [S * b, D]),
                     _c("mask", mask.reshape(S, FULL, D)[:, :b].reshape(S * b, D)), _c("table", table),
                     _c("ids", ids[:b]), _c("id_rows", id_rows[:b]), _c("per_sample", per_sample[:b]),
                     _c("col", np.array(3)), _c("per_sample_t", per_sample_t[:, :b]), _c("rows", [4, 0, 2]),
                     _c("extra", extra[:b])]
        return _model(nodes, _x(b), constants, outputs=["late_flat", "plus_one", "doubled", "shifted", "masked",
                                                        "with_ids", "with_rows", "with_column", "with_picked",
                                                        "joined", "node_half", "weighted"])
    twin, got = _check_tracking(build, keep={"table"})
    # cut: node_weights, node_mask, mask, ids, id_rows, per_sample, per_sample_t, extra; written for
    # the batch: ones_shape, late_shape, x_shape (for Expand and for Reshape), flat_shape, merged_shape
    assert twin.rewritten_constants == 8 + 6
    assert got["mask"] == (0, S) and got["flat"] == (0, 1) and got["per_sample_t"] == (1, 1)
    cut = {t.name: numpy_helper.to_array(t) for t in twin.model.graph.initializer}
    assert np.array_equal(cut["mask"], mask.reshape(S, FULL, D)[:, :SMALL].reshape(S * SMALL, D))
    assert np.array_equal(cut["table"], table) and cut["col"].tolist() == 3 and cut["rows"].tolist() == [4, 0, 2]


def test_cut_keeps_the_first_samples_of_the_batch_factor():
    """The axis's dimension is outer * B * inner: the cut keeps, of each outer block, the first
    `batch` runs of `inner` (a [outer, B, inner] view, written out by hand here)."""
    full, batch = 4, 3
    for outer, inner, axis in [(1, 1, 0), (2, 3, 1), (3, 1, 1), (1, 2, 2), (2, 2, 0)]:
        shape = [5, outer * full * inner, 2] if axis == 1 else ([outer * full * inner, 5] if axis == 0
                                                                 else [2, 3, outer * full * inner])
        array = np.arange(np.prod(shape)).reshape(shape)
        keep = [o * full * inner + s * inner + i for o in range(outer) for s in range(batch) for i in range(inner)]
        want = np.take(array, keep, axis=axis)
        got = _cut(array, axis, outer, full, batch)
        assert got.shape == want.shape and np.array_equal(got, want), (outer, inner, axis)
        assert got.flags.c_contiguous


def test_linear_puts_the_batch_on_the_axis_that_holds_its_elements():
    """Row-major: the batch factor's position is the elements before it (the axes before its
    axis times `outer`); it lands on the first output axis whose prefix divides that and whose
    dimension holds the factor (worked by hand)."""
    assert _linear((0, 1), [6, 3, 4], [18, 4], 6) == (0, 1)
    assert _linear((1, 1), [3, 6, 4], [18, 4], 6) == (0, 3)
    assert _linear((1, 1), [3, 6, 4], [3, 24], 6) == (1, 1)
    assert _linear((0, 3), [18, 4], [3, 6, 4], 6) == (1, 1)
    assert _linear((0, 1), [6, 3, 4], [1, 72], 6) == (1, 1)
    assert _linear((0, 1), [6, 6], [36], 6) == (0, 1)              # another dimension equal to B
    assert _linear((1, 1), [6, 6], [36], 6) == (0, 6)
    assert _linear((0, 2), [12, 5], [2, 30], 6) == (1, 1)
    assert _linear((2, 1), [2, 3, 6, 4], [2, 3, 24], 6) == (2, 1)  # six elements before it, over two axes
    assert _linear((2, 1), [2, 3, 6, 4], [6, 24], 6) == (1, 1)
    assert _linear((0, 1), [6, 4], [4, 6], 6) is None              # no axis holds the factor whole
    assert _linear((1, 1), [2, 6], [3, 4], 6) is None


def test_the_twin_writes_each_shape_constant_for_its_users_and_copies_a_shared_one():
    """Resize's sizes, Expand's and ConstantOfShape's shapes, a Reshape's shape held by a Constant
    node, a shape constant two Reshapes read with different batch entries (a copy for each), one
    read by a Reshape that holds no batch (kept for it, a copy for the other), and entries 1, 0
    and -1 (never the batch's). The graph built at SMALL shares no constant where the values
    differ there."""
    rng = np.random.default_rng(10)
    rows = rng.standard_normal((FULL, 2 * FULL)).astype(np.float32)

    def build(b):
        shared = [_c("shape_6_12", [b, 2 * FULL])] if b == FULL else \
            [_c("shape_6_12", [b, 2 * FULL]), _c("shape_6_12_kept", [FULL, 2 * FULL]), _c("shape_6_12_t", [FULL, 2 * b])]
        nodes = [n("Resize", ["x", "", "", "sizes_hw"], ["resized_hw"], mode="nearest", axes=[2, 3]),  # [B, 2, 4, 6]
                 n("Resize", ["x", "", "scales"], ["scaled"], mode="nearest"),                  # [B, 2, 10, 10]
                 n("Reshape", ["x", "flat_50" if b == FULL else "flat_50_b"], ["rows_50"]),     # [B, 50]
                 n("Reshape", ["param_300", "flat_50"], ["param_50"]),                          # [6, 50]
                 n("Resize", ["x", "", "", "sizes"], ["resized"], mode="nearest"),             # [B, 2, 4, 6]
                 n("Constant", [], ["rows_shape"], value=_c("rows_shape", [b, 2 * 5 * 5])),
                 n("Reshape", ["x", "rows_shape"], ["rows"]),                                   # [B, 50]
                 n("Reshape", ["x", "keep_dims"], ["same"]),                                    # [B, 2, 5, 5] by 0, -1
                 n("Reshape", ["x", "one_rows"], ["one_row"]),                                  # [1, B * 50]
                 n("ReduceMean", ["x", "hw"], ["pooled"], keepdims=0),                          # [B, 2]
                 n("Reshape", ["pooled", "to_column"], ["column"]),                             # [B * 2, 1]
                 n("Expand", ["column", "wide"], ["widened"]),                                  # [B * 2, 6]
                 n("Reshape", ["widened", "shape_6_12"], ["regrouped"]),                        # [B, 12]
                 n("Reshape", ["rows_param", "shape_6_12" if b == FULL else "shape_6_12_kept"], ["param_rows"]),
                 n("Transpose", ["regrouped"], ["cols"]),                                       # [12, B]
                 n("Reshape", ["cols", "shape_6_12" if b == FULL else "shape_6_12_t"], ["cols_regrouped"]),
                 n("Identity", ["x"], ["shape_6_12__b2_1"]),                 # the first copy's name, taken
                 n("Reshape", ["x", "minus_one_rows"], ["by_minus_one"]),                       # [B, 50]
                 n("Reshape", ["pooled", "pooled_3d_shape"], ["pooled_3d"]),                    # [B, 1, 2]
                 n("Transpose", ["pooled_3d"], ["pooled_t"], perm=[2, 0, 1]),                   # [2, B, 1]
                 n("Expand", ["pooled_t", "short"], ["expanded"]),                              # [2, B, 3] by [B, 3]
                 n("Reshape", ["pooled", "column_3d"], ["pooled_col"]),                         # [B, 2, 1]
                 n("Expand", ["pooled_col", "two_by_6"], ["widened_6"]),                        # [B, 2, 6]: a 6, no batch
                 n("Transpose", ["x"], ["x_last"], perm=[1, 2, 3, 0]),                          # [2, 5, 5, B]
                 n("Resize", ["x_last", "", "", "sizes_4_6"], ["resized_last"], mode="nearest", axes=[1, 2])]
        flat_50 = [_c("flat_50", [FULL, 50])] + ([_c("flat_50_b", [b, 50])] if b != FULL else [])
        constants = [*flat_50, _c("param_300", np.arange(300, dtype=np.float32)), _c("hw", [2, 3]),
                     _c("column_3d", [b, 2, 1]), _c("two_by_6", [2, 6]), _c("sizes_4_6", [4, 6]),
                     _c("sizes_hw", [4, 6]), _c("scales", np.array([1, 1, 2, 2], np.float32)),
                     _c("minus_one_rows", [-1, 50]), _c("pooled_3d_shape", [b, 1, 2]), _c("short", [b, 3]),
                     _c("sizes", [b, 2, 4, 6]), _c("keep_dims", [0, -1, 5, 5]), _c("one_rows", [1, b * 50]),
                     _c("to_column", [b * 2, 1]), _c("wide", [b * 2, 6]), _c("rows_param", rows), *shared]
        return _model(nodes, _x(b, 2, 5, 5), constants,
                      outputs=["resized", "rows", "same", "one_row", "param_rows", "cols_regrouped",
                               "shape_6_12__b2_1", "by_minus_one", "expanded", "resized_hw", "scaled",
                               "rows_50", "param_50", "widened_6", "resized_last"], opset=18)
    twin, got = _check_tracking(build, keep={"rows_param", "param_300"})
    constants = {t.name: numpy_helper.to_array(t).tolist() for t in twin.model.graph.initializer}
    assert constants["sizes"] == [SMALL, 2, 4, 6] and constants["keep_dims"] == [0, -1, 5, 5]
    assert constants["shape_6_12"] == [FULL, 2 * FULL]              # kept for the parameter's Reshape
    copies = {name: value for name, value in constants.items() if name.startswith("shape_6_12__")}
    assert sorted(copies.values()) == [[SMALL, 2 * FULL], [FULL, 2 * SMALL]] and "shape_6_12__b2_1" not in copies
    assert [name for name in constants if name.startswith("flat_50")] == ["flat_50", "flat_50__b2_1"]
    assert constants["minus_one_rows"] == [-1, 50] and constants["short"] == [SMALL, 3]
    assert constants["sizes_hw"] == [4, 6] and constants["flat_50"] == [FULL, 50]     # kept for param_300's
    assert constants["two_by_6"] == [2, 6] and constants["sizes_4_6"] == [4, 6]      # their 6s are no batch
    assert FULL == 6
    users = {node.output[0]: list(node.input) for node in twin.model.graph.node}
    assert constants[users["rows_50"][1]] == [SMALL, 50]
    assert users["param_rows"][1] == "shape_6_12"
    assert {constants[users["regrouped"][1]][0], constants[users["cols_regrouped"][1]][1]} == {SMALL, 2 * SMALL}
    # sizes, the Constant node, one_rows, to_column, wide, two copies of shape_6_12, pooled_3d_shape,
    # short, the copy of flat_50, column_3d: one a node each
    assert twin.rewritten_constants == 11
    kinds = {t.name: t.data_type for t in twin.model.graph.initializer}
    assert all(kinds[name] == TensorProto.INT64 for name in copies)


def test_the_twin_drops_the_declared_full_size_shapes():
    """Declared intermediate and output shapes at the full batch would contradict the twin's:
    dropped; the batch inputs declared at the twin's batch."""
    def build(b):
        nodes = [n("Reshape", ["x", "rows_shape"], ["rows"]), n("Relu", ["rows"], ["out"])]
        model = _model(nodes, _x(b) | {"w": (F, [FULL, D])}, [_c("rows_shape", [b, S * D])])
        model.graph.value_info.append(vi("rows", F, [b, S * D]))
        del model.graph.output[:]
        model.graph.output.append(vi("out", F, [b, S * D]))
        return model
    model = build(FULL)
    feeds = _feeds(model, {}) | {"w": np.ones((FULL, D), np.float32)}   # state: its FULL is no batch
    twin = make_twin(model, feeds, SMALL, state={"w"})
    g = twin.model.graph
    assert len(g.value_info) == 0 and not g.output[0].type.tensor_type.HasField("shape")
    assert [d.dim_value for d in g.input[0].type.tensor_type.shape.dim] == [SMALL, S, D]
    assert [d.dim_value for d in g.input[1].type.tensor_type.shape.dim] == [FULL, D]  # state: not the batch
    assert twin.inputs["w"] is feeds["w"] and twin.inputs["x"].shape == (SMALL, S, D)
    assert (twin.batch, twin.full_batch) == (SMALL, FULL)
    assert model.graph.value_info[0].type.tensor_type.shape.dim[0].dim_value == FULL    # the original kept


def test_a_constant_that_holds_the_batch_is_read_from_its_external_data(tmp_path):
    mask = (np.random.default_rng(11).random((FULL, S, D)) > 0.5).astype(np.float32)

    def build(b):
        return _model([n("Mul", ["x", "mask"], ["masked"])], _x(b), [_c("mask", mask[:b])])
    model = build(FULL)
    from onnx.external_data_helper import convert_model_to_external_data
    convert_model_to_external_data(model, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    onnx.save(model, str(tmp_path / "m.onnx"))
    model = build(FULL)
    external = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    feeds = _feeds(model, {})
    with pytest.raises(TwinError, match="constant 'mask' holds the batch and its data is not in the graph"):
        make_twin(external, feeds, SMALL)
    twin = make_twin(external, feeds, SMALL, base_dir=str(tmp_path))
    np.testing.assert_array_equal(numpy_helper.to_array(twin.model.graph.initializer[0]), mask[:SMALL])
    got = _ort(twin.model, twin.inputs)["masked"]
    np.testing.assert_array_equal(got, feeds["x"][:SMALL] * mask[:SMALL])


def test_a_shape_computed_from_a_tracked_tensor_is_learned_from_the_twins_inference():
    """Expand(1, Shape(x)) meets no tracked tensor: its batch position is learned from the twin's
    inferred shapes (the full one scaled on axis 0), and the Reshape after it written for the
    batch in the next twin."""
    def build(b):
        nodes = [n("Shape", ["x"], ["x_shape"]),
                 n("Expand", ["one", "x_shape"], ["ones"]),                 # [B, S, D] from the batch's shape
                 n("ReduceSum", ["ones", "inner_axes"], ["counts"], keepdims=0),      # [B]
                 n("Reshape", ["counts", "column_shape"], ["column"]),     # [B, 1]
                 n("Relu", ["x"], ["out"])]
        constants = [_c("one", np.array(1.0, np.float32)), _c("inner_axes", [1, 2]), _c("column_shape", [b, 1])]
        return _model(nodes, _x(b), constants, outputs=["out", "column"])
    twin, got = _check_tracking(build, learned=True)
    assert got["ones"] == (0, 1) and "ones" not in _positions(build(FULL))


def _computed_reshapes(b: int, rounds: int) -> onnx.ModelProto:
    """y_k = Reshape(y_{k-1}, [Size(y_{k-1}) / 2, 2]) (y_0 = x, k = 1..rounds): each shape is
    known only once the one before it is (Size and Div are not data-propagated by ONNX)."""
    nodes, previous = [], "x"
    for k in range(1, rounds + 1):
        nodes += [n("Size", [previous], [f"size{k}"]),
                  n("Div", [f"size{k}", "two"], [f"half{k}"]),
                  n("Unsqueeze", [f"half{k}", "zero"], [f"rows{k}"]),
                  n("Concat", [f"rows{k}", "two_1d"], [f"shape{k}"], axis=0),
                  n("Reshape", [previous, f"shape{k}"], [f"y{k}"])]
        previous = f"y{k}"
    return _model(nodes, _x(b), [_c("two", np.array(2)), _c("zero", [0]), _c("two_1d", [2])])


@pytest.mark.parametrize("rounds", [1, 3, 4])
def test_full_shapes_completes_inference_with_the_folded_shape_computations(rounds):
    """Oracle: every tensor's shape in ONNX Runtime. Each round of folding and inferring again
    makes one more Reshape's shape known; full_shapes does four rounds."""
    model = _computed_reshapes(FULL, rounds)
    measured = {k: list(v.shape) for k, v in _ort(model, _feeds(model, {})).items()}
    shapes = full_shapes(model)
    assert f"y{rounds}" not in _inferred(model)
    for name, shape in measured.items():
        assert shapes.get(name) == shape, (name, shapes.get(name), shape)
    assert shapes["x"] == [FULL, S, D] and shapes["two"] == [] and shapes["two_1d"] == [1]
    assert set(shapes) == set(measured) | {"x", "two", "zero", "two_1d"}


def test_full_shapes_stops_after_four_rounds():
    shapes = full_shapes(_computed_reshapes(FULL, 5))
    assert shapes["y4"] == [FULL * S * D // 2, 2] and "y5" not in shapes and "size5" in shapes


def test_a_contraction_over_the_batch_holds_none_where_its_result_has_a_dimension_like_it():
    """The weight gradient's pattern, x [B, 6, 3, 3] at B = 6: MatMul, Gemm, Conv and
    ConvTranspose contracting the batch make results of 6 x 6 channels or rows that do not
    change with the batch (the oracle's None), though an axis of theirs equals B."""
    def build(b):
        nodes = [n("Transpose", ["x"], ["x_t"], perm=[1, 0, 2, 3]),                     # [6, B, 3, 3]
                 n("Reshape", ["x", "rows_shape"], ["rows"]),                             # [B, 54]
                 n("ReduceMean", ["x"], ["pooled"], axes=[2, 3], keepdims=0),             # [B, 6]
                 n("Transpose", ["pooled"], ["cols"]),                                    # [6, B]
                 n("MatMul", ["cols", "pooled"], ["gram"]),                               # [6, 6]
                 n("Gemm", ["cols", "pooled"], ["gemm_gram"]),                            # [6, 6]
                 n("Gemm", ["pooled", "pooled"], ["gemm_t"], transA=1),                   # [6, 6]
                 n("Gemm", ["cols", "cols"], ["gemm_tb"], transB=1),                      # [6, 6]
                 n("Conv", ["x_t", "x_t"], ["conv_grad"]),                                # [6, 6, 1, 1]
                 n("ConvTranspose", ["x_t", "x"], ["deconv_grad"]),                       # [6, 6, 5, 5]
                 n("ReduceMean", ["pooled"], ["per_x"], axes=[1], keepdims=0),            # [B]
                 n("MatMul", ["per_x", "pooled"], ["weighted"])]                          # [B] x [B, 6] -> [6]
        return _model(nodes, _x(b, 6, 3, 3), [_c("rows_shape", [b, 54])],
                      outputs=["rows", "gram", "gemm_gram", "gemm_t", "gemm_tb", "conv_grad", "deconv_grad",
                               "weighted"])
    assert FULL == 6
    _, got = _check_tracking(build)
    assert not {"gram", "gemm_gram", "gemm_t", "gemm_tb", "conv_grad", "deconv_grad", "weighted"} & set(got)


def test_gathers_indices_and_data_take_the_batch_backward_on_the_axis_the_output_holds_it():
    """Gather's and GatherND's untracked constant indices and data, from a tracked output:
    indices where the output's batch axis came from them (Gather's axis 1, 2-D indices, GatherND
    into a vector), data where it came from the data (past Gather's axis, GatherND's trailing
    axes); a table read by tracked tokens holds none (axis 0 and 1)."""
    rng = np.random.default_rng(12)
    table = rng.standard_normal((5, D)).astype(np.float32)
    ids, id_rows = rng.integers(0, 5, FULL), rng.integers(0, 5, (FULL, 1))
    trailing = rng.standard_normal((5, FULL)).astype(np.float32)
    stacked = rng.standard_normal((5, FULL)).astype(np.float32)
    plain = rng.standard_normal((4, 5)).astype(np.float32)
    plain_t = rng.standard_normal((5, 4)).astype(np.float32)
    last_axis = rng.standard_normal((S, FULL, 5)).astype(np.float32)

    def build(b):
        nodes = [n("ReduceMean", ["x"], ["pooled"], axes=[1], keepdims=0),               # [B, D]
                 n("Transpose", ["pooled"], ["pooled_t"]),                              # [D, B]
                 n("Gather", ["table_t", "ids"], ["by_column"], axis=1),                # [D, B]
                 n("Add", ["by_column", "pooled_t"], ["columns"]),
                 n("ReduceMean", ["x"], ["per_x"], axes=[1, 2], keepdims=0),           # [B]
                 n("GatherND", ["vector", "id_rows"], ["picked"]),                      # [B]
                 n("Add", ["picked", "per_x"], ["picked_sum"]),
                 n("ReduceMean", ["x"], ["sums"], axes=[2], keepdims=0),               # [B, S]
                 n("Transpose", ["sums"], ["sums_t"]),                                  # [S, B]
                 n("GatherND", ["trailing", "rows"], ["trail"]),                        # [S, B]
                 n("Add", ["trail", "sums_t"], ["trail_sum"]),
                 n("Unsqueeze", ["sums_t", "one"], ["sums_3d"]),                        # [S, 1, B]
                 n("Gather", ["stacked", "rows"], ["stack_rows"]),                      # [S, 1, B]
                 n("Add", ["stack_rows", "sums_3d"], ["stack_sum"]),
                 n("Gather", ["plain", "tokens"], ["plain_rows"], axis=1),              # [4, B, S]
                 n("Gather", ["plain_t", "tokens"], ["plain_cols"]),                    # [B, S, 4]
                 n("Gather", ["last_axis", "two"], ["last_picked"], axis=2),            # [S, B]
                 n("Add", ["last_picked", "sums_t"], ["last_sum"])]
        constants = [_c("table_t", table.T.copy()), _c("ids", ids[:b]), _c("vector", table[:, 0].copy()),
                     _c("id_rows", id_rows[:b]), _c("trailing", trailing[:, :b]), _c("rows", [[1], [4], [0]]),
                     _c("one", [1]), _c("stacked", stacked[:, :b]), _c("plain", plain), _c("plain_t", plain_t),
                     _c("last_axis", last_axis[:, :b]), _c("two", np.array(2))]
        return _model(nodes, _x(b) | {"tokens": (I64, [b, S])}, constants,
                      outputs=["columns", "picked_sum", "trail_sum", "stack_sum", "plain_rows", "plain_cols",
                               "last_sum"])
    _, got = _check_tracking(build, {"tokens": 4}, keep={"table_t", "vector"})
    assert got["ids"] == (0, 1) and got["id_rows"] == (0, 1) and got["trailing"] == (1, 1)
    assert got["stacked"] == (1, 1) and "rows" not in got and "plain" not in got and "plain_t" not in got
    assert got["last_axis"] == (1, 1)


def test_constants_meet_the_batch_through_flatten_and_a_broadcast_of_lower_rank():
    rng = np.random.default_rng(13)
    per_sample = rng.standard_normal((FULL, D)).astype(np.float32)

    def build(b):
        nodes = [n("ConstantOfShape", ["ones_shape"], ["ones"], value=_c("v", np.array([1.0], np.float32))),
                 n("Flatten", ["ones"], ["ones_flat"], axis=1),                         # [B, S*D]
                 n("Flatten", ["x"], ["x_flat"], axis=1),
                 n("Add", ["ones_flat", "x_flat"], ["flat_sum"]),
                 n("Transpose", ["x"], ["t"], perm=[1, 0, 2]),                          # [S, B, D]
                 n("Add", ["t", "per_sample"], ["t_plus"])]                             # per_sample [B, D]
        constants = [_c("ones_shape", [b, S, D]), _c("per_sample", per_sample[:b])]
        return _model(nodes, _x(b), constants, outputs=["flat_sum", "t_plus"])
    _, got = _check_tracking(build)
    assert got["per_sample"] == (0, 1) and got["ones"] == (0, 1)


def test_constants_read_by_contractions_keep_their_shape_though_a_dimension_equals_the_batch():
    """At B = 6, constants (not parameters) of 6 x 6 read by MatMul, Gemm, Conv and
    ConvTranspose with the batch: their 6s do not change with the batch, and stay."""
    rng = np.random.default_rng(14)
    square, kernel = rng.standard_normal((6, 6)).astype(np.float32), rng.standard_normal((6, 6, 1, 1))

    def build(b):
        nodes = [n("MatMul", ["x", "square"], ["mm"]),                                  # [B, 6]
                 n("Gemm", ["x", "square_g"], ["gemm"]),
                 n("Reshape", ["x", "image_shape"], ["image"]),                         # [B, 6, 1, 1]
                 n("Conv", ["image", "kernel"], ["conv"]),
                 n("ConvTranspose", ["image", "kernel_t"], ["deconv"])]
        constants = [_c("square", square), _c("square_g", square.T.copy()), _c("image_shape", [b, 6, 1, 1]),
                     _c("kernel", kernel.astype(np.float32)), _c("kernel_t", kernel.transpose(1, 0, 2, 3).copy().astype(np.float32))]
        return _model(nodes, _x(b, 6), constants, outputs=["mm", "gemm", "conv", "deconv"])
    assert FULL == 6
    _, got = _check_tracking(build)
    assert not {"square", "square_g", "kernel", "kernel_t"} & set(got)


@pytest.mark.parametrize("full,small", [(2, 1), (3, 2)])
def test_a_batch_of_two_or_three_is_tracked_backward_like_any_other(full, small, monkeypatch):
    """The backward rule leaves a size-1 axis alone (a broadcast, not the batch): a batch of 2
    is no such axis."""
    monkeypatch.setattr(sys.modules[__name__], "FULL", full)
    monkeypatch.setattr(sys.modules[__name__], "SMALL", small)
    mask = (np.random.default_rng(15).random((full, S, D)) > 0.5).astype(np.float32)

    def build(b):
        nodes = [n("Mul", ["x", "mask"], ["masked"]), n("Reshape", ["masked", "rows_shape"], ["rows"])]
        return _model(nodes, _x(b), [_c("mask", mask[:b]), _c("rows_shape", [b, S * D])])
    twin, got = _check_tracking(build)
    assert got["mask"] == (0, 1)
    assert numpy_helper.to_array(twin.model.graph.initializer[1]).tolist() == [small, S * D]


def test_the_backward_rules_give_nothing_they_cannot_place():
    """Worked from _backward's docstring: a parameter (not movable) never takes the batch; an
    input of unknown shape gets none; a Reshape that does not keep the batch factor whole on one
    axis gives its input none; indices whose shape is unknown get none."""
    shapes = {"x": [6, 6], "p": [6, 6], "y": [6, 6], "c": [4, 6], "r": [6, 4], "g": [6, 6], "data": [10, 6]}
    add = n("Add", ["x", "p"], ["y"])
    assert _backward(add, shapes, {"x": (0, 1), "y": (0, 1)}, {"y"}, 6) == {}
    assert _backward(add, shapes, {"x": (0, 1), "y": (0, 1)}, {"p"}, 6) == {"p": (0, 1)}
    unknown = {k: v for k, v in shapes.items() if k != "p"}
    assert _backward(add, unknown, {"x": (0, 1), "y": (0, 1)}, {"p"}, 6) == {}
    reshape = n("Reshape", ["c", "shape"], ["r"])                     # [4, 6] -> [6, 4]: the batch scattered
    assert _backward(reshape, shapes, {"r": (0, 1)}, {"c", "shape"}, 6) == {}
    for op in ("Gather", "GatherND"):
        gather = n(op, ["data", "idx"], ["g"])
        assert _backward(gather, shapes, {"g": (0, 1)}, {"idx"}, 6) == {}      # idx's shape unknown
        assert _backward(gather, shapes | {"idx": [6, 1]}, {"g": (0, 1)}, set(), 6) == {}   # not movable
    gather = n("Gather", ["unknown", "idx"], ["g"])
    assert _backward(gather, shapes | {"idx": [6]}, {"g": (0, 1)}, {"unknown"}, 6) == {}     # data's shape unknown


def test_the_forward_rules_give_nothing_they_cannot_place():
    """Worked from the module docstring: an output of unknown shape gets no position; a Reshape
    that scatters the batch factor over axes gives none; Gather's data past its axis needs the
    indices' rank."""
    shapes = {"x": [6, 4], "y": [4, 6], "i": [2, 3]}
    assert _forward(n("Relu", ["x"], ["y"]), {"x": [6, 4]}, {"x": (0, 1)}, 6, {}) == {}
    assert _forward(n("Reshape", ["x", "s"], ["y"]), shapes, {"x": (0, 1)}, 6, {}) == {}
    gather = n("Gather", ["x", "i"], ["g"], axis=1)
    assert _forward(gather, {"x": [6, 4], "g": [6, 2, 3]}, {"x": (0, 1)}, 6, {}) == {}
    assert _forward(gather, {"x": [6, 4], "i": [2, 3], "g": [6, 2, 3]}, {"x": (0, 1)}, 6, {}) == {"g": (0, 1)}


def test_an_input_declared_with_a_symbolic_batch_takes_its_shape_from_what_is_fed():
    """x declared ["B", S, D]: inference knows its shape only from the feed; the twin computes what
    the graph built at SMALL does, and the shapes handed in are not changed."""
    def build(b, symbolic=False):
        nodes = [n("Reshape", ["x", "merged_shape"], ["merged"]), n("Relu", ["merged"], ["relu"]),
                 n("Reshape", ["relu", "split_shape"], ["split"]), n("Mul", ["split", "x"], ["out"]),
                 n("Relu", ["x"], ["relu_x"]),
                 n("Expand", ["x", "split_shape"], ["expanded"])]           # static from its shape alone
        model = _model(nodes, _x(b), [_c("merged_shape", [b * S, D]), _c("split_shape", [b, S, D])],
                       outputs=["out", "relu_x", "expanded"])
        if symbolic:
            model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "B"
        return model
    model = build(FULL, symbolic=True)
    shapes = full_shapes(model)
    assert "x" not in shapes and "relu_x" not in shapes and shapes["merged"] == [FULL * S, D]
    handed = {k: list(v) for k, v in shapes.items()}
    feeds = _feeds(build(FULL), {})
    twin = make_twin(model, feeds, SMALL, shapes=shapes)
    assert shapes == handed
    assert twin.positions["merged"] == (0, 1) and twin.positions["out"] == (0, 1) and "relu_x" not in twin.positions
    assert twin.positions["expanded"] == (0, 1)
    # shapes the caller knows (measured at full size) are the ones used: there relu_x holds the batch
    known = full_shapes(build(FULL))
    told = make_twin(model, feeds, SMALL, shapes=known)
    assert told.positions["relu_x"] == (0, 1)
    native = _ort(build(SMALL), {k: v[:SMALL] for k, v in feeds.items()})
    for made in (twin, told):
        mine = _ort(made.model, made.inputs)
        for name, value in native.items():
            np.testing.assert_allclose(mine[name], value, rtol=1e-6, err_msg=name)


def test_the_batch_is_the_leading_dimension_most_fed_inputs_share():
    """batch_inputs' docstring: the fed inputs that are not state nor initializers and have an
    axis; the leading dimension most of them share (the larger on a tie), and those that have it,
    in the graph's order."""
    from graphopt.reduced import batch_inputs
    inputs = {"x": [6, 3], "scalar": [], "z": [4, 2], "y": [6], "w": [6, 6], "init": [6], "unfed": [6], "z2": [4]}
    model = _model([n("Identity", ["x"], ["out"])], {k: (F, v) for k, v in inputs.items()},
                   [_c("init", np.zeros(6, np.float32))])
    feeds = {k: np.zeros(v, np.float32) for k, v in inputs.items() if k != "unfed"} | {"not_an_input": np.zeros(6)}
    assert batch_inputs(model, feeds, state={"w"}) == (6, ["x", "y"])
    assert batch_inputs(model, feeds, state={"w", "x"}) == (4, ["z", "z2"])         # two 4s, one 6
    assert batch_inputs(model, feeds, state={"w", "y", "z2"}) == (6, ["x"])         # one each: the larger
    with pytest.raises(TwinError) as refused:
        batch_inputs(model, {"scalar": np.zeros(()), "w": np.zeros((6, 6)), "init": np.zeros(6)}, state={"w"})
    assert str(refused.value) == "no fed input that is not state: nothing carries a batch"


def test_a_constant_to_replace_that_is_not_there_is_named():
    from graphopt.reduced import _replace_constant
    graph = helper.make_graph([n("Constant", [], ["c"], value=_c("c", [1]))], "g", [], [vi("c", I64, [1])],
                              [_c("i", [2])])
    _replace_constant(graph, "c", _c("c", [3]))
    _replace_constant(graph, "i", _c("i", [4]))
    assert numpy_helper.to_array(graph.node[0].attribute[0].t).tolist() == [3]
    assert numpy_helper.to_array(graph.initializer[0]).tolist() == [4]
    with pytest.raises(TwinError, match="constant 'nope' not found"):
        _replace_constant(graph, "nope", _c("nope", [5]))


def test_a_transpose_or_gather_does_not_hand_the_batch_to_its_input_by_size_alone():
    """At B = 6, x [B, 6]: a constant c [B, 6] whose transpose meets x transposed, and indices
    [6, 2] that pick 6 rows of x (their 6 is no batch: the gathered rows are). The batch axis of
    c is the one its own consumer gives; the indices keep their shape."""
    c = np.random.default_rng(16).standard_normal((FULL, 6)).astype(np.float32)
    picks = np.array([[0, 1], [1, 0], [0, 0], [1, 1], [0, 1], [1, 0]])

    def build(b):
        nodes = [n("Add", ["c", "x"], ["plus"]),                          # c's batch: axis 0
                 n("Transpose", ["c"], ["c_t"]),                           # [6, B]
                 n("Transpose", ["x"], ["x_t"]),
                 n("Add", ["c_t", "x_t"], ["plus_t"]),
                 n("Gather", ["x", "picks"], ["rows"])]                    # [6, 2, 6]: no batch
        return _model(nodes, _x(b, 6), [_c("c", c[:b]), _c("picks", picks)], outputs=["plus", "plus_t", "rows"])
    assert FULL == 6
    _, got = _check_tracking(build)
    assert got["c"] == (0, 1) and "picks" not in got and "rows" not in got


def test_node_seconds_scale_by_the_tensors_that_have_bytes_at_the_twin():
    """A tensor of no bytes at the twin (an empty slice) and one the twin's annotations lack (a
    constant) give no ratio; the node's seconds scale by the others' (docstring: the largest
    ratio of full to twin bytes among the tensors it reads and writes)."""
    nodes = [n("Relu", ["x"], ["h"], name="relu"), n("Slice", ["h", "starts", "ends"], ["empty"], name="take")]
    graph = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, ["B", 8])], [vi("empty", TensorProto.FLOAT, None)],
                              [_c("starts", [0]), _c("ends", [0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    def twin(batch):
        shapes = {"x": [batch, 8], "h": [batch, 8], "empty": [0, 8]}
        return _annotations(shapes, {k: "float32" for k in shapes}, {"relu": 1e-3, "take": 2e-3}, ["relu", "take"])
    out = full_size_annotations(model, twin(2), twin(4), 2, 4, 16, {})
    assert out.tensor_bytes == {"x": 512, "h": 512, "empty": 0}
    assert out.node_seconds == pytest.approx({"relu": 4e-3, "take": 8e-3}, rel=1e-12)
