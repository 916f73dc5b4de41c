"""Put a forward model's layers in training mode before it is differentiated.

* BatchNormalization: `training_mode=1` (normalize with the batch's statistics). Its running
  statistics become separate buffers (an exporter may alias them to other initializers of
  equal value) and the updated ones become extra graph outputs ``<running stat>_updated``.
  The running variance is updated with the unbiased batch variance, as PyTorch does (ONNX's
  own output uses the biased one): ``var_new = c * var_onnx + (1 - c) * momentum * var_old``
  with ``c = n / (n - 1)``, a handful of per-channel ops.
  After differentiation the node reads copies of its statistics (copy_statistics_inputs).
* Dropout: its training-mode computation in plain ops, a mask drawn by RandomUniformLike
  with a fixed seed per node (reproducible runs, so a rewritten graph can be compared with
  the original) and a Where; the boolean mask is an extra graph output, and is what the
  backward reads. Random ops are never recomputed (graphopt/op_rules.py), so the mask is
  drawn once per step.

Each pass changes the model in place and returns the Extras to add once the model has been
differentiated: nodes and initializers that compute extra outputs (nothing on the loss's
path), and the names of those outputs.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphopt.errors import InvalidModelError

from .graph_util import Names, attribute, infer_shapes
from graphopt.onnx_ops import STANDARD_DOMAINS

MIN_OPSET = 14   # BatchNormalization's training_mode attribute


@dataclass
class Extras:
    outputs: list[str] = field(default_factory=list)
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    constants: list[str] = field(default_factory=list)   # float initializers that are not parameters
    shapes: dict[str, list[int]] = field(default_factory=dict)   # outputs' shapes known when made

    def __add__(self, other: "Extras") -> "Extras":
        return Extras(self.outputs + other.outputs, self.nodes + other.nodes,
                      self.initializers + other.initializers, self.constants + other.constants,
                      {**self.shapes, **other.shapes})


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in STANDARD_DOMAINS), 0)


def _set_attribute(node: onnx.NodeProto, name: str, value) -> None:
    for existing in node.attribute:
        if existing.name == name:
            node.attribute.remove(existing)
            break
    node.attribute.append(helper.make_attribute(name, value))


def _resolve_buffer(model, name: str, producers: dict) -> onnx.TensorProto | None:
    """The initializer a tensor is (through Identity nodes), or None."""
    initializers = {t.name: t for t in model.graph.initializer}
    seen = set()
    while name not in initializers:
        node = producers.get(name)
        if node is None or node.op_type != "Identity" or name in seen:
            return None
        seen.add(name)
        name = node.input[0]
    return initializers[name]


def _own_buffer(model, graph, bn, slot, producers, readers, names, dropped) -> str:
    """The initializer holding running statistic `slot` of `bn`, made its own (exporters alias
    equal-valued initializers, e.g. a fresh running_var to a weight of ones), and declared a
    graph input with that default (a trainer feeds the current statistics each step; and
    ONNX Runtime's Conv+BatchNormalization fusion, which treats the node as inference-mode,
    cannot fire on statistics that are not constant)."""
    name = bn.input[slot]
    source = _resolve_buffer(model, name, producers)
    if source is None:
        raise InvalidModelError(f"BatchNormalization {bn.name!r}: running statistic {name!r} is "
                                "not an initializer; cannot train it")
    if not (source.name == name and readers.get(name, 0) == 1):
        alias = producers.get(name)
        if alias is not None and alias.op_type == "Identity" and readers.get(name, 0) == 1:
            dropped.add(id(alias))   # the alias fed only this node: the buffer takes its name
            buffer_name = name
        else:
            buffer_name = names.fresh(f"{name}.buffer")
        graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(source).copy(), buffer_name))
        name = buffer_name
    if name not in {i.name for i in graph.input}:
        initializer = next(t for t in graph.initializer if t.name == name)
        graph.input.append(helper.make_tensor_value_info(name, initializer.data_type, list(initializer.dims)))
    return name


def batchnorm_training(model: onnx.ModelProto) -> Extras:
    """In place: every BatchNormalization in training mode, updated running statistics as extras."""
    batchnorms = [n for n in model.graph.node if n.op_type == "BatchNormalization" and n.domain in STANDARD_DOMAINS]
    extras = Extras()
    if not batchnorms:
        return extras
    if _opset(model) < MIN_OPSET:
        raise InvalidModelError(f"BatchNormalization in training mode needs opset >= {MIN_OPSET}, the model has "
                                f"opset {_opset(model)}; convert it with onnx.version_converter first")
    names = Names(model)
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output if o}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    ones: dict[int, str] = {}   # element type -> a constant 1 of that type
    dropped = set()   # Identity aliases to remove
    for bn in batchnorms:
        mean_in, var_in = (_own_buffer(model, graph, bn, slot, producers, readers, names, dropped) for slot in (3, 4))
        elem_type = next(t.data_type for t in graph.initializer if t.name == var_in)
        np_dtype = helper.tensor_dtype_to_np_dtype(elem_type)
        if elem_type not in ones:
            ones[elem_type] = names.fresh("batchnorm/one")
            graph.initializer.append(numpy_helper.from_array(np.array(1, np_dtype), ones[elem_type]))
            extras.constants.append(ones[elem_type])
        one = ones[elem_type]
        bn.input[3], bn.input[4] = mean_in, var_in
        momentum = float(attribute(bn, "momentum", 0.9))
        _set_attribute(bn, "training_mode", 1)
        mean_out = names.fresh(f"{mean_in}_updated")
        var_onnx = names.fresh(f"{var_in}_biased_update")
        var_out = names.fresh(f"{var_in}_updated")
        del bn.output[1:]
        bn.output.extend([mean_out, var_onnx])
        # unbiased running variance: var_out = c * var_onnx + (1 - c) * momentum * var_in, c = n / (n - 1)
        channels = int(np.prod(next(t.dims for t in graph.initializer if t.name == bn.input[1])))
        k = lambda stem: names.fresh(f"{bn.name}/unbiased/{stem}")  # noqa: E731
        size, size_f, n, n_minus_1, c, one_minus_c, a, b, scaled = (k(s) for s in (
            "size", "size_f", "n", "n_minus_1", "c", "one_minus_c", "a", "b", "scaled"))
        channels_name, momentum_name = k("channels"), k("momentum")
        extras.initializers.extend([numpy_helper.from_array(np.array(channels, np_dtype), channels_name),
                                    numpy_helper.from_array(np.array(momentum, np_dtype), momentum_name)])
        extras.nodes += [
            helper.make_node("Size", [bn.input[0]], [size], name=k("Size")),
            helper.make_node("Cast", [size], [size_f], name=k("Cast"), to=elem_type),
            helper.make_node("Div", [size_f, channels_name], [n], name=k("Div_n")),
            helper.make_node("Sub", [n, one], [n_minus_1], name=k("Sub")),
            helper.make_node("Div", [n, n_minus_1], [c], name=k("Div_c")),
            helper.make_node("Sub", [one, c], [one_minus_c], name=k("Sub_c")),
            helper.make_node("Mul", [var_onnx, c], [a], name=k("Mul_a")),
            helper.make_node("Mul", [one_minus_c, momentum_name], [scaled], name=k("Mul_m")),
            helper.make_node("Mul", [var_in, scaled], [b], name=k("Mul_b")),
            helper.make_node("Add", [a, b], [var_out], name=k("Add")),
        ]
        extras.outputs += [mean_out, var_out]
        statistics_dims = list(next(t.dims for t in graph.initializer if t.name == bn.input[1]))
        extras.shapes.update({mean_out: statistics_dims, var_out: statistics_dims})
    kept = [node for node in graph.node if id(node) not in dropped]
    graph.ClearField("node")
    graph.node.extend(kept)
    return extras


def copy_statistics_inputs(model: onnx.ModelProto) -> None:
    """In place, on the finished training graph: each training-mode BatchNormalization reads
    copies of its running statistics, made right before it.

    ONNX Runtime may write the updated statistics into the buffers of those inputs; a copy
    keeps the fed statistics intact for whatever reads them later (the variance correction,
    a recomputed clone of the node) and keeps a trainer's own arrays untouched. The copies
    are added after differentiation, where nothing folds them into constants."""
    graph = model.graph
    names = Names(model)
    ones: dict[int, str] = {}
    elem_types = {t.name: t.data_type for t in graph.initializer}
    nodes = []
    for node in graph.node:
        if node.op_type == "BatchNormalization" and attribute(node, "training_mode", 0):
            for slot in (3, 4):
                source = node.input[slot]
                elem_type = elem_types.get(source, TensorProto.FLOAT)
                if elem_type not in ones:
                    ones[elem_type] = names.fresh("batchnorm/copy_one")
                    graph.initializer.append(numpy_helper.from_array(
                        np.array(1, helper.tensor_dtype_to_np_dtype(elem_type)), ones[elem_type]))
                copy = names.fresh(f"{source}.copy")
                nodes.append(helper.make_node("Mul", [source, ones[elem_type]], [copy],
                                              name=names.fresh(f"{node.name}/copy")))
                node.input[slot] = copy
        nodes.append(node)
    graph.ClearField("node")
    graph.node.extend(nodes)


def dropout_training(model: onnx.ModelProto) -> Extras:
    """In place: every Dropout becomes its training-mode computation in plain ops,

        keep = RandomUniformLike(x, seed) >= ratio        (bool, an extra output: the mask)
        y = Where(keep, x, 0) * 1 / (1 - ratio)

    so the backward reads the 1-byte mask, and a mask drawn once per step (random ops are
    never recomputed). The seed is fixed per node, so runs are reproducible."""
    graph = model.graph
    if not any(n.op_type == "Dropout" and n.domain in STANDARD_DOMAINS for n in graph.node):
        return Extras()
    names = Names(model)
    types = {}
    inferred = infer_shapes(model, strict_mode=False)
    for value in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        types[value.name] = value.type.tensor_type.elem_type
    nodes, masks, constants = [], [], []
    for node in graph.node:
        if node.op_type != "Dropout" or node.domain not in STANDARD_DOMAINS:
            nodes.append(node)
            continue
        x, y = node.input[0], node.output[0]
        dtype = types.get(x, TensorProto.FLOAT)
        np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
        stem = node.name or y
        k = lambda suffix: names.fresh(f"{stem}/{suffix}")  # noqa: E731
        if len(node.input) > 1 and node.input[1]:
            ratio = k("ratio")
            nodes.append(helper.make_node("Cast", [node.input[1]], [ratio], name=k("Cast"), to=dtype))
        else:
            ratio = k("ratio")
            graph.initializer.append(numpy_helper.from_array(np.array(0.5, np_dtype), ratio))
        one, zero = k("one"), k("zero")
        graph.initializer.extend([numpy_helper.from_array(np.array(1, np_dtype), one),
                                  numpy_helper.from_array(np.array(0, np_dtype), zero)])
        uniform, keep_probability, scale, kept = k("uniform"), k("keep_probability"), k("scale"), k("kept")
        mask = node.output[1] if len(node.output) > 1 and node.output[1] else names.fresh(f"{y}_mask")
        seed = float(zlib.crc32(stem.encode()) % 65521)
        nodes += [
            helper.make_node("RandomUniformLike", [x], [uniform], name=k("RandomUniformLike"), dtype=dtype,
                             seed=seed),
            helper.make_node("GreaterOrEqual", [uniform, ratio], [mask], name=k("GreaterOrEqual")),
            helper.make_node("Sub", [one, ratio], [keep_probability], name=k("Sub")),
            helper.make_node("Div", [one, keep_probability], [scale], name=k("Div")),
            helper.make_node("Where", [mask, x, zero], [kept], name=k("Where")),
            helper.make_node("Mul", [kept, scale], [y], name=k("Mul")),
        ]
        masks.append(mask)
        constants += [one, zero] + ([] if len(node.input) > 1 and node.input[1] else [ratio])
    graph.ClearField("node")
    graph.node.extend(nodes)
    return Extras(outputs=masks, constants=constants)
