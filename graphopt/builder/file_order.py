"""The builder's node order for a graph that runs in file order (``PRIORITY_BASED``).

A training graph with its optimizer step runs in the order of its file (graphopt/builder/
optimizer.py writes each update where it should run), so the builder picks that order:
`leanest_file_order` keeps the candidate order the cost model gives the least peak, after
`sink_to_readers` has moved each node whose outputs outweigh the inputs it keeps alive down to
right before its first reader (autodiff computes a tied embedding's gradient from the output
projection at the start of the backward pass, and it is read only at the end, where the
embedding's own contribution is added). `default_order` is the order ONNX Runtime's DEFAULT
walk runs a graph in, one of the candidates.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from graphopt.analyze import implicit_inputs

from .graph_util import infer_shapes


def static_tensor_bytes(model: onnx.ModelProto) -> dict[str, int]:
    """Bytes of every tensor whose type and shape ONNX shape inference knows fully."""
    inferred = infer_shapes(model)
    sizes: dict[str, int] = {}
    graph = inferred.graph
    for value in list(graph.value_info) + list(graph.input) + list(graph.output):
        tensor_type = value.type.tensor_type
        if not value.type.HasField("tensor_type") or not tensor_type.HasField("shape"):
            continue
        dims = tensor_type.shape.dim
        if not all(d.HasField("dim_value") for d in dims):
            continue
        try:
            itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)).itemsize
        except (KeyError, TypeError, ValueError):
            continue
        sizes[value.name] = int(np.prod([d.dim_value for d in dims], dtype=np.int64)) * itemsize
    return sizes


def sink_to_readers(nodes: list[onnx.NodeProto], sizes: dict[str, int], resident: set[str],
                    graph_outputs: set[str]) -> list[onnx.NodeProto]:
    """`nodes` (topologically sorted) with each node moved to right before its first reader
    when its outputs are larger than the inputs whose life that would extend (inputs no later
    node reads); the memory between its old and new place then only goes down. A node moves
    only when every size involved is known (`sizes`); nodes that write graph outputs, have no
    reader or hold subgraphs stay. The order stays topological."""
    reads = [[t for t in dict.fromkeys(list(n.input) + list(implicit_inputs(n))) if t] for n in nodes]
    readers: dict[str, list[int]] = {}
    for i, names in enumerate(reads):
        for t in names:
            readers.setdefault(t, []).append(i)
    key: list[tuple[int, int]] = [(i, 0) for i in range(len(nodes))]
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        outputs = [o for o in node.output if o]
        if (not outputs or any(o in graph_outputs for o in outputs)
                or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)):
            continue
        consumers = [j for o in outputs for j in readers.get(o, ()) if j > i]
        if not consumers:
            continue
        target = min(key[j] for j in consumers)
        if target[0] <= i or any(o not in sizes for o in outputs):
            continue
        extended = 0
        for t in reads[i]:
            if t in resident:
                continue
            if max((key[j][0] for j in readers[t] if j != i), default=-1) >= target[0]:
                continue                    # read there or later anyway
            if t not in sizes:
                extended = None
                break
            extended += sizes[t]
        if extended is not None and sum(sizes[o] for o in outputs) > extended:
            key[i] = (target[0], target[1] - 1)
    return [nodes[i] for i in sorted(range(len(nodes)), key=lambda i: (key[i], i))]


def leanest_file_order(model: onnx.ModelProto, candidates: list[list[str]]) -> float:
    """In place: write the model's nodes in the candidate order (node names, each a
    topological order of all of them) whose run in file order (PRIORITY_BASED) the cost model
    gives the least peak, after `sink_to_readers` (the first of equally lean ones); sizes from ONNX shape inference (a tensor of
    unknown size counts 0). Returns that peak in bytes."""
    from graphopt.analyze import analyze
    from graphopt.costmodel import priority_order, simulate
    from graphopt.op_rules import build_cost_graph

    graph = model.graph
    by_name = {n.name: n for n in graph.node}
    if len(by_name) != len(graph.node) or any(sorted(names) != sorted(by_name) for names in candidates):
        raise ValueError("each candidate order must name every node of the model once (unique names)")
    sizes = static_tensor_bytes(model)
    resident = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    outputs = {v.name for v in graph.output}
    cost_graph = build_cost_graph(analyze(model), sizes, {})
    best, best_peak = None, None
    for names in candidates:
        nodes = sink_to_readers([by_name[n] for n in names], sizes, resident, outputs)
        schedule = [(n.name, 0) for n in nodes if n.name in cost_graph]
        peak = simulate(cost_graph, priority_order(cost_graph, schedule)).peak_bytes
        if best_peak is None or peak < best_peak:
            best, best_peak = nodes, peak
    graph.ClearField("node")
    graph.node.extend(best)
    return best_peak


def default_order(model: onnx.ModelProto) -> list[int]:
    """Positions of the model's nodes (Constant nodes left out: ORT makes them initializers at
    load) in the order ONNX Runtime's ``ExecutionOrder.DEFAULT`` runs them: a post-order
    depth-first walk back from the nodes nobody reads, the highest file position first, and
    among a node's producers the highest position first (docs/ort-facts.md, section 3)."""
    nodes = list(model.graph.node)
    kept = [i for i, n in enumerate(nodes) if n.op_type != "Constant"]
    producer = {o: i for i in kept for o in nodes[i].output if o}
    producers: dict[int, list[int]] = {}
    has_reader: set[int] = set()
    for i in kept:
        found = {producer[t] for t in list(nodes[i].input) + list(implicit_inputs(nodes[i])) if t in producer}
        producers[i] = sorted(found)
        has_reader.update(found)
    stack = [(i, False) for i in kept if i not in has_reader]
    visited: set[int] = set()
    order: list[int] = []
    while stack:
        i, done = stack.pop()
        if done:
            order.append(i)
            continue
        if i in visited:
            continue
        visited.add(i)
        stack.append((i, True))
        stack.extend((p, False) for p in producers[i] if p not in visited)
    return order
