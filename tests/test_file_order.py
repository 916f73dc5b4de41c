"""The builder's node orders (graphopt/builder/file_order.py), checked against ONNX Runtime: the
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
from graphopt.builder.file_order import default_order, sink_to_readers, static_tensor_bytes  # noqa: E402
from graphopt.builder.optimizer import OptimizerSpec  # noqa: E402
from graphopt.builder.train_graph import build_training_graph  # noqa: E402
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
    from graphopt_zoo import real_zoo
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


def _tied_embedding_with_a_wide_middle() -> onnx.ModelProto:
    """A training graph whose backward pass starts with a tied embedding's gradient from the
    output projection ([4000, 64], 1 MB, read only at the end, where the token lookup's part is
    added) and holds its largest transient in the middle (a ReduceMean over a 64x tiled [8, 4096]
    activation: its gradient is an 8 MiB Expand), so that what the embedding's gradient holds
    from the start is on top of the peak."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    vocabulary, width, hidden, tokens, tiles = 4000, 64, 4096, 8, 64
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal((vocabulary, width)) * 0.1).astype(np.float32), "E"),
               numpy_helper.from_array((rng.standard_normal((width, hidden)) * 0.1).astype(np.float32), "W"),
               numpy_helper.from_array(np.array([1, tiles], np.int64), "tiles")]
    nodes = [helper.make_node("Gather", ["E", "tokens"], ["x"], name="embed"),
             helper.make_node("MatMul", ["x", "W"], ["h"], name="up"),
             helper.make_node("Tile", ["h", "tiles"], ["wide"], name="widen"),
             helper.make_node("ReduceMean", ["wide"], ["m"], name="mean", axes=[1], keepdims=1),
             helper.make_node("Mul", ["x", "m"], ["y"], name="scale"),
             helper.make_node("Transpose", ["E"], ["Et"], name="tie", perm=[1, 0]),
             helper.make_node("MatMul", ["y", "Et"], ["logits"], name="project"),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="xent")]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("tokens", TensorProto.INT64, [tokens]),
                                              helper.make_tensor_value_info("labels", TensorProto.INT64, [tokens])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], weights)
    forward = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return build_training_graph(forward, loss="output:loss")


def test_sinking_a_tied_embeddings_gradient_lowers_the_peak_predicted_and_measured(tmp_path):
    """Sinking must lower the peak where a large early output waits for a late reader across
    the peak: the cost model's peak of the file order strictly drops, and ONNX Runtime running
    each order as written (PRIORITY_BASED, optimizations off) measures the drop too."""
    import numpy as np
    model = _tied_embedding_with_a_wide_middle()
    sizes = static_tensor_bytes(model)
    graph = model.graph
    resident = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    nodes = list(graph.node)
    sunk = sink_to_readers(nodes, sizes, resident, {v.name for v in graph.output})
    cost_graph = build_cost_graph(analyze(model), sizes, {})

    def predicted(order):
        return simulate(cost_graph, priority_order(cost_graph, [(n.name, 0) for n in order
                                                                if n.name in cost_graph])).peak_bytes
    drop = predicted(nodes) - predicted(sunk)
    assert drop > 512 * 1024, (predicted(nodes), predicted(sunk))
    settings = dataclasses.replace(UNOPTIMIZED_SETTINGS, execution_order="PRIORITY_BASED")
    inputs = tmp_path / "inputs.npz"
    save_inputs(inputs, {"tokens": np.arange(8, dtype=np.int64) * 7, "labels": np.arange(8, dtype=np.int64)})
    measured = []
    for label, order in (("file", nodes), ("sunk", sunk)):
        written = onnx.ModelProto()
        written.CopyFrom(model)
        written.graph.ClearField("node")
        written.graph.node.extend(order)
        path = tmp_path / f"{label}.onnx"
        onnx.save(written, path)
        measured.append(measure(path, inputs, settings, timing=False).peak_bytes)
    assert measured[0] - measured[1] > drop / 2, (measured, drop)


def test_leanest_file_order_refuses_candidates_that_are_not_orders_of_every_node():
    from graphopt.builder.file_order import leanest_file_order
    model = _tied_embedding_with_a_wide_middle()
    names = [n.name for n in model.graph.node]
    before = [n.name for n in model.graph.node]
    for candidates in ([names[:-1]], [names + [names[0]]], [names, names[1:] + ["not a node"]]):
        with pytest.raises(ValueError, match="every node of the model once"):
            leanest_file_order(model, candidates)
    assert [n.name for n in model.graph.node] == before      # nothing written
    duplicated = onnx.ModelProto()
    duplicated.CopyFrom(model)
    duplicated.graph.node[1].name = duplicated.graph.node[0].name
    with pytest.raises(ValueError, match="unique names"):
        leanest_file_order(duplicated, [[n.name for n in duplicated.graph.node]])
    assert leanest_file_order(model, [names]) > 0



