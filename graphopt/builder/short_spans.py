"""Broadcasts by a per-channel operand over small maps, with the operand expanded over the map
first, so that ONNX Runtime's CPU kernel runs them in long spans (issue 48).

ONNX Runtime runs a broadcasting elementwise node as a loop over the output's contiguous spans
that share one element of the smaller operand, about 6 ns per span beside 0.16 ns per element
(unit_axes.py). A batch norm's backward multiplies [N, C, H, W] tensors by [1, C, 1, 1] factors,
and over the small maps late in a CNN (MobileNetV2's 960 channels at 2 x 2) a span is 4 elements:
most of the node's time is the loop. With the factor expanded to [1, C, H, W] first (an Expand of
C x H x W elements, 1/N of the product), the same node runs N spans of C x H x W. The values are bit
for bit the same: the same operator on the same elements.

Measured (onnxruntime 1.32, CPU, the node alone, optimizations off, medians of 200 runs, the
per-channel Mul's time over the Expand and Mul's, one thread / two): [8, 960, 2, 2] 2.40 / 2.39;
[8, 384, 4, 4] 1.59 / 1.57; [16, 512, 4, 4] 2.18 / 3.46; [8, 192, 8, 8] 1.15 / 1.10; [16, 256, 8,
8] 1.20 / 2.04; but [8, 144, 16, 16] 0.80 / 0.76 and [8, 96, 32, 32] 0.73 / 0.42: past
`MAX_SPAN_ELEMENTS` elements a span the expansion costs more than the loop saves.

Which nodes (`short_spans_expanded`): Add, Sub, Mul and Div of two operands with static shapes,
one of the output's shape, the other broadcast over the output's innermost axes only where those
come to at most `MAX_SPAN_ELEMENTS` elements (and more than one), the output at least
`unit_axes.MIN_ELEMENTS` elements, and the operand expanded at most half the output (a batch or
another outer axis still broadcast: otherwise the expansion would be a copy of the output's
size). The Expand is placed right before the node, so that the expanded copy lives no longer than
the node's read of it in the file's order.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphopt.onnx_ops import STANDARD_DOMAINS

from .graph_util import Names
from .unit_axes import MIN_ELEMENTS

SPANNED = frozenset({"Add", "Sub", "Mul", "Div"})
# the longest span of the output (the innermost axes the operand is broadcast over) expanded:
# measured above, 16 and 64 elements gained, 256 and 1024 lost
MAX_SPAN_ELEMENTS = 64


def _expanded_shape(small: list, out: list) -> list | None:
    """The shape `small` is expanded to (its trailing broadcast axes filled in from `out`), or
    None where the node is left as it is (the module docstring)."""
    if len(small) > len(out) or any(d is None for d in small) or any(d is None for d in out):
        return None
    aligned = [1] * (len(out) - len(small)) + list(small)
    if any(a != 1 and a != o for a, o in zip(aligned, out)):
        return None
    wide = [axis for axis, extent in enumerate(aligned) if extent != 1]
    last = wide[-1] if wide else -1
    span = int(np.prod(out[last + 1:], dtype=np.int64))
    if span <= 1 or span > MAX_SPAN_ELEMENTS:
        return None
    expanded = aligned[:last + 1] + list(out[last + 1:])
    if 2 * int(np.prod(expanded, dtype=np.int64)) > int(np.prod(out, dtype=np.int64)):
        return None
    return expanded


def short_spans_expanded(model: onnx.ModelProto, shapes: dict[str, list]) -> int:
    """Each node of the module docstring reads its broadcast operand expanded over the output's
    innermost axes (an Expand right before it). `shapes`: every value's static shape (None: an
    unknown extent). The top-level graph, standard operators; in place; returns how many nodes
    were rewritten."""
    graph = model.graph
    names = Names(model)
    nodes, rewritten = [], 0
    for node in graph.node:
        out = shapes.get(node.output[0]) if len(node.output) == 1 else None
        if (node.op_type not in SPANNED or node.domain not in STANDARD_DOMAINS or len(node.input) != 2
                or out is None or None in out or int(np.prod(out, dtype=np.int64)) < MIN_ELEMENTS):
            nodes.append(node)
            continue
        ins = [shapes.get(name) for name in node.input]
        full = [i for i, shape in enumerate(ins) if shape is not None and list(shape) == list(out)]
        small = 1 - full[0] if len(full) == 1 else None
        expanded = None if small is None or ins[small] is None else _expanded_shape(list(ins[small]), list(out))
        if expanded is None:
            nodes.append(node)
            continue
        target = names.fresh("span_shape")
        graph.initializer.append(numpy_helper.from_array(np.array(expanded, dtype=np.int64), target))
        wide = names.fresh(node.input[small] + "_spanned")
        nodes.append(helper.make_node("Expand", [node.input[small], target], [wide],
                                      name=names.fresh((node.name or "node") + "_spanned")))
        node.input[small] = wide
        nodes.append(node)
        rewritten += 1
    if rewritten:
        graph.ClearField("node")
        graph.node.extend(nodes)
    return rewritten
