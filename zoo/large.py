"""A synthetic forward model past protobuf's 2 GB limit, for the tests and benchmarks of
models whose weights cannot be serialized in one ModelProto.

A frozen embedding table (the bulk of the bytes, as a pretrained backbone is when a head is
fine-tuned) feeds a two-layer MLP head whose two weights are the trainable parameters:

    tokens [B, S] -> Gather(table [V, D]) -> MatMul(w1 [D, H]) -> Relu -> MatMul(w2 [H, C])

Little compute (B*S rows), a few large initializers. `write_large_forward` writes it to a
folder with every initializer as external data in one file beside the model, each tensor
generated and written one at a time: no process ever holds the whole model serialized, nor
all its weights at once.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

# at the default sizes: the table 2.05e9 bytes (under protobuf's 2**31 alone), all 2.22e9 (over it);
# w1 and w2 (168 MB) are the trainable weights
DEFAULT_SIZES = {"vocab": 125_000, "d_model": 4096, "hidden": 8192, "classes": 1024, "batch": 2, "seq": 8}
TRAINABLE = ("w1", "w2")
FROZEN = ("table",)


def large_forward_bytes(vocab: int, d_model: int, hidden: int, classes: int, **_) -> int:
    """The float32 bytes of the model's initializers."""
    return 4 * (vocab * d_model + d_model * hidden + hidden * classes)


def write_large_forward(folder: str | os.PathLike, *, seed: int = 0, **sizes) -> Path:
    """Write the forward model as `folder`/large.onnx with its weights in `folder`/large.onnx.data;
    returns the model's path. The weights are seeded (numpy's default generator, one tensor at
    a time: the table is the row index's sine, cheap to write at this size)."""
    s = {**DEFAULT_SIZES, **sizes}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "large.onnx"
    data_name = path.name + ".data"
    shapes = {"table": (s["vocab"], s["d_model"]), "w1": (s["d_model"], s["hidden"]),
              "w2": (s["hidden"], s["classes"])}
    rng = np.random.default_rng(seed)
    initializers = []
    offset = 0
    with open(folder / data_name, "wb") as data:
        for name, shape in shapes.items():
            if name == "table":      # written in row blocks: never the whole table twice in memory
                rows_per_block = max(1, (64 << 20) // (4 * shape[1]))
                columns = np.arange(shape[1], dtype=np.float32)
                for start in range(0, shape[0], rows_per_block):
                    rows = np.arange(start, min(shape[0], start + rows_per_block), dtype=np.float32)
                    block = np.sin(rows[:, None] * 0.001 + columns[None, :] * 0.01).astype(np.float32)
                    data.write(block.tobytes())
            else:
                scale = 1.0 / np.sqrt(shape[0])
                data.write((rng.standard_normal(shape, dtype=np.float32) * scale).astype("<f4").tobytes())
            length = 4 * int(np.prod(shape))
            tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape,
                                 data_location=TensorProto.EXTERNAL)
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            initializers.append(tensor)
            offset += length
    nodes = [
        helper.make_node("Gather", ["table", "tokens"], ["embedded"], name="/embed/Gather"),
        helper.make_node("MatMul", ["embedded", "w1"], ["hidden"], name="/head/fc1/MatMul"),
        helper.make_node("Relu", ["hidden"], ["activated"], name="/head/act/Relu"),
        helper.make_node("MatMul", ["activated", "w2"], ["logits"], name="/head/fc2/MatMul"),
    ]
    graph = helper.make_graph(
        nodes, "large_head",
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, [s["batch"], s["seq"]])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [s["batch"], s["seq"], s["classes"]])],
        initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="graphopt_zoo.large")
    model.ir_version = 8
    onnx.save(model, str(path))        # the graph alone: the initializers reference the data file
    return path


def large_inputs(model_or_sizes=None, seed: int = 0, **sizes) -> dict[str, np.ndarray]:
    """Tokens and labels for the forward model with the cross-entropy loss on it."""
    s = {**DEFAULT_SIZES, **sizes}
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, s["vocab"], (s["batch"], s["seq"]), dtype=np.int64),
            "labels": rng.integers(0, s["classes"], (s["batch"], s["seq"]), dtype=np.int64)}