@pytest.fixture(scope="module")
def qwen2_steps(tmp_path_factory):
    """A small Qwen2 from transformers' config (4 layers, d 512, tied 32000-word embedding: 62.5
    of its 105 MiB of weights), its training step built returning the gradients and with AdamW
    inside, saved with the model's inputs."""
    from graphopt_zoo import real_zoo
    entry = real_zoo.CORPUS["qwen2"]("full")
    forward = real_zoo.export(entry, "legacy")
    folder = tmp_path_factory.mktemp("qwen2")
    inputs = folder / "inputs.npz"
    save_inputs(inputs, real_zoo.model_feeds(entry))
    paths = {}
    for label, spec in (("plain", None), ("adamw", OptimizerSpec("adamw", lr=1e-4))):
        model = build_training_graph(forward, loss="cross_entropy", class_axis=entry.class_axis, optimizer=spec)
        paths[label] = folder / f"{label}.onnx"
        onnx.save(model, paths[label])
    return paths, inputs


def test_a_fused_adamw_step_peaks_no_higher_than_the_gradients_it_consumes(qwen2_steps):
    """Measured in ONNX Runtime, each in its own settings: the step with AdamW inside (the updated
    parameters and state written into buffers bound before the step, as a trainer runs it) peaks
    no higher than the step that returns the gradients. Made whole and where its gradient is
    completed, the embedding's update held the gradient and two temporaries of its size while the
    activations the weight gradients after it read were alive: 202 MiB against 141."""
    paths, inputs = qwen2_steps
    peaks = {label: measure(path, inputs, timing=False).peak_bytes for label, path in paths.items()}
    print("measured peaks, MiB:", {k: round(v / 2 ** 20, 1) for k, v in peaks.items()})
    assert peaks["adamw"] <= peaks["plain"], peaks


def test_updates_are_placed_where_moving_them_whole_gives_the_least_peak(qwen2_steps):
    """Against brute force: each update of a parameter of 1 MiB or more (the nodes named after
    it) moved, in one piece, to every place after the node that completes its gradient, each
    order simulated by the cost model with the floor's sizes (recomputable activations taking
    nothing) and with every activation kept; the order the builder wrote is no higher, in that
    order of importance, than the least of those. And places matter: for some update the worst
    place is over 1 MiB higher; moved there, `place_updates` brings it back to the least."""
    from graphopt.builder.file_order import place_updates
    from graphopt.search.plan import floor_schedule_and_sizes
    paths, _ = qwen2_steps
    model = onnx.load(paths["adamw"])
    cost_graph = build_cost_graph(analyze(model), static_tensor_bytes(model), {})
    _, zeroed = floor_schedule_and_sizes(cost_graph)
    names = [n.name for n in model.graph.node]
    by_name = {n.name: n for n in model.graph.node}

    def peaks(order):
        steps = [(n, 0) for n in order if n in cost_graph]
        return simulate(cost_graph, steps, zeroed).peak_bytes, simulate(cost_graph, steps).peak_bytes

    built = peaks(names)
    large = [t.name for t in model.graph.initializer if t.name in {v.name for v in model.graph.input}
             and t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2 and t.dims[0] * t.dims[1] * 4 >= 2 ** 20]
    spread, checked = [], 0
    for param in large:
        chain = [n for n in names if n.startswith(param + "/")]
        rest = [n for n in names if n not in set(chain)]
        makers = [rest.index(n.name) for n in model.graph.node if param + "_grad" in n.output]
        if not makers:
            continue
        made = max(makers)
        tried = {t: peaks(rest[:t] + chain + rest[t:]) for t in range(made + 1, len(rest) + 1)}
        assert built <= min(tried.values()), (param, built, min(tried.values()))
        checked += 1
        worst = max(tried, key=tried.__getitem__)
        if tried[worst][0] > min(tried.values())[0] + 2 ** 20:
            spread.append((param, chain, rest, worst, min(tried.values())))
    assert checked >= 20 and spread, (len(large), checked, len(spread))
    param, chain, rest, worst, least = spread[0]
    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    moved.graph.ClearField("node")
    moved.graph.node.extend(by_name[n] for n in rest[:worst] + chain + rest[worst:])
    assert peaks([n.name for n in moved.graph.node]) > least
    assert place_updates(moved, [chain]) == 1
    assert peaks([n.name for n in moved.graph.node]) <= least, param
