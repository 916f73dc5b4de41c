"""Rewrite: turn a plan into an ONNX training graph that ONNX Runtime executes as planned.

- nodes are written in the plan's order; recompute clones (`<node>__rc<k>`) produce renamed
  tensors (`<tensor>__rc<k>`) and every reader is rewired to the version the plan reads
  (`costmodel.resolve_versions`, the rule the cost model uses);
- each clone carries a `__recompute_id` attribute so common-subexpression elimination can
  never merge it back into the original (ONNX checkers skip `__` attributes);
- optional outputs nobody reads are dropped (ONNX Runtime never frees an unread output);
- nodes that feed no graph output are removed;
- a plan that reads a tensor after an op overwrote it in place (a training-mode
  BatchNormalization's statistics inputs, `op_rules.clobbered_inputs`) is refused with a
  ValueError: its rewritten model would compute from the updated values;
- the session settings the order needs go into `metadata_props["graphopt.session"]`.

`expand_functions` writes the nodes ONNX Runtime would inline at load (function ops it has no
kernel for, e.g. HardSwish on the CPU provider) as their ONNX function bodies, before
planning: inlined at load, their body nodes get node indices after every node of the file,
so PRIORITY_BASED runs them only when nothing else is ready and the file's order is lost
(MobileNetV3: each HardSwish ran late, the BatchNormalization statistics' Muls early).
"""
from __future__ import annotations

import json

import onnx
import onnx.defs
import onnx.inliner
from onnx import helper

from .analyze import TrainingGraph
from .costgraph import CostGraph
from .op_rules import clobbered_inputs
from .costmodel import resolve_versions
from .runtime.session import SessionSettings, write_settings
from .search.plan import Plan
from .onnx_ops import STANDARD_DOMAINS

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


def rewrite(training: TrainingGraph, graph: CostGraph, plan: Plan,
            settings: SessionSettings = PLANNED_SETTINGS) -> onnx.ModelProto:
    """The training graph rewritten to follow `plan` (a new model; the input is untouched)."""
    source = training.model
    nodes = training.nodes
    steps = resolve_versions(graph, plan.schedule)
    graph_outputs = {o.name for o in source.graph.output}
    read = {r for step in steps for r in step.reads}
    droppable = graph.droppable
    taken = {t for n in source.graph.node for t in list(n.input) + list(n.output)}
    taken |= {i.name for i in source.graph.input} | {i.name for i in source.graph.initializer}

    names: dict[tuple[str, int], str] = {}

    def name_of(version):
        if version not in names:
            names[version] = version_name(version[0], version[1], taken)
            taken.add(names[version])
        return names[version]

    new_nodes = []
    overwritten: dict[tuple[str, int], str] = {}   # version -> the step that overwrote it in place
    for step in steps:
        original = nodes[step.op]
        for version in step.reads:
            if version in overwritten:
                raise ValueError(
                    f"the plan has {step.op!r} (copy {step.copy}) read {version[0]!r} (copy {version[1]}) "
                    f"after {overwritten[version]!r} overwrote it in place (ONNX Runtime aliases an "
                    "output to that input): the plan must recompute it")
        clobbers = set(clobbered_inputs(original))
        for t, version in zip((t for t in original.input if t), step.reads):
            if t in clobbers and version[1] >= 0:
                overwritten[version] = f"{step.op}" + (f" (copy {step.copy})" if step.copy else "")
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


_INLINE_DOMAIN = "graphopt.inline"


def _schema_domain(domain: str) -> str:
    """The domain onnx.defs knows `domain`'s operators by ("ai.onnx" is the default domain's
    other name; onnx.defs has no schema under it)."""
    return "" if domain == "ai.onnx" else domain


