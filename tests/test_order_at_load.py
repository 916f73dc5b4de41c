"""Nodes ONNX Runtime inserts at load (copies between host and device on CUDA, precision casts on
the CPU) and the planned order: shown on the CPU, where a float16 node without a float16 kernel
makes ONNX Runtime insert casts, by the same mechanism (a node made at load, with the highest
index, which the priority order runs last among the ready ones) as the copies on CUDA."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from graphopt.ingest import follow_order
from graphopt.rewrite import PLANNED_SETTINGS
from graphopt.runtime.offline import optimize_offline
from graphopt.verify import compare_order, executed_order, inserted_at_load


def _mixed_graph() -> onnx.ModelProto:
    """A (float32), B (a float16 Relu: ONNX Runtime's CPU provider casts around it) and C
    (float32), independent, in that order in the file."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [64, 64])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [64, 64])
    outputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, [64, 64]),
               helper.make_tensor_value_info("b", TensorProto.FLOAT16, [64, 64]),
               helper.make_tensor_value_info("c", TensorProto.FLOAT, [64, 64])]
    nodes = [helper.make_node("Add", ["w", "w"], ["a"], name="A"),
             helper.make_node("Relu", ["x"], ["b"], name="B"),
             helper.make_node("Neg", ["w"], ["c"], name="C")]
    return helper.make_model(helper.make_graph(nodes, "mixed", [x, w], outputs),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


FEEDS = {"x": np.ones((64, 64), np.float16), "w": np.ones((64, 64), np.float32)}


def _saved_as_loaded(model: onnx.ModelProto, tmp_path) -> onnx.ModelProto:
    """ONNX Runtime's own graph of `model`, as it saves it after load (casts inserted)."""
    onnx.save(model, tmp_path / "model.onnx")
    optimize_offline(tmp_path / "model.onnx", tmp_path / "loaded.onnx", "basic")
    return onnx.load(tmp_path / "loaded.onnx")


def test_inserted_casts_are_reported_apart_from_the_files_nodes(tmp_path):
    model = _mixed_graph()
    inserted: list[str] = []
    ran = executed_order(model, FEEDS, PLANNED_SETTINGS, inserted_into=inserted)
    assert sorted(ran) == ["A", "B", "C"]
    # the oracle: the nodes of ONNX Runtime's own saved graph that the file lacks
    loaded = _saved_as_loaded(model, tmp_path)
    made = sorted(f"{n.name} ({n.op_type})" for n in loaded.graph.node if n.name not in {"A", "B", "C"})
    assert made and sorted(inserted) == made


def test_a_node_inserted_at_load_runs_late_and_the_check_sees_its_reader_move():
    """The cast B waits for is made at load with the highest index: ONNX Runtime's priority order
    runs C (ready, lower index) first, so B runs after C though the plan (the file) says before.
    Leaving the inserted nodes out of the order compared must not hide that."""
    ran = executed_order(_mixed_graph(), FEEDS, PLANNED_SETTINGS)
    check = compare_order(["A", "B", "C"], ran)
    assert not check.followed
    assert (check.position, check.planned, check.executed) == (1, ["B", "C"], ["C", "B"])


def test_written_into_the_file_where_they_run_the_inserted_nodes_keep_the_order(tmp_path):
    """The route graphopt takes (its offline pass saves ONNX Runtime's graph, then the file's order
    is restored): the casts become nodes of the file, placed before their readers; ONNX Runtime
    inserts none again and runs the file's order."""
    model = _mixed_graph()
    loaded = follow_order(_saved_as_loaded(model, tmp_path), model)
    inserted: list[str] = []
    ran = executed_order(loaded, FEEDS, PLANNED_SETTINGS, inserted_into=inserted)
    assert inserted == []
    assert compare_order([n.name for n in loaded.graph.node], ran).followed
    assert ran.index("B") < ran.index("C")


def test_what_counts_as_inserted_at_load():
    assert inserted_at_load("Memcpy", "MemcpyFromHost")
    assert inserted_at_load("Memcpy_token_12", "MemcpyToHost")
    assert inserted_at_load("InsertedPrecisionFreeCast_x", "Cast")
    assert not inserted_at_load("InsertedPrecisionFreeCast_x", "Relu")   # a node of the file, named so
    assert not inserted_at_load("Cast_3", "Cast")


def test_copies_a_device_graph_carries_are_removed_and_its_readers_read_their_sources():
    """ONNX Runtime's saved graph of a device provider carries its copies between host and device
    (ops of that provider alone): `without_transfers` takes them out; the result runs on the CPU
    provider with the original's outputs (the oracle: the graph without the copies, run as given)."""
    from graphopt.runtime.offline import without_transfers
    from graphopt.runtime.session import UNOPTIMIZED_SETTINGS, open_session
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    nodes = [helper.make_node("Abs", ["x"], ["a"], name="abs"),
             helper.make_node("MemcpyToHost", ["a"], ["a_host"], name="Memcpy"),
             helper.make_node("Neg", ["a_host"], ["n"], name="neg"),
             helper.make_node("MemcpyFromHost", ["n"], ["y"], name="Memcpy_token_1")]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert without_transfers(model) == 2
    assert [n.op_type for n in model.graph.node] == ["Abs", "Neg", "Identity"]
    assert [o.name for o in model.graph.output] == ["y"]
    feed = np.array([-1.0, 2.0, -3.0, 0.5], np.float32)
    (y,) = open_session(model, UNOPTIMIZED_SETTINGS, providers=["CPUExecutionProvider"]).run(None, {"x": feed})
    np.testing.assert_array_equal(y, -np.abs(feed))
    assert without_transfers(model) == 0
