"""Broadcasts, reductions and Transposes without the axes of extent 1 that make ONNX Runtime's CPU
kernels run element by element (issue 48).

A built training graph carries onnx-ad's seed axis: most backward tensors end in an axis of
extent 1 ([16, 4, 256, 256, 1] for an attention's scores). ONNX Runtime's CPU kernels run a
broadcast, a reduction or a Transpose as a loop over contiguous spans, and an axis of extent 1 in the wrong
place cuts those spans down to one element:

* a broadcast whose operands' innermost common axes are all 1 (a tensor ending in 1 times a
  one-element tensor of lower rank: the attention scale's gradient, Div of [16, 4, 256, 256, 1]
  by a scalar) runs one element a span. Measured (onnxruntime 1.32, CPU, one thread, the node
  alone): 25-51 ms against 0.7 ms for the same node without the trailing axis (or with the
  scalar given the other's rank), 35-70x; GELU's backward Mul and Div of [16, 256, 512, 1] by a
  scalar, 13 ms each;
* a reduction over an axis followed by an axis of extent 1 (ReduceSum of [16, 4, 256, 256, 1]
  over axis 3, the softmax's backward) reduces over a strided axis: 9.0 ms against 0.24 without
  the unit axis (the same reduction over the innermost axis);
* a Transpose that moves an axis of extent 1 (a whole-map weight gradient's bank, [16, 32, 32,
  32, 1] by (1, 4, 0, 2, 3)) copies element by element: 1.10 ms against 0.044 for the same
  elements moved by (1, 0, 2, 3) without it (thread CPU time, the least of 9).

Span by span, ONNX Runtime spends about 6 ns per span and 0.16 ns per element on such a node
(a [N/k, k] by [k] product of 4 M elements: 25 ms at k = 1, 3.7 at 8, 0.96 at 64, 0.65 at 1024).

The rewrite (`unit_axes_dropped`): every such node computes on its operands reshaped without the
output's axes of extent 1 (the reduction's axes renumbered, the Transpose's perm taken over the axes
left), and its result is reshaped back to the shape it had; a Transpose that then moves nothing is a
Reshape alone. A broadcast's and a Transpose's values are bit for bit the same (the same operator on
the same elements); a sum over the innermost axis adds in another order than over a strided one
(float32 rounding). A Reshape between two nodes is a view in ONNX Runtime (its buffer is reused): in
a graph, Relu -> Mul -> Relu over [16, 4, 256, 256, 1] took 2.08 ms with the Mul's operands reshaped
and 2.04 without. Which nodes, at least `MIN_ELEMENTS` elements each (where the element-by-element
loop costs more than the Reshapes' launches), shapes known, at most one unknown extent per reshape,
not writing a graph output: a broadcast (an operand not of the output's shape) whose output has an
axis of extent 1 after one that is not (operands of the output's shape run in one span already); a
reduction over its input's innermost axis of more than one element with a unit axis after it (a sum
of [65536, 32, 1] over axis 0 took 0.238 ms, [65536, 32] 0.241: only the innermost reduction is
slow); a Transpose whose input has a unit axis.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphopt.onnx_ops import ALIAS_OPS, STANDARD_DOMAINS

from .graph_util import Names, attribute, small_constants

# broadcasting elementwise operators (numpy's rules, every input)
BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Where", "Equal",
                          "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor"})
REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare",
                        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp"})
# below this many elements a node is left as it is: an element-by-element loop over 1024
# elements costs about 6 us, the two or three Reshapes' launches (about 3 us each) about as much;
# by hand, 1024, 4096 and 16384 gave the same steps within 1% on four graphs (resnet, the
# transformer, MobileNetV3, EfficientNet-B0), 16384 2-3% slower on the last two
MIN_ELEMENTS = 1024


def _inner_unit_axes(shape) -> list[int]:
    """The axes of extent 1 of `shape` that come after an axis that is not (leading ones cost
    nothing: the spans are the same without them)."""
    seen_wide, axes = False, []
    for axis, extent in enumerate(shape):
        if extent == 1:
            if seen_wide:
                axes.append(axis)
        else:
            seen_wide = True
    return axes


def _broadcast(shapes: list[list]) -> list | None:
    """numpy's broadcast of `shapes` (None: an unknown extent), or None where it is not known."""
    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(rank):
        extents = {s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0}
        wide = extents - {1}
        if None in wide:
            if len(wide) > 1:
                return None
            out.append(None)
        else:
            out.append(max(wide) if wide else 1)
    return out


