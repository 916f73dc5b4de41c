"""Runtime layer: session settings, input synthesis, annotation by measuring,
peak-memory measurement and output comparison — real models in real onnxruntime."""

from __future__ import annotations

import inspect
import json
import math
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from graphopt.annotate import Annotations, annotate, read_annotations, write_annotations
from graphopt.errors import InvalidModelError
from graphopt.inputs import load_inputs, parse_input_dims, save_inputs, synthesize_inputs
from graphopt.runtime.measure import MeasurementError, measure
from graphopt.runtime.session import (
    DEFAULT_SETTINGS,
    METADATA_KEY,
    SessionSettings,
    default_providers,
    open_session,
    read_settings,
    session_options,
    write_settings,
)
from graphopt.verify import compare_outputs, run_outputs

OPSET = [h.make_opsetid("", 17)]
NO_OPT = SessionSettings(graph_optimization_level="ORT_DISABLE_ALL")


# --------------------------------------------------------------------------- graphs
def mlp_training_graph(layers=3, batch=8, width=16, sym_batch=False, two=2.0):
    """Forward + backward of a tanh MLP with a squared-error loss, written by hand.

    Inputs x, y (data, labels) and W0..W{layers-1} (parameters); outputs: loss, then
    the gradient of every W."""
    B = "batch" if sym_batch else batch
    nodes = []

    def n(op, ins, out, **kw):
        nodes.append(h.make_node(op, ins, [out], name=f"{op.lower()}_{len(nodes)}", **kw))
        return out

    inputs = [h.make_tensor_value_info("x", T.FLOAT, [B, width]), h.make_tensor_value_info("y", T.FLOAT, [B, width])]
    inputs += [h.make_tensor_value_info(f"W{i}", T.FLOAT, [width, width]) for i in range(layers)]
    inits = [h.make_tensor("one", T.FLOAT, [], [1.0]), h.make_tensor("two", T.FLOAT, [], [two])]
    acts = ["x"]
    for i in range(layers):
        acts.append(n("Tanh", [n("MatMul", [acts[-1], f"W{i}"], f"z{i}")], f"a{i}"))
    d = n("Sub", [acts[-1], "y"], "diff")
    n("ReduceSum", [n("Mul", [d, d], "sq")], "loss", keepdims=0)
    g = n("Mul", [d, "two"], f"g_a{layers - 1}")
    for i in reversed(range(layers)):
        a = acts[i + 1]
        dt = n("Sub", ["one", n("Mul", [a, a], f"a2_{i}")], f"dtanh_{i}")
        dz = n("Mul", [g, dt], f"g_z{i}")
        n("MatMul", [n("Transpose", [acts[i]], f"aT_{i}", perm=[1, 0]), dz], f"g_W{i}")
        if i > 0:
            g = n("MatMul", [dz, n("Transpose", [f"W{i}"], f"WT_{i}", perm=[1, 0])], f"g_a{i - 1}")
    outputs = [h.make_tensor_value_info("loss", T.FLOAT, [])]
    outputs += [h.make_tensor_value_info(f"g_W{i}", T.FLOAT, [width, width]) for i in range(layers)]
    m = h.make_model(h.make_graph(nodes, "mlp_train", inputs, outputs, initializer=inits), opset_imports=OPSET)
    onnx.checker.check_model(m)
    return m


def chain_graph(n=5, rows=2048, cols=2048):
    """x -> Sigmoid -> Sigmoid -> ...: every step a graph output, so all n stay live.
    2048x2048 float32 = 16 MiB each."""
    nodes, prev = [], "x"
    for i in range(n):
        nodes.append(h.make_node("Sigmoid", [prev], [f"t{i}"], name=f"sig{i}"))
        prev = f"t{i}"
    g = h.make_graph(nodes, "chain", [h.make_tensor_value_info("x", T.FLOAT, [rows, cols])],
                     [h.make_tensor_value_info(f"t{i}", T.FLOAT, [rows, cols]) for i in range(n)])
    return h.make_model(g, opset_imports=OPSET)


def duplicated_tanh_graph():
    """Two identical Tanh nodes (what a naive recompute produces): CSE merges them."""
    nodes = [h.make_node("Tanh", ["x"], ["a"], name="tanh_fwd"),
             h.make_node("Tanh", ["x"], ["b"], name="tanh_recompute"),
             h.make_node("Add", ["a", "b"], ["y"], name="add")]
    g = h.make_graph(nodes, "dup", [h.make_tensor_value_info("x", T.FLOAT, [4, 4])],
                     [h.make_tensor_value_info("y", T.FLOAT, [4, 4])])
    return h.make_model(g, opset_imports=OPSET)


