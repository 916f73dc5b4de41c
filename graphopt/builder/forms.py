"""Where the builder can write a gradient in more than one form, the form that is faster on the
provider the graph is built for, measured there.

A Conv's weight gradient is written per kernel tap (matrix products: `rules.per_tap_weight_gradient`)
or over the whole map (one convolution of the input with the output's adjoint). Which is faster
depends on the device: per tap was chosen by a rule measured on the CPU (`rules.per_tap_applies`),
and on an H200 the whole-map form was faster on two of the four CNN examples (docs/gpu.md).

`build_for_provider` builds a forward model's training graph (`train_graph.build_training_graph`)
with each Conv weight gradient in its faster form there: `measured_per_tap_choices` times both
forms of each distinct Conv of the forward (input, output and kernel shapes, group) on the provider: a model of that Conv alone with a sum as its
loss, built into a training graph once per form, each run on the device (inputs and outputs bound
there: graphopt/runtime/replay.py) to its median step; the two steps differ only in the weight
gradient's form. The rule's form is kept unless the other is faster by more than `MARGIN` (a
choice the measurement cannot tell apart stays what the CPU's rule says). The choices go to the
build through `rules.per_tap_choices`; what was measured and chosen, to the model's metadata
(`FORMS_KEY`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import rules
from .graph_util import infer_shapes
from .train_graph import build_training_graph

log = logging.getLogger(__name__)

# the other form is taken where it is faster by more than this fraction of the rule's
MARGIN = 0.05
FORMS_KEY = "graphopt.forms"   # metadata: the gradient forms measured and chosen (`build_for_provider`)


@dataclass(frozen=True)
class ConvShape:
    """What decides a Conv weight gradient's cost: the shapes, the attributes, the element type."""
    input_shape: tuple
    output_shape: tuple
    weight_shape: tuple
    strides: tuple
    dilations: tuple
    pads: tuple
    group: int
    elem_type: int

    @property
    def key(self) -> tuple:
        return rules.per_tap_key(self.input_shape, self.output_shape, self.weight_shape[2:], self.group)


def conv_shapes(model: onnx.ModelProto, shapes: dict[str, list], elem_types: dict[str, int]) -> list[ConvShape]:
    """The distinct Convs of `model` whose weight gradient could be written per tap, from the static
    `shapes` of its values (shape inference) and their element types."""
    found: dict[tuple, ConvShape] = {}
    for node in model.graph.node:
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        x, w, y = node.input[0], node.input[1], node.output[0]
        x_shape, w_shape, y_shape = shapes.get(x), shapes.get(w), shapes.get(y)
        if x_shape is None or w_shape is None or y_shape is None:
            continue
        spatial = len(w_shape) - 2
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            continue   # (pads the build would work out itself: left to the rule)
        group = int(attrs.get("group", 1))
        if not rules.per_tap_possible(x_shape, y_shape, w_shape[2:], group):
            continue
        shape = ConvShape(tuple(x_shape), tuple(y_shape), tuple(w_shape),
                          tuple(attrs.get("strides", [1] * spatial)), tuple(attrs.get("dilations", [1] * spatial)),
                          tuple(attrs.get("pads", [0] * 2 * spatial)), group, elem_types.get(x, TensorProto.FLOAT))
        found.setdefault(shape.key + (shape.elem_type,), shape)
    return list(found.values())


