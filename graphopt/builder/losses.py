"""Losses the builder puts on a forward model that returns a prediction.

    cross_entropy   class indices in `labels` (int64); mean over every labelled position,
                    like torch.nn.functional.cross_entropy. The class axis is 1 for rank-2
                    logits and the last axis for higher ranks (language-model heads),
                    unless `class_axis` says otherwise.
    mse             a float `labels` shaped like the prediction; mean of squared differences.
    output:NAME     the model computes its scalar loss itself, as output NAME.

The prediction is the forward model's first output. Ops are standard ONNX (opset >= 13).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphopt.errors import InvalidModelError, InvalidOptionError

from .graph_util import Names, infer_shapes

LOSS_KINDS = ("cross_entropy", "mse", "output:NAME")
LOSS_NAME = "loss"


def parse_loss(kind: str | None) -> tuple[str, str | None]:
    """('output', NAME or None) | ('cross_entropy', None) | ('mse', None)."""
    if kind is None:
        return "output", None
    if kind in ("cross_entropy", "mse"):
        return kind, None
    if kind.startswith("output:") and kind[len("output:"):]:
        return "output", kind[len("output:"):]
    raise InvalidOptionError(f"unknown loss {kind!r}: use one of {', '.join(LOSS_KINDS)}")


def _value_info(model: onnx.ModelProto, name: str):
    for value in list(model.graph.output) + list(model.graph.value_info) + list(model.graph.input):
        if value.name == name and value.type.HasField("tensor_type"):
            return value.type.tensor_type
    return None


@dataclass
class CrossEntropyParts:
    """What the lean cross-entropy gradient reads from the loss attach_loss wrote."""
    prediction: str             # the model's output (logits)
    prediction_shape: list[int]
    perm: list[int] | None      # Transpose putting the class axis last, or None
    log_probs: str              # LogSoftmax of the rows of classes [N, C]
    column: str                 # the labels as a column [N, 1] (int64)
    rows: int                   # N, the positions the mean is over
    elem_type: int


def attach_loss(model: onnx.ModelProto, kind: str, labels: str = "labels",
                class_axis: int | None = None) -> onnx.ModelProto:
    """A copy of `model` whose outputs are the scalar `loss` alone, computed from its first
    output and a new `labels` input."""
    return attach_loss_parts(model, kind, labels, class_axis)[0]


def attach_loss_parts(model: onnx.ModelProto, kind: str, labels: str = "labels",
                      class_axis: int | None = None) -> tuple[onnx.ModelProto, CrossEntropyParts | None]:
    """attach_loss, and for cross_entropy the names cross_entropy_seed needs."""
    if not model.graph.output:
        raise InvalidModelError("the forward model has no outputs, so no prediction to put a loss on")
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    prediction = graph.output[0].name
    names = Names(result)
    taken = names.taken
    if labels in taken:
        raise InvalidModelError(f"the model already has a tensor named {labels!r}; pick another --labels name")
    if LOSS_NAME in taken:
        raise InvalidModelError(f"the model already has a tensor named {LOSS_NAME!r}; "
                                f"if it is the loss, use --loss output:{LOSS_NAME}")
    taken.add(labels)
    inferred = infer_shapes(result, strict_mode=False)     # on the skeleton: any size
    info = _value_info(inferred, prediction)
    if info is None or not info.HasField("shape"):
        raise InvalidModelError(f"the shape of the prediction {prediction!r} cannot be inferred")
    rank = len(info.shape.dim)
    elem_type = info.elem_type
    if elem_type not in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16):
        raise InvalidModelError(f"the prediction {prediction!r} is not floating-point")
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in info.shape.dim]
    nodes, inits = [], []
    parts = None

    def const(stem, array):
        name = names.fresh(stem)
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(op, inputs, stem, **attrs):
        out = names.fresh(stem)
        nodes.append(helper.make_node(op, inputs, [out], name=names.fresh(f"loss/{op}"), **attrs))
        return out

    if kind == "mse":
        graph.input.append(helper.make_tensor_value_info(labels, elem_type, dims))
        diff = node("Sub", [prediction, labels], "loss/diff")
        squared = node("Mul", [diff, diff], "loss/squared")
        nodes.append(helper.make_node("ReduceMean", [squared], [LOSS_NAME], name=names.fresh("loss/mean"),
                                      keepdims=0))
    elif kind == "cross_entropy":
        if rank < 2:
            raise InvalidModelError(f"cross_entropy needs logits of rank >= 2, {prediction!r} has rank {rank}")
        axis = (1 if rank == 2 else rank - 1) if class_axis is None else class_axis % rank
        classes = dims[axis]
        if not isinstance(classes, int) or classes <= 0:
            raise InvalidModelError(f"the class axis {axis} of {prediction!r} has no static size")
        label_dims = dims[:axis] + dims[axis + 1:]
        graph.input.append(helper.make_tensor_value_info(labels, TensorProto.INT64, label_dims))
        logits = prediction
        if axis != rank - 1:  # classes last, then rows of classes
            perm = [d for d in range(rank) if d != axis] + [axis]
            logits = node("Transpose", [logits], "loss/classes_last", perm=perm)
        rows = node("Reshape", [logits, const("loss/rows_shape", np.array([-1, classes], np.int64))], "loss/rows")
        log_probs = node("LogSoftmax", [rows], "loss/log_probs", axis=1)
        column = node("Reshape", [labels, const("loss/column_shape", np.array([-1, 1], np.int64))], "loss/labels")
        picked = node("GatherElements", [log_probs, column], "loss/picked", axis=1)
        static = [d if isinstance(d, int) else None for d in dims]
        if None not in static:
            parts = CrossEntropyParts(prediction, static, perm if axis != rank - 1 else None,
                                      log_probs, column, int(np.prod(static)) // classes, elem_type)
        mean = node("ReduceMean", [picked], "loss/mean", keepdims=0)
        nodes.append(helper.make_node("Neg", [mean], [LOSS_NAME], name=names.fresh("loss/Neg")))
    else:
        raise InvalidOptionError(f"attach_loss: unknown kind {kind!r}")
    graph.node.extend(nodes)
    graph.initializer.extend(inits)
    graph.ClearField("output")
    graph.output.append(helper.make_tensor_value_info(LOSS_NAME, elem_type, []))
    return result, parts


def cross_entropy_seed(parts: CrossEntropyParts, seed: str, names: Names) -> tuple[list, list]:
    """Nodes and initializers computing `seed`, the derivative of the mean cross entropy with
    respect to the prediction, with onnx-ad's trailing seed axis of 1, as PyTorch's fused
    backward does: (softmax - onehot(labels)) / N, written so that at most two tensors of the
    logits' size are live at a time (Exp of the kept log-probabilities; the one-hot subtracted
    in place of a scatter into it; the 1/N scale), where reverse mode through LogSoftmax,
    GatherElements and ReduceMean keeps zeros, a scattered copy, the softmax, a product and a
    difference of that size."""
    dtype = helper.tensor_dtype_to_np_dtype(parts.elem_type)
    nodes, inits = [], []

    def const(stem, array):
        name = names.fresh(stem)
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(op, inputs, stem, output=None, **attrs):
        out = output or names.fresh(stem)
        nodes.append(helper.make_node(op, inputs, [out], name=names.fresh(f"loss_grad/{op}"), **attrs))
        return out

    probs = node("Exp", [parts.log_probs], "loss_grad/probs")
    minus_one = const("loss_grad/minus_one", np.full((parts.rows, 1), -1, dtype))
    shifted = node("ScatterElements", [probs, parts.column, minus_one], "loss_grad/probs_minus_onehot",
                   axis=1, reduction="add")
    scaled = node("Mul", [shifted, const("loss_grad/inverse_rows", np.array(1.0 / parts.rows, dtype))],
                  "loss_grad/rows")
    if parts.perm:
        moved = [parts.prediction_shape[a] for a in parts.perm]
        grid = node("Reshape", [scaled, const("loss_grad/classes_last_shape", np.array(moved, np.int64))],
                    "loss_grad/classes_last")
        inverse = [parts.perm.index(a) for a in range(len(parts.perm))]
        scaled = node("Transpose", [grid], "loss_grad/prediction", perm=inverse)
    node("Reshape", [scaled, const("loss_grad/seed_shape", np.array(parts.prediction_shape + [1], np.int64))],
         "loss_grad/seed", output=seed)
    return nodes, inits
