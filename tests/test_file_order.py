"""The builder's node orders (graphopt/build/file_order.py), checked against ONNX Runtime: the
DEFAULT walk it predicts is the order ORT runs, the sink never raises the cost model's peak,
and a training graph with its optimizer step runs exactly in its file's order, at a measured
peak no higher than ORT's own DEFAULT walk of the same graph gives."""
from __future__ import annotations

import dataclasses
import os
import sys

import onnx
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graphopt.analyze import analyze  # noqa: E402
from graphopt.build.file_order import default_order, sink_to_readers, static_tensor_bytes  # noqa: E402
from graphopt.build.optimizer import OptimizerSpec  # noqa: E402
from graphopt.build.train_graph import build_training_graph  # noqa: E402
from graphopt.costmodel import priority_order, simulate  # noqa: E402
from graphopt.examples import example_inputs, forward_example  # noqa: E402
from graphopt.inputs import save_inputs  # noqa: E402
from graphopt.op_rules import build_cost_graph  # noqa: E402
from graphopt.runtime.measure import measure  # noqa: E402
from graphopt.runtime.session import UNOPTIMIZED_SETTINGS, read_settings  # noqa: E402
from graphopt.verify import executed_order  # noqa: E402


@pytest.mark.parametrize("name,optimizer", [("resnet", None), ("transformer", None),
                                            ("densenet", OptimizerSpec("adamw", lr=1e-3))])
def test_default_order_is_the_order_onnx_runtime_runs(name, optimizer):
    model = build_training_graph(forward_example(name, small=True), optimizer=optimizer)
    feeds = example_inputs(model)
    ran = executed_order(model, feeds, UNOPTIMIZED_SETTINGS)     # ORT's DEFAULT order, profiled
    assert [model.graph.node[k].name for k in default_order(model)] == ran


@pytest.mark.parametrize("name", ["resnet", "unet", "transformer", "randwire"])
def test_sinking_never_raises_the_peak_of_the_file_order(name):
    model = build_training_graph(forward_example(name, small=True))
    sizes = static_tensor_bytes(model)
    graph = model.graph
    resident = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    nodes = list(graph.node)
    sunk = sink_to_readers(nodes, sizes, resident, {v.name for v in graph.output})
    assert sorted(n.name for n in sunk) == sorted(n.name for n in nodes)
    cost_graph = build_cost_graph(analyze(model), sizes, {})

    def peak(order):
        return simulate(cost_graph, priority_order(cost_graph, [(n.name, 0) for n in order
                                                                if n.name in cost_graph])).peak_bytes
    assert peak(sunk) <= peak(nodes)
    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    moved.graph.ClearField("node")
    moved.graph.node.extend(sunk)
    onnx.checker.check_model(moved)                 # still topologically sorted


def test_fused_step_runs_in_file_order_no_higher_than_orts_walk(tmp_path):
    """A GPT-2 whose tied embedding is most of its weights: its gradient is completed last, from
    the output projection and the token lookup; ORT's DEFAULT walk of the fused graph runs other
    updates around it in an order the builder beats."""
    real_zoo = pytest.importorskip("real_zoo")
    entry = real_zoo.CORPUS["gpt2"]("tiny")
    forward = real_zoo.export(entry, "legacy")
    model = build_training_graph(forward, loss="cross_entropy", class_axis=entry.class_axis,
                                 optimizer=OptimizerSpec("adamw", lr=1e-4))
    settings = read_settings(model)
    assert settings.execution_order == "PRIORITY_BASED"
    feeds = real_zoo.model_feeds(entry)
    path, inputs = tmp_path / "train.onnx", tmp_path / "inputs.npz"
    onnx.save(model, path)
    save_inputs(inputs, feeds)
    ran = executed_order(path, feeds)
    # PRIORITY_BASED: the file's order, Shape and Size as soon as they are ready
    cost_graph = build_cost_graph(analyze(model), static_tensor_bytes(model), {})
    planned = priority_order(cost_graph, [(n.name, 0) for n in model.graph.node if n.name in cost_graph])
    assert ran == [op for op, _ in planned]
    in_file = measure(path, inputs, timing=False).peak_bytes
    walked = measure(path, inputs, dataclasses.replace(settings, execution_order="DEFAULT"), timing=False).peak_bytes
    print("fused step peak, file order vs DEFAULT walk:", in_file, walked)
    assert in_file <= walked + 256 * 1024, (in_file, walked)