def _reshape_target(shape) -> list[int] | None:
    """`shape` as a Reshape's shape input: an unknown extent as -1 (at most one)."""
    if sum(1 for d in shape if d is None) > 1:
        return None
    return [-1 if d is None else int(d) for d in shape]


def _numel(shape) -> int:
    return int(np.prod([d for d in shape if d is not None], dtype=np.int64))


class _Writer:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.names = Names(model)
        self.operand_reshapes: set[int] = set()   # ids of the Reshapes of operands made
        # a rewritten node's output -> what it now computes: an operand read from there is a
        # Reshape of that, not of the Reshape back (following the builder's own views the same
        # way raised GPT's peak in graphopt's sessions, 53 to 60 MiB: ONNX Runtime copies some,
        # and reading past one keeps what it viewed alive longer)
        self.backs: dict[str, str] = {}
        self.created: set[str] = set()   # the initializers made

    def ints(self, values: list[int], stem: str) -> str:
        """A new int64 initializer holding `values`, never one shared between nodes: ONNX Runtime's
        common-subexpression elimination (level BASIC up) merges nodes that read the same inputs
        by name, and two rewritten reductions of one tensor that the builder keeps apart (a batch
        norm's mean in the forward and recomputed in the backward) must not become one."""
        name = self.names.fresh(stem)
        self.model.graph.initializer.append(numpy_helper.from_array(np.array(values, dtype=np.int64), name))
        self.created.add(name)
        return name

    def reshape(self, value: str, target: list[int], stem: str) -> tuple[str, onnx.NodeProto]:
        """A Reshape of `value` to `target`; of what a rewritten node computed, where `value` is
        its output (two Reshapes in a row are one new node under ONNX Runtime's level BASIC, and a
        new node changes its default order: MobileNet's peak in a default session rose 35%)."""
        value = self.backs.get(value, value)
        out = self.names.fresh(stem)
        node = helper.make_node("Reshape", [value, self.ints(target, "unit_axes_shape")], [out],
                                name=self.names.fresh(stem))
        self.operand_reshapes.add(id(node))
        return out, node


def _copy(node: onnx.NodeProto, inputs: list[str], output: str, **attributes) -> onnx.NodeProto:
    """`node` reading `inputs`, writing `output`, with `attributes` replaced."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    del copy.input[:]
    copy.input.extend(inputs)
    copy.output[0] = output
    for name, value in attributes.items():
        for attr in list(copy.attribute):
            if attr.name == name:
                copy.attribute.remove(attr)
        copy.attribute.append(helper.make_attribute(name, value))
    return copy


def _back(node: onnx.NodeProto, out_shape: list[int], writer: _Writer) -> tuple[str, onnx.NodeProto]:
    """A new name for `node`'s output and the Reshape from it back to the output as it was."""
    inner = writer.names.fresh(node.output[0] + "_spans")
    back = helper.make_node("Reshape", [inner, writer.ints(out_shape, "unit_axes_shape")], [node.output[0]],
                            name=writer.names.fresh(node.name + "_unspanned" if node.name else "unspanned"))
    writer.backs[node.output[0]] = inner
    return inner, back


