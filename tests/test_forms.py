"""Each Conv weight gradient in the form measured faster on the provider the graph is built for
(graphopt/builder/forms.py, `train-graph --provider`)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.builder import rules
from graphopt.builder.forms import FORMS_KEY, MARGIN, build_for_provider
from graphopt.builder.train_graph import build_training_graph
from graphopt.runtime.session import UNOPTIMIZED_SETTINGS, open_session


def _two_convs(seed: int = 0) -> onnx.ModelProto:
    """x [4, 64, 14, 14] -> 1 x 1 Conv to 64 -> Relu -> 3 x 3 Conv (pad 1) to 32 -> sum: the loss."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array((rng.standard_normal([64, 64, 1, 1]) * 0.1).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal([32, 64, 3, 3]) * 0.1).astype(np.float32), "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["b"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("ReduceSum", ["b"], ["loss"], name="loss_sum", keepdims=0)]
    graph = helper.make_graph(nodes, "two_convs",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64, 14, 14])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], initializer=[w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _gradients_float64(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    """The oracle: d(sum of conv2(relu(conv1(x))))/dW in float64 with numpy."""
    w1 = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    w2 = numpy_helper.to_array(model.graph.initializer[1]).astype(np.float64)
    x = x.astype(np.float64)
    a = np.einsum("nchw,fc->nfhw", x, w1[:, :, 0, 0])
    r = np.maximum(a, 0)
    padded = np.pad(r, [(0, 0), (0, 0), (1, 1), (1, 1)])
    # dL/db = 1 everywhere: dW2[f, c, i, j] = sum over n, h, w of padded[n, c, h + i, w + j]
    dw2 = np.zeros_like(w2)
    for i in range(3):
        for j in range(3):
            dw2[:, :, i, j] = padded[:, :, i:i + 14, j:j + 14].sum(axis=(0, 2, 3))[None, :]
    # dL/dr[n, c, h, w] = sum over f, i, j of w2[f, c, i, j] where the window covers it
    dr = np.zeros_like(padded)
    for i in range(3):
        for j in range(3):
            dr[:, :, i:i + 14, j:j + 14] += w2[:, :, i, j].sum(axis=0)[None, :, None, None]
    da = dr[:, :, 1:15, 1:15] * (a > 0)
    dw1 = np.einsum("nfhw,nchw->fc", da, x)[:, :, None, None]
    return {"w1_grad": dw1, "w2_grad": dw2}


def _run(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    session = open_session(model, UNOPTIMIZED_SETTINGS, providers=["CPUExecutionProvider"])
    return dict(zip((o.name for o in session.get_outputs()), session.run(None, {"x": x})))


def _count(model: onnx.ModelProto, op_type: str) -> int:
    return sum(1 for n in model.graph.node if n.op_type == op_type)


def _blocked_input_gradients() -> int:
    """The input gradient of `_two_convs`' 3 x 3 Conv (64 channels to 32) is a Conv where convolutions
    are written in the blocked layout with 32 filters filling whole blocks, over enough pixels
    (rules.conv_input_gradient_applies)."""
    from graphopt.builder.blocked_convs import MIN_OUTPUT_PIXELS_COMPUTED_WEIGHT
    block = rules.conv_block()
    return int(block is not None and 32 % block == 0 and 4 * 14 * 14 >= MIN_OUTPUT_PIXELS_COMPUTED_WEIGHT)


@pytest.mark.parametrize("per_tap", [True, False])
def test_the_form_chosen_is_the_form_built_and_its_gradients_are_exact(per_tap):
    forward = _two_convs()
    keys = [rules.per_tap_key((4, 64, 14, 14), (4, 64, 14, 14), (1, 1), 1),
            rules.per_tap_key((4, 64, 14, 14), (4, 32, 14, 14), (3, 3), 1)]
    training = build_training_graph(forward, per_tap_choices={key: per_tap for key in keys})
    # the forward's two Convs; whole-map: a Conv more per weight gradient; per tap: products instead;
    # with convolutions in the blocked layout, the 3 x 3's input gradient a (blocked) Conv too
    assert _count(training, "Conv") == (2 if per_tap else 4) + _blocked_input_gradients()
    assert (_count(training, "Gemm") + _count(training, "MatMul") > 0) == per_tap
    x = np.random.default_rng(1).standard_normal([4, 64, 14, 14]).astype(np.float32)
    got, expected = _run(training, x), _gradients_float64(forward, x)
    for name, value in expected.items():
        assert np.abs(got[name] - value).max() <= 1e-4 * np.abs(value).max(), name


def test_each_conv_takes_the_form_measured_faster_on_the_provider():
    training = build_for_provider(_two_convs(), "CPUExecutionProvider")
    forms = json.loads(next(p.value for p in training.metadata_props if p.key == FORMS_KEY))
    assert forms["provider"] == "CPUExecutionProvider"
    measured = {tuple(c["weight_shape"]): c for c in forms["conv_weight_gradients"]}
    assert set(measured) == {(64, 64, 1, 1), (32, 64, 3, 3)}
    for c in measured.values():
        ours, other = ((c["per_tap_seconds"], c["whole_map_seconds"]) if c["rule_per_tap"]
                       else (c["whole_map_seconds"], c["per_tap_seconds"]))
        assert c["per_tap"] == (c["rule_per_tap"] if other >= ours * (1 - MARGIN) else not c["rule_per_tap"])
    # a 1 x 1 Conv over 64 channels: per tap is one product, several times faster than a convolution
    assert measured[(64, 64, 1, 1)]["per_tap"]
    # what the measurement chose is what was built
    convs = 2 + sum(1 for c in measured.values() if not c["per_tap"]) + _blocked_input_gradients()
    assert _count(training, "Conv") == convs


def test_train_graph_provider_flag_and_an_unavailable_provider(tmp_path):
    onnx.save(_two_convs(), tmp_path / "forward.onnx")
    ok = subprocess.run([sys.executable, "-m", "graphopt.cli", "train-graph", str(tmp_path / "forward.onnx"),
                         "-o", str(tmp_path / "train.onnx"), "--provider", "CPUExecutionProvider"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "Conv weight gradients measured on CPUExecutionProvider: 2 distinct" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "graphopt.cli", "train-graph", str(tmp_path / "forward.onnx"),
                          "-o", str(tmp_path / "bad.onnx"), "--provider", "NoSuchExecutionProvider"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert "NoSuchExecutionProvider" in bad.stderr and "not available" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert not (tmp_path / "bad.onnx").exists()