def embedding_graph(vocab=10, dim=4, seq="seq"):
    """ids (int32, symbolic batch/seq) -Cast-> Gather on an embedding table; labels for a
    SoftmaxCrossEntropyLoss over 7 classes; a OneHot with constant depth 5."""
    table = h.make_tensor("table", T.FLOAT, [vocab, dim], np.random.default_rng(0).standard_normal(vocab * dim))
    depth = h.make_tensor("depth", T.INT64, [], [5])
    w = h.make_tensor("proj", T.FLOAT, [dim, 7], np.ones(dim * 7))
    oh_values = h.make_tensor("oh_values", T.FLOAT, [2], [0.0, 1.0])
    nodes = [
        h.make_node("Cast", ["ids"], ["ids64"], name="cast", to=T.INT64),
        h.make_node("Gather", ["table", "ids64"], ["emb"], name="gather", axis=0),
        h.make_node("ReduceMean", ["emb"], ["pooled"], name="pool", axes=[1], keepdims=0),
        h.make_node("MatMul", ["pooled", "proj"], ["scores"], name="proj_mm"),
        h.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"], name="sce"),
        h.make_node("OneHot", ["cls", "depth", "oh_values"], ["onehot"], name="onehot"),
        h.make_node("Identity", ["flag"], ["flag_out"], name="flag_id"),
        h.make_node("Identity", ["count"], ["count_out"], name="count_id"),
    ]
    g = h.make_graph(
        nodes, "emb",
        [h.make_tensor_value_info("ids", T.INT32, ["batch", seq]),
         h.make_tensor_value_info("labels", T.INT64, ["batch"]),
         h.make_tensor_value_info("cls", T.INT64, [3]),
         h.make_tensor_value_info("flag", T.BOOL, [2]),
         h.make_tensor_value_info("count", T.INT64, [50])],
        [h.make_tensor_value_info("loss", T.FLOAT, []), h.make_tensor_value_info("onehot", T.FLOAT, [3, 5]),
         h.make_tensor_value_info("flag_out", T.BOOL, [2]), h.make_tensor_value_info("count_out", T.INT64, [50])],
        initializer=[table, depth, w, oh_values],
    )
    m = h.make_model(g, opset_imports=OPSET)
    onnx.checker.check_model(m)
    return m


def mlp_inputs(m, batch=8, width=16, seed=0):
    return synthesize_inputs(m, seed=seed)


# --------------------------------------------------------------------------- settings
def test_settings_json_round_trip_and_metadata():
    s = SessionSettings(graph_optimization_level="ORT_DISABLE_ALL", execution_order="PRIORITY_BASED",
                        disabled_optimizers=("CommonSubexpressionElimination",),
                        session_config={"session.intra_op.allow_spinning": "0"},
                        enable_mem_reuse=False, enable_mem_pattern=False)
    assert SessionSettings.from_json(s.to_json()) == s
    assert SessionSettings.from_json(DEFAULT_SETTINGS.to_json()) == DEFAULT_SETTINGS
    assert s.session_config_dict == {"session.intra_op.allow_spinning": "0"}
    assert SessionSettings.from_json("{}") == DEFAULT_SETTINGS

    m = mlp_training_graph()
    assert read_settings(m) is None
    write_settings(m, DEFAULT_SETTINGS)
    write_settings(m, s)  # replaces
    assert [p.key for p in m.metadata_props].count(METADATA_KEY) == 1
    m2 = onnx.load_from_string(m.SerializeToString())
    assert read_settings(m2) == s


@pytest.mark.parametrize("bad, key", [
    ('{"execution_order": "FASTEST"}', "execution_order"),
    ('{"graph_optimization_level": "ORT_ENABLE_TURBO"}', "graph_optimization_level"),
    ('{"enable_mem_reuse": "yes"}', "enable_mem_reuse"),
    ('{"disabled_optimizers": "CommonSubexpressionElimination"}', "disabled_optimizers"),
    ('{"session_config": {"a": 1}}', "session_config"),
    ('{"arena": true}', "arena"),
])
def test_settings_bad_json_names_the_key(bad, key):
    with pytest.raises(InvalidModelError, match=key):
        SessionSettings.from_json(bad)


def test_settings_not_json():
    with pytest.raises(InvalidModelError, match="JSON"):
        SessionSettings.from_json("{not json")
    m = mlp_training_graph()
    m.metadata_props.add(key=METADATA_KEY, value='{"execution_order": 3}')
    with pytest.raises(InvalidModelError, match="execution_order"):
        read_settings(m)


def test_session_options_and_open_session_follow_metadata(tmp_path):
    s = SessionSettings(graph_optimization_level="ORT_DISABLE_ALL", execution_order="PRIORITY_BASED",
                        enable_mem_pattern=False, session_config={"session.intra_op.allow_spinning": "0"})
    so = session_options(s, threads=1, profile_prefix=str(tmp_path / "p"), deterministic=True)
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert so.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert so.enable_cpu_mem_arena is False and so.enable_profiling and so.use_deterministic_compute
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"

    m = mlp_training_graph()
    write_settings(m, s)
    for model in (m, str(tmp_path / "m.onnx")):
        if isinstance(model, str):
            onnx.save(m, model)
        sess = open_session(model)
        opts = sess.get_session_options()
        assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        assert opts.execution_order == ort.ExecutionOrder.PRIORITY_BASED
        assert opts.enable_mem_pattern is False
    # No metadata: defaults, as a plain InferenceSession.
    plain = mlp_training_graph()
    opts = open_session(plain).get_session_options()
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert opts.execution_order == ort.ExecutionOrder.DEFAULT
    # Explicit settings win over metadata.
    opts = open_session(m, DEFAULT_SETTINGS).get_session_options()
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert default_providers()[-1] == "CPUExecutionProvider"


