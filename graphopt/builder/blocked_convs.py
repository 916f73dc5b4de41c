"""Convolutions written in ONNX Runtime's blocked channel layout (NCHWc), so that ONNX Runtime runs
its fastest CPU convolution kernels on every session kind and for fed weights too (issue 48).

ONNX Runtime's CPU convolution is fastest in its NCHWc kernels (channels in blocks of the
machine's vector width, no im2col), which its layout transformer (optimization level ALL) puts in
at load, and only for a Conv whose weight is a constant initializer. So two sessions of the same
training graph ran different kernels:

* graphopt's own sessions run a planned graph with graph optimizations off, to keep the planned
  order (runtime/offline.py): plain MLAS convolutions;
* a training step whose parameters are fed every step (`train-graph --optimizer`, or a training
  loop feeding new weights) has no constant weight: plain convolutions in the default session too.

Here each eligible Conv is written out as the layout transformer would write it, with the weight's
reordering in the graph (the filters padded to whole blocks, ONNX Runtime's ReorderInput blocking
the weight's input channels, one Transpose moving each block of filters innermost), so it works for
fed weights and survives any optimization level:

    ReorderInput(x) -> com.microsoft.nchwc.Conv(x_blocked, w_blocked[, b_padded]) -> ReorderOutput(channels=F)

Which Convs (`eligible`): two spatial axes, static shapes, explicit pads (auto_pad NOTSET), and
either ungrouped with input channels a multiple of the block over enough output pixels
(`MIN_OUTPUT_PIXELS`, or `MIN_OUTPUT_PIXELS_COMPUTED_WEIGHT` for a weight computed in the graph),
or depthwise (one filter per channel, channels a multiple of the block). The weight layouts are
ONNX Runtime's: OIHWBiBo for an ungrouped Conv ([F/B, C/B, kh, kw, B_in, B_out], the filters
padded with zeros to a multiple of B), OIHWBo for a depthwise one ([C/B, 1, kh, kw, B]); `block_size` reads both, and the block size, from what ONNX
Runtime's own transformer writes for a probe model on this machine (16 here, an AVX-512 machine).

The blocked layout is tied to the machine's vector width, as ONNX Runtime's own saved level-ALL
models are (it warns so). A graph written here carries a check that fails a run loudly on a
machine with another block size (`_guard`: ReorderInput of 4 zero channels is reshaped to the
block size written here, on the first blocked weight's path) instead of computing with a misread
weight, and records the block size in its metadata (`BLOCK_KEY`).
"""
from __future__ import annotations

import functools
import os
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphopt.onnx_ops import STANDARD_DOMAINS

from .graph_util import Names

NCHWC_DOMAIN = "com.microsoft.nchwc"
# An ungrouped Conv is written blocked where its output has at least this many pixels (batch x height
# x width): its weight is reordered every step (in graphopt's sessions and for fed weights), a pass
# or two over the weight, against a compute of as many multiply-adds per weight element as output
# pixels. On resnet50 (the corpus at its full size) with every size blocked, the reorders and the
# flipped weights of the input gradients' Convs took more than the blocked kernels saved: by hand,
# its step blocked over plain at two threads 1.19x in the default session and 1.25x with
# optimizations off; with this threshold 1.05x and 1.02x. A depthwise Conv's weight is a pass over
# a few thousand elements, its blocked kernel several times faster: any size.
MIN_OUTPUT_PIXELS = 2048
# ... and where its weight is computed in the graph (an input gradient's flipped weight): no session
# prepacks such a weight, and the input gradient's other form is ONNX Runtime's ConvTranspose, slower
# than the blocked kernel at small maps too. Measured by hand (onnxruntime 1.32, two threads, the
# gradient alone, the blocked kernel's weight prepacked): 3 x 3 over 64-256 channels at 256-1024
# pixels, 0.49-0.72x ConvTranspose's time (0.64-0.80x at one thread); whole steps with 512 against
# 2048 here: the resnet example 0.986x at two threads and 0.974x at one, resnet50 1.004x.
MIN_OUTPUT_PIXELS_COMPUTED_WEIGHT = 512
BLOCK_KEY = "graphopt.nchwc_block"


