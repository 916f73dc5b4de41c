"""annotate's parts that run no model, against values written out here: the annotations' JSON form
and its refusals, the value of each kind of Constant node, sizes from shapes and dtypes, the
kernel events whose sizes are taken (and the ones left to be measured by exposing them), ONNX
Runtime's load errors as graphopt's, and the annotations written into a model. Milliseconds;
tests/test_annotate.py measures real graphs in ONNX Runtime.

Then, on small graphs in ONNX Runtime (seconds in all): the sessions annotate, measure_sizes,
measure_exposed and replay open (each real InferenceSession's options and providers recorded as
it is made: the providers, threads, cap, spinning, optimization level, profiling and runs the
module docstring says each run has), a cap too small and a model that fails as the errors they
give, the file beside the model a graph held without its weights is exposed from, the profile's
own temporary folder, the chunks values are exposed in, and the values replay replays with
against onnx's reference evaluator."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.annotate import (
    ANNOTATIONS_KEY,
    Annotations,
    annotate,
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


# -- the sessions annotate opens, as ONNX Runtime is handed them --------------------------------------
# A session's providers, threads, spinning, cap and optimization level leave no mark on the sizes
# measured; they are read here from the SessionOptions each real InferenceSession is made with, and
# from the session itself (its providers, its runs). Nothing is replaced: every session is ONNX
# Runtime's own and runs.
@dataclass
class _Opened:
    graph: onnx.GraphProto      # the model ONNX Runtime was handed (its graph)
    source: str | None          # the file it opened (None: the model's bytes)
    level: str                  # graph optimization level
    threads: int                # intra-op threads (0: ONNX Runtime's default)
    spinning: str | None        # the session's "allow spinning" entry (None: ONNX Runtime's default)
    profile_prefix: str | None  # where it profiles to (None: not profiled)
    capped: bool                # opened under a memory cap (the env's capped arena)
    providers: list[str]        # the providers the session has (ONNX Runtime's answer)
    runs: int = 0

    def added_outputs(self, model: onnx.ModelProto) -> list[str]:
        """The graph outputs this session has beyond `model`'s."""
        own = [o.name for o in model.graph.output]
        return [o.name for o in self.graph.output][len(own):]


def _entry(so, key: str) -> str | None:
    try:
        return so.get_session_config_entry(key)
    except RuntimeError:                     # no such entry
        return None


