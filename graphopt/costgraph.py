"""Build the abstract cost graph (networkx, bytes and seconds) from an analyzed training
graph and its measured annotations. This is where ONNX knowledge ends: the solvers and the
cost model see only this graph."""
from __future__ import annotations

import networkx as nx
import onnx
from onnx import defs

from .analyze import TrainingGraph

# Ops whose output 0 shares the buffer of input 0 in ONNX Runtime's CPU and CUDA providers.
ALIAS_OPS = frozenset({"Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"})
# Ops that draw random numbers: never recomputed (their outputs are always checkpoints).
RANDOM_OPS = frozenset({"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform",
                        "RandomUniformLike", "Multinomial", "Bernoulli"})
# Ops ONNX Runtime's priority-based order runs as soon as they are ready.
RUNS_FIRST_OPS = frozenset({"Shape", "Size"})


def is_alias(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in ALIAS_OPS


def is_random(node: onnx.NodeProto) -> bool:
    """Random ops, and ops with subgraphs (their bodies are not looked into)."""
    has_subgraph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                       for a in node.attribute)
    return node.op_type in RANDOM_OPS or has_subgraph


def optional_output_positions(node: onnx.NodeProto, opset: int) -> set[int]:
    """Positions of outputs that the op's schema declares optional (may be left unnamed)."""
    try:
        schema = defs.get_schema(node.op_type, opset, node.domain)
    except Exception:
        return set()
    positions = set()
    for k, formal in enumerate(schema.outputs):
        if formal.option == defs.OpSchema.FormalParameterOption.Optional:
            positions.add(k)
    return positions


def opset_of(model: onnx.ModelProto, domain: str = "") -> int:
    for imp in model.opset_import:
        if imp.domain in (domain, "ai.onnx" if domain == "" else domain):
            return imp.version
    return onnx.defs.onnx_opset_version()


def build_cost_graph(training: TrainingGraph, tensor_bytes: dict[str, int],
                     node_seconds: dict[str, float]) -> nx.DiGraph:
    """The cost graph of `training`: one node per forward/backward op (see costmodel)."""
    model = training.model
    nodes = training.nodes
    opset = opset_of(model)
    graph = nx.DiGraph()
    forward = set(training.forward)
    producer: dict[str, str] = {}
    readers: dict[str, int] = {}
    for name in training.forward + training.backward:
        for t in nodes[name].input:
            if t:
                readers[t] = readers.get(t, 0) + 1
    outputs = {o.name for o in model.graph.output}
    droppable = set()
    for name in training.forward + training.backward:
        node = nodes[name]
        inputs = tuple(t for t in node.input if t)
        outs = tuple(t for t in node.output if t)
        optional = optional_output_positions(node, opset)
        for k, t in enumerate(node.output):
            if t and k in optional and t not in outputs and k > 0:
                droppable.add(t)
        graph.add_node(
            name,
            op_type=node.op_type,
            inputs=inputs,
            outputs=outs,
            seconds=float(node_seconds.get(name, 0.0)),
            phase="forward" if name in forward else "backward",
            alias=is_alias(node),
            recomputable=not is_random(node),
            runs_first=node.op_type in RUNS_FIRST_OPS,
        )
        for t in inputs:
            if t in producer:
                graph.add_edge(producer[t], name)
        for t in outs:
            producer[t] = name
    graph.graph.update(
        tensor_bytes={t: int(b) for t, b in tensor_bytes.items()},
        resident=frozenset(training.resident),
        kept=frozenset(outputs),
        droppable=frozenset(droppable),
        forward_order=list(training.forward),
        backward_order=list(training.backward),
    )
    return graph
