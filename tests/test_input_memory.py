"""Inputs a model declares too large to synthesize: an error naming the input, not numpy's."""
from __future__ import annotations

import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper

from graphopt.errors import LimitExceededError
from graphopt.inputs import synthesize_inputs


def _huge_input_model() -> onnx.ModelProto:
    # 2**20 x 2**20 x 2**3 float32 = 32 TiB for x alone; a small second input beside it
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"], name="mul"),
             helper.make_node("ReduceSum", ["y"], ["loss"], name="loss", keepdims=0)]
    graph = helper.make_graph(
        nodes, "huge", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1 << 20, 1 << 20, 8]),
                        helper.make_tensor_value_info("w", TensorProto.FLOAT, [8])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    return helper.make_model(graph)


def test_an_input_too_large_for_memory_is_named():
    with pytest.raises(LimitExceededError, match=r"input 'x' of shape \[1048576, 1048576, 8\] would need 32\.0 TiB"):
        synthesize_inputs(_huge_input_model())


def test_cli_names_the_input_not_a_numpy_traceback(tmp_path):
    path = tmp_path / "huge.onnx"
    onnx.save(_huge_input_model(), path)
    result = subprocess.run([sys.executable, "-m", "graphopt.cli", "optimize", str(path), "-o",
                             str(tmp_path / "out.onnx"), "--no-measure"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "input 'x'" in result.stderr and "TiB" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "_ArrayMemoryError" not in result.stderr, result.stderr
