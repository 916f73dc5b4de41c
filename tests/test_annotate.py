"""graphopt.annotate's sizes against real arrays: annotate takes sizes from ORT's profile
(``output_type_shape`` of each kernel), Constant attributes and, for what is left, runs that
expose only those values; the oracle here exposes *every* node output in one run (what
annotate used to do) and reads ``ndarray.nbytes``. Every size annotate records must equal
the oracle's, on hand-written graphs with awkward ops and on real transformer training
graphs. Memory and time on large graphs: benchmarks/annotate_memory.py."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from graphopt_zoo import real_zoo
from graphopt.annotate import SOURCES, annotate, measure_exposed, measure_sizes
from graphopt.runtime.profile import profile_events
from graphopt.builder.train_graph import build_training_graph
from graphopt.ingest import name_nodes
from graphopt.inputs import synthesize_inputs
from graphopt.runtime.session import UNOPTIMIZED_SETTINGS, SessionSettings
from test_runtime import NO_OPT, embedding_graph, mlp_training_graph

OPSET = [h.make_opsetid("", 17)]


def _oracle(model: onnx.ModelProto, inputs: dict) -> dict[str, tuple[int, list[int], str]]:
    """name -> (bytes, shape, dtype) from real arrays: fed inputs, initializers and every node
    output, all exposed as graph outputs of one run."""
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    names = [o for n in model.graph.node for o in n.output if o and o not in inits]
    arrays = dict(inits)
    arrays.update({i.name: np.asarray(inputs[i.name]) for i in model.graph.input if i.name in inputs})
    arrays.update(measure_exposed(model, inputs, names, chunk=0))
    return {k: (int(a.nbytes), [int(d) for d in a.shape], a.dtype.name) for k, a in arrays.items()}


def _assert_matches_oracle(model, inputs, ann):
    expected = _oracle(model, inputs)
    got = {k: (ann.tensor_bytes[k], ann.tensor_shapes[k], ann.tensor_dtypes[k]) for k in ann.tensor_bytes}
    assert set(got) == set(expected), (set(got) ^ set(expected))
    wrong = {k: (got[k], expected[k]) for k in got if got[k] != expected[k]}
    assert not wrong, wrong


def _plain_profile_order(model, inputs, settings: SessionSettings, tmp_path) -> list[str]:
    """The kernel order of the last of two runs of the unmodified model, profiled by a plain
    InferenceSession (independent of graphopt's session helper and parser)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.__members__[settings.graph_optimization_level]
    so.execution_order = ort.ExecutionOrder.__members__[settings.execution_order]
    so.enable_mem_pattern = settings.enable_mem_pattern
    so.enable_mem_reuse = settings.enable_mem_reuse
    so.enable_cpu_mem_arena = False
    so.intra_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "plain")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess.run(None, inputs)
    sess.run(None, inputs)
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    last = max((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                      and last["ts"] <= e["ts"] <= last["ts"] + last["dur"]), key=lambda e: e["ts"])
    return [e["name"][: -len("_kernel_time")] for e in kernels]


