"""The zoo the batch is tested and benchmarked on (tests/test_batch.py, benchmarks/batch_ray.py):
the six example training graphs and four forward classifiers, each a file of its own."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphopt.examples import EXAMPLES, IR_VERSION, training_example
from graphopt.optimize import save_model


def forward_classifier(seed: int) -> onnx.ModelProto:
    """A forward model (logits, no loss): the batch builds its training graph."""
    r = np.random.RandomState(seed)
    weights = [numpy_helper.from_array((r.randn(64, 128) * 0.2).astype(np.float32), "fc1.weight"),
               numpy_helper.from_array((r.randn(128, 10) * 0.2).astype(np.float32), "fc2.weight")]
    nodes = [helper.make_node("MatMul", ["x", "fc1.weight"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["a"], name="relu"),
             helper.make_node("MatMul", ["a", "fc2.weight"], ["logits"], name="fc2")]
    graph = helper.make_graph(nodes, f"classifier{seed}", [helper.make_tensor_value_info("x", 1, [256, 64])],
                              [helper.make_tensor_value_info("logits", 1, [256, 10])], weights)
    # the IR version onnxruntime releases back to 1.20 load (onnx's default is newer: a server
    # whose onnxruntime is one release behind the client's onnx refuses it)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def write_batch_zoo(folder: Path, small: bool = True) -> Path:
    """training/<example>.onnx for each example (small sizes by default) and
    forward/classifier<k>.onnx for k < 4, under `folder`."""
    (folder / "training").mkdir(parents=True, exist_ok=True)
    (folder / "forward").mkdir(exist_ok=True)
    for name in EXAMPLES:
        model, _ = training_example(name, small=small)
        save_model(model, folder / "training" / f"{name}.onnx")
    for seed in range(4):
        onnx.save(forward_classifier(seed), folder / "forward" / f"classifier{seed}.onnx")
    return folder