def _elementwise(node, shapes, writer: _Writer) -> list | None:
    """The nodes that replace broadcasting `node`, or None to keep it."""
    ins = [shapes.get(name) for name in node.input]
    out = shapes.get(node.output[0])
    broadcast = None if any(s is None for s in ins) else _broadcast(ins)
    if broadcast is None or out is None or len(out) != len(broadcast):
        return None
    if _numel(out) < MIN_ELEMENTS or not _inner_unit_axes(out):
        return None
    if all(list(shape) == list(out) for shape in ins):   # no broadcast: one span already
        return None
    dropped = {axis for axis, extent in enumerate(out) if extent == 1}
    target_out = _reshape_target(out)
    if target_out is None:
        return None
    targets = {}
    for name, shape in zip(node.input, ins):
        aligned = [1] * (len(out) - len(shape)) + list(shape)
        reduced = [d for axis, d in enumerate(aligned) if axis not in dropped]
        if list(shape) != reduced:
            targets[name] = _reshape_target(reduced)
            if targets[name] is None:
                return None
    replacement, reshaped = [], {}
    for name, target in targets.items():
        reshaped[name], reshape = writer.reshape(name, target, name + "_spans")
        replacement.append(reshape)
    inner, back = _back(node, target_out, writer)
    return replacement + [_copy(node, [reshaped.get(name, name) for name in node.input], inner), back]


def _reduction(node, shapes, constants, writer: _Writer) -> list | None:
    """The nodes that replace reduction `node`, or None to keep it."""
    x = shapes.get(node.input[0]) if node.input else None
    out = shapes.get(node.output[0])
    if x is None or out is None or _numel(x) < MIN_ELEMENTS or not _inner_unit_axes(x):
        return None
    axes_as_input = len(node.input) > 1 and bool(node.input[1])
    if axes_as_input:
        if node.input[1] not in constants:
            return None
        axes = [int(a) for a in np.asarray(constants[node.input[1]]).reshape(-1)]
    else:
        axes = attribute(node, "axes", None)
    if not axes:   # every axis, or none (noop_with_empty_axes), or not known: nothing to gain
        return None
    rank = len(x)
    axes = sorted({a % rank for a in axes})
    kept_axes = [axis for axis in range(rank) if x[axis] != 1]
    if not kept_axes or kept_axes[-1] not in axes or kept_axes[-1] == rank - 1:
        return None   # the innermost axis is not reduced, or no unit axis follows it: one span already
    new_axes = [kept_axes.index(a) for a in axes if x[a] != 1]
    if not new_axes:   # reduced only over axes of extent 1
        return None
    target_in = _reshape_target([x[a] for a in kept_axes])
    target_out = _reshape_target(out)
    if target_in is None or target_out is None:
        return None
    reshaped, reshape = writer.reshape(node.input[0], target_in, node.input[0] + "_spans")
    inner, back = _back(node, target_out, writer)
    if axes_as_input:
        reduce = _copy(node, [reshaped, writer.ints(new_axes, "unit_axes_axes")] + list(node.input[2:]), inner)
    else:
        reduce = _copy(node, [reshaped] + list(node.input[1:]), inner, axes=new_axes)
    return [reshape, reduce, back]


def _transpose(node, shapes, writer: _Writer) -> list | None:
    """The nodes that replace Transpose `node`, or None to keep it: its perm over the axes not of
    extent 1, or a Reshape alone where that perm leaves them in order."""
    x = shapes.get(node.input[0])
    out = shapes.get(node.output[0])
    if x is None or out is None or _numel(x) < MIN_ELEMENTS or 1 not in x:
        return None
    rank = len(x)
    perm = attribute(node, "perm", None)
    perm = list(reversed(range(rank))) if perm is None else [int(p) % rank for p in perm]
    kept = [axis for axis in range(rank) if x[axis] != 1]
    new_perm = [kept.index(p) for p in perm if x[p] != 1]
    target_in, target_out = _reshape_target([x[a] for a in kept]), _reshape_target(out)
    if target_in is None or target_out is None:
        return None
    if new_perm == sorted(new_perm):   # the same elements in the same order
        return [helper.make_node("Reshape", [node.input[0], writer.ints(target_out, "unit_axes_shape")],
                                 [node.output[0]], name=node.name or writer.names.fresh("unspanned"))]
    reshaped, reshape = writer.reshape(node.input[0], target_in, node.input[0] + "_spans")
    inner, back = _back(node, target_out, writer)
    return [reshape, _copy(node, [reshaped], inner, perm=new_perm), back]