def awkward_graph():
    """Ops whose outputs are awkward to size: Constants (tensor, ints, float attributes; no
    kernel at run time), multi-output Dropout and TopK, LayerNormalization with its optional
    outputs left empty, casts to float16 and bool, Shape, unnamed nodes, and a function op ORT
    inlines at load (SoftmaxCrossEntropyLoss: its outputs have no kernel event of their own)."""
    nodes = [
        h.make_node("Constant", [], ["c_tensor"], name="c0",
                    value=h.make_tensor("v", T.FLOAT, [2, 3], np.arange(6, dtype=np.float32))),
        h.make_node("Constant", [], ["c_ints"], name="c1", value_ints=[1, -1]),
        h.make_node("Constant", [], ["c_float"], value_float=0.5),  # unnamed
        h.make_node("MatMul", ["x", "w"], ["y"]),  # unnamed
        h.make_node("Dropout", ["y", "ratio", "train"], ["d", "mask"], name="drop"),
        h.make_node("LayerNormalization", ["d", "scale"], ["ln", "", ""], name="ln", axis=-1),
        h.make_node("Mul", ["ln", "c_float"], ["half"], name="half"),
        h.make_node("Cast", ["half"], ["h16"], name="to16", to=T.FLOAT16),
        h.make_node("Cast", ["h16"], ["back"], name="to32", to=T.FLOAT),
        h.make_node("Greater", ["back", "c_float"], ["pos"], name="gt"),
        h.make_node("TopK", ["back", "k"], ["top_v", "top_i"], name="topk", axis=-1),
        h.make_node("Shape", ["d"], ["shape"], name="shape"),
        h.make_node("Reshape", ["back", "c_ints"], ["flat"], name="flat"),
        h.make_node("SoftmaxCrossEntropyLoss", ["back", "labels"], ["loss", "log_prob"], name="sce"),
        h.make_node("Add", ["c_tensor", "c_tensor"], ["c_sum"], name="csum"),
    ]
    vi = h.make_tensor_value_info
    g = h.make_graph(
        nodes, "awkward",
        [vi("x", T.FLOAT, [4, 8]), vi("labels", T.INT64, [4]), vi("k", T.INT64, [1])],
        [vi("loss", T.FLOAT, []), vi("mask", T.BOOL, [4, 6]), vi("pos", T.BOOL, [4, 6]),
         vi("top_i", T.INT64, [4, 3]), vi("shape", T.INT64, [2]), vi("flat", T.FLOAT, [1, 24]),
         vi("c_sum", T.FLOAT, [2, 3])],
        initializer=[h.make_tensor("w", T.FLOAT, [8, 6], np.linspace(-1, 1, 48)),
                     h.make_tensor("scale", T.FLOAT, [6], np.ones(6)),
                     h.make_tensor("ratio", T.FLOAT, [], [0.25]),
                     h.make_tensor("train", T.BOOL, [], [True])],
    )
    m = h.make_model(g, opset_imports=OPSET)
    onnx.checker.check_model(m)
    return m


def awkward_inputs():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((4, 8)).astype(np.float32),
            "labels": np.array([0, 5, 2, 1], dtype=np.int64), "k": np.array([3], dtype=np.int64)}


def test_sizes_match_real_arrays_on_awkward_ops():
    m = awkward_graph()
    before = m.SerializeToString()
    inputs = awkward_inputs()
    ann = annotate(m, inputs, NO_OPT)
    assert m.SerializeToString() == before  # the exposing run left the model as it was
    _assert_matches_oracle(m, inputs, ann)
    sizes = measure_sizes(m, inputs)
    assert set(sizes.sources.values()) <= set(SOURCES)
    # Only the inlined function op's outputs needed a run that exposes them.
    assert {k for k, s in sizes.sources.items() if s == "exposed"} == {"loss", "log_prob"}
    assert sizes.sources["c_tensor"] == sizes.sources["c_ints"] == sizes.sources["c_float"] == "constant"
    assert sizes.sources["y"] == sizes.sources["mask"] == sizes.sources["h16"] == "profile"
    assert ann.tensor_dtypes["h16"] == "float16" and ann.tensor_dtypes["mask"] == "bool"
    assert ann.tensor_shapes["top_v"] == [4, 3] and ann.tensor_shapes["flat"] == [1, 24]


def test_sizes_and_order_of_the_mlp_training_graph(tmp_path):
    m = mlp_training_graph(layers=3, batch=8, width=16)
    inputs = synthesize_inputs(m, seed=0)
    for settings in (NO_OPT, UNOPTIMIZED_SETTINGS, SessionSettings()):
        ann = annotate(m, inputs, settings)
        _assert_matches_oracle(m, inputs, ann)
        # The order is that of the model as given, under the given settings.
        assert ann.execution_order == _plain_profile_order(m, inputs, settings, tmp_path)
    sizes = measure_sizes(m, inputs)
    assert "exposed" not in sizes.sources.values()
    emb = embedding_graph()
    feeds = synthesize_inputs(emb, {"ids": [2, 3]}, seed=0)
    _assert_matches_oracle(emb, feeds, annotate(emb, feeds, NO_OPT))