@pytest.fixture
def opened(monkeypatch):
    import onnxruntime as ort
    from graphopt.runtime.session import ALLOW_SPINNING_CONFIG

    sessions: list[_Opened] = []

    class Recorded(ort.InferenceSession):
        def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
            if isinstance(path_or_bytes, bytes):
                graph, source = onnx.load_from_string(path_or_bytes).graph, None
            else:
                source = os.fspath(path_or_bytes)
                graph = onnx.load(source, load_external_data=False).graph
            so = sess_options
            super().__init__(path_or_bytes, sess_options, providers, provider_options, **kwargs)
            self._opened = _Opened(graph, source, so.graph_optimization_level.name, so.intra_op_num_threads,
                                   _entry(so, ALLOW_SPINNING_CONFIG),
                                   so.profile_file_prefix if so.enable_profiling else None,
                                   _entry(so, "session.use_env_allocators") == "1", self.get_providers())
            sessions.append(self._opened)

        def run(self, *args, **kwargs):
            self._opened.runs += 1
            return super().run(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", Recorded)
    return sessions


def _other_provider() -> list[str]:
    """A providers list unlike the default one: another provider this ONNX Runtime has (the stock
    wheel's Azure provider, which runs none of these ops: the CPU runs them), then the CPU."""
    import onnxruntime as ort
    others = [p for p in ort.get_available_providers() if p not in ("CPUExecutionProvider", "CUDAExecutionProvider")]
    if not others:
        pytest.skip("this ONNX Runtime has no provider but the CPU's")
    return [others[0], "CPUExecutionProvider"]


def _loss_graph() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x @ w -> logits; SoftmaxCrossEntropyLoss (a function op ONNX Runtime inlines at load: its
    outputs have no kernel event, so they are sized by exposing them); Shape and a Reshape to it (a
    value computed in the step that replay replays with its real value)."""
    n, vi = helper.make_node, helper.make_tensor_value_info
    nodes = [n("MatMul", ["x", "w"], ["logits"], name="mm"),
             n("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss", "log_prob"], name="sce"),
             n("Shape", ["logits"], ["shp"], name="shape"),
             n("Reshape", ["logits", "shp"], ["r"], name="reshape")]
    graph = helper.make_graph(nodes, "loss_graph", [vi("x", TensorProto.FLOAT, [4, 6]), vi("labels", TensorProto.INT64, [4])],
                              [vi("loss", TensorProto.FLOAT, []), vi("r", TensorProto.FLOAT, [4, 5])],
                              [numpy_helper.from_array(np.linspace(-1, 1, 30, dtype=np.float32).reshape(6, 5), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    inputs = {"x": np.linspace(-2, 2, 24, dtype=np.float32).reshape(4, 6), "labels": np.array([0, 4, 2, 1], np.int64)}
    return model, inputs


def _of_the_model(sessions: list[_Opened], model: onnx.ModelProto) -> list[_Opened]:
    return [s for s in sessions if s.graph.name == model.graph.name]


def _role(s: _Opened, model: onnx.ModelProto) -> tuple:
    return (s.level, s.profile_prefix is not None, s.runs, s.spinning, s.added_outputs(model))


def test_each_session_of_an_annotation_runs_on_the_callers_providers_and_threads(opened):
    """annotate's every session, and replay's, gets the providers and threads the caller gave; the
    runs whose time nobody reads (the sizes, the values exposed) open with optimizations off and
    threads that do not spin; with optimizations on the sizes come from a profiled run of their
    own (one run, optimizations off) before the timed one (two runs), with them off from the timed
    run itself (module docstring (a), (b)). Oracle: the docstrings' list of runs, written out."""
    model, inputs = _loss_graph()
    providers = _other_provider()
    exposed_for_sizes = ["log_prob"]          # loss is an output already
    computed_for_replay = ["logits", "shp"]   # x, labels (fed) and w (an initializer) are the graph's
    for settings, expected in [
        (SessionSettings(), [("ORT_DISABLE_ALL", True, 1, "0", []),
                             ("ORT_DISABLE_ALL", False, 1, "0", exposed_for_sizes),
                             ("ORT_ENABLE_ALL", True, 2, None, []),
                             ("ORT_DISABLE_ALL", False, 1, "0", computed_for_replay)]),
        (SessionSettings(graph_optimization_level="ORT_DISABLE_ALL"),
         [("ORT_DISABLE_ALL", True, 2, None, []),
          ("ORT_DISABLE_ALL", False, 1, "0", exposed_for_sizes),
          ("ORT_DISABLE_ALL", False, 1, "0", computed_for_replay)])]:
        opened.clear()
        ann = annotate(model, inputs, settings, providers=providers, threads=2, node_times="replay")
        assert ann.provider == providers[0]
        whole = _of_the_model(opened, model)
        assert [_role(s, model) for s in whole] == expected, settings
        replayed = [s for s in opened if s.graph.name != model.graph.name]
        assert replayed and {s.graph.name for s in replayed} == {"call", "replay"}
        assert all(s.threads == 2 and s.providers == providers and not s.capped for s in opened)
        assert all(s.source is None for s in opened)
        # the Reshape is replayed as the view ONNX Runtime makes it: its output's shape is read
        reshapes = [s for s in replayed if [x.op_type for x in s.graph.node][:1] == ["Reshape"]]
        assert reshapes and all([x.op_type for x in s.graph.node] == ["Reshape", "Shape"] for s in reshapes)


def test_what_each_entry_point_opens_by_default(opened):
    """Without providers or threads: ONNX Runtime's default providers, one thread, in every session
    of annotate, measure_sizes, measure_exposed and replay."""
    from graphopt.annotate import annotate, measure_exposed, measure_sizes, replay
    from graphopt.runtime.session import default_providers
    model, inputs = _loss_graph()
    ann = annotate(model, inputs, SessionSettings())
    measure_sizes(model, inputs)
    measure_exposed(model, inputs, ["logits"])
    replay(model, inputs, ann.tensor_shapes, ann.tensor_dtypes)
    assert len(_of_the_model(opened, model)) == 3 + 2 + 1 + 1 and len(opened) > 7
    assert all(s.threads == 1 and s.providers == default_providers() for s in opened)
    # measure_sizes alone: its profiled run (one, optimizations off, not spinning), then the exposing one
    assert [_role(s, model) for s in _of_the_model(opened, model)[3:5]] == [
        ("ORT_DISABLE_ALL", True, 1, "0", []), ("ORT_DISABLE_ALL", False, 1, "0", ["log_prob"])]


def test_under_a_cap_every_session_of_the_annotation_is_capped(opened):
    """cap_bytes reaches every session annotate opens (the sizes' profiled run, the values exposed,
    the timed run), with optimizations on and off, and measure_sizes' own."""
    from graphopt.annotate import measure_exposed, measure_sizes
    model, inputs = _loss_graph()
    for settings in (SessionSettings(), SessionSettings(graph_optimization_level="ORT_DISABLE_ALL")):
        opened.clear()
        annotate(model, inputs, settings, providers=["CPUExecutionProvider"], cap_bytes=64 << 20)
        assert len(opened) == (3 if settings.graph_optimization_level != "ORT_DISABLE_ALL" else 2)
        assert all(s.capped for s in opened), settings
    opened.clear()
    measure_sizes(model, inputs, cap_bytes=64 << 20)
    measure_exposed(model, inputs, ["logits"], cap_bytes=64 << 20)
    assert len(opened) == 3 and all(s.capped for s in opened)
    opened.clear()
    annotate(model, inputs, SessionSettings())
    assert len(opened) == 3 and not any(s.capped for s in opened)


def _relu_graph(n: int = 64) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x (n x n floats) -> Relu -> a -> Neg -> y: no initializer, so a cap of a few KiB binds."""
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["a"], name="relu"),
                               helper.make_node("Neg", ["a"], ["y"], name="neg")], "relu_graph",
                              [vi("x", TensorProto.FLOAT, [n, n])], [vi("y", TensorProto.FLOAT, [n, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, {"x": np.linspace(-1, 1, n * n, dtype=np.float32).reshape(n, n)}


def test_a_cap_too_small_for_a_step_fails_each_run_with_onnx_runtimes_error():
    """A 4 KiB cap on a step of 16 KiB values: the exposing run, the sizes' profiled run and the
    timed run each fail, saying so with ONNX Runtime's out-of-memory message; without the cap
    they run."""
    from graphopt.annotate import measure_exposed, measure_sizes
    model, inputs = _relu_graph()
    runs = [lambda cap: measure_exposed(model, inputs, ["a"], cap_bytes=cap),
            lambda cap: measure_sizes(model, inputs, cap_bytes=cap),
            lambda cap: annotate(model, inputs, SessionSettings(graph_optimization_level="ORT_DISABLE_ALL"),
                                 cap_bytes=cap)]
    for run in runs:
        with pytest.raises(InvalidModelError, match=r"^annotate: the model failed to run: .*Available memory of"):
            run(4096)
        run(None)


def test_a_model_that_fails_to_run_or_to_load_says_so_with_onnx_runtimes_message():
    """A Reshape fed a shape its input does not fit fails in ONNX Runtime's run: the exposing run
    and the profiled run say "the model failed to run" with ONNX Runtime's message; an operator
    ONNX Runtime has no kernel for fails at load: graphopt's UnsupportedOpError with its message."""
    from graphopt.annotate import measure_exposed, measure_sizes
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape"),
                               helper.make_node("Neg", ["y"], ["z"], name="neg")], "bad_reshape",
                              [vi("x", TensorProto.FLOAT, [2, 3]), vi("shape", TensorProto.INT64, [2])],
                              [vi("z", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inputs = {"x": np.ones((2, 3), np.float32), "shape": np.array([4, 2], np.int64)}
    for run in (lambda: measure_exposed(model, inputs, ["y"]), lambda: measure_sizes(model, inputs)):
        with pytest.raises(InvalidModelError, match=r"^annotate: the model failed to run: .*Reshape.*"
                                                    r"[Tt]he input tensor cannot be reshaped"):
            run()
    unknown = helper.make_model(helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"], name="foo", domain="my.ops"),
                                                   helper.make_node("Neg", ["y"], ["z"], name="neg")], "unknown_op",
                                                  [vi("x", TensorProto.FLOAT, [2, 3])], [vi("z", TensorProto.FLOAT, None)]),
                                opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.ops", 1)])
    inputs = {"x": np.ones((2, 3), np.float32)}
    for run in (lambda: measure_exposed(unknown, inputs, ["y"]), lambda: measure_sizes(unknown, inputs)):
        with pytest.raises(UnsupportedOpError, match=r"^this ONNX Runtime has no kernel for an operator of the model: "
                                                     r".*NoSuchOp"):
            run()


def _graph_only(model: onnx.ModelProto, folder) -> tuple[onnx.ModelProto, str]:
    """`model` saved in `folder` with every initializer's data in a file beside it, and its graph
    loaded without them (what the annotating child holds)."""
    on_disk = onnx.ModelProto()
    on_disk.CopyFrom(model)
    path = str(folder / "model.onnx")
    onnx.save(on_disk, path, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
              size_threshold=0)
    graph_only = onnx.load(path, load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in graph_only.graph.initializer)
    return graph_only, path


def test_every_session_from_the_file_when_the_weights_are_on_disk(opened, tmp_path, monkeypatch):
    """With model_path (the graph held without its weights), every session opens from the file:
    the model's own, or, where values are exposed, a hidden `.exposing-*.onnx` written beside it
    (its weights found there) and removed after; optimizations on and off, replay included. The
    sizes and the timed run's outputs equal those of the model held whole."""
    model, inputs = _loss_graph()
    (tmp_path / "model").mkdir()
    graph_only, path = _graph_only(model, tmp_path / "model")
    monkeypatch.chdir(tmp_path)               # not the model's folder
    for settings in (SessionSettings(), SessionSettings(graph_optimization_level="ORT_DISABLE_ALL")):
        opened.clear()
        outputs, whole_outputs = {}, {}
        ann = annotate(graph_only, inputs, settings, model_path=path, node_times="replay", outputs_into=outputs)
        whole = annotate(model, inputs, settings, outputs_into=whole_outputs)
        assert (ann.tensor_bytes, ann.tensor_shapes) == (whole.tensor_bytes, whole.tensor_shapes)
        assert outputs.keys() == whole_outputs.keys() and all(np.array_equal(outputs[k], whole_outputs[k]) for k in outputs)
        sessions = _of_the_model(opened, model)[:4 if settings.graph_optimization_level != "ORT_DISABLE_ALL" else 3]
        exposing = [s for s in sessions if s.profile_prefix is None]
        assert len(exposing) == 2 and all(s.source == path for s in sessions if s.profile_prefix is not None)
        for s in exposing:
            folder, name = os.path.split(s.source)
            assert folder == str(tmp_path / "model") and name.startswith(".exposing-") and name.endswith(".onnx")
        assert sorted(os.listdir(tmp_path / "model")) == ["model.onnx", "weights.bin"]


def test_the_profile_is_written_in_a_folder_of_its_own_and_removed(opened, tmp_path, monkeypatch):
    """Each profiled session writes its profile in a fresh folder of the temporary directory (named
    graphopt-profile-*), which is gone after; nothing is left in the temporary directory or the
    working one."""
    import tempfile
    model, inputs = _loss_graph()
    (tmp_path / "tmp").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.chdir(tmp_path / "cwd")
    annotate(model, inputs, SessionSettings())
    prefixes = [s.profile_prefix for s in opened if s.profile_prefix is not None]
    assert len(prefixes) == 2
    folders = {os.path.dirname(p) for p in prefixes}
    assert len(folders) == 2
    for folder in folders:
        assert os.path.dirname(folder) == str(tmp_path / "tmp")
        assert os.path.basename(folder).startswith("graphopt-profile-")
    assert os.listdir(tmp_path / "tmp") == [] and os.listdir(tmp_path / "cwd") == []


def test_values_are_exposed_in_chunks_of_the_size_asked(opened):
    """measure_exposed: `chunk` values per run (0: all in one; by default EXPOSE_CHUNK), each name
    once, in the order given; every value comes back (oracle: the arrays of one run exposing all)."""
    from graphopt.annotate import EXPOSE_CHUNK, measure_exposed
    model, inputs, names = _many_values(EXPOSE_CHUNK + 3)
    whole = measure_exposed(model, inputs, names + names[:2], chunk=0)
    assert [s.added_outputs(model) for s in opened] == [names]
    for chunk, parts in [(None, [names[:EXPOSE_CHUNK], names[EXPOSE_CHUNK:]]),
                         (1, [[n] for n in names]),
                         (10, [names[i:i + 10] for i in range(0, len(names), 10)])]:
        opened.clear()
        got = measure_exposed(model, inputs, names, chunk=chunk)
        assert [s.added_outputs(model) for s in opened] == parts, chunk
        assert got.keys() == whole.keys() == set(names)
        assert all(np.array_equal(got[k], whole[k]) for k in names)


def _many_values(count: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[str]]:
    """x times each of `count` initializers (values a0..; every initializer 2, so that replay
    replays their Mul nodes as one), summed."""
    vi = helper.make_tensor_value_info
    names = [f"a{i}" for i in range(count)]
    nodes = [helper.make_node("Mul", ["x", f"k{i}"], [name], name=f"mul{i}") for i, name in enumerate(names)]
    nodes.append(helper.make_node("Sum", names, ["y"], name="sum"))
    graph = helper.make_graph(nodes, "many_values", [vi("x", TensorProto.FLOAT, [3])], [vi("y", TensorProto.FLOAT, [3])],
                              [numpy_helper.from_array(np.array(2, np.float32), f"k{i}") for i in range(count)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, {"x": np.array([1.0, -2.0, 3.0], np.float32)}, names


@pytest.fixture
def replayed_with(monkeypatch):
    """The values replay hands graphopt/runtime/replay.py's replay_node_seconds (which then runs)."""
    import graphopt.runtime.replay as replay_module
    calls = []
    real = replay_module.replay_node_seconds

    def recorded(model, tensor_shapes, tensor_dtypes, values, **kwargs):
        calls.append(dict(values))
        return real(model, tensor_shapes, tensor_dtypes, values, **kwargs)

    monkeypatch.setattr(replay_module, "replay_node_seconds", recorded)
    return calls


def _replayed_graph() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Every source of a value replay replays with: fed inputs (w also an initializer, fed another
    value), an initializer (b), a Constant (c_shape; c_unread is read by no node), values computed
    in the step (xr, s1, sb, shp, zb), and an initializer too large to be replayed with its value
    (big, 65 x 64 floats)."""
    n, vi = helper.make_node, helper.make_tensor_value_info
    nodes = [n("Constant", [], ["c_shape"], name="c_shape", value_ints=[3, 2]),
             n("Constant", [], ["c_unread"], name="c_unread", value_float=1.0),
             n("Reshape", ["x", "c_shape"], ["xr"], name="reshape_x"),
             n("Add", ["xr", "w"], ["s1"], name="add"),
             n("Mul", ["s1", "b"], ["sb"], name="mul"),
             n("Shape", ["sb"], ["shp"], name="shape"),
             n("Reshape", ["sb", "shp"], ["s2"], name="reshape_s"),
             n("MatMul", ["z", "big"], ["zb"], name="mm"),
             n("Relu", ["zb"], ["zr"], name="relu")]
    graph = helper.make_graph(nodes, "replayed", [vi("x", TensorProto.FLOAT, [2, 3]), vi("w", TensorProto.FLOAT, [3, 2]),
                                                  vi("z", TensorProto.FLOAT, [1, 65])],
                              [vi("s2", TensorProto.FLOAT, [3, 2]), vi("zr", TensorProto.FLOAT, [1, 64])],
                              [numpy_helper.from_array(np.zeros((3, 2), np.float32), "w"),
                               numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2) - 2, "b"),
                               numpy_helper.from_array((np.arange(65 * 64) % 5 - 2).astype(np.float32).reshape(65, 64), "big")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    inputs = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "w": np.full((3, 2), 0.5, np.float32),
              "z": (np.arange(65) % 3).astype(np.float32).reshape(1, 65)}   # integers: every sum exact
    return model, inputs


def _reference_values(model, inputs, names) -> dict[str, np.ndarray]:
    """The values of `names` in one step, from onnx's reference evaluator (not ONNX Runtime)."""
    from onnx.reference import ReferenceEvaluator
    graph_inputs = {i.name for i in model.graph.input}
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    found = dict(zip(names, ReferenceEvaluator(model).run(list(names), inputs)))
    for name in names:                               # inputs fed and initializers are themselves
        if name in inputs:
            found[name] = inputs[name]
        elif name in initializers and name not in graph_inputs:
            found[name] = initializers[name]
    return found


def test_replay_replays_with_the_real_values_of_the_step(opened, replayed_with, tmp_path, monkeypatch):
    """The values replay hands the replaying (the inputs of the nodes replayed that are replayed
    with their real values, graphopt/runtime/replay.py): fed inputs as fed (an initializer that is
    also an input: the value fed), Constants from their attributes, the others from one run of the
    model exposing exactly them; nothing else. Oracle: onnx's reference evaluator. From the graph
    held without its weights and its file, the same values."""
    from graphopt.annotate import measure_sizes, replay
    model, inputs = _replayed_graph()
    wanted = {"x", "w", "b", "z", "c_shape", "xr", "s1", "sb", "shp", "zb"}
    computed = ["s1", "sb", "shp", "xr", "zb"]
    expected = _reference_values(model, inputs, sorted(wanted))
    assert np.array_equal(expected["w"], inputs["w"]) and expected["c_shape"].tolist() == [3, 2]
    assert expected["b"].tolist() == [[-2, -1], [0, 1], [2, 3]]
    sizes = measure_sizes(model, inputs)
    (tmp_path / "model").mkdir()
    graph_only, path = _graph_only(model, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    for held, model_path in ((model, None), (graph_only, path)):
        opened.clear()
        replayed_with.clear()
        out = replay(held, inputs, sizes.shapes, sizes.dtypes, model_path=model_path)
        (values,) = replayed_with
        assert set(values) == wanted
        for name in wanted:
            got = values[name]
            assert got.dtype == expected[name].dtype and np.array_equal(got, expected[name]), name
        assert [s.added_outputs(model) for s in _of_the_model(opened, model)] == [computed]
        assert out.skipped == {} and set(out.node_seconds) == {n.name for n in model.graph.node
                                                               if n.op_type != "Constant"}


def test_replay_reads_what_the_graph_holds_without_a_run(opened, replayed_with, tmp_path, monkeypatch):
    """Where every value replayed with is fed, an initializer or a Constant, replay runs no session
    of the model; with the weights on disk and no model_path, they are read as onnx reads external
    data, from the working directory."""
    from graphopt.annotate import measure_sizes, replay
    n, vi = helper.make_node, helper.make_tensor_value_info
    graph = helper.make_graph([n("Constant", [], ["c"], name="c", value_ints=[3, 2]),
                               n("Reshape", ["x", "c"], ["xr"], name="reshape"),
                               n("MatMul", ["x", "w"], ["y"], name="mm")], "from_the_graph",
                              [vi("x", TensorProto.FLOAT, [2, 3])],
                              [vi("xr", TensorProto.FLOAT, [3, 2]), vi("y", TensorProto.FLOAT, [2, 2])],
                              [numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inputs = {"x": np.ones((2, 3), np.float32)}
    sizes = measure_sizes(model, inputs)
    (tmp_path / "model").mkdir()
    graph_only, _ = _graph_only(model, tmp_path / "model")
    monkeypatch.chdir(tmp_path / "model")
    for held in (model, graph_only):
        opened.clear()
        replayed_with.clear()
        replay(held, inputs, sizes.shapes, sizes.dtypes)
        (values,) = replayed_with
        assert set(values) == {"x", "c", "w"}
        assert values["c"].tolist() == [3, 2] and values["c"].dtype == np.int64
        assert np.array_equal(values["w"], numpy_helper.to_array(model.graph.initializer[0]))
        assert _of_the_model(opened, model) == [] and opened


def test_kernel_events_matched_one_by_one_whatever_came_before():
    """Loaded: relu 0, an unnamed Neg 1 (profiled as Neg_1), split 2, topk 3, mul2 4. An event
    without arguments, or without node_index for the unnamed node (it is known by its index alone),
    or named nothing, or with an index that is no number, sizes nothing; an index at another named
    node falls back to the event's name; an event that matches no node leaves the later ones to be
    matched, and an output left alone (known already, a type numpy cannot name) the node's later
    outputs."""
    n, vi = helper.make_node, helper.make_tensor_value_info
    nodes = [n("Relu", ["x"], ["a"], name="relu"),
             n("Neg", ["a"], ["na"]),
             n("Split", ["a"], ["s1", "s2"], name="split", axis=0, num_outputs=2),
             n("TopK", ["a", "k"], ["tv", "ti"], name="topk"),
             n("Mul", ["a", "a"], ["m"], name="mul2")]
    model = helper.make_model(helper.make_graph(nodes, "events", [vi("x", TensorProto.FLOAT, [4]),
                                                                  vi("k", TensorProto.INT64, [1])], []),
                              opset_imports=[helper.make_opsetid("", 18)])

    def no_index(name, op, produced):
        return {"name": name + "_kernel_time", "args": {"op_name": op, "output_type_shape": produced}}

    kernels = [{"name": "relu_kernel_time"},                                 # no arguments
               no_index("Neg_1", "Neg", [{"float": [4]}]),                   # the unnamed node without its index
               no_index("", "Neg", [{"float": [4]}]),                        # no name
               _event("Neg_1", "x", "Neg", [{"float": [4]}]),                # an index that is no number
               _event("relu", 0, "Abs", [{"float": [9]}]),                   # another op type: matches nothing
               _event("split", 2, "Split", [{"float": [2]}]),                # one output reported for two
               _event("mul2", 0, "Mul", [{"float": [4]}]),                   # index 0 is relu: by its name
               _event("split", 2, "Split", [{"float": [2]}, {"float": [2]}]),
               _event("topk", 3, "TopK", [{"bfloat16": [1]}, {"int64": [1]}])]
    sizes = _Sizes()
    sizes.add("s1", [7], np.dtype("float32"), "exposed")                     # known already: kept
    _sizes_from_kernels(model, kernels, sizes, skip=set())
    assert sizes.shapes == {"s1": [7], "m": [4], "s2": [2], "ti": [1]}
    assert sizes.sources == {"s1": "exposed", "m": "profile", "s2": "profile", "ti": "profile"}


def test_the_static_sizes_go_on_past_what_they_leave():
    """An initializer fed as an input is sized from what was fed and the next initializer from the
    graph; a ConstantOfShape (a `value` attribute, but not a Constant) is left to be measured; a
    node's empty output is skipped and its next one left."""
    n, vi = helper.make_node, helper.make_tensor_value_info
    nodes = [n("ConstantOfShape", ["shape"], ["filled"], name="fill",
               value=numpy_helper.from_array(np.array([3], np.int64))),
             n("Split", ["w1"], ["", "half"], name="split", axis=0, num_outputs=2),
             n("Add", ["half", "w2"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "static", [vi("shape", TensorProto.INT64, [1]), vi("w1", TensorProto.FLOAT, [4])],
                              [vi("y", TensorProto.FLOAT, [2])],
                              [numpy_helper.from_array(np.zeros(4, np.float32), "w1"),
                               numpy_helper.from_array(np.zeros(2, np.float16), "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    sizes, left = _static_sizes(model, {"shape": np.array([5], np.int64), "w1": np.zeros(4, np.float64)})
    assert sizes.sources == {"shape": "input", "w1": "input", "w2": "initializer"}
    assert sizes.bytes == {"shape": 8, "w1": 32, "w2": 4}
    assert left == ["filled", "half", "y"]


def test_a_nodes_later_outputs_get_their_value_info_after_one_left_out():
    """A node whose first output is a graph output (or has a dtype numpy cannot name) still has
    value_info written for its later outputs."""
    n, vi = helper.make_node, helper.make_tensor_value_info
    nodes = [n("TopK", ["x", "k"], ["top", "idx"], name="topk"),
             n("Split", ["x"], ["u", "v"], name="split", axis=0, num_outputs=2)]
    model = helper.make_model(helper.make_graph(nodes, "later", [vi("x", TensorProto.FLOAT, [4]),
                                                                 vi("k", TensorProto.INT64, [1])],
                                                [vi("top", TensorProto.FLOAT, [1])]),
                              opset_imports=[helper.make_opsetid("", 18)])
    ann = Annotations(provider="CPUExecutionProvider", settings=SessionSettings(),
                      tensor_shapes={"top": [1], "idx": [1], "u": [2], "v": [2]},
                      tensor_dtypes={"top": "float32", "idx": "int64", "u": "bfloat_nothing", "v": "float32"})
    write_annotations(model, ann)
    added = {v.name: (v.type.tensor_type.elem_type, [d.dim_value for d in v.type.tensor_type.shape.dim])
             for v in model.graph.value_info}
    assert added == {"idx": (TensorProto.INT64, [1]), "v": (TensorProto.FLOAT, [2])}


def test_a_constant_of_no_ints_is_an_empty_int64_array():
    """A Constant with an empty value_ints (empty axes, say) holds int64 values like any other:
    zero bytes, dtype int64 (not numpy's default for an empty list, float64)."""
    node = helper.make_node("Constant", [], ["e"], name="e")
    attr = node.attribute.add()
    attr.name, attr.type = "value_ints", onnx.AttributeProto.INTS
    value = _constant_value(node)
    assert value.dtype == np.int64 and value.shape == (0,)
    model = helper.make_model(helper.make_graph([node], "empty", [], []), opset_imports=[helper.make_opsetid("", 18)])
    sizes, left = _static_sizes(model, {})
    assert (sizes.bytes, sizes.shapes, sizes.dtypes, left) == ({"e": 0}, {"e": [0]}, {"e": "int64"}, [])


def test_replay_computes_its_values_in_one_run(opened):
    """However many values replay needs from the step (here more than EXPOSE_CHUNK), one run of the
    model exposes them all (replay's docstring)."""
    from graphopt.annotate import EXPOSE_CHUNK, measure_sizes, replay
    model, inputs, names = _many_values(EXPOSE_CHUNK + 3)
    sizes = measure_sizes(model, inputs)
    opened.clear()
    out = replay(model, inputs, sizes.shapes, sizes.dtypes)
    assert [s.added_outputs(model) for s in _of_the_model(opened, model)] == [sorted(names)]
    assert out.skipped == {} and out.groups == 2