def test_open_session_rejects_broken_model():
    m = mlp_training_graph()
    m.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(InvalidModelError):
        open_session(m)


# --------------------------------------------------------------------------- inputs
def test_parse_input_dims():
    assert parse_input_dims(["x=4,3,224,224", "ids = 2, 7", "s="]) == {
        "x": [4, 3, 224, 224], "ids": [2, 7], "s": []}
    for bad in (["x"], ["x=4,a"], ["=4"], ["x=4,-1"], ["x=1", "x=2"], ["x=4,,3"]):
        with pytest.raises(InvalidModelError):
            parse_input_dims(bad)
        with pytest.raises(ValueError):
            parse_input_dims(bad)


def test_synthesize_index_bounds_and_dtypes():
    m = embedding_graph(vocab=10)
    feeds = synthesize_inputs(m, {"ids": [64, 33]}, seed=1)
    assert set(feeds) == {"ids", "labels", "cls", "flag", "count"}
    ids, labels = feeds["ids"], feeds["labels"]
    assert ids.dtype == np.int32 and ids.shape == (64, 33)
    assert ids.min() >= 0 and ids.max() <= 9 and ids.max() >= 8  # reaches the top of [0, 10)
    assert labels.shape == (64,) and labels.dtype == np.int64  # "batch" resolved from ids
    assert labels.min() >= 0 and labels.max() <= 6 and len(np.unique(labels)) > 2  # 7 classes
    assert feeds["cls"].max() <= 4  # OneHot depth 5
    assert feeds["flag"].dtype == np.bool_
    assert set(np.unique(feeds["count"])) <= {0, 1}
    # Same seed, same values; the model really runs on them.
    again = synthesize_inputs(m, {"ids": [64, 33]}, seed=1)
    assert all(np.array_equal(feeds[k], again[k]) for k in feeds)
    out = run_outputs(m, feeds)
    assert np.isfinite(out["loss"])


def test_synthesize_symbolic_dims():
    m = embedding_graph()
    with pytest.raises(InvalidModelError, match=r"'ids'.*dim 0.*'batch'"):
        synthesize_inputs(m)
    with pytest.raises(InvalidModelError, match="rank"):
        synthesize_inputs(m, {"ids": [4]})
    with pytest.raises(InvalidModelError, match="fixes it to 3"):
        synthesize_inputs(m, {"ids": [4, 3], "cls": [4]})
    with pytest.raises(InvalidModelError, match="not a graph input"):
        synthesize_inputs(m, {"nope": [1]})
    mlp = mlp_training_graph(sym_batch=True)
    feeds = synthesize_inputs(mlp, parse_input_dims(["x=5,16"]))
    assert feeds["x"].shape == (5, 16) and feeds["y"].shape == (5, 16)  # y shares "batch"
    assert feeds["x"].dtype == np.float32 and abs(float(feeds["x"].std()) - 1) < 0.5
    assert "one" not in feeds and "two" not in feeds


def test_save_and_load_inputs(tmp_path):
    feeds = synthesize_inputs(embedding_graph(), {"ids": [2, 3]})
    feeds["odd/name:0"] = np.arange(3, dtype=np.float16)
    feeds["file"] = np.zeros(2)
    p = tmp_path / "in.npz"
    save_inputs(p, feeds)
    back = load_inputs(p)
    assert list(back) == list(feeds)
    for k in feeds:
        assert back[k].dtype == feeds[k].dtype and np.array_equal(back[k], feeds[k])


# --------------------------------------------------------------------------- annotate
def _check_topological(model, order):
    producer = {o: n.name for n in model.graph.node for o in n.output}
    pos = {name: i for i, name in enumerate(order)}
    for n in model.graph.node:
        for i in n.input:
            if i in producer:
                assert pos[producer[i]] < pos[n.name], (producer[i], n.name)