def has_function(node: onnx.NodeProto, opset: int) -> bool:
    """Whether `node`'s operator is defined by an ONNX function at `opset` (ORT inlines such a
    node at load when its provider has no kernel for it)."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, _schema_domain(node.domain))
    except onnx.defs.SchemaError:
        return False
    return bool(schema.has_function or schema.has_context_dependent_function)


def _function_body(node: onnx.NodeProto, opset: int, input_types: list[onnx.TypeProto] | None):
    """The FunctionProto of `node`'s operator at `opset`, or None where it cannot be had (a
    context-dependent function without the input types, or a body whose operators mean
    something else at `opset` than at the body's own opset)."""
    schema = onnx.defs.get_schema(node.op_type, opset, _schema_domain(node.domain))
    if schema.has_function:
        version = max((v for v in schema.function_opset_versions if v <= opset), default=None)
        body = schema.get_function_with_opset_version(version) if version else None
    elif schema.has_context_dependent_function and input_types is not None:
        version = max((v for v in schema.context_dependent_function_opset_versions if v <= opset), default=None)
        body = schema.get_context_dependent_function_with_opset_version(
            version, node.SerializeToString(), [t.SerializeToString() for t in input_types]) if version else None
    else:
        return None
    if not body:
        return None
    function = onnx.FunctionProto()
    function.ParseFromString(body)
    body_opset = {o.domain: o.version for o in function.opset_import}.get("", opset)
    for inner in function.node:
        if inner.domain not in STANDARD_DOMAINS:
            return None
        try:
            same = (onnx.defs.get_schema(inner.op_type, body_opset).since_version
                    == onnx.defs.get_schema(inner.op_type, opset).since_version)
        except onnx.defs.SchemaError:
            return None
        if not same:
            return None
    return function


def expand_functions(model: onnx.ModelProto, names, input_types: dict[str, onnx.TypeProto] | None = None
                     ) -> tuple[onnx.ModelProto, list[str]]:
    """`model` with the nodes named in `names` replaced, in place in the file, by their ONNX
    function bodies (as ONNX Runtime inlines them), each body node named
    ``<node>/<op_type>_<k>``. `input_types`: tensor -> TypeProto, needed by context-dependent
    functions (SoftmaxCrossEntropyLoss, ...). Returns the new model and the names expanded
    (nodes whose body cannot be had are left as they are)."""
    names = set(names)
    model_opsets = {o.domain or "": o.version for o in model.opset_import}
    opset = model_opsets.get("", model_opsets.get("ai.onnx", onnx.defs.onnx_opset_version()))
    work = onnx.ModelProto()
    work.CopyFrom(model)
    selected = []
    sizes: dict[str, int] = {}
    for k, node in enumerate(work.graph.node):
        if node.name not in names or node.domain not in STANDARD_DOMAINS:
            continue
        types = None
        if input_types is not None:
            types = [input_types.get(t) for t in node.input]
            types = None if any(t is None for t in types) else types
        function = _function_body(node, opset, types)
        if function is None:
            continue
        function.domain, function.name = _INLINE_DOMAIN, f"f{k}"
        del function.opset_import[:]
        function.opset_import.append(helper.make_opsetid("", opset))
        work.functions.append(function)
        sizes[node.name] = len(function.node)
        node.domain, node.op_type = _INLINE_DOMAIN, function.name
        selected.append((_INLINE_DOMAIN, function.name))
    if not selected:
        return model, []
    work.opset_import.append(helper.make_opsetid(_INLINE_DOMAIN, 1))
    expanded = onnx.inliner.inline_selected_functions(work, selected, exclude=False)
    kept = [o for o in expanded.opset_import if o.domain != _INLINE_DOMAIN]
    del expanded.opset_import[:]
    expanded.opset_import.extend(kept)
    # name the body nodes: the inliner writes each body where its node stood, in order
    taken = {n.name for n in model.graph.node}
    new = iter(expanded.graph.node)
    for node in model.graph.node:
        if node.name not in sizes:
            next(new)
            continue
        for j in range(sizes[node.name]):
            inner = next(new)
            name = f"{node.name}/{inner.op_type}_{j}"
            while name in taken:
                name += "_"
            inner.name = name
            taken.add(name)
    return expanded, sorted(sizes)
