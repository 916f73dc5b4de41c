"""short_spans.py: per-channel broadcasts over small maps read their operand expanded over the map.
Each case is one node in a real ONNX Runtime session, before and after the rewrite: the outputs
must be bit for bit the same, and the node rewritten exactly where the module docstring says."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from graphopt.builder import short_spans
from graphopt.builder.train_graph import build_training_graph

# (op, full operand's shape, other operand's shape, other first?): the expanded shape, or None (kept)
CASES = {
    "per_channel_2x2": ("Mul", [8, 96, 2, 2], [1, 96, 1, 1], False, [1, 96, 2, 2]),
    "per_channel_first": ("Sub", [8, 96, 2, 2], [1, 96, 1, 1], True, [1, 96, 2, 2]),
    "lower_rank": ("Add", [8, 96, 4, 4], [96, 1, 1], False, [1, 96, 4, 4]),
    "span_64": ("Div", [4, 32, 8, 8], [1, 32, 1, 1], False, [1, 32, 8, 8]),
    "span_65": ("Mul", [4, 32, 5, 13], [1, 32, 1, 1], False, None),       # 65 elements a span
    "span_256": ("Mul", [4, 32, 16, 16], [1, 32, 1, 1], False, None),
    "one_axis_span": ("Mul", [64, 40, 3], [1, 40, 1], False, [1, 40, 3]),
    "no_span": ("Mul", [8, 96, 4, 4], [1, 96, 4, 4], False, None),         # spans as long as the map
    "scalar": ("Mul", [8, 96, 4, 4], [], False, None),                      # one span already
    "same_shape": ("Add", [8, 96, 4, 4], [8, 96, 4, 4], False, None),
    "batch_kept": ("Mul", [8, 96, 2, 2], [8, 96, 1, 1], False, None),       # expanded: the output's size
    "half": ("Mul", [2, 192, 2, 2], [1, 192, 1, 1], False, [1, 192, 2, 2]),    # expanded: half the output
    "small_output": ("Mul", [2, 16, 2, 2], [1, 16, 1, 1], False, None),     # under MIN_ELEMENTS
    "both_broadcast": ("Mul", [8, 1, 4, 4], [1, 96, 1, 1], False, None),    # neither is the output
    "pow": ("Pow", [8, 96, 2, 2], [1, 96, 1, 1], False, None),              # not one of SPANNED
}


def _model(op, full_shape, other_shape, other_first):
    inputs = ["o", "f"] if other_first else ["f", "o"]
    node = helper.make_node(op, inputs, ["y"], name="the_node")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("f", 1, full_shape),
                                            helper.make_tensor_value_info("o", 1, other_shape)],
                              [helper.make_tensor_value_info("out", 1, list(np.broadcast_shapes(full_shape, other_shape)))])
    graph.node.append(helper.make_node("Identity", ["y"], ["out"]))   # the node does not write a graph output
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _shapes(model):
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {}
    for v in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        dims = v.type.tensor_type.shape.dim
        shapes[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    return shapes


def _run(model, feeds):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_short_spans_are_expanded_where_the_docstring_says_and_compute_the_same(name):
    op, full_shape, other_shape, other_first, expected = CASES[name]
    model = _model(op, full_shape, other_shape, other_first)
    rng = np.random.default_rng(len(name))
    feeds = {"f": rng.uniform(0.5, 2.0, full_shape).astype(np.float32),
             "o": rng.uniform(0.5, 2.0, other_shape).astype(np.float32)}
    before = _run(model, feeds)
    rewritten = short_spans.short_spans_expanded(model, _shapes(model))
    onnx.checker.check_model(model, full_check=True)
    after = _run(model, feeds)
    assert after.shape == before.shape and np.array_equal(after, before)
    expands = [n for n in model.graph.node if n.op_type == "Expand"]
    if expected is None:
        assert rewritten == 0 and not expands
        return
    assert rewritten == 1 and len(expands) == 1
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["Expand", op, "Identity"], ops   # right before the node
    the_node = model.graph.node[1]
    assert the_node.input[0 if other_first else 1] == expands[0].output[0]
    assert expands[0].input[0] == "o"
    target = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}[expands[0].input[1]]
    assert target.tolist() == expected


def test_unknown_shapes_are_left_alone():
    model = _model("Mul", [8, 96, 2, 2], [1, 96, 1, 1], False)
    shapes = _shapes(model)
    shapes["f"] = [None, 96, 2, 2]
    shapes["y"] = [None, 96, 2, 2]
    assert short_spans.short_spans_expanded(model, shapes) == 0


def test_a_built_mobilenet_block_expands_its_batch_norm_factors_and_matches_without():
    """A small MobileNet-style block (depthwise, pointwise, batch norm in training mode) built with and
    without the rewrite: the per-channel products of its batch norms' backward over the 4 x 4 maps
    read expanded factors, and every output of the step is bit for bit the same."""
    import torch
    from torch import nn

    from graphopt.builder import train_graph

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU6(),
                                      nn.Conv2d(64, 64, 3, padding=1, groups=64), nn.BatchNorm2d(64), nn.ReLU6(),
                                      nn.Conv2d(64, 96, 1), nn.BatchNorm2d(96))
            self.head = nn.Linear(96, 10)

        def forward(self, x):
            return self.head(self.body(x).mean((2, 3)))

    import io
    torch.manual_seed(0)
    module = Block().train()
    x = torch.randn(8, 3, 8, 8)
    buffer = io.BytesIO()
    torch.onnx.export(module, (x,), buffer, input_names=["x"], output_names=["logits"], opset_version=17,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, dynamo=False)
    forward = onnx.load_from_string(buffer.getvalue())
    built = {}
    for on in (False, True):
        saved, train_graph.SHORT_SPANS_EXPANDED = train_graph.SHORT_SPANS_EXPANDED, on
        try:
            built[on] = build_training_graph(forward, loss="cross_entropy")
        finally:
            train_graph.SHORT_SPANS_EXPANDED = saved
    expands = [n for n in built[True].graph.node if n.op_type == "Expand"]
    assert len(expands) > len([n for n in built[False].graph.node if n.op_type == "Expand"]) + 3
    labels = np.arange(8, dtype=np.int64) % 10
    feeds = {"x": x.numpy(), "labels": labels}
    outputs = {}
    for on, model in built.items():
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        known = {i.name for i in session.get_inputs()}
        outputs[on] = session.run(None, {k: v for k, v in feeds.items() if k in known})
    assert len(outputs[True]) == len(outputs[False]) > 1
    for a, b in zip(outputs[False], outputs[True]):
        assert np.array_equal(a, b)