def _reshapes_read_through(nodes: list, backs: dict[str, str], outputs: set[str], constants: dict) -> None:
    """A Reshape to a given shape (no 0 in it) that reads a rewritten node's output reads what
    that node computed instead, not the Reshape back (two Reshapes in a row: `_Writer.reshape`);
    a Reshape back that nothing reads then goes. In place."""
    read = {}
    for node in nodes:
        if node.op_type == "Reshape" and node.domain in STANDARD_DOMAINS and node.input[0] in backs:
            target = constants.get(node.input[1]) if len(node.input) > 1 else None
            if target is not None and 0 not in np.asarray(target).reshape(-1).tolist():
                node.input[0] = backs[node.input[0]]
        for name in node.input:
            read[name] = read.get(name, 0) + 1
    nodes[:] = [node for node in nodes if not (node.op_type == "Reshape" and node.output[0] in backs
                                               and node.input[0] == backs[node.output[0]]
                                               and not read.get(node.output[0]) and node.output[0] not in outputs)]


def unit_axes_dropped(model: onnx.ModelProto, shapes: dict[str, list]) -> int:
    """Broadcasting elementwise nodes, reductions and Transposes computed without the axes of
    extent 1 that cut ONNX Runtime's spans (the module docstring): each reads its operands
    reshaped without them and writes a Reshape of its result back to its own output (a Transpose
    that then moves nothing: that Reshape alone). `shapes`: every value's static shape (None: an
    unknown extent). The top-level graph, standard operators, not the nodes that write a graph
    output (a Reshape would copy it); in place; returns how many nodes were rewritten."""
    graph = model.graph
    writer = _Writer(model)
    constants = small_constants(model)
    rewritten, nodes, replaced_axes = 0, [], set()
    # a graph output written by a Reshape is a copy in ONNX Runtime (lean.outputs_written_in_place)
    outputs = {v.name for v in graph.output}
    # the Reshapes of operands, each placed right after what writes its operand (a graph input or
    # initializer's: first): ONNX Runtime's default order walks a node's producers by their place
    # in the file, and each then sorts where its operand's producer did, so that order is kept
    after: dict[str, list] = {}
    for node in list(graph.node):
        replacement = None
        if node.domain in STANDARD_DOMAINS and len(node.output) == 1 and node.output[0] not in outputs:
            if node.op_type in BROADCASTING and len(node.input) >= 2 and all(node.input):
                replacement = _elementwise(node, shapes, writer)
            elif node.op_type in REDUCTIONS:
                replacement = _reduction(node, shapes, constants, writer)
                if replacement and len(node.input) > 1:
                    replaced_axes.add(node.input[1])
            elif node.op_type == "Transpose":
                replacement = _transpose(node, shapes, writer)
        if replacement is None:
            nodes.append(node)
            continue
        for new in replacement:
            if id(new) in writer.operand_reshapes:
                after.setdefault(new.input[0], []).append(new)
            else:
                nodes.append(new)
        rewritten += 1
    if rewritten:
        _reshapes_read_through(nodes, writer.backs, outputs, constants)
    if after:
        written = {o for node in nodes for o in node.output}
        placed = [n for name, reshapes in after.items() if name not in written for n in reshapes]
        for node in nodes:
            placed.append(node)
            for name in node.output:
                placed.extend(after.get(name, []))
        nodes = placed
    if rewritten:
        graph.ClearField("node")
        graph.node.extend(nodes)
        # a reduction's old axes, read by it alone, go with it; so do the shapes of Reshapes gone
        read = {name for node in graph.node for name in node.input} | {v.name for v in graph.output}
        unread = [t for t in graph.initializer if t.name in replaced_axes | writer.created and t.name not in read]
        for tensor in unread:
            graph.initializer.remove(tensor)
    return rewritten