def test_exposing_in_chunks_gives_the_same_arrays():
    m = awkward_graph()
    inputs = awkward_inputs()
    names = [o for n in m.graph.node for o in n.output if o]
    whole = measure_exposed(m, inputs, names, chunk=0)
    chunked = measure_exposed(m, inputs, names, chunk=3)
    assert set(whole) == set(chunked) == set(names)
    for k in names:
        assert whole[k].dtype == chunked[k].dtype and whole[k].shape == chunked[k].shape


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_sizes_match_real_arrays_on_real_training_graphs(name, tmp_path):
    model = real_zoo.CORPUS[name]("tiny")
    train = build_training_graph(real_zoo.export(model, "legacy"), loss=model.loss, class_axis=model.class_axis)
    name_nodes(train)
    feeds = {k: v.numpy() for k, v in model.inputs.items()}
    feeds["labels"] = model.labels.numpy().astype(np.int64)
    known = {i.name for i in train.graph.input}
    feeds = {k: v for k, v in feeds.items() if k in known}
    ann = annotate(train, feeds, UNOPTIMIZED_SETTINGS)
    _assert_matches_oracle(train, feeds, ann)
    assert ann.execution_order == _plain_profile_order(train, feeds, UNOPTIMIZED_SETTINGS, tmp_path)
    sizes = measure_sizes(train, feeds)
    exposed = [k for k, s in sizes.sources.items() if s == "exposed"]
    # What the profile cannot size is a handful of values (function ops inlined at load).
    assert len(exposed) <= 8, exposed


def test_sizes_measured_from_the_file_with_its_weights_left_on_disk(tmp_path):
    """The annotating child loads the graph without its weights and opens its sessions from the
    file (one copy of the weights, ONNX Runtime's): every size, the exposed ones included (no
    kernel events given, so every value is exposed from a file written beside the model), equals
    what the model held in memory gives."""
    from graphopt.examples import training_example

    from graphopt.runtime.isolated import WEIGHTS_ON_DISK_MIN_BYTES

    model, inputs = training_example("mlp", small=True)
    path = tmp_path / "train.onnx"
    on_disk = onnx.ModelProto()
    on_disk.CopyFrom(model)
    # as the workspace keeps them (isolated.Workspace.copy_keeping_weights_on_disk): shape constants inline
    onnx.save(on_disk, path, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
              size_threshold=WEIGHTS_ON_DISK_MIN_BYTES)
    graph_only = onnx.load(path, load_external_data=False)
    assert sum(not t.HasField("raw_data") for t in graph_only.graph.initializer) >= 3
    from_file = measure_sizes(graph_only, inputs, kernels=[], model_path=str(path))
    in_memory = measure_sizes(model, inputs, kernels=[])
    assert from_file.bytes == in_memory.bytes and from_file.shapes == in_memory.shapes
    assert "exposed" in set(from_file.sources.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.onnx", "weights.bin"]
    ann = annotate(graph_only, inputs, UNOPTIMIZED_SETTINGS, model_path=str(path))
    assert ann.tensor_bytes == annotate(model, inputs, UNOPTIMIZED_SETTINGS).tensor_bytes


def test_profile_events_read_one_line_at_a_time_equal_the_profile_read_whole(tmp_path):
    """graphopt reads ONNX Runtime's profiles one event per line (a profile read whole made a
    timing process larger than the session it timed); against json.load of the same file, and
    of the file rewritten on one line (the fallback when the layout is not one event a line)."""
    model = mlp_training_graph()
    inputs = synthesize_inputs(model)
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "p")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess.run(None, inputs)
    sess.run(None, inputs)
    path = sess.end_profiling()
    with open(path) as f:
        events = json.load(f)
    expected_runs = [e for e in events if e.get("name") == "model_run"]
    expected_kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    assert len(expected_runs) == 2 and expected_kernels
    one_line = tmp_path / "one_line.json"
    one_line.write_text(json.dumps(events))
    for source in (path, str(one_line)):
        runs, kernels = profile_events(source)
        assert runs == expected_runs and kernels == expected_kernels
        _, light = profile_events(source, keep_args=False)
        assert light == [{"name": e["name"], "ts": e["ts"], "dur": e.get("dur", 0)} for e in expected_kernels]


# every element type a kernel output may have here, with an op of ONNX Runtime's CPU provider that
# computes in it after the Cast into it (Max where the provider has one); bfloat16 is not in it
# (annotate cannot size a bfloat16 value: the run exposing it fails, numpy has no such type)
_TYPED = {T.INT8: "Max", T.UINT8: "Max", T.INT16: None, T.UINT16: None, T.INT32: "Max", T.UINT32: "Max",
          T.INT64: "Max", T.UINT64: "Max", T.FLOAT16: None, T.DOUBLE: "Max", T.BOOL: "Not"}


