"""Rewrite: turn a plan into an ONNX training graph that ONNX Runtime executes as planned.

- nodes are written in the plan's order; recompute clones (`<node>__rc<k>`) produce renamed
  tensors (`<tensor>__rc<k>`) and every reader is rewired to the version the plan reads
  (`costmodel.resolve_versions`, the rule the cost model uses);
- each clone carries a `__recompute_id` attribute so common-subexpression elimination can
  never merge it back into the original (ONNX checkers skip `__` attributes);
- optional outputs nobody reads are dropped (ONNX Runtime never frees an unread output);
- nodes that feed no graph output are removed;
- the session settings the order needs go into `metadata_props["graphopt.session"]`.
"""
from __future__ import annotations

import json

import networkx as nx
import onnx
from onnx import helper

from .analyze import TrainingGraph
from .costmodel import resolve_versions
from .runtime.session import SessionSettings, write_settings
from .search.plan import Plan

PLAN_KEY = "graphopt.plan"

# What a rewritten graph needs from ONNX Runtime: no graph optimizations (they would merge
# or reorder nodes) and the priority-based order, which runs a topologically sorted file in
# file order (Shape and Size as soon as ready, which the cost model knows).
PLANNED_SETTINGS = SessionSettings(
    graph_optimization_level="ORT_DISABLE_ALL",
    execution_order="PRIORITY_BASED",
    disabled_optimizers=("CommonSubexpressionElimination",),
    enable_mem_pattern=False,  # the pattern plans one block per run: measured +1 activation
    # With reuse on, the planner keeps a dead buffer allocated until a later output of the same
    # shape takes it over, so recomputation frees little: measured (ORT 1.32, CPU) unet 48.6
    # MiB with reuse vs 20.2 without, densenet 96.9 vs 45.2, transformer 84.3 vs 39.5; the
    # cost model (costmodel.py) models the planner without reuse.
    enable_mem_reuse=False,
)


def version_name(tensor: str, version: int, taken: set[str]) -> str:
    if version <= 0:
        return tensor
    name = f"{tensor}__rc{version}"
    while name in taken:
        name += "_"
    return name


def rewrite(training: TrainingGraph, graph: nx.DiGraph, plan: Plan,
            settings: SessionSettings = PLANNED_SETTINGS) -> onnx.ModelProto:
    """The training graph rewritten to follow `plan` (a new model; the input is untouched)."""
    source = training.model
    nodes = training.nodes
    steps = resolve_versions(graph, plan.schedule)
    graph_outputs = {o.name for o in source.graph.output}
    read = {r for step in steps for r in step.reads}
    droppable = graph.graph.get("droppable", frozenset())
    taken = {t for n in source.graph.node for t in list(n.input) + list(n.output)}
    taken |= {i.name for i in source.graph.input} | {i.name for i in source.graph.initializer}

    names: dict[tuple[str, int], str] = {}

    def name_of(version):
        if version not in names:
            names[version] = version_name(version[0], version[1], taken)
            taken.add(names[version])
        return names[version]

    new_nodes = []
    for step in steps:
        original = nodes[step.op]
        node = onnx.NodeProto()
        node.CopyFrom(original)
        reads = iter(step.reads)
        for k, t in enumerate(original.input):
            if t:
                node.input[k] = name_of(next(reads))
        writes = iter(step.writes)
        for k, t in enumerate(original.output):
            if not t:
                continue
            version = next(writes)
            unused = version not in read and not (step.copy == 0 and t in graph_outputs)
            node.output[k] = "" if (unused and t in droppable) else name_of(version)
        while len(node.output) > 1 and not node.output[-1]:
            node.output.pop()
        if step.copy:
            node.name = f"{original.name}__rc{step.copy}"
            node.attribute.append(helper.make_attribute("__recompute_id", f"{step.copy}"))
        new_nodes.append(node)

    model = onnx.ModelProto()
    model.CopyFrom(source)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    write_settings(model, settings)
    plan_info = {"strategy": plan.strategy, "checkpoints": sorted(plan.checkpoints),
                 "recompute_nodes": plan.recompute_ops}
    _set_metadata(model, PLAN_KEY, json.dumps(plan_info))
    return model


def _set_metadata(model: onnx.ModelProto, key: str, value: str) -> None:
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    model.metadata_props.add(key=key, value=value)
