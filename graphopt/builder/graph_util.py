"""Small helpers the builder's passes share: attributes, fresh names, small constants."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from graphopt.onnx_ops import STANDARD_DOMAINS


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


def sequence_splits_to_split(model: onnx.ModelProto) -> int:
    """In place: a SplitToSequence read only by SequenceAt at constant positions (what the
    dynamo exporter writes for ``torch.split``/``chunk`` when its optimizer is off: GPT-2's
    q, k, v) becomes one Split, each SequenceAt an Identity of its piece (Squeezed when
    keepdims=0). onnx-ad differentiates no sequence ops; Split it does. Returns how many
    were replaced; a sequence used any other way is left as it is."""
    graph = model.graph
    splits = [n for n in graph.node if n.op_type == "SplitToSequence" and n.domain in STANDARD_DOMAINS]
    if not splits:
        return 0
    consts = small_constants(model)
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {v.name for v in graph.output}
    inferred = infer_shapes(model, strict_mode=False, data_prop=True)
    shapes = {}
    for value in list(inferred.graph.value_info) + list(inferred.graph.input):
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    opset = next((o.version for o in model.opset_import if o.domain in STANDARD_DOMAINS), 18)
    fresh = Names(model).fresh
    replace: dict[int, list] = {}
    for node in splits:
        sequence = node.output[0]
        users = readers.get(sequence, [])
        if sequence in outputs or not users or any(
                u.op_type != "SequenceAt" or u.input[1] not in consts for u in users):
            continue
        x = node.input[0]
        shape = shapes.get(x)
        axis, keepdims = attribute(node, "axis", 0), attribute(node, "keepdims", 1)
        extent = shape[axis] if shape and -len(shape) <= axis < len(shape) else None
        given = consts.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if len(node.input) > 1 and node.input[1] and given is None:
            continue
        if given is not None and given.ndim == 1:
            sizes, squeeze = [int(s) for s in given], False
        elif extent is None:
            continue
        elif given is not None:               # a scalar: pieces of that size, the last shorter
            step = int(given)
            sizes, squeeze = [step] * (extent // step) + ([extent % step] if extent % step else []), False
        else:                                 # no split: pieces of 1, squeezed unless keepdims
            sizes, squeeze = [1] * extent, not keepdims
        pieces = [fresh(f"{sequence}_piece{k}") for k in range(len(sizes))]
        stem = node.name or sequence
        if opset >= 13:
            sizes_name = fresh(f"{stem}/sizes")
            graph.initializer.append(numpy_helper.from_array(np.array(sizes, np.int64), sizes_name))
            new = [helper.make_node("Split", [x, sizes_name], pieces, name=fresh(f"{stem}/Split"), axis=axis)]
        else:
            new = [helper.make_node("Split", [x], pieces, name=fresh(f"{stem}/Split"), axis=axis, split=sizes)]
        if squeeze:
            axes_name = fresh(f"{stem}/axes")
            graph.initializer.append(numpy_helper.from_array(np.array([axis], np.int64), axes_name))
        for user in users:
            index = int(consts[user.input[1]])
            piece = pieces[index % len(pieces)]
            if squeeze:
                operands = [piece, axes_name] if opset >= 13 else [piece]
                extra = {} if opset >= 13 else {"axes": [axis]}
                replace[id(user)] = [helper.make_node("Squeeze", operands, list(user.output),
                                                      name=user.name or fresh(f"{stem}/Squeeze"), **extra)]
            else:
                replace[id(user)] = [helper.make_node("Identity", [piece], list(user.output),
                                                      name=user.name or fresh(f"{stem}/Identity"))]
        replace[id(node)] = new
    if not replace:
        return 0
    nodes = []
    for node in graph.node:
        nodes.extend(replace.get(id(node), [node]))
    graph.ClearField("node")
    graph.node.extend(nodes)
    return sum(1 for n in splits if id(n) in replace)


def skeleton_check(model: onnx.ModelProto) -> None:
    """onnx.checker on `model` without its large initializers' data (each declared as a graph
    input of its type and shape instead): the checks of the graph that hold at any size, where
    ``check_model`` on the model itself fails past 2 GB and on stubs (their data is not in a file
    of its folder). Raises onnx.checker.ValidationError."""
    onnx.checker.check_model(shape_skeleton(model))