def test_annotate_training_graph():
    m = mlp_training_graph(layers=3, batch=8, width=16, sym_batch=True)
    feeds = synthesize_inputs(m, {"x": [8, 16]})
    started = time.perf_counter()
    ann = annotate(m, feeds, NO_OPT)
    elapsed = time.perf_counter() - started
    names = [n.name for n in m.graph.node]
    assert sorted(ann.execution_order) == sorted(names)  # every node exactly once
    _check_topological(m, ann.execution_order)
    assert set(ann.node_seconds) == set(names) and all(v >= 0 for v in ann.node_seconds.values())
    # seconds (not ONNX Runtime's microseconds), of kernels that ran inside the annotate call
    assert 0 < sum(ann.node_seconds.values()) < elapsed, (sum(ann.node_seconds.values()), elapsed)
    assert ann.provider == "CPUExecutionProvider" and ann.settings == NO_OPT
    values = {o for n in m.graph.node for o in n.output} | set(feeds)
    assert values <= set(ann.tensor_bytes)
    for k, nbytes in ann.tensor_bytes.items():
        assert nbytes == int(np.prod(ann.tensor_shapes[k])) * np.dtype(ann.tensor_dtypes[k]).itemsize
    assert ann.tensor_shapes["z0"] == [8, 16] and ann.tensor_bytes["z0"] == 8 * 16 * 4
    assert ann.tensor_shapes["loss"] == [] and ann.tensor_dtypes["loss"] == "float32"
    assert ann.tensor_shapes["aT_0"] == [16, 8]

    # JSON and metadata round trip, value_info added for intermediates.
    assert Annotations.from_json(ann.to_json()) == ann
    write_annotations(m, ann)
    write_annotations(m, ann)
    m2 = onnx.load_from_string(m.SerializeToString())
    assert read_annotations(m2) == ann
    vi = {v.name: v for v in m2.graph.value_info}
    assert [d.dim_value for d in vi["z0"].type.tensor_type.shape.dim] == [8, 16]
    assert len(vi) == len({v.name for v in m2.graph.value_info})
    onnx.checker.check_model(m2)
    assert read_annotations(mlp_training_graph()) is None


def test_the_kernel_events_read_are_the_last_runs_alone(tmp_path):
    """A profile holds the kernel events of every run of its session (annotate's warm-up and its
    profiled run; here three runs): `kernel_events` and `last_run_order_and_seconds` keep the last
    run's. Oracle: the profile parsed here (json.load), the kernel events inside the span of the
    latest model_run; were every run's kept, each node's seconds would be about three runs'."""
    from graphopt.runtime.profile import kernel_events, last_run_order_and_seconds
    m = mlp_training_graph(layers=3, batch=64, width=32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "p")
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = mlp_inputs(m)
    for _ in range(3):
        sess.run(None, feeds)
    path = sess.end_profiling()
    with open(path) as f:
        events = json.load(f)
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    every = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    last = [e for e in every if runs[-1]["ts"] <= e["ts"] <= runs[-1]["ts"] + runs[-1]["dur"]]
    names = [n.name for n in m.graph.node]
    assert len(runs) == 3 and len(every) == 3 * len(names) and len(last) == len(names)
    got = kernel_events(path)
    assert [(e["name"], e["ts"], e["dur"]) for e in got] == sorted(
        ((e["name"], e["ts"], e["dur"]) for e in last), key=lambda k: k[1])
    order, seconds = last_run_order_and_seconds(path)
    by_time = sorted(last, key=lambda e: e["ts"])
    assert order == [e["name"][: -len("_kernel_time")] for e in by_time]
    assert seconds == pytest.approx({e["name"][: -len("_kernel_time")]: e["dur"] * 1e-6 for e in last})


def test_annotate_records_optimized_names_and_disabled_optimizers():
    m = mlp_training_graph()
    ann = annotate(m, mlp_inputs(m), DEFAULT_SETTINGS)
    # ORT_ENABLE_ALL fuses Transpose into MatMul: the order is of the optimized graph.
    assert any("MatmulTransposeFusion" in n for n in ann.execution_order)
    assert len(ann.execution_order) < len(m.graph.node)
    # Sizes still come from the unoptimized run: every node output is there.
    assert {o for n in m.graph.node for o in n.output} <= set(ann.tensor_bytes)

    dup = duplicated_tanh_graph()
    feeds = synthesize_inputs(dup)
    basic = SessionSettings(graph_optimization_level="ORT_ENABLE_BASIC")
    merged = annotate(dup, feeds, basic).execution_order
    kept = annotate(dup, feeds, SessionSettings(graph_optimization_level="ORT_ENABLE_BASIC",
                                                disabled_optimizers=("CommonSubexpressionElimination",)))
    assert sum(n.startswith("tanh") for n in merged) == 1
    assert sorted(kept.execution_order) == ["add", "tanh_fwd", "tanh_recompute"]


def test_annotations_bad_json():
    with pytest.raises(InvalidModelError, match="provider"):
        Annotations.from_json(json.dumps({"settings": {}}))
    with pytest.raises(InvalidModelError):
        Annotations.from_json("[")


# --------------------------------------------------------------------------- measure
MiB = 2**20


