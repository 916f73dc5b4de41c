"""Build a training graph (forward + reverse-mode backward in standard ONNX ops) from a
forward model whose output is a scalar loss.

The training graph has the forward's data inputs (data, labels, ...), the parameters as
initializers, and the outputs ``loss`` (first) then one ``<param>_grad`` per parameter,
shaped exactly like the parameter. It runs on a stock onnxruntime wheel.

The backward pass is produced by ``onnx_ad.reverse`` (layout ``"onnx"``). onnx-ad
differentiates graph *inputs* and works with a trailing seed axis, so this module

* exposes the parameters as graph inputs for the reverse pass and turns them back into
  initializers afterwards,
* replaces the seed input (the loss adjoint) by a constant 1 initializer with a seed axis
  of size 1,
* drops the trailing seed axis from each gradient with a Reshape whose output is the
  graph output ``<param>_grad``,
* cleans up what the seed axis leaves behind once its size is known to be 1: Transposes
  that only move size-1 axes become Reshapes (aliases in ORT, no copy), no-op Expands and
  Reshapes, Identity chains and dead nodes disappear,
* gives every node a unique, non-empty name.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from graphopt.errors import InvalidModelError, UnsupportedOpError
from graphopt.analyze import implicit_inputs
from graphopt.ingest import name_nodes
from graphopt.runtime.session import UNOPTIMIZED_SETTINGS, write_settings
from graphopt.runtime.weights import Weights, is_stub

from . import rules
from .deterministic import scatter_nd_rows_to_elements, static_shapes
from .graph_util import Names, infer_shapes, sequence_splits_to_split, skeleton_check, small_constants
from .embedding_grad import lean_embedding_gradients
from .blocked_convs import blocked_convs
from .short_spans import short_spans_expanded
from .unit_axes import unit_axes_dropped
from .lean import (gradients_early, loss_first, masks_as_products, outputs_written_in_place, pads_sum_to_concat,
                   sums_as_adds, sums_as_produced,
                   recompute_gelu_intermediates, transposed_products,
                   transposed_weights_into_gemm)
from .file_order import default_order, leanest_file_order, peak_places, place_updates, static_tensor_bytes
from .optimizer import CHUNK_BYTES, OptimizerSpec, fuse_optimizer
from .losses import LOSS_NAME, attach_loss_parts, cross_entropy_seed, parse_loss
from .training_mode import batchnorm_training, copy_statistics_inputs, dropout_training
from graphopt.onnx_ops import FLOAT_TYPES, STANDARD_DOMAINS

__all__ = ["build_training_graph", "cleanup_graph"]



# --------------------------------------------------------------------------- helpers --

def _node_reads(node):
    """Explicit inputs plus the outer names any subgraph captures."""
    return {name for name in node.input if name} | set(implicit_inputs(node))


def _elem_types(model):
    """name -> ONNX element type, from initializers, inputs, outputs and inferred info."""
    types = {}
    for tensor in model.graph.initializer:
        types[tensor.name] = tensor.data_type
    for value in (list(model.graph.input) + list(model.graph.output)
                  + list(model.graph.value_info)):
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types.setdefault(value.name, value.type.tensor_type.elem_type)
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    types.setdefault(node.output[0], attribute.t.data_type)
    return types


def _static_shapes(model):
    """name -> tuple of ints for every value whose shape is fully static."""
    shapes = {}
    for tensor in model.graph.initializer:
        shapes[tensor.name] = tuple(tensor.dims)
    for value in (list(model.graph.input) + list(model.graph.output)
                  + list(model.graph.value_info)):
        tensor_type = value.type.tensor_type
        if not tensor_type.HasField("shape"):
            continue
        dims = []
        for d in tensor_type.shape.dim:
            if d.WhichOneof("value") != "dim_value":
                dims = None
                break
            dims.append(d.dim_value)
        if dims is not None:
            shapes.setdefault(value.name, tuple(dims))
    return shapes


def _infer(model, data_prop=True):
    try:
        return infer_shapes(model, strict_mode=False, data_prop=data_prop)
    except Exception:
        try:
            return infer_shapes(model, strict_mode=False)
        except Exception:
            return model


# -------------------------------------------------------------------- cleanup pass --

def _is_trivial_transpose(perm, in_shape):
    """True when the permutation only moves size-1 axes (the data order is unchanged)."""
    kept = [axis for axis in perm if in_shape[axis] != 1]
    return kept == sorted(kept)


def cleanup_graph(model: onnx.ModelProto, max_rounds: int = 8) -> onnx.ModelProto:
    """Remove cheap waste from a graph with static shapes; returns a new model.

    * ``Transpose`` that only moves size-1 axes -> ``Reshape`` (an alias in ORT).
    * ``Transpose(Transpose(x))`` -> one ``Transpose`` of x, or x itself (then a weight's
      gradient reads the weight, not a transposed copy kept from the forward).
    * ``Expand`` / ``Reshape`` / ``Squeeze`` / ``Unsqueeze`` to the shape the input
      already has -> removed.
    * ``Reshape(Reshape(x))`` -> ``Reshape(x)``.
    * ``Identity`` chains -> removed (a graph output keeps its name).
    * Dead nodes and unused initializers -> removed.
    """
    result = onnx.ModelProto()
    result.CopyFrom(model)
    for _ in range(max_rounds):
        changed = _cleanup_round(result)
        changed |= _dead_code(result)
        if not changed:
            break
    _drop_unused_initializers(result)
    return result


def _cleanup_round(model):
    graph = model.graph
    inferred = _infer(model)
    shapes = _static_shapes(inferred)
    consts = small_constants(model)
    outputs = {v.name for v in graph.output}
    producers = {o: n for n in graph.node for o in n.output if o}
    shape_consts = {}
    new_inits = []
    taken = {t.name for t in graph.initializer} | {v.name for v in graph.input} | \
        {o for n in graph.node for o in n.output}

    def shape_const(shape):
        key = tuple(int(d) for d in shape)
        if key not in shape_consts:
            base = "shape_" + "x".join(str(d) for d in key) if key else "shape_scalar"
            name, k = base, 0
            while name in taken:
                k += 1
                name = "%s_%d" % (base, k)
            taken.add(name)
            new_inits.append(numpy_helper.from_array(np.array(key, dtype=np.int64), name))
            shape_consts[key] = name
        return shape_consts[key]

    alias = {}  # output name -> name it is equal to (node removed)
    new_nodes = []
    changed = False
    for node in graph.node:
        for i, name in enumerate(node.input):
            while name in alias:
                name = alias[name]
            if name != node.input[i]:
                node.input[i] = name
                changed = True
        op = node.op_type
        if node.domain not in STANDARD_DOMAINS:
            new_nodes.append(node)
            continue
        src = node.input[0] if node.input else None
        out = node.output[0] if node.output else None
        in_shape = shapes.get(src)
        out_shape = shapes.get(out)
        same = in_shape is not None and out_shape is not None and in_shape == out_shape
        removable = out not in outputs
        if op == "Identity" and removable:
            alias[out] = src
            changed = True
            continue
        if op in ("Expand", "Reshape", "Squeeze", "Unsqueeze", "Flatten") and same \
                and removable and len(node.output) == 1:
            alias[out] = src
            changed = True
            continue
        inner = producers.get(src) if op == "Transpose" else None
        if inner is not None and inner.op_type == "Transpose" and inner.domain in STANDARD_DOMAINS \
                and shapes.get(inner.input[0]) is not None:
            # Transpose(Transpose(x, p), q) = Transpose(x, p[q]); the identity when that is sorted
            rank = len(shapes[inner.input[0]])
            p_perm = next((list(a.ints) for a in inner.attribute if a.name == "perm"), list(reversed(range(rank))))
            q_perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), list(reversed(range(rank))))
            composed = [p_perm[i] for i in q_perm]
            source = inner.input[0]
            while source in alias:
                source = alias[source]
            if composed == list(range(rank)) and removable:
                alias[out] = source
            else:
                new_nodes.append(helper.make_node("Transpose", [source], [out], name=node.name, perm=composed))
            changed = True
            continue
        if op == "Transpose" and in_shape is not None and out_shape is not None:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"),
                        list(reversed(range(len(in_shape)))))
            if _is_trivial_transpose(perm, in_shape):
                if removable and in_shape == out_shape:
                    alias[out] = src
                else:
                    new_nodes.append(helper.make_node(
                        "Reshape", [src, shape_const(out_shape)], [out], name=node.name))
                changed = True
                continue
        if op == "Reshape" and out_shape is not None and 0 not in out_shape:
            # collapse chains and pin the target to the static shape
            source = src
            producer = producers.get(source)
            while producer is not None and producer.op_type in ("Reshape", "Flatten",
                                                                "Squeeze", "Unsqueeze",
                                                                "Identity") \
                    and producer.domain in STANDARD_DOMAINS:
                source = producer.input[0]
                while source in alias:
                    source = alias[source]
                producer = producers.get(source)
            target = node.input[1]
            if source != src or (target not in consts and target not in shape_consts.values()):
                target = shape_const(out_shape)
                new_nodes.append(helper.make_node("Reshape", [source, target], [out],
                                                  name=node.name))
                changed = True
                continue
        new_nodes.append(node)
    # graph outputs that are aliases of something removed: impossible (we never remove
    # a node whose output is a graph output), but an output may read an alias name
    graph.ClearField("node")
    graph.node.extend(new_nodes)
    graph.initializer.extend(new_inits)
    return changed


def _dead_code(model):
    graph = model.graph
    needed = {v.name for v in graph.output}
    keep = []
    for node in reversed(list(graph.node)):
        if any(o in needed for o in node.output if o):
            keep.append(node)
            needed |= _node_reads(node)
    keep.reverse()
    if len(keep) == len(graph.node):
        return False
    graph.ClearField("node")
    graph.node.extend(keep)
    return True


def _drop_unused_initializers(model):
    graph = model.graph
    used = {v.name for v in graph.output}
    for node in graph.node:
        used |= _node_reads(node)
    kept = [t for t in graph.initializer if t.name in used]
    if len(kept) != len(graph.initializer):
        graph.ClearField("initializer")
        graph.initializer.extend(kept)
    inputs = [v for v in graph.input if v.name in used]
    if len(inputs) != len(graph.input):
        graph.ClearField("input")
        graph.input.extend(inputs)


# ------------------------------------------------------------------ main function --

def _loss_name(model, loss):
    outputs = [v.name for v in model.graph.output]
    if not outputs:
        raise InvalidModelError("the forward model has no outputs, so no loss")
    if loss is None:
        return "loss" if "loss" in outputs else outputs[0]
    if loss not in outputs:
        produced = {o for n in model.graph.node for o in n.output}
        if loss not in produced:
            raise InvalidModelError("loss '%s' is not an output of the forward model" % loss)
    return loss


# floating-point operand slots no derivative flows through (sizes, scales, ratios)
_NON_DIFFERENTIABLE_SLOTS = {"Resize": {1, 2, 3}, "Upsample": {1}, "Dropout": {1, 2},
                             "BatchNormalization": {3, 4},
                             "ConstantOfShape": {0}, "EyeLike": {0},
                             "RandomNormalLike": {0}, "RandomUniformLike": {0},
                             "Bernoulli": {0}, "Multinomial": {0}}


def _float_ancestors(model, loss, types):
    """Names a floating-point derivative can flow from into `loss`."""
    needed = {loss}
    for node in reversed(list(model.graph.node)):
        if not any(o in needed and types.get(o, TensorProto.FLOAT) in FLOAT_TYPES
                   for o in node.output if o):
            continue
        skip = _NON_DIFFERENTIABLE_SLOTS.get(node.op_type, set()) \
            if node.domain in STANDARD_DOMAINS else set()
        explicit = {name for i, name in enumerate(node.input) if name and i not in skip}
        for name in explicit | (_node_reads(node) - set(node.input)):
            if types.get(name, TensorProto.FLOAT) in FLOAT_TYPES:
                needed.add(name)
    return needed


def _check_ops(model, reaching):
    """Custom-domain operators on the path from a parameter to the loss: not supported."""
    for node in model.graph.node:
        if node.domain not in STANDARD_DOMAINS and (_node_reads(node) & reaching):
            raise UnsupportedOpError(
                "operator %s:%s (node '%s') has no gradient rule"
                % (node.domain, node.op_type, node.name or node.output[0]))


def build_training_graph(forward: onnx.ModelProto, loss: str | None = None,
                         parameters: list[str] | None = None,
                         freeze: list[str] = (), labels: str = "labels",
                         class_axis: int | None = None,
                         optimizer: OptimizerSpec | None = None,
                         weights: Weights | None = None,
                         per_tap_choices: dict | None = None) -> onnx.ModelProto:
    """The training graph of `forward`: outputs ``loss``, then ``<param>_grad`` per parameter,
    then the extra outputs of training-mode layers (updated BatchNormalization statistics
    ``<stat>_updated``, Dropout masks).

    `loss`: ``cross_entropy`` or ``mse`` put that loss on the forward's first output against a
    new input `labels` (see graphopt/builder/losses.py); ``output:NAME`` (or None: the output
    named ``loss``, else the first output) takes the scalar loss the model computes.
    `parameters` defaults to every floating-point initializer from which a derivative reaches
    the loss, minus `freeze`. BatchNormalization and Dropout run in training mode
    (graphopt/builder/training_mode.py).

    `optimizer`: the update of each parameter in the graph instead of its gradient as an output
    (graphopt/builder/optimizer.py): inputs the parameters and optimizer state, outputs ``loss``
    then every ``<input>_updated``.

    `weights`: the builder works on the graph, never on the weights: each initializer of 1 MiB or
    more is a stub (graphopt/weights.py) while it builds, so that no model is serialized or copied
    with its weights, at any size. Without `weights`, the returned model holds its data (a copy of
    the forward's weights; the optimizer's state made); with it, the returned model keeps its stubs
    and `weights` their data, for `graphopt.runtime.weights.save_model` to write one tensor at a time (past
    2 GB, as external data). A forward loaded without its external data keeps its references
    either way (`weights.folder` is where they are read from when written).

    `per_tap_choices`: a Conv weight gradient's form (per kernel tap or over the whole map) by its
    `rules.per_tap_key`, where it is not the rule's (graphopt/builder/forms.py measures them on a
    provider: `build_for_provider`).

    Raises UnsupportedOpError for an operator without a gradient rule and InvalidModelError
    when the loss is not found, is not scalar-like, or no parameter reaches it.
    """
    held = weights if weights is not None else Weights()
    with rules.per_tap_choices(per_tap_choices or {}):
        model = _build(forward, loss, parameters, freeze, labels, class_axis, optimizer, held)
    if weights is None:
        held.attach(model)
    return model


def _build(forward, loss, parameters, freeze, labels, class_axis, optimizer, held):
    try:
        import onnx_ad
    except ImportError as exc:  # pragma: no cover
        raise UnsupportedOpError("onnx-ad is required to build training graphs") from exc
    if not isinstance(forward, onnx.ModelProto):
        raise InvalidModelError("forward must be an onnx.ModelProto")

    if optimizer is not None:
        optimizer.check()
    rules.register()
    kind, loss = parse_loss(loss)
    model = held.detach(forward)          # the graph copied, the weights stubs (not copied)
    sequence_splits_to_split(model)       # torch.split as the dynamo exporter writes it unoptimized
    extras = batchnorm_training(model) + dropout_training(model)
    parts = None    # cross entropy: the seed is its gradient at the prediction (losses.py)
    if kind != "output":
        model, parts = attach_loss_parts(model, kind, labels, class_axis)
        loss = LOSS_NAME
    graph = model.graph
    loss = _loss_name(model, loss)

    inferred = _infer(model)
    types = _elem_types(inferred)
    if types.get(loss, TensorProto.FLOAT) not in FLOAT_TYPES:
        raise InvalidModelError("loss '%s' is not floating-point" % loss)
    all_shapes = _static_shapes(inferred)
    loss_shape = all_shapes.get(loss)
    if loss_shape is None:
        raise InvalidModelError("the shape of loss '%s' cannot be inferred statically" % loss)
    if int(np.prod(loss_shape, dtype=np.int64)) != 1:
        raise InvalidModelError("loss '%s' has shape %s, not a scalar" % (loss, loss_shape))

    initializers = {t.name: t for t in graph.initializer}
    reaching = _float_ancestors(inferred, loss, types)
    frozen = set(freeze) | set(extras.constants)
    if parameters is None:
        params = [t.name for t in graph.initializer
                  if t.data_type in FLOAT_TYPES and t.name in reaching
                  and t.name not in frozen]
    else:
        params = [p for p in parameters if p not in frozen]
        for p in params:
            if p not in initializers:
                raise InvalidModelError("parameter '%s' is not an initializer" % p)
            if initializers[p].data_type not in FLOAT_TYPES:
                raise InvalidModelError("parameter '%s' is not floating-point" % p)
        params = [p for p in params if p in reaching]
    if not params:
        raise InvalidModelError("no trainable parameter reaches the loss '%s'" % loss)
    if len(set(params)) != len(params):
        raise InvalidModelError("duplicate parameter names")
    _check_ops(inferred, set(params) | _downstream(inferred, params))

    # loss must be a graph output with a declared shape; drop every other output
    graph.ClearField("output")
    graph.output.append(helper.make_tensor_value_info(
        loss, types.get(loss, TensorProto.FLOAT), list(loss_shape)))
    seeded = loss
    if parts is not None:
        seeded = parts.prediction
        graph.output.append(helper.make_tensor_value_info(seeded, parts.elem_type, parts.prediction_shape))

    # parameters become graph inputs for the reverse pass
    # and the frozen stubs graph inputs too (onnx-ad reads every initializer's data; theirs is
    # elsewhere): no derivative is taken for them, and _finish makes them initializers again
    param_set = set(params)
    kept_inits = [t for t in graph.initializer if t.name not in param_set and not is_stub(t)]
    frozen_stubs = [t for t in graph.initializer if t.name not in param_set and is_stub(t)]
    data_inputs = [v for v in graph.input if v.name not in param_set]
    graph.ClearField("initializer")
    graph.initializer.extend(kept_inits)
    graph.ClearField("input")
    graph.input.extend(data_inputs)
    for p in params:
        t = initializers[p]
        graph.input.append(helper.make_tensor_value_info(p, t.data_type, list(t.dims)))
    declared_inputs = {v.name for v in graph.input}
    stub_inputs = {t.name for t in frozen_stubs if t.name not in declared_inputs}
    graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                       for t in frozen_stubs if t.name in stub_inputs)
    # shapes help onnx-ad place the seed axis statically
    graph.ClearField("value_info")
    graph.value_info.extend(v for v in inferred.graph.value_info)

    try:
        # onnx-ad folds constant subgraphs with numpy; T5's relative position buckets take
        # log(0) and cast -inf to int64 where a Where discards them, as torch does: no warning
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            # with the optimizer inside, the parameters stay graph inputs, fed every step (else
            # whatever a caller said is fed: rules.weights_fed)
            with rules.weights_fed(params) if optimizer is not None else contextlib.nullcontext():
                reversed_model = onnx_ad.reverse(model, inputs=params, outputs=[seeded],
                                                 prefix="adj_", dim="nadj", layout="onnx")
    except onnx_ad.UnsupportedOperator as exc:
        message = str(exc)
        match = re.search(r"rule for (\S+) \(node '([^']*)'\)", message)
        if match:
            raise UnsupportedOpError("operator %s (node '%s') is not differentiable by "
                                     "onnx-ad: %s" % (match.group(1), match.group(2),
                                                      message)) from exc
        ops = {n.op_type for n in model.graph.node}
        named = [op for op in re.findall(r"[A-Z][A-Za-z0-9]+", message) if op in ops]
        if named:
            nodes = [n.name or n.output[0] for n in model.graph.node if n.op_type == named[0]]
            raise UnsupportedOpError("operator %s (node%s %s) is not differentiable by "
                                     "onnx-ad: %s" % (named[0], "s" if len(nodes) > 1 else "",
                                                      ", ".join("'%s'" % n for n in nodes[:5]),
                                                      message)) from exc
        raise UnsupportedOpError("onnx-ad cannot differentiate this model: %s"
                                 % message) from exc
    except ValueError as exc:
        raise InvalidModelError("onnx-ad rejected the model: %s" % exc) from exc

    model = _finish(reversed_model, loss, loss_shape, types.get(loss, TensorProto.FLOAT),
                    params, initializers, extras, types, parts, frozen_stubs, stub_inputs)
    if optimizer is not None:
        model = _fused(model, params, optimizer)   # in file order (PRIORITY_BASED): see _fused
        write_settings(model, dataclasses.replace(UNOPTIMIZED_SETTINGS, execution_order="PRIORITY_BASED"))
        try:
            skeleton_check(model)
        except onnx.checker.ValidationError as exc:  # pragma: no cover - a bug if it happens
            raise InvalidModelError("the training graph with its optimizer fails onnx.checker: %s" % exc) from exc
    return model


# False: broadcasts and reductions keep their axes of extent 1 (unit_axes.py; for comparisons)
UNIT_AXES_DROPPED = True
# False: per-channel broadcasts over small maps read their operand as it is (short_spans.py)
SHORT_SPANS_EXPANDED = True
# at most this many rounds of `_fused` making the moments of one more parameter in blocks of rows
CHUNKED_ROUNDS = 4
# the updates of parameters of at least this many bytes are placed where the peak is least
PLACED_MIN_BYTES = 1 << 20


def _fused(training: onnx.ModelProto, params: list[str], optimizer: OptimizerSpec) -> onnx.ModelProto:
    """`training` (outputs: loss, gradients) with `optimizer`'s step inside (`fuse_optimizer`),
    its nodes in the leanest of three candidate file orders, then each update of
    PLACED_MIN_BYTES or more placed where the peak is least (`file_order.place_updates`).

    The fused graph runs in file order (PRIORITY_BASED), so that each update runs where it is
    written. The candidates (`file_order.leanest_file_order` keeps the leanest): the training
    graph's file order and the order ORT's DEFAULT walk runs it in (each gradient late, right
    before the walk needs it), each with the updates right after their gradients; and the order
    ORT's DEFAULT walk would run the fused graph in.

    Where the cost model puts the peak inside a parameter's AdamW update, or the least peak a
    plan can reach there (`search.plan.peak_floor_bytes`: the gradient and two temporaries of
    the parameter's size on top of what else is alive, against the gradient alone in a graph
    that returns it), that parameter's moments are made in blocks of rows
    (`optimizer.chunk_rows`, CHUNK_BYTES each), and kept if that lowers either peak; up to
    CHUNKED_ROUNDS parameters, the largest such first."""
    from graphopt.analyze import analyze
    from graphopt.op_rules import build_cost_graph

    constants = [n.name for n in training.graph.node if n.op_type == "Constant"]
    walked = [training.graph.node[k].name for k in default_order(training)]
    chunks: dict[str, int] = {}
    initializers = {t.name: t for t in training.graph.initializer}
    sizes = {p: int(np.prod(initializers[p].dims, dtype=np.int64))
             * helper.tensor_dtype_to_np_dtype(initializers[p].data_type).itemsize for p in params}
    rows = {p: int(initializers[p].dims[0]) if initializers[p].dims else 1 for p in params}

    def fused_with(chunks):
        model = onnx.ModelProto()
        model.CopyFrom(training)
        fused = fuse_optimizer(model, params, optimizer, chunks)
        name_nodes(model)
        in_file = [n.name for n in model.graph.node]
        in_walk = constants + fused.head + [x for name in walked for x in [name] + fused.after.get(name, [])]
        fused_walk = [model.graph.node[k].name for k in default_order(model)]
        cost_graph = build_cost_graph(analyze(model), static_tensor_bytes(model), {})
        leanest_file_order(model, [in_file, in_walk, constants + fused_walk], cost_graph)
        large = sorted((p for p in params if sizes[p] >= PLACED_MIN_BYTES), key=lambda p: -sizes[p])
        place_updates(model, [fused.by_param[p] for p in large], cost_graph)
        return model, fused, peak_places(model, cost_graph)

    model, fused, peaks = fused_with(chunks)
    if optimizer.kind != "adamw":
        return model
    for _ in range(CHUNKED_ROUNDS):
        owner = {name: p for p, names in fused.by_param.items() for name in names}
        found = [owner[node] for _, node in peaks if node in owner]
        found = [p for p in found if p not in chunks and rows[p] > 1 and sizes[p] > CHUNK_BYTES]
        if not found:
            break
        p = max(found, key=sizes.__getitem__)
        trial = {**chunks, p: -(-sizes[p] // CHUNK_BYTES)}
        trial_model, trial_fused, trial_peaks = fused_with(trial)
        if not any(new < old for (new, _), (old, _) in zip(trial_peaks, peaks)):
            break
        model, fused, peaks, chunks = trial_model, trial_fused, trial_peaks, trial
    return model


def _loss_ancestors(model, loss) -> list:
    """The nodes the loss is computed from."""
    producers = {o: n for n in model.graph.node for o in n.output if o}
    found, stack, seen = [], [loss], set()
    while stack:
        node = producers.get(stack.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        stack.extend(i for i in _node_reads(node) if i)
    return found


def _forward_values(model, loss) -> set[str]:
    """The values the loss is computed from (the outputs of its ancestors)."""
    return {o for node in _loss_ancestors(model, loss) for o in node.output if o}


def _backward_names(model, loss):
    """Names of the nodes that are not ancestors of the loss (the backward and the extras)."""
    return {n.name for n in model.graph.node} - {n.name for n in _loss_ancestors(model, loss)}


def _downstream(model, params):
    live = set(params)
    for node in model.graph.node:
        if _node_reads(node) & live:
            live.update(o for o in node.output if o)
    return live


def _finish(model, loss, loss_shape, loss_type, params, initializers, extras, types, parts=None,
            frozen_stubs=(), stub_inputs=frozenset()):
    graph = model.graph
    adj_names = {p: "adj_" + p for p in params}

    # 1. the seed input becomes a constant 1 of shape loss_shape ++ [1], or, for cross
    # entropy, its gradient at the prediction, computed right before the backward reads it
    seed, seed_nodes = None, []
    if parts is None:
        seed_name = "adj_" + loss
        dtype = helper.tensor_dtype_to_np_dtype(loss_type)
        seed = numpy_helper.from_array(np.ones(tuple(loss_shape) + (1,), dtype=dtype), seed_name)
    else:
        seed_name = "adj_" + parts.prediction
        seed_nodes, seed_inits = cross_entropy_seed(parts, seed_name, Names(model))
        graph.initializer.extend(seed_inits)

    # 2. parameters back to initializers; inputs = the forward's data inputs
    param_set = set(params)
    inputs = [v for v in graph.input if v.name not in param_set and v.name != seed_name
              and v.name not in stub_inputs]
    graph.ClearField("input")
    graph.input.extend(inputs)
    graph.initializer.extend(initializers[p] for p in params)
    graph.initializer.extend(frozen_stubs)
    if seed is not None:
        graph.initializer.append(seed)

    # 3. gradients: Reshape(adj_p, shape(p)) -> <p>_grad, output names free of clashes
    taken = {t.name for t in graph.initializer} | {v.name for v in graph.input} | \
        {o for n in graph.node for o in n.output}
    nodes = list(graph.node)
    if seed_nodes:
        first = next((k for k, n in enumerate(nodes) if seed_name in _node_reads(n)), len(nodes))
        nodes[first:first] = seed_nodes
    outputs = [helper.make_tensor_value_info(loss, loss_type, list(loss_shape))]
    for p in params:
        grad = p + "_grad"
        if grad in taken:  # rename the internal tensor that took the name
            fresh = grad + "_internal"
            k = 0
            while fresh in taken:
                k += 1
                fresh = "%s_internal%d" % (grad, k)
            for n in nodes:
                for i, name in enumerate(n.input):
                    if name == grad:
                        n.input[i] = fresh
                for i, name in enumerate(n.output):
                    if name == grad:
                        n.output[i] = fresh
            taken.add(fresh)
        taken.add(grad)
        t = initializers[p]
        shape_name = grad + "_shape"
        k = 0
        while shape_name in taken:
            k += 1
            shape_name = "%s_shape%d" % (grad, k)
        taken.add(shape_name)
        graph.initializer.append(numpy_helper.from_array(
            np.array(list(t.dims), dtype=np.int64), shape_name))
        nodes.append(helper.make_node("Reshape", [adj_names[p], shape_name], [grad]))
        outputs.append(helper.make_tensor_value_info(grad, t.data_type, list(t.dims)))
    produced = {o for n in nodes for o in n.output} | {o for n in extras.nodes for o in n.output}
    missing = [name for name in extras.outputs if name not in produced]
    if missing:  # pragma: no cover - a bug if it happens
        raise InvalidModelError(f"training-mode outputs lost while differentiating: {missing}")
    nodes.extend(extras.nodes)
    graph.initializer.extend(extras.initializers)
    for name in extras.outputs:
        outputs.append(helper.make_tensor_value_info(name, types.get(name, TensorProto.FLOAT), None))
    graph.ClearField("node")
    graph.node.extend(nodes)
    graph.ClearField("output")
    graph.output.extend(outputs)
    graph.ClearField("value_info")

    model = cleanup_graph(model)
    scatter_nd_rows_to_elements(model)
    shapes = static_shapes(model)
    if pads_sum_to_concat(model, shapes) + transposed_products(model, shapes) \
            + lean_embedding_gradients(model, shapes) + transposed_weights_into_gemm(model, shapes) \
            + masks_as_products(model, loss):
        model = cleanup_graph(model)
        shapes = static_shapes(model)
    if outputs_written_in_place(model, shapes):
        model = cleanup_graph(model)
    sums_as_produced(model, _forward_values(model, loss))
    sums_as_adds(model)
    gradients_early(model, {o for n in seed_nodes for o in n.output})
    loss_first(model, loss)
    name_nodes(model)
    recompute_gelu_intermediates(model, _backward_names(model, loss))
    copy_statistics_inputs(model)
    if UNIT_AXES_DROPPED:
        unit_axes_dropped(model, static_shapes(model))
    if SHORT_SPANS_EXPANDED:
        short_spans_expanded(model, static_shapes(model))
    block = rules.conv_block()
    if block is not None:
        blocked_convs(model, static_shapes(model), block)
    # value_info for the planner; the seed axis is gone, so shapes are the real ones. The extra
    # outputs were declared without shapes: infer them as intermediates, then declare them.
    extra_names = set(extras.outputs)
    declared = list(model.graph.output)
    model.graph.ClearField("output")
    model.graph.output.extend(o for o in declared if o.name not in extra_names)
    inferred = _infer(model)
    inferred_types = {v.name: v.type for v in inferred.graph.value_info}
    unshaped = []
    for output in declared:
        if output.name not in extra_names:
            continue
        if output.name in inferred_types and inferred_types[output.name].tensor_type.HasField("shape"):
            output.type.CopyFrom(inferred_types[output.name])
        elif output.name in extras.shapes:     # shape inference gave up; the shape made with it
            output.type.CopyFrom(helper.make_tensor_type_proto(
                output.type.tensor_type.elem_type, extras.shapes[output.name]))
        else:
            unshaped.append(output.name)
    if unshaped:
        raise InvalidModelError("shape inference found no shape for the training-mode outputs %s "
                                "of the training graph" % unshaped)
    model.graph.ClearField("output")
    model.graph.output.extend(declared)
    model.graph.ClearField("value_info")
    outputs_set = {v.name for v in model.graph.output}
    model.graph.value_info.extend(v for v in inferred.graph.value_info
                                  if v.name not in outputs_set)
    name_nodes(model)
    write_settings(model, UNOPTIMIZED_SETTINGS)   # open_session(model) runs it lean
    try:
        skeleton_check(model)
    except onnx.checker.ValidationError as exc:  # pragma: no cover - a bug if it happens
        raise InvalidModelError("the training graph fails onnx.checker: %s" % exc) from exc
    return model
