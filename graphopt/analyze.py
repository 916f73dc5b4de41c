"""Analyze: check that a model is a training graph and split it into forward and backward.

Forward = the nodes the loss depends on; backward = every other node that feeds a graph
output; stashed = forward tensors that backward nodes read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import onnx

from .errors import InvalidModelError, UnsupportedOpError
from .runtime.step_state import UPDATED_SUFFIX, fed_back_outputs  # noqa: F401  (the library's names)
from .ingest import KNOWN_DOMAINS, subgraphs
from .onnx_ops import FLOAT_TYPES

if TYPE_CHECKING:
    import networkx as nx



@dataclass
class TrainingGraph:
    """A checked training graph and its forward/backward split (node names)."""
    model: onnx.ModelProto
    loss: str
    forward: list[str]                 # node names, file order
    backward: list[str]                # node names, file order
    stashed: list[str]                 # forward tensors read by backward nodes
    parameters: list[str]              # floating initializers / inputs that reach the loss
    resident: frozenset[str] = field(default_factory=frozenset)  # graph inputs and initializers

    @property
    def nodes(self) -> dict[str, onnx.NodeProto]:
        return {n.name: n for n in self.model.graph.node}


def producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    out: dict[str, onnx.NodeProto] = {}
    for node in model.graph.node:
        for name in node.output:
            if name:
                if name in out:
                    raise InvalidModelError(
                        f"tensor {name!r} is produced twice (nodes {out[name].name!r} and {node.name!r})")
                out[name] = node
    return out


def implicit_inputs(node: onnx.NodeProto) -> tuple[str, ...]:
    """Outer-scope tensors that the node's subgraphs (If branches, Loop and Scan bodies, at any
    depth) read without taking them as inputs, in first-use order: ONNX Runtime keeps them
    alive until the node runs, like its inputs."""
    found: list[str] = []
    for graph in subgraphs(node):
        _outer_names(graph, frozenset(), found)
    explicit = set(node.input)
    return tuple(t for t in dict.fromkeys(found) if t not in explicit)


def _outer_names(graph: onnx.GraphProto, bound: frozenset, found: list[str]) -> None:
    local = set(bound) | {i.name for i in graph.input} | {t.name for t in graph.initializer}
    local |= {t.values.name for t in graph.sparse_initializer}
    for node in graph.node:
        found.extend(t for t in node.input if t and t not in local)
        for body in subgraphs(node):
            _outer_names(body, frozenset(local), found)
        local.update(t for t in node.output if t)
    found.extend(o.name for o in graph.output if o.name not in local)   # an outer tensor passed out


def node_graph(model: onnx.ModelProto) -> "nx.DiGraph":
    """Node-level dependency graph (node name -> node name); checks missing tensors and cycles."""
    import networkx as nx   # here, not at import: the measuring children read this module without it (17 MiB)
    produced = producers(model)
    resident = {i.name for i in model.graph.input} | {i.name for i in model.graph.initializer}
    graph = nx.DiGraph()
    for node in model.graph.node:
        if node.domain not in KNOWN_DOMAINS:
            raise UnsupportedOpError(
                f"node {node.name!r}: operator {node.op_type!r} of unknown domain {node.domain!r}")
        graph.add_node(node.name)
        for name in list(node.input) + list(implicit_inputs(node)):
            if not name or name in resident:
                continue
            if name not in produced:
                raise InvalidModelError(
                    f"node {node.name!r} ({node.op_type}) reads tensor {name!r}, which no node, "
                    "graph input or initializer provides")
            graph.add_edge(produced[name].name, node.name)
    for out in model.graph.output:
        if out.name not in produced and out.name not in resident:
            raise InvalidModelError(f"graph output {out.name!r} is not produced by any node")
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise InvalidModelError("the graph has a cycle: " + " -> ".join(a for a, _ in cycle))
    return graph


def _floating_resident(model: onnx.ModelProto) -> set[str]:
    names = {t.name for t in model.graph.initializer if t.data_type in FLOAT_TYPES}
    names |= {i.name for i in model.graph.input
              if i.type.HasField("tensor_type") and i.type.tensor_type.elem_type in FLOAT_TYPES}
    return names


def analyze(model: onnx.ModelProto, loss: str | None = None) -> TrainingGraph:
    """Check that `model` is a training graph and split it; node names must be unique."""
    import networkx as nx
    graph = node_graph(model)   # well-formed first: known ops, every tensor produced, no cycle
    if not model.graph.output:
        raise InvalidModelError("the model has no outputs; a training graph outputs the loss, then gradients")
    loss = loss or model.graph.output[0].name
    outputs = [o.name for o in model.graph.output]
    if loss not in outputs:
        raise InvalidModelError(f"loss {loss!r} is not a graph output (outputs: {outputs})")
    if len(outputs) < 2:
        raise InvalidModelError(
            "not a training graph: the only output is the loss; gradients must be outputs too "
            "(use `graphopt train-graph` to build a training graph from a forward model)")
    produced = producers(model)
    resident = frozenset({i.name for i in model.graph.input} | {i.name for i in model.graph.initializer})
    if loss not in produced:
        raise InvalidModelError(f"loss {loss!r} is not computed by any node")

    loss_node = produced[loss].name
    forward_set = nx.ancestors(graph, loss_node) | {loss_node}
    needed = set()
    for name in outputs:
        if name in produced:
            node = produced[name].name
            needed |= nx.ancestors(graph, node) | {node}
    order = [n.name for n in model.graph.node]
    forward = [n for n in order if n in forward_set]
    backward = [n for n in order if n in needed and n not in forward_set]
    if not backward:
        raise InvalidModelError("not a training graph: no node outside the loss's ancestors feeds an output "
                                "(no backward pass)")

    nodes = {n.name: n for n in model.graph.node}
    forward_inputs = {t for n in forward for t in nodes[n].input if t}
    parameters = sorted(_floating_resident(model) & forward_inputs)
    # a parameter must reach the loss: forward_inputs are inputs of loss ancestors, so yes
    if not parameters:
        raise InvalidModelError("not a training graph: no parameter (floating initializer or input) "
                                "has a path to the loss")
    forward_tensors = {t for n in forward for t in nodes[n].output if t}
    stashed = sorted({t for n in backward for t in nodes[n].input if t in forward_tensors})
    return TrainingGraph(model=model, loss=loss, forward=forward, backward=backward,
                         stashed=stashed, parameters=parameters, resident=resident)