def test_measure_peak_matches_live_bytes(tmp_path):
    n = 5
    m = chain_graph(n)
    settings = SessionSettings(graph_optimization_level="ORT_DISABLE_ALL", execution_order="PRIORITY_BASED")
    write_settings(m, settings)
    onnx.save(m, tmp_path / "chain.onnx")
    save_inputs(tmp_path / "chain.npz", synthesize_inputs(m))
    expected = n * 16 * MiB  # every output stays live; x was allocated before the baseline
    peaks = []
    for _ in range(2):
        meas = measure(tmp_path / "chain.onnx", tmp_path / "chain.npz", repeats=2)  # settings from metadata
        assert meas.settings == settings and meas.provider == "CPUExecutionProvider"
        assert meas.step_seconds > 0
        peaks.append(meas.peak_bytes)
    for p in peaks:
        assert abs(p - expected) <= 0.10 * expected, (p / MiB, expected / MiB)
    assert abs(peaks[0] - peaks[1]) <= 0.02 * expected, [p / MiB for p in peaks]


def test_arena_extensions_are_read_off_onnx_runtimes_own_log(capfd):
    """The CUDA peak's reading (graphopt/runtime/_measure_worker.py): ONNX Runtime's log of its
    arena's growth, captured from fd 2 during a run. Checked here on the CPU arena, which logs
    the same lines: a first run grows it by at least its two 4 MiB products, a second reuses
    them, and stderr is this process's again afterwards."""
    from graphopt.runtime._measure_worker import _arena_extensions
    x = h.make_tensor_value_info("x", T.FLOAT, [1024, 1024])
    y = h.make_tensor_value_info("y", T.FLOAT, [1024, 1024])
    model = h.make_model(h.make_graph([h.make_node("MatMul", ["x", "x"], ["t"]), h.make_node("MatMul", ["t", "x"], ["y"])],
                                      "g", [x], [y]), opset_imports=[h.make_opsetid("", 17)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": np.ones((1024, 1024), np.float32)}
    first = _arena_extensions(ort, lambda: session.run(None, feeds))
    assert sum(first) >= 2 * 4 * 1024 * 1024, first
    assert _arena_extensions(ort, lambda: session.run(None, feeds)) == []
    capfd.readouterr()
    import os
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


def test_measure_sees_order_dependent_peak(tmp_path):
    # Same training graph, two execution orders: ORT's DEFAULT walk on the unoptimized
    # file holds more activations than PRIORITY_BASED (file order).
    m = mlp_training_graph(layers=6, batch=2048, width=256)  # each activation 2 MiB
    onnx.save(m, tmp_path / "mlp.onnx")
    save_inputs(tmp_path / "mlp.npz", mlp_inputs(m))
    default = measure(tmp_path / "mlp.onnx", tmp_path / "mlp.npz", NO_OPT, repeats=1)
    prio = measure(tmp_path / "mlp.onnx", tmp_path / "mlp.npz",
                   SessionSettings(graph_optimization_level="ORT_DISABLE_ALL", execution_order="PRIORITY_BASED"),
                   repeats=1)
    assert prio.peak_bytes >= 6 * 2 * MiB  # the six forward activations are live at once
    assert default.peak_bytes > prio.peak_bytes + 4 * MiB


def test_time_steps_times_sessions_in_turn_one_of_them_profiled(tmp_path):
    """`time_steps`: one median per session (in the order given) from at least MIN_ROUNDS runs
    each, the ratio of two sessions as the median of the rounds' ratios, and the profiled
    session's median seconds for every node it ran (no speed is asserted: that is a benchmark's)."""
    from graphopt.runtime.measure import MIN_ROUNDS, time_steps
    m = mlp_training_graph(layers=3, batch=256, width=64)
    onnx.save(m, tmp_path / "mlp.onnx")
    save_inputs(tmp_path / "mlp.npz", mlp_inputs(m))
    prio = SessionSettings(graph_optimization_level="ORT_DISABLE_ALL", execution_order="PRIORITY_BASED")
    times = time_steps([(tmp_path / "mlp.onnx", NO_OPT), (tmp_path / "mlp.onnx", prio)], tmp_path / "mlp.npz",
                       rounds=4, profile=(1,))
    assert len(times.step_seconds) == 2 and all(s > 0 for s in times.step_seconds)
    assert all(len(r) >= MIN_ROUNDS and len(r) == len(times.runs[0]) for r in times.runs)
    expected = float(np.median([a / b for a, b in zip(times.runs[1], times.runs[0])]))
    assert times.ratio(1, 0) == pytest.approx(expected)
    (nodes,) = times.node_seconds
    assert set(nodes) == {n.name for n in m.graph.node if n.op_type != "Constant"}, set(nodes) ^ {
        n.name for n in m.graph.node}
    # the profiled session's node seconds are over its profiled steps alone: the profiler is off
    # for the steps timed (its cost must not be in the step times)
    from graphopt.runtime._timing_worker import PROFILE_STEPS
    assert times.profiled_runs == [PROFILE_STEPS], times.profiled_runs
    # each node's median over the profiled steps: together about one step of that session (1.01-1.06x
    # its median timed step in three runs here; the sum of the PROFILE_STEPS steps would be ~3x)
    assert all(v >= 0 for v in nodes.values())
    assert 0 < sum(nodes.values()) <= 2.5 * times.step_seconds[1], (sum(nodes.values()), times.step_seconds)
    assert times.provider == "CPUExecutionProvider"


def test_time_steps_stops_once_the_ratios_have_settled(tmp_path):
    """`settle`: the rounds stop early once the rounds left could not move the median of any
    ratio to the first session by more than the band (a band of 1000% holds for two runs of
    one model: 3 rounds of 5; sub-millisecond steps of two runs of one model once spread by
    more than 100%), and without it every round asked for is run (the timed steps stay far
    under `max_seconds`)."""
    from graphopt.runtime.measure import MIN_ROUNDS, median_bounds, settled, time_steps
    m = mlp_training_graph(layers=3, batch=64, width=32)
    onnx.save(m, tmp_path / "mlp.onnx")
    save_inputs(tmp_path / "mlp.npz", mlp_inputs(m))
    sessions = [(tmp_path / "mlp.onnx", NO_OPT)] * 2
    assert len(time_steps(sessions, tmp_path / "mlp.npz", rounds=5, settle=10.0).runs[0]) == MIN_ROUNDS
    assert len(time_steps(sessions, tmp_path / "mlp.npz", rounds=6).runs[0]) == 6
    # the rule itself, on rounds of known seconds: the second session 1.5x the first
    steady = [[1.0, 2.0, 1.0], [1.5, 3.0, 1.5]]        # the machine's speed moves, the ratio does not
    moving = [[1.0, 1.0, 1.0], [1.5, 1.6, 1.5]]        # a ratio 6.7% off the others
    assert settled(steady, 0.02, 5) and not settled(moving, 0.02, 5) and settled(moving, 0.07, 5)
    # a fourth round of five: only the middle two decide where the median of five can lie
    assert settled([[1.0] * 4, [1.5, 1.6, 1.5, 1.4]], 0.02, 5)
    assert not settled([[1.0] * 4, [1.5, 1.6, 1.45, 1.4]], 0.02, 5)
    # three of seven rounds: two more than known could still be the median's neighbours
    assert not settled(steady, 0.02, 7) and not settled(steady, 1.0, 7)
    assert settled([[1.0, 1.01, 0.99]], 0.025, 5) and not settled([[1.0, 1.1, 0.99]], 0.025, 5)
    assert not settled(steady, None, 5)
    # the bounds against every way the values left could fall (0, 1 or 2 more, each low or high)
    import itertools
    for values in ([3.0, 1.0, 2.0], [1.0, 4.0, 2.0, 3.0], [5.0, 1.0, 4.0, 2.0, 3.0]):
        for more in range(4):
            bounds = median_bounds(values, more)
            medians = [statistics.median(values + list(extra))
                       for extra in itertools.product([-100.0, 2.5, 100.0], repeat=more)]
            if bounds is None:
                assert min(medians) < min(values) or max(medians) > max(values)
            else:
                assert bounds[0] <= min(medians) and max(medians) <= bounds[1]
                if (len(values) + more) % 2:   # an odd count: the median is a value, the bounds reached
                    assert (min(medians), max(medians)) == bounds


def test_time_steps_holds_one_session_per_process(tmp_path):
    """Each session timed in a process of its own: the largest of them holds about one session
    (weights and step), not all of them. Oracle: the peak resident memory of the largest child,
    from outside (RUSAGE_CHILDREN), under twice the step measured alone (`measure`) plus 200 MiB
    for the interpreter with onnx and onnxruntime; five sessions of a MLP whose step is about
    60 MiB (one process for all held more than three steps)."""
    import subprocess
    import sys

    from graphopt.runtime.measure import measure
    m = mlp_training_graph(layers=12, batch=2048, width=256)
    onnx.save(m, tmp_path / "mlp.onnx")
    save_inputs(tmp_path / "mlp.npz", mlp_inputs(m))
    step = measure(tmp_path / "mlp.onnx", tmp_path / "mlp.npz", NO_OPT, timing=False).peak_bytes
    code = ("import sys, resource; from graphopt.runtime.measure import time_steps; "
            "from graphopt.runtime.session import SessionSettings as S; s = S(graph_optimization_level='ORT_DISABLE_ALL', "
            "enable_mem_pattern=False, enable_mem_reuse=False); "
            f"time_steps([({str(tmp_path / 'mlp.onnx')!r}, s)] * 4, {str(tmp_path / 'mlp.npz')!r}, rounds=3, "
            "profile=(0,)); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    largest = int(done.stdout.strip().splitlines()[-1]) * 1024
    assert step > 40 * MiB
    # one session's step and weights, and the interpreter with onnx and onnxruntime loaded;
    # five sessions in one process held more than three steps
    print(f"largest timing process {largest / MiB:.0f} MiB, step {step / MiB:.0f} MiB")
    assert largest < 2 * step + 200 * MiB, (largest / MiB, step / MiB)


def test_measure_failure_carries_stderr(tmp_path):
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    save_inputs(tmp_path / "in.npz", {"x": np.zeros(2, np.float32)})
    with pytest.raises(MeasurementError, match="stderr"):
        measure(tmp_path / "bad.onnx", tmp_path / "in.npz", timeout_seconds=120)


# --------------------------------------------------------------------------- verify
def test_compare_outputs_catches_a_difference():
    m = mlp_training_graph()
    feeds = mlp_inputs(m)
    ref = run_outputs(m, feeds, NO_OPT)
    assert list(ref) == ["loss", "g_W0", "g_W1", "g_W2"]
    same = compare_outputs(ref, run_outputs(m, feeds, DEFAULT_SETTINGS))
    assert same.match and same.max_relative_difference <= 1e-5

    wrong = run_outputs(mlp_training_graph(two=2.001), feeds)
    cmp = compare_outputs(ref, wrong)
    assert not cmp.match and cmp.max_relative_difference > 1e-4
    assert cmp.per_output["loss"] == 0.0 and cmp.worst_output().startswith("g_W")

    missing = dict(ref)
    del missing["g_W1"]
    cmp = compare_outputs(ref, missing)
    assert not cmp.match and math.isinf(cmp.per_output["g_W1"]) and cmp.worst_output() == "g_W1"
    reshaped = dict(ref, g_W2=ref["g_W2"].reshape(-1))
    assert math.isinf(compare_outputs(ref, reshaped).per_output["g_W2"])
    retyped = dict(ref, g_W0=ref["g_W0"].astype(np.float64))
    assert math.isinf(compare_outputs(ref, retyped).per_output["g_W0"])
    nan = dict(ref, g_W0=np.full_like(ref["g_W0"], np.nan))
    assert not compare_outputs(ref, nan).match
    assert compare_outputs({}, {}).match


def test_outputs_larger_than_a_block_compare_as_whole_arrays_do():
    """compare_outputs reads an output a block at a time (verify.COMPARE_BLOCK_ELEMENTS): on
    outputs of 3.5 blocks, with NaN and inf at the same places in different blocks and the
    largest value and the largest difference in blocks of their own, the difference must be the
    whole-array max|a-b| / max|a| over the finite places, computed here; a NaN or an inf that
    differs in the last block, and only there, must still make it inf."""
    from graphopt.verify import COMPARE_BLOCK_ELEMENTS as block
    rng = np.random.default_rng(5)
    a = rng.standard_normal(int(3.5 * block)).astype(np.float32).reshape(-1, 7)
    b = a + rng.standard_normal(a.shape).astype(np.float32) * 1e-6
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    flat_a[10] = flat_b[10] = np.nan
    flat_a[block + 3] = flat_b[block + 3] = np.inf
    flat_a[2 * block + 1] = flat_b[2 * block + 1] = 40.0   # the scale, in a block of its own
    flat_b[3 * block + 5] = flat_a[3 * block + 5] + 0.5   # the worst difference, in the last block
    finite = np.isfinite(flat_a)
    expected = float(np.max(np.abs(flat_a[finite].astype(np.float64) - flat_b[finite]))) / 40.0
    got = compare_outputs({"g": a}, {"g": b}, tolerance=1.0)
    assert got.max_relative_difference == pytest.approx(expected, rel=1e-12)
    assert got.max_relative_difference == pytest.approx(0.5 / 40.0, rel=1e-3)
    late_nan, late_inf = b.copy(), b.copy()
    late_nan.reshape(-1)[-1] = np.nan
    late_inf.reshape(-1)[3 * block + 9] = -np.inf
    assert math.isinf(compare_outputs({"g": a}, {"g": late_nan}).max_relative_difference)
    assert math.isinf(compare_outputs({"g": a}, {"g": late_inf}).max_relative_difference)


def test_run_outputs_deterministic_embedding_gradient():
    # The gradient of an embedding Gather is ScatterND(reduction="add") with repeated
    # indices; ORT's CPU kernel is wrong with >1 thread (docs/ort-facts.md section 6).
    # run_outputs must use one thread and match numpy exactly enough.
    vocab, dim, n = 50, 64, 20000
    rng = np.random.default_rng(0)
    idx = rng.integers(0, vocab, size=(n, 1)).astype(np.int64)
    upd = rng.standard_normal((n, dim)).astype(np.float32)
    zeros = h.make_tensor("zeros", T.FLOAT, [vocab, dim], np.zeros(vocab * dim, np.float32))
    g = h.make_graph(
        [h.make_node("ScatterND", ["zeros", "idx", "upd"], ["grad"], name="scatter", reduction="add")],
        "emb_grad",
        [h.make_tensor_value_info("idx", T.INT64, [n, 1]), h.make_tensor_value_info("upd", T.FLOAT, [n, dim])],
        [h.make_tensor_value_info("grad", T.FLOAT, [vocab, dim])],
        initializer=[zeros],
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
    expected = np.zeros((vocab, dim), np.float64)
    np.add.at(expected, idx[:, 0], upd.astype(np.float64))
    # Measured on 1.32 (2 cores): with use_deterministic_compute and 2 threads the
    # 2nd and later runs of one session were off by 0.07-0.4; 1 thread was always right.
    assert inspect.signature(run_outputs).parameters["threads"].default == 1
    for _ in range(3):
        out = run_outputs(m, {"idx": idx, "upd": upd})
        cmp = compare_outputs({"grad": expected.astype(np.float32)}, out, tolerance=1e-5)
        assert cmp.match, cmp.per_output
    sess = open_session(m, NO_OPT, threads=1, deterministic=True, providers=["CPUExecutionProvider"])
    for _ in range(3):
        got = sess.run(None, {"idx": idx, "upd": upd})[0]
        assert compare_outputs({"grad": expected.astype(np.float32)}, {"grad": got}).match


def test_a_model_saved_with_its_weights_one_tensor_at_a_time_is_the_model_loaded_whole(tmp_path):
    """Workspace.save_with_weights streams the weights the workspace keeps into the file, one
    tensor at a time (the graph then each initializer as a further occurrence of the graph), and
    save_model writes a model in memory the same way: both files must parse to exactly the
    model `with_weights` loads into memory as onnx.save writes it whole, initializers in their
    order, small ones inline among them, and ONNX Runtime must give the same outputs."""
    from graphopt.examples import training_example
    from graphopt.runtime.isolated import Workspace, save_model
    model, inputs = training_example("mlp", batch=8, width=64, depth=3, d_in=16)
    with Workspace(inputs) as workspace:
        working = workspace.copy_keeping_weights_on_disk(model)
        assert any(t.data_location == T.EXTERNAL for t in working.graph.initializer)
        assert any(t.data_location != T.EXTERNAL for t in working.graph.initializer)
        streamed = workspace.save_with_weights(working, "streamed")
        whole, pieces = str(tmp_path / "whole.onnx"), str(tmp_path / "pieces.onnx")
        loaded = workspace.with_weights(working, copy=True)
        onnx.save(loaded, whole)               # the whole serialization, as onnx writes it
        save_model(loaded, pieces)             # an in-memory model written in pieces
        assert onnx.load(streamed) == onnx.load(whole) == onnx.load(pieces)
        back = onnx.load(streamed).graph.initializer
        assert [t.name for t in back] == [t.name for t in model.graph.initializer]
        for got, want in zip(back, model.graph.initializer):
            np.testing.assert_array_equal(onnx.numpy_helper.to_array(got), onnx.numpy_helper.to_array(want))
        onnx.checker.check_model(streamed)
        names = [o.name for o in model.graph.output]
        a = ort.InferenceSession(streamed, providers=["CPUExecutionProvider"]).run(names, inputs)
        b = ort.InferenceSession(whole, providers=["CPUExecutionProvider"]).run(names, inputs)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_a_copy_keeping_its_weights_on_disk_is_made_without_a_second_copy_of_them(tmp_path):
    """Workspace.copy_keeping_weights_on_disk (one initializer at a time) leaves the model it is
    given untouched and gives what onnx.save makes of the model with its tensors of
    WEIGHTS_ON_DISK_MIN_BYTES or more as external data: the same tensors in the weights file, the
    same small ones inline, the same graph; the weights load back."""
    from graphopt.examples import training_example
    from graphopt.runtime.isolated import WEIGHTS_ON_DISK_MIN_BYTES, Workspace
    model, inputs = training_example("mlp", batch=8, width=64, depth=3, d_in=16)
    before = model.SerializeToString()
    saved = onnx.ModelProto()
    saved.CopyFrom(model)      # (onnx.save converts the model it writes to external data in place)
    onnx.save(saved, tmp_path / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="w.bin", size_threshold=WEIGHTS_ON_DISK_MIN_BYTES)
    whole = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    with Workspace(inputs) as workspace:
        copied = workspace.copy_keeping_weights_on_disk(model)
        assert model.SerializeToString() == before
        assert [t.data_location for t in copied.graph.initializer] == [t.data_location for t in whole.graph.initializer]
        assert any(t.data_location == T.EXTERNAL for t in copied.graph.initializer)
        for a, b in zip(copied.graph.initializer, whole.graph.initializer):
            assert (a.name, list(a.dims), a.data_type) == (b.name, list(b.dims), b.data_type)
        for a, b in zip(copied.graph.initializer, whole.graph.initializer):
            a.ClearField("external_data"), b.ClearField("external_data")
        assert copied == whole
        copied = workspace.copy_keeping_weights_on_disk(model)
        loaded = workspace.with_weights(copied, copy=True)
        for got, want in zip(loaded.graph.initializer, model.graph.initializer):
            np.testing.assert_array_equal(onnx.numpy_helper.to_array(got), onnx.numpy_helper.to_array(want))