@functools.lru_cache(maxsize=None)
def block_size() -> int | None:
    """The channel block of ONNX Runtime's NCHWc kernels on this machine: the filters of a 1 x 1 Conv
    with one filter, as ONNX Runtime's layout transformer pads them (None: it wrote no NCHWc Conv,
    or its weight layouts are not the ones this module writes)."""
    import onnxruntime as ort
    channels = 64
    rng = np.random.default_rng(0)
    probes = {"dense": (rng.standard_normal((1, channels, 1, 1)).astype(np.float32), 1),
              "depthwise": (rng.standard_normal((channels, 1, 3, 3)).astype(np.float32), channels)}
    found = {}
    for kind, (weight, group) in probes.items():
        graph = helper.make_graph(
            [helper.make_node("Conv", ["x", "w"], ["y"], group=group, pads=[1, 1, 1, 1] if group > 1 else [0] * 4)],
            "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 4, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(weight, "w")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        with tempfile.TemporaryDirectory() as tmp:
            options.optimized_model_filepath = os.path.join(tmp, "probe.onnx")
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            optimized = onnx.load(options.optimized_model_filepath)
        convs = [n for n in optimized.graph.node if n.domain == NCHWC_DOMAIN and n.op_type == "Conv"]
        blocked = {t.name: numpy_helper.to_array(t) for t in optimized.graph.initializer}
        if len(convs) != 1 or convs[0].input[1] not in blocked:
            return None
        found[kind] = blocked[convs[0].input[1]]
    block = int(found["dense"].shape[0])
    if block < 4 or channels % block:
        return None
    # the layouts this module writes must be the ones ONNX Runtime wrote
    dense = np.zeros((block, channels, 1, 1), np.float32)
    dense[:1] = probes["dense"][0]
    if not np.array_equal(_dense_layout(dense, block), found["dense"]):
        return None
    if not np.array_equal(_depthwise_layout(probes["depthwise"][0], block), found["depthwise"]):
        return None
    return block


def _dense_layout(weight: np.ndarray, block: int) -> np.ndarray:
    """numpy twin of the dense reorder written in the graph (filters already padded)."""
    f, c, kh, kw = weight.shape
    return weight.reshape(f // block, block, c // block, block, kh, kw).transpose(0, 2, 4, 5, 3, 1).reshape(f, c, kh, kw)


def _depthwise_layout(weight: np.ndarray, block: int) -> np.ndarray:
    c, _, kh, kw = weight.shape
    return weight.reshape(c // block, block, 1, kh, kw).transpose(0, 2, 3, 4, 1).reshape(c, 1, kh, kw)


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def eligible(node, shapes: dict, block: int, computed_weight: bool = False) -> str | None:
    """'dense' or 'depthwise' where `node` is a Conv written blocked here (the module docstring), else
    None; `computed_weight`: its weight is computed in the graph (MIN_OUTPUT_PIXELS_COMPUTED_WEIGHT)."""
    if node.op_type != "Conv" or node.domain not in STANDARD_DOMAINS or len(node.input) < 2:
        return None
    x, w = shapes.get(node.input[0]), shapes.get(node.input[1])
    if x is None or w is None or len(x) != 4 or len(w) != 4 or None in x or None in w:
        return None
    attrs = _attrs(node)
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    if w[2] * w[3] == 1:   # a 1 x 1 Conv is one matrix product in ONNX Runtime's plain kernel
        return None
    group, channels = int(attrs.get("group", 1)), x[1]
    if channels % block or w[1] * group != channels:
        return None
    if group == 1:
        y = shapes.get(node.output[0])
        least = MIN_OUTPUT_PIXELS_COMPUTED_WEIGHT if computed_weight else MIN_OUTPUT_PIXELS
        if y is None or len(y) != 4 or None in y or y[0] * y[2] * y[3] < least:
            return None
        return "dense"
    if group == channels == w[0] and w[1] == 1:
        return "depthwise"
    return None


def blocked_convs(model: onnx.ModelProto, shapes: dict[str, list], block: int | None = None) -> int:
    """Each eligible Conv of `model`'s top-level graph (`eligible`) rewritten in the blocked layout
    (the module docstring), in place; `shapes`: every value's static shape. Returns how many.

    Only Convs whose weight is computed from constants and parameters alone: not from the
    graph's data inputs (those not initializers), as the whole-map weight gradient's Conv reads
    the output's adjoint as its weight, a tensor of the batch's size, which a reorder per step
    would copy, and whose batch a reduced twin (graphopt/reduced.py) must find in the weight."""
    block = block or block_size()
    if block is None:
        return 0
    graph = model.graph
    names = Names(model)
    elem_types = _elem_types(model)
    from_data = _downstream(graph, {v.name for v in graph.input} - {t.name for t in graph.initializer})
    nodes, rewritten, guard = [], 0, None
    produced = {o for n in graph.node for o in n.output}
    for node in graph.node:
        kind = eligible(node, shapes, block, computed_weight=len(node.input) > 1 and node.input[1] in produced)
        if (kind is None or node.input[1] in from_data
                or elem_types.get(node.input[0], TensorProto.FLOAT) != TensorProto.FLOAT):
            nodes.append(node)
            continue
        x_shape, w_shape = shapes[node.input[0]], shapes[node.input[1]]
        y_shape = shapes.get(node.output[0])
        filters, kh, kw = w_shape[0], w_shape[2], w_shape[3]
        padded = -(-filters // block) * block
        stem = node.name or node.output[0]

        def const(values, what):
            name = names.fresh(f"{stem}_{what}")
            graph.initializer.append(numpy_helper.from_array(np.array(values, dtype=np.int64), name))
            return name

        def add(op, inputs, what, domain="", **attrs):
            out = names.fresh(f"{stem}_{what}")
            nodes.append(helper.make_node(op, inputs, [out], name=names.fresh(f"{stem}_{what}"), domain=domain, **attrs))
            return out

        weight = node.input[1]
        if kind == "dense":
            # OIHWBiBo: ONNX Runtime's own ReorderInput blocks the input channels ([F, C/B, kh, kw, B]
            # in memory), then one Transpose moves each block of B filters innermost
            if padded != filters:
                weight = add("Pad", [weight, const([0, 0, 0, 0, padded - filters, 0, 0, 0], "filter_pads")], "filters_padded")
            weight = add("ReorderInput", [weight], "filter_channels_blocked", domain=NCHWC_DOMAIN)
            split = add("Reshape", [weight, const([padded // block, block, -1], "filter_blocks")], "filter_blocks")
            whole = [padded, x_shape[1], kh, kw]
        else:
            # OIHWBo: each block of B filters innermost
            split = add("Reshape", [weight, const([filters // block, block, -1], "filter_blocks")], "filter_blocks")
            whole = [filters, 1, kh, kw]
        reordered = add("Transpose", [split], "filter_reordered", perm=[0, 2, 1])   # [..., block]
        if guard is None:
            # the first blocked weight goes through the check: zeros of the block written here added
            # along the block axis (one small Add, and the check stays on the graph's data path)
            guard = _guard(graph, names, nodes, block)
            reordered = add("Add", [reordered, guard], "filter_checked")
        blocked_weight = add("Reshape", [reordered, const(whole, "filter_shape")], "filter_blocked")
        inputs = [add("ReorderInput", [node.input[0]], "input_blocked", domain=NCHWC_DOMAIN), blocked_weight]
        if len(node.input) > 2 and node.input[2]:
            bias = node.input[2]
            if padded != filters:
                bias = add("Pad", [bias, const([0, padded - filters], "bias_pads")], "bias_padded")
            inputs.append(bias)
        attrs = {k: v for k, v in _attrs(node).items() if k in ("strides", "dilations", "pads", "group")}
        out_blocked = add("Conv", inputs, "output_blocked", domain=NCHWC_DOMAIN, **attrs)
        nodes.append(helper.make_node("ReorderOutput", [out_blocked], list(node.output[:1]), name=names.fresh(stem),
                                      domain=NCHWC_DOMAIN, channels=filters))
        # the blocked input's logical shape is the input's (its channels fill whole blocks)
        graph.value_info.append(helper.make_tensor_value_info(inputs[0], TensorProto.FLOAT, list(x_shape)))
        if y_shape is not None:
            graph.value_info.append(helper.make_tensor_value_info(
                out_blocked, TensorProto.FLOAT, [y_shape[0], padded] + list(y_shape[2:])))
            if not any(v.name == node.output[0] for v in graph.value_info):
                graph.value_info.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, list(y_shape)))
        rewritten += 1
    if rewritten:
        graph.ClearField("node")
        graph.node.extend(nodes)
        if not any(o.domain == NCHWC_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(NCHWC_DOMAIN, 1))
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, BLOCK_KEY: str(block)})
    return rewritten


def _guard(graph, names: Names, nodes: list, block: int) -> str:
    """Zeros of shape [block]: ReorderInput of 4 zero channels (padded by ONNX Runtime to its own
    block) reshaped to this block, so that a run on a machine with another block fails here."""
    zeros = names.fresh("nchwc_probe")
    graph.initializer.append(numpy_helper.from_array(np.zeros((1, 4, 1, 1), np.float32), zeros))
    shape = names.fresh("nchwc_block_shape")
    graph.initializer.append(numpy_helper.from_array(np.array([block], dtype=np.int64), shape))
    blocked = names.fresh("nchwc_probe_blocked")
    nodes.append(helper.make_node("ReorderInput", [zeros], [blocked], name=blocked, domain=NCHWC_DOMAIN))
    guard = names.fresh(f"nchwc_block_{block}_check")
    nodes.append(helper.make_node("Reshape", [blocked, shape], [guard], name=guard))
    return guard


def _downstream(graph, sources: set) -> set:
    """The values computed (in the file's order) from any of `sources`, the sources included."""
    reached = set(sources)
    for node in graph.node:
        if any(name in reached for name in node.input):
            reached.update(o for o in node.output if o)
    return reached


def _elem_types(model) -> dict:
    types = {}
    for v in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if v.type.HasField("tensor_type"):
            types[v.name] = v.type.tensor_type.elem_type
    for t in model.graph.initializer:
        types[t.name] = t.data_type
    return types
