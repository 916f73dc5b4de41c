"""Small helpers the builder's passes share: attributes, fresh names, small constants."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def attribute(node: onnx.NodeProto, name: str, default):
    """The value of attribute `name` of `node`, or `default`."""
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


class Names:
    """Fresh tensor and node names for a model: `stem`, else `stem_1`, `stem_2`, ..."""

    def __init__(self, model: onnx.ModelProto):
        graph = model.graph
        self.taken = ({v.name for v in graph.input} | {t.name for t in graph.initializer}
                      | {o for n in graph.node for o in n.output} | {n.name for n in graph.node}
                      | {v.name for v in graph.output})

    def fresh(self, stem: str) -> str:
        name, k = stem, 0
        while name in self.taken:
            k += 1
            name = f"{stem}_{k}"
        self.taken.add(name)
        return name


def small_constants(model: onnx.ModelProto, max_elements: int = 64) -> dict[str, np.ndarray]:
    """name -> value of the small initializers and Constant nodes (shapes, axes, scalars)."""
    values = {}
    for tensor in model.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL and np.prod(tensor.dims, dtype=np.int64) <= max_elements:
            values[tensor.name] = numpy_helper.to_array(tensor)
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and np.prod(attr.t.dims, dtype=np.int64) <= max_elements:
                    values[node.output[0]] = numpy_helper.to_array(attr.t)
    return values


def shape_skeleton(model: onnx.ModelProto, max_elements: int = 64) -> onnx.ModelProto:
    """`model` for shape inference: the same nodes, inputs, outputs and value_info, the small
    initializers (shapes, axes: what data propagation reads), and every larger initializer
    declared as a graph input of its type and shape instead of carried with its data. ONNX
    shape inference serializes the whole model, weights included (on VGG-11's 400 MB
    classifier that was most of a build), and infers the same shapes from the skeleton."""
    graph = model.graph
    skeleton = onnx.ModelProto()
    skeleton.ir_version = model.ir_version
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    inner = skeleton.graph
    inner.name = graph.name
    inner.node.extend(graph.node)
    inner.input.extend(graph.input)
    inner.output.extend(graph.output)
    inner.value_info.extend(graph.value_info)
    declared = {v.name for v in graph.input}
    for tensor in graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL and np.prod(tensor.dims, dtype=np.int64) <= max_elements:
            inner.initializer.append(tensor)
        elif tensor.name not in declared:
            inner.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return skeleton


def infer_shapes(model: onnx.ModelProto, **options) -> onnx.ModelProto:
    """onnx.shape_inference.infer_shapes on the model's shape_skeleton: a model whose
    value_info (and inputs, outputs) carry the inferred types; its large initializers are
    graph inputs, so read nodes and shapes from it, never weights."""
    return onnx.shape_inference.infer_shapes(shape_skeleton(model), **options)
