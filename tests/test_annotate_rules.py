"""annotate's parts that run no model, against values written out here: the annotations' JSON form
and its refusals, the value of each kind of Constant node, sizes from shapes and dtypes, the
kernel events whose sizes are taken (and the ones left to be measured by exposing them), ONNX
Runtime's load errors as graphopt's, and the annotations written into a model. Milliseconds;
tests/test_annotate.py measures real graphs in ONNX Runtime."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.annotate import (
    ANNOTATIONS_KEY,
    Annotations,
    _constant_value,
    _is_constant,
    _load_error,
    _Sizes,
    _sizes_from_kernels,
    _static_sizes,
    read_annotations,
    write_annotations,
)
from graphopt.errors import InvalidModelError, UnsupportedOpError
from graphopt.runtime.session import SessionSettings


def _annotations() -> Annotations:
    return Annotations(provider="CPUExecutionProvider", settings=SessionSettings(execution_order="PRIORITY_BASED"),
                       execution_order=["a", "b"], tensor_bytes={"x": 48, "y": 8},
                       tensor_shapes={"x": [3, 4], "y": [2]}, tensor_dtypes={"x": "float32", "y": "int32"},
                       node_seconds={"a": 1.5e-3, "b": 2e-4}, node_seconds_from="replay", nodes_not_replayed=3)


def test_annotations_as_json_and_back():
    ann = _annotations()
    d = ann.to_dict()
    assert d == {"provider": "CPUExecutionProvider", "settings": ann.settings.to_dict(),
                 "execution_order": ["a", "b"], "tensor_bytes": {"x": 48, "y": 8},
                 "tensor_shapes": {"x": [3, 4], "y": [2]}, "tensor_dtypes": {"x": "float32", "y": "int32"},
                 "node_seconds": {"a": 1.5e-3, "b": 2e-4}, "node_seconds_from": "replay", "nodes_not_replayed": 3}
    assert json.loads(ann.to_json()) == d
    assert Annotations.from_json(ann.to_json()) == ann
    assert Annotations.from_json(ann.to_json().encode()) == ann
    # loose types are made the declared ones; the later fields have defaults
    loose = dict(d, execution_order=[1], tensor_bytes={"x": "48"}, tensor_shapes={"x": ["3", 4.0]},
                 tensor_dtypes={"x": np.dtype("float32")}, node_seconds={"a": "0.5"})
    for key in ("node_seconds_from", "nodes_not_replayed"):
        del loose[key]
    back = Annotations.from_dict(loose)
    assert (back.execution_order, back.tensor_bytes, back.tensor_shapes, back.tensor_dtypes, back.node_seconds) == (
        ["1"], {"x": 48}, {"x": [3, 4]}, {"x": "float32"}, {"a": 0.5})
    assert (back.node_seconds_from, back.nodes_not_replayed) == ("profile", 0)
    del loose["node_seconds"]
    assert Annotations.from_dict(loose).node_seconds == {}


def test_annotations_that_cannot_be_read_say_why():
    d = _annotations().to_dict()
    with pytest.raises(InvalidModelError, match=r"^annotations: expected a JSON object$"):
        Annotations.from_dict([d])
    for key in ("provider", "settings", "execution_order", "tensor_bytes", "tensor_shapes", "tensor_dtypes"):
        with pytest.raises(InvalidModelError, match=rf"^annotations: missing key '{key}'$"):
            Annotations.from_dict({k: v for k, v in d.items() if k != key})
    for bad in (dict(d, tensor_bytes={"x": "many"}), dict(d, tensor_bytes=[1]), dict(d, tensor_shapes={"x": 3}),
                dict(d, nodes_not_replayed=None)):
        with pytest.raises(InvalidModelError, match=r"^annotations: malformed value \("):
            Annotations.from_dict(bad)
    for text in ("[", b"\xff", None):
        with pytest.raises(InvalidModelError, match=r"^annotations: not valid JSON \("):
            Annotations.from_json(text)


def test_the_value_of_each_kind_of_constant():
    c = helper.make_node
    cases = [(c("Constant", [], ["a"], value=numpy_helper.from_array(np.array([[1, 2]], np.int32))),
              np.array([[1, 2]], np.int32)),
             (c("Constant", [], ["b"], value_float=1.5), np.array(1.5, np.float32)),
             (c("Constant", [], ["c"], value_floats=[1.0, 2.5]), np.array([1.0, 2.5], np.float32)),
             (c("Constant", [], ["d"], value_int=7), np.array(7, np.int64)),
             (c("Constant", [], ["e"], value_ints=[3, 4]), np.array([3, 4], np.int64))]
    for node, expected in cases:
        value = _constant_value(node)
        assert value.dtype == expected.dtype and value.shape == expected.shape and np.array_equal(value, expected)
    assert _constant_value(c("Constant", [], ["s"], value_string="x")) is None
    assert _is_constant(c("Constant", [], ["a"], value_int=1))
    assert _is_constant(c("Constant", [], ["a"], value_int=1, domain="ai.onnx"))
    assert not _is_constant(c("Constant", [], ["a"], value_int=1, domain="custom"))
    assert not _is_constant(c("Relu", ["x"], ["a"]))


def test_sizes_from_shapes_and_dtypes_and_arrays():
    sizes = _Sizes()
    sizes.add("x", (np.int64(3), 4.0), np.dtype("float16"), "profile")
    sizes.add("s", [], np.dtype("int64"), "constant")
    sizes.add("e", [0, 5], np.dtype("float32"), "exposed")
    sizes.add_array("a", np.ones((2, 3), np.bool_), "input")
    sizes.add_array("not_an_array", [1, 2], "input")
    assert sizes.bytes == {"x": 24, "s": 8, "e": 0, "a": 6}
    assert sizes.shapes == {"x": [3, 4], "s": [], "e": [0, 5], "a": [2, 3]}
    assert all(type(d) is int for shape in sizes.shapes.values() for d in shape)
    assert sizes.dtypes == {"x": "float16", "s": "int64", "e": "float32", "a": "bool"}
    assert sizes.sources == {"x": "profile", "s": "constant", "e": "exposed", "a": "input"}


def _graph() -> onnx.ModelProto:
    """x -> Relu "r" -> a; Constant k; a + k -> Add "add" -> y (and an unnamed Neg of y, and a
    node named "dup" twice); w an initializer that is also an input."""
    n, vi = helper.make_node, helper.make_tensor_value_info
    nodes = [n("Relu", ["x"], ["a"], name="r"),
             n("Constant", [], ["k"], name="k", value_float=2.0),
             n("Add", ["a", "k"], ["y"], name="add"),
             n("Neg", ["y"], ["ny"]),
             n("Abs", ["y"], ["d1"], name="dup"),
             n("Abs", ["d1"], ["d2"], name="dup"),
             n("Split", ["y"], ["s1", ""], name="split", axis=0, num_outputs=2),
             n("Mul", ["w", "x"], ["wx"], name="mul")]
    graph = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [4]), vi("w", TensorProto.FLOAT, [4])],
                              [vi("d2", TensorProto.FLOAT, [4])],
                              [numpy_helper.from_array(np.ones(4, np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _event(name, index, op, produced):
    return {"name": name + "_kernel_time", "args": {"node_index": index, "op_name": op, "output_type_shape": produced}}


def test_the_kernel_events_whose_sizes_are_taken():
    """ONNX Runtime numbers the nodes without the Constant: r 0, add 1, Neg_2 (unnamed) 2, the two
    "dup" 3 and 4, split 5, mul 6."""
    model = _graph()
    kernels = [_event("r", 0, "Relu", [{"float": [4]}]),
               _event("add", 1, "Add", [{"float16": [4, 1]}]),
               _event("Neg_2", 2, "Neg", [{"int64": [2]}]),             # unnamed: by its index
               _event("dup", 3, "Abs", [{"double": [4]}]),
               _event("dup", 9, "Abs", [{"float": [7]}]),                # a name not unique, a bad index
               _event("split", 5, "Split", [{"float": [1]}]),            # one output reported for s1 alone
               _event("mul", "x", "Mul", [{"float": [4]}]),              # no index: by its unique name
               _event("elsewhere", 7, "Relu", [{"float": [9]}]),         # no such node
               _event("r", 0, "Abs", [{"float": [9]}])]                  # another op type
    sizes = _Sizes()
    sizes.add("a", [5], np.dtype("float32"), "constant")               # known already: kept
    _sizes_from_kernels(model, kernels, sizes, skip={"w"})
    assert sizes.shapes == {"a": [5], "y": [4, 1], "ny": [2], "d1": [4], "s1": [1], "wx": [4]}
    assert sizes.dtypes == {"a": "float32", "y": "float16", "ny": "int64", "d1": "float64", "s1": "float32",
                            "wx": "float32"}
    assert sizes.sources["y"] == "profile" and sizes.bytes["y"] == 8 and sizes.bytes["d1"] == 32
    # what is left: outputs in `skip`, entries not of one type and shape, types ONNX Runtime
    # names that numpy has no match for, a count of outputs that does not match
    left = [_event("mul", 6, "Mul", [{"float": [4]}]),
            _event("r", 0, "Relu", [{"float": [4], "int64": [1]}]),
            _event("add", 1, "Add", [{"bfloat16": [4]}]),
            _event("Neg_2", 2, "Neg", [{"float": 4}]),
            _event("dup", 3, "Abs", [{"float": [4]}, {"float": [4]}]),
            _event("dup", 4, "Abs", "[4]")]
    sizes = _Sizes()
    _sizes_from_kernels(model, left, sizes, skip={"wx"})
    assert sizes.bytes == {}


def test_the_static_sizes_and_the_values_left():
    model = _graph()
    sizes, left = _static_sizes(model, {"x": np.ones(4, np.float32), "w": np.zeros(4, np.float64), "z": 1})
    assert sizes.sources == {"x": "input", "w": "input", "k": "constant"}
    assert sizes.bytes == {"x": 16, "w": 32, "k": 4}                   # the fed w, not the initializer
    assert left == ["a", "y", "ny", "d1", "d2", "s1", "wx"]
    sizes, _ = _static_sizes(model, {})
    assert sizes.sources == {"w": "initializer", "k": "constant"} and sizes.bytes["w"] == 16


def test_onnx_runtimes_load_errors_as_graphopts():
    for message in ("Could not find an implementation for SoftmaxCrossEntropyLossGrad(1) node",
                    "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : x", "Foo is not a registered function/op"):
        error = _load_error(RuntimeError(f"  {message}\n"))
        assert type(error) is UnsupportedOpError
        assert str(error) == (f"this ONNX Runtime has no kernel for an operator of the model: {message} (training "
                              "artifacts of onnxruntime-training need its own kernels; build the training graph "
                              "from the forward model with `graphopt train-graph` instead)")
    own = InvalidModelError("already ours")
    assert _load_error(own) is own
    error = _load_error(RuntimeError(" bad model \n"))
    assert type(error) is InvalidModelError and str(error) == "ONNX Runtime cannot load the model: bad model"


def test_annotations_written_into_a_model_and_read_back():
    model = _graph()
    assert read_annotations(model) is None
    model.graph.value_info.append(helper.make_tensor_value_info("a", TensorProto.DOUBLE, [1]))
    ann = Annotations(provider="CPUExecutionProvider", settings=SessionSettings(),
                      tensor_shapes={"a": [4], "y": [4], "ny": [4], "d1": [4], "d2": [4], "x": [4], "w": [4],
                                     "s1": [2]},
                      tensor_dtypes={"a": "float32", "y": "float32", "ny": "int8", "d1": "bfloat_nothing",
                                     "d2": "float32", "x": "float32", "w": "float32", "s1": "float16"})
    write_annotations(model, ann)
    write_annotations(model, ann)                                      # replaces, adds nothing twice
    assert [p.key for p in model.metadata_props].count(ANNOTATIONS_KEY) == 1
    assert read_annotations(model) == ann
    added = {v.name: (v.type.tensor_type.elem_type, [d.dim_value for d in v.type.tensor_type.shape.dim])
             for v in model.graph.value_info}
    # a's own is kept; inputs, outputs and initializers get none; a dtype numpy cannot name is left
    assert added == {"a": (TensorProto.DOUBLE, [1]), "y": (TensorProto.FLOAT, [4]), "ny": (TensorProto.INT8, [4]),
                     "s1": (TensorProto.FLOAT16, [2])}


# -- annotate itself, on the small MLP example in ONNX Runtime ------------------------------------
@pytest.fixture(scope="module")
def mlp():
    from graphopt.examples import training_example
    return training_example("mlp", small=True)


def test_node_times_replayed_or_profiled(mlp):
    """node_times="replay": the node seconds of the nodes replayed alone replace the profile's
    (graphopt/runtime/replay.py says which it skips and why), the sizes and order are the same
    run's, and the annotations say where their seconds came from; another word is refused."""
    from graphopt.annotate import annotate, replay
    from graphopt.runtime.session import UNOPTIMIZED_SETTINGS
    model, inputs = mlp
    profiled = annotate(model, inputs, UNOPTIMIZED_SETTINGS)
    replayed = annotate(model, inputs, UNOPTIMIZED_SETTINGS, node_times="replay")
    assert (profiled.node_seconds_from, profiled.nodes_not_replayed) == ("profile", 0)
    assert replayed.node_seconds_from == "replay"
    skipped = replay(model, inputs, profiled.tensor_shapes, profiled.tensor_dtypes).skipped
    assert replayed.nodes_not_replayed == len(skipped)
    assert set(replayed.node_seconds) == set(profiled.node_seconds) == {n.name for n in model.graph.node} - {
        n.name for n in model.graph.node if n.op_type == "Constant"}
    assert replayed.tensor_bytes == profiled.tensor_bytes and replayed.execution_order == profiled.execution_order
    assert sum(replayed.node_seconds[k] != profiled.node_seconds[k] for k in profiled.node_seconds) > len(skipped)
    with pytest.raises(ValueError, match=r"^node_times must be 'profile' or 'replay', got 'kernels'$"):
        annotate(model, inputs, UNOPTIMIZED_SETTINGS, node_times="kernels")


def test_annotated_with_optimizations_from_the_file_with_its_weights_on_disk(mlp, tmp_path):
    """Optimizations on (the sizes from a run of their own, optimizations off): from the graph
    alone and its file, every size as from the model in memory; the file's folder as it was."""
    from graphopt.annotate import annotate
    from graphopt.runtime.isolated import WEIGHTS_ON_DISK_MIN_BYTES
    model, inputs = mlp
    path = tmp_path / "train.onnx"
    on_disk = onnx.ModelProto()
    on_disk.CopyFrom(model)                 # (saving with external data rewrites the model saved)
    onnx.save(on_disk, path, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
              size_threshold=WEIGHTS_ON_DISK_MIN_BYTES)
    graph_only = onnx.load(path, load_external_data=False)
    settings = SessionSettings()
    from_file = annotate(graph_only, inputs, settings, model_path=str(path))
    in_memory = annotate(model, inputs, settings)
    assert from_file.tensor_bytes == in_memory.tensor_bytes and from_file.tensor_shapes == in_memory.tensor_shapes
    assert from_file.settings == settings and from_file.provider == "CPUExecutionProvider"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.onnx", "weights.bin"]