def _conv_alone(shape: ConvShape) -> onnx.ModelProto:
    """The forward of one Conv, its output summed as the loss; the input fed, the weight trained."""
    dtype = helper.tensor_dtype_to_np_dtype(shape.elem_type)
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal(shape.weight_shape).astype(dtype) * 0.1, "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], strides=list(shape.strides),
                              dilations=list(shape.dilations), pads=list(shape.pads), group=shape.group),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "conv_alone",
                              [helper.make_tensor_value_info("x", shape.elem_type, list(shape.input_shape))],
                              [helper.make_tensor_value_info("loss", shape.elem_type, [])], initializer=[weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def step_seconds(shape: ConvShape, per_tap: bool, providers: list, threads: int) -> float:
    """The median step of `shape`'s Conv alone built with its weight gradient in one form."""
    from graphopt.runtime.replay import median_run_seconds
    training = build_training_graph(_conv_alone(shape), per_tap_choices={shape.key: per_tap})
    dtype = helper.tensor_dtype_to_np_dtype(shape.elem_type)
    feeds = {"x": np.random.default_rng(1).uniform(0.5, 1.5, size=shape.input_shape).astype(dtype)}
    return median_run_seconds(training, feeds, providers, threads)


def measured_per_tap_choices(shapes: list[ConvShape], providers: list, threads: int = 1
                             ) -> tuple[dict[tuple, bool], list[dict]]:
    """For each of `shapes`, whether its weight gradient is written per tap (module docstring), and
    what was measured: per shape, both steps' seconds, the rule's form and the one chosen."""
    import onnxruntime as ort
    from graphopt.errors import InvalidOptionError
    provider = providers[0]
    if provider not in ort.get_available_providers():
        raise InvalidOptionError(f"execution provider {provider!r} is not available here "
                                 f"(available: {ort.get_available_providers()})")
    choices: dict[tuple, bool] = {}
    measured: list[dict] = []
    for shape in shapes:
        rule = rules.per_tap_applies(shape.input_shape, shape.output_shape, shape.weight_shape[2:], shape.group)
        per_tap = step_seconds(shape, True, providers, threads)
        whole = step_seconds(shape, False, providers, threads)
        ours, other = (per_tap, whole) if rule else (whole, per_tap)
        chosen = rule if other >= ours * (1 - MARGIN) else not rule
        choices[shape.key] = chosen
        measured.append({"input_shape": list(shape.input_shape), "weight_shape": list(shape.weight_shape),
                         "group": shape.group, "per_tap_seconds": per_tap, "whole_map_seconds": whole,
                         "rule_per_tap": rule, "per_tap": chosen})
        log.info("Conv %s * %s: per tap %.3g s, whole map %.3g s: %s", shape.input_shape, shape.weight_shape,
                 per_tap, whole, "per tap" if chosen else "whole map")
    return choices, measured


def _static(model: onnx.ModelProto) -> tuple[dict[str, tuple], dict[str, int]]:
    """Every value's static shape and element type, by ONNX shape inference."""
    inferred = infer_shapes(model)
    shapes: dict[str, tuple] = {t.name: tuple(t.dims) for t in inferred.graph.initializer}
    types: dict[str, int] = {t.name: t.data_type for t in inferred.graph.initializer}
    for value in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            continue
        types.setdefault(value.name, tensor.elem_type)
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in tensor.shape.dim):
            shapes.setdefault(value.name, tuple(d.dim_value for d in tensor.shape.dim))
    return shapes, types


def build_for_provider(forward: onnx.ModelProto, provider: str, threads: int = 1, **build) -> onnx.ModelProto:
    """`build_training_graph(forward, **build)` with each Conv weight gradient in the form measured
    faster on `provider` at `threads` (module docstring); what was measured in the model's
    metadata under `FORMS_KEY`."""
    shapes, types = _static(forward)
    providers = [provider] + (["CPUExecutionProvider"] if provider != "CPUExecutionProvider" else [])
    # the blocked convolutions are kernels of ONNX Runtime's CPU provider (blocked_convs.py)
    with rules.blocked_layout(rules.BLOCKED_CONVS and provider == "CPUExecutionProvider"):
        choices, measured = measured_per_tap_choices(conv_shapes(forward, shapes, types), providers, threads)
        model = build_training_graph(forward, per_tap_choices=choices, **build)
    helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                   FORMS_KEY: json.dumps({"provider": provider, "threads": threads,
                                                          "conv_weight_gradients": measured})})
    return model
