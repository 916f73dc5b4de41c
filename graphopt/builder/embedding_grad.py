"""Embedding gradients without table-sized scratch: one table-sized tensor per gradient, as
PyTorch's embedding backward (zeros, then index_add_ in place) has.

Reverse mode writes the gradient of Gather (an embedding lookup) as a scatter-add of the
looked-up rows' adjoints into a table of zeros (after deterministic.py:
``ScatterElements(ConstantOfShape(0), Expand(column), rows, axis=0, reduction="add")``), and
a table read several times (a language model's tied input and output embeddings, T5's
encoder and decoder) sums those contributions: per contribution a zeros table and a
scattered copy, then a Sum of all of them, several tables live at once (measured on
T5-small: five 63 MiB tables). ONNX has no in-place scatter, so:

* a Sum (or Add) of such scatters and other terms scatters each contribution into the
  running total instead (``ScatterElements(total, ...)``), one table after another;
* a scatter with nothing to accumulate into gathers the dense table from a compact one:
  each vocabulary row's first position among the indices (a [V] int64 map, positions
  written by a ScatterElements, absent rows pointing at a zero row), the rows summed by
  position into [M + 1, ...] (M = the rows looked up) and ``Gather(compact, map)``: the table
  is allocated once, by the Gather.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph_util import Names, attribute


def _is_zeros(node: onnx.NodeProto | None) -> bool:
    if node is None or node.op_type != "ConstantOfShape":
        return False
    value = attribute(node, "value", None)
    return value is None or not np.any(numpy_helper.to_array(value))


def _scatter_adds(model, producers, readers):
    """ScatterElements(zeros, Expand(column), rows, axis=0, add) nodes -> (column, rows)."""
    found = {}
    for node in model.graph.node:
        if node.op_type != "ScatterElements" or attribute(node, "axis", 0) != 0 \
                or attribute(node, "reduction", b"none") not in (b"add", "add"):
            continue
        zeros, expand = producers.get(node.input[0]), producers.get(node.input[1])
        if not _is_zeros(zeros) or len(readers.get(node.input[0], [])) != 1:
            continue
        if expand is None or expand.op_type != "Expand":
            continue
        found[node.output[0]] = (node, expand.input[0], node.input[2])
    return found


def lean_embedding_gradients(model: onnx.ModelProto, shapes: dict[str, list]) -> int:
    """In place; `shapes`: static shapes by name. Returns how many scatters changed."""
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output if o}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    scatters = _scatter_adds(model, producers, readers)
    if not scatters:
        return 0
    names = Names(model)
    replaced: dict[int, list] = {}      # id(node) -> nodes in its place
    removed: set[int] = set()
    changed = 0

    def static(name):
        shape = shapes.get(name)
        return None if shape is None or any(not isinstance(d, int) or d is None for d in shape) else list(shape)

    def const(stem, array):
        name = names.fresh(stem)
        graph.initializer.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def make(op, inputs, stem, output=None, **attrs):
        out = output or names.fresh(stem)
        return out, helper.make_node(op, inputs, [out], name=names.fresh(f"{stem}/{op}"), **attrs)

    def dense(scatter, column, rows, output):
        """Nodes computing scatter's table with one table-sized allocation (or None)."""
        table, column_shape, rows_shape = static(scatter.output[0]), static(column), static(rows)
        if table is None or column_shape is None or rows_shape is None:
            return None
        m, stem = rows_shape[0], scatter.name or scatter.output[0]
        nodes = []

        def add(op, inputs, suffix, output=None, **attrs):
            out, node = make(op, inputs, f"{stem}/{suffix}", output, **attrs)
            nodes.append(node)
            return out
        ids = add("Reshape", [column, const(f"{stem}/flat", np.array([-1], np.int64))], "ids")
        unset = add("ConstantOfShape", [const(f"{stem}/vocabulary", np.array(table[:1], np.int64))], "unset",
                    value=helper.make_tensor("value", TensorProto.INT64, [1], [m]))
        first = add("ScatterElements", [unset, ids, const(f"{stem}/positions", np.arange(m, dtype=np.int64))],
                    "first_position", axis=0)
        representative = add("Gather", [first, ids], "representative", axis=0)
        index = add("Expand", [add("Reshape", [representative, const(f"{stem}/column_shape",
                                                                     np.array(column_shape, np.int64))],
                                   "representative_column"),
                               const(f"{stem}/rows_shape", np.array(rows_shape, np.int64))], "representative_rows")
        zeros = add("ConstantOfShape", [const(f"{stem}/compact_shape", np.array([m + 1] + rows_shape[1:], np.int64))],
                    "compact_zeros", value=helper.make_tensor("value", _elem_type(producers.get(scatter.input[0])), [1], [0]))
        compact = add("ScatterElements", [zeros, index, rows], "compact", axis=0, reduction="add")
        add("Gather", [compact, first], "dense", output=output, axis=0)
        return nodes

    # 1. sums with scatter-add terms: scatter into the running total
    for node in graph.node:
        if node.op_type not in ("Sum", "Add") or node.output[0] in outputs:
            continue
        total_shape = static(node.output[0])
        terms = [name for name in node.input if name in scatters and len(readers.get(name, [])) == 1
                 and name not in outputs and static(name) == total_shape]
        if not terms or total_shape is None:
            continue
        others = [name for name in node.input if name not in terms]
        if any(static(name) != total_shape for name in others):
            continue      # a broadcast term: leave the sum as it is
        nodes = []
        if len(others) == 1:
            total = others[0]
        elif others:
            total, sum_node = make("Sum", others, f"{node.name}/others")
            nodes.append(sum_node)
        else:
            scatter, column, rows = scatters[terms[0]]
            first = dense(scatter, column, rows, names.fresh(f"{terms[0]}__dense"))
            if first is None:
                continue
            nodes.extend(first)
            total = first[-1].output[0]
            removed.add(id(scatter))
            terms = terms[1:]
        for k, name in enumerate(terms):
            scatter, _, _ = scatters[name]
            output = node.output[0] if k == len(terms) - 1 else names.fresh(f"{node.output[0]}__partial")
            accumulated = onnx.NodeProto()
            accumulated.CopyFrom(scatter)
            accumulated.input[0] = total
            accumulated.output[0] = output
            accumulated.name = names.fresh(f"{node.name}/accumulate")
            nodes.append(accumulated)
            total = output
            removed.add(id(scatter))
        replaced[id(node)] = nodes
        changed += 1
    # 2. a lone scatter-add: the dense table gathered from a compact one
    for name, (scatter, column, rows) in scatters.items():
        if id(scatter) in removed:
            continue
        nodes = dense(scatter, column, rows, scatter.output[0])
        if nodes is not None:
            replaced[id(scatter)] = nodes
            changed += 1
    if changed:
        kept = []
        for node in graph.node:
            if id(node) in removed:
                continue
            kept.extend(replaced.get(id(node), [node]))
        graph.ClearField("node")
        graph.node.extend(kept)
    return changed


def _elem_type(zeros: onnx.NodeProto) -> int:
    """The element type of a ConstantOfShape's output (float when its value is unset)."""
    value = attribute(zeros, "value", None)
    return value.data_type if value is not None else TensorProto.FLOAT