def test_sizes_of_every_element_type_are_onnxs_own_item_sizes():
    """Kernel outputs of eleven element types (int32 among them, made by Cast, Max and Add), an
    int32 graph input and an int32 initializer. Oracle: ONNX's own item size of each type
    (`tensor_dtype_to_np_dtype`) times the elements, and the type the graph says; none of it read
    from ONNX Runtime's profile, which is where annotate reads the kernel outputs' types."""
    vi = h.make_tensor_value_info
    nodes, back, expected = [], [], {}
    for elem, op in _TYPED.items():
        kind = onnx.helper.tensor_dtype_to_np_dtype(elem).name
        value = f"as_{kind}"
        nodes.append(h.make_node("Cast", ["x"], [value], name=f"to_{kind}", to=elem))
        expected[value] = elem
        if op is not None:
            nodes.append(h.make_node(op, [value, value][:1 if op == "Not" else 2], [f"{op}_{kind}"],
                                     name=f"{op}_{kind}"))
            value = f"{op}_{kind}"
            expected[value] = elem
        nodes.append(h.make_node("Cast", [value], [f"back_{kind}"], name=f"back_{kind}", to=T.FLOAT))
        back.append(f"back_{kind}")
    nodes.append(h.make_node("Add", ["i", "w"], ["i_plus_w"], name="add_int32"))
    nodes.append(h.make_node("Cast", ["i_plus_w"], ["back_i"], name="back_i", to=T.FLOAT))
    nodes.append(h.make_node("Sum", back + ["back_i"], ["y"], name="sum"))
    expected.update({"i": T.INT32, "w": T.INT32, "i_plus_w": T.INT32})
    graph = h.make_graph(nodes, "element_types", [vi("x", T.FLOAT, [3, 5]), vi("i", T.INT32, [3, 5])],
                         [vi("y", T.FLOAT, [3, 5])],
                         initializer=[h.make_tensor("w", T.INT32, [5], [1, 2, 3, 4, 5])])
    model = h.make_model(graph, opset_imports=OPSET)
    onnx.checker.check_model(model)
    inputs = {"x": np.linspace(-3, 3, 15, dtype=np.float32).reshape(3, 5),
              "i": np.arange(15, dtype=np.int32).reshape(3, 5)}
    ann = annotate(model, inputs, NO_OPT)
    sizes = measure_sizes(model, inputs)
    for name, elem in expected.items():
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
        shape = [5] if name == "w" else [3, 5]
        assert (ann.tensor_bytes[name], ann.tensor_dtypes[name], ann.tensor_shapes[name]) == (
            int(np.prod(shape)) * dtype.itemsize, dtype.name, shape), name
    # the sizes under test are the profile's (the inputs' and the initializer's: from their arrays)
    assert {name for name in expected if sizes.sources[name] != "profile"} == {"i", "w"}, sizes.sources
    assert sizes.sources["i"] == "input" and sizes.sources["w"] == "initializer"


def test_the_timed_run_follows_a_warm_up_run_of_its_session():
    """annotate times the second run of its session (the first is a warm-up: ONNX Runtime plans
    its memory pattern on a session's first run). Counted without a clock: a seeded
    RandomUniformLike draws the next values at each run of a session, so the outputs of the timed
    run (`outputs_into`) say which run it was. Oracle: the second run of a plain InferenceSession,
    whose first differs."""
    vi = h.make_tensor_value_info
    graph = h.make_graph([h.make_node("RandomUniformLike", ["x"], ["noise"], name="draw", seed=3.0),
                          h.make_node("Add", ["x", "noise"], ["y"], name="add")],
                         "draws", [vi("x", T.FLOAT, [4, 6])], [vi("y", T.FLOAT, [4, 6])])
    model = h.make_model(graph, opset_imports=OPSET)
    inputs = {"x": np.zeros((4, 6), np.float32)}
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    first, second = (plain.run(None, inputs)[0] for _ in range(2))
    assert not np.array_equal(first, second)
    for settings in (NO_OPT, SessionSettings()):
        timed: dict = {}
        ann = annotate(model, inputs, settings, outputs_into=timed)
        np.testing.assert_array_equal(timed["y"], second, err_msg=str(settings))
        assert ann.execution_order == ["draw", "add"]
