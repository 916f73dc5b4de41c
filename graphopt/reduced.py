"""A training graph's reduced twin: the same graph at a smaller batch, to annotate (and verify)
a step that does not fit where it will run.

Training graphs exported with static shapes carry the batch size in their constants (the
shape of every Reshape, Expand, ConstantOfShape, Resize), so a smaller batch cannot simply be
fed. The twin rewrites them:

1. **The batch.** ``B`` is the leading dimension shared by the fed inputs that are not state
   (parameters, optimizer state: inputs a step feeds back); those inputs carry it on axis 0.
2. **Where the batch goes.** With every tensor's full-size shape from ONNX shape inference,
   each tensor's batch position is tracked forward from those inputs: ``(axis, outer)`` where
   the axis's dimension is ``outer * B * inner``. A Reshape (Flatten, Squeeze, Unsqueeze)
   keeps the row-major layout, so the batch factor keeps the number of elements before it and
   lands on the one output axis that holds that position: a merge ``[B, S] -> [B*S]`` and a
   split back are exact, whatever other dimension happens to equal ``B``. Transpose moves
   it; broadcasting ops align it from the right; Gather carries it from its indices; other
   ops keep it where an output of the same rank has the same dimension. A tensor made from
   nothing (ConstantOfShape, an Expand of a batchless value) gets it from the consumer that
   meets a tracked tensor on an axis of the same size.
3. **The rewrite.** Each constant shape of a node whose output holds the batch gets that
   entry scaled to ``b`` (a constant shared with a node that keeps it is copied); the batch
   inputs are cut to their first ``b`` samples (real values: labels stay valid); declared
   intermediate shapes are dropped.
4. **The check.** The twin's shapes (ONNX shape inference at ``b``) must be the full ones
   with the batch axis scaled; after annotating twins at two batches, every measured shape
   extrapolated to ``B`` (each dimension affine in the batch) must equal the full-size
   inferred one where inference knows it. A mismatch names the tensor and the node
   (:class:`TwinError`), and the step is annotated at full size instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .builder.graph_util import attribute, infer_shapes
from .errors import InvalidModelError
from .onnx_ops import STANDARD_DOMAINS

# Where a constant gives a node its output's shape: op type -> input position.
SHAPE_SLOTS = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0, "Resize": 3}

_LAYOUT_OPS = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"}
_BROADCAST_OPS = {"Add", "Sub", "Mul", "Div", "Pow", "Where", "And", "Or", "Xor", "Equal", "Less", "Greater",
                  "LessOrEqual", "GreaterOrEqual", "Sum", "Max", "Min", "Mean", "Mod", "BitShift", "PRelu",
                  "Expand"}


class TwinError(InvalidModelError):
    """No reduced twin can be made of this graph (the message says why)."""


Position = tuple[int, int]  # (axis, outer): the axis's dimension is outer * B * inner


@dataclass
class Twin:
    """The graph at batch `batch` (the original's is `full_batch`), with its inputs."""
    model: onnx.ModelProto
    inputs: dict[str, np.ndarray]
    batch: int
    full_batch: int
    rewritten_constants: int
    positions: dict[str, Position] = field(default_factory=dict)


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, int) and d >= 0 for d in shape)


# Ops evaluated on small known values to complete shape inference (a shape computed with Size
# or from a Concat of computed pieces, which ONNX data propagation leaves unknown).
_FOLDABLE = {"Shape", "Size", "Concat", "Slice", "Gather", "Unsqueeze", "Squeeze", "Reshape", "Cast", "Mul",
             "Add", "Sub", "Div", "Identity", "ReduceProd", "Neg", "Equal", "Where", "Max", "Min", "Abs"}
_FOLD_MAX_ELEMENTS = 64


def _inferred(model: onnx.ModelProto) -> dict[str, list[int]]:
    try:
        inferred = infer_shapes(model, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - an inference failure means: shapes unknown
        raise TwinError(f"ONNX shape inference failed on the graph: {exc}") from None
    shapes: dict[str, list[int]] = {}
    g = inferred.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            if _static(dims):
                shapes[vi.name] = dims
    for t in model.graph.initializer:
        shapes[t.name] = list(t.dims)
    return shapes


def _fold(model: onnx.ModelProto, shapes: dict[str, list[int]], values: dict[str, np.ndarray]) -> int:
    """Evaluate the small shape computations whose inputs are known (ONNX's reference
    evaluator, one node at a time) into `values`; how many were added."""
    from onnx.reference import ReferenceEvaluator
    added = 0
    for node in model.graph.node:
        if node.op_type not in _FOLDABLE or node.domain not in STANDARD_DOMAINS or not node.output:
            continue
        if all(o in values for o in node.output if o):
            continue
        if node.op_type in ("Shape", "Size"):
            if node.input[0] not in shapes:
                continue
            shape = shapes[node.input[0]]
            if node.op_type == "Size":
                result = [np.array(math.prod(shape), dtype=np.int64)]
            else:
                start, end = attribute(node, "start", 0), attribute(node, "end", None)
                result = [np.array(shape[start:end], dtype=np.int64)]
        else:
            if not all((not i) or i in values for i in node.input):
                continue
            try:
                graph = helper.make_graph([node], "fold", [], [helper.make_tensor_value_info(o, 0, None)
                                                               for o in node.output if o],
                                          [numpy_helper.from_array(np.asarray(values[i]), i)
                                           for i in dict.fromkeys(node.input) if i])
                folded = helper.make_model(graph, opset_imports=list(model.opset_import))
                result = ReferenceEvaluator(folded).run(None, {})
            except Exception:  # noqa: BLE001 - not foldable: left to inference
                continue
        for name, value in zip([o for o in node.output if o], result):
            value = np.asarray(value)
            if value.size <= _FOLD_MAX_ELEMENTS and name not in values:
                values[name] = value
                added += 1
    return added


def full_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Every tensor's static shape: ONNX shape inference with data propagation, completed by
    evaluating the small shape computations it leaves unknown (`_fold`) and inferring again
    with their values as constants."""
    from .builder.graph_util import small_constants
    shapes = _inferred(model)
    values = dict(small_constants(model, _FOLD_MAX_ELEMENTS))
    for _ in range(4):
        produced = {o for n in model.graph.node for o in n.output if o}
        if not _fold(model, shapes, values):
            break
        skeleton = onnx.ModelProto()
        skeleton.CopyFrom(_graph_only(model))
        nodes = []
        for node in skeleton.graph.node:
            outs = [o for o in node.output if o]
            if outs and all(o in values for o in outs) and node.op_type != "Constant":
                nodes.extend(helper.make_node("Constant", [], [o], value=numpy_helper.from_array(values[o], o))
                             for o in outs)
            else:
                nodes.append(node)
        del skeleton.graph.node[:]
        skeleton.graph.node.extend(nodes)
        more = _inferred(skeleton)
        grew = [n for n in more if n not in shapes and n in produced]
        shapes.update({n: s for n, s in more.items() if n not in shapes})
        if not grew:
            break
    return shapes


def _graph_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` without the data of its large initializers (declared as inputs instead)."""
    from .builder.graph_util import shape_skeleton
    return shape_skeleton(model)


def batch_inputs(model: onnx.ModelProto, inputs: dict[str, np.ndarray],
                 state: set[str] | frozenset[str] = frozenset()) -> tuple[int, list[str]]:
    """``(B, names)``: the batch and the fed inputs that carry it on axis 0 (state excluded)."""
    initializers = {t.name for t in model.graph.initializer}
    data = [i.name for i in model.graph.input
            if i.name not in initializers and i.name not in state and i.name in inputs
            and np.ndim(inputs[i.name]) >= 1]
    if not data:
        raise TwinError("no fed input that is not state: nothing carries a batch")
    leading = [int(np.shape(inputs[n])[0]) for n in data]
    counts: dict[int, int] = {}
    for d in leading:
        counts[d] = counts.get(d, 0) + 1
    full = max(counts, key=lambda d: (counts[d], d))
    return full, [n for n, d in zip(data, leading) if d == full]


def _linear(pos: Position, xs: list[int], ys: list[int], full: int) -> Position | None:
    """The batch's position in `ys` for a layout-preserving reshape of `xs`."""
    axis, outer = pos
    before = math.prod(xs[:axis]) * outer  # elements (row-major) before the batch factor
    prefix = 1
    for j, d in enumerate(ys):
        if prefix > before:
            break
        if before % prefix == 0:
            o = before // prefix
            if d and d % (o * full) == 0:
                return (j, o)
        prefix *= d
    return None


def _ints_input(node: onnx.NodeProto, position: int, constants: dict) -> list[int] | None:
    if len(node.input) > position and node.input[position] in constants:
        return [int(v) for v in np.asarray(constants[node.input[position]]).ravel()]
    return None


def _reduced_axes(node: onnx.NodeProto, rank: int, constants: dict) -> list[int] | None:
    axes = attribute(node, "axes", None)
    if axes is None:
        axes = _ints_input(node, 1, constants)
    if axes is None:
        return None if len(node.input) > 1 and node.input[1] else list(range(rank))
    return [a % rank for a in axes]


def _forward(node, shapes, positions, full, constants) -> dict[str, Position]:
    """The batch positions of `node`'s outputs from its inputs' (see the module docstring)."""
    op = node.op_type
    outs = [o for o in node.output if o and o in shapes]
    ins = [(i, positions[i]) for i in node.input if i in positions and i in shapes]
    if not ins or not outs:
        return {}
    y = outs[0]
    ys = shapes[y]
    name, pos = ins[0]
    xs = shapes[name]
    if op in _LAYOUT_OPS and name == node.input[0]:
        found = _linear(pos, xs, ys, full)
        return {y: found} if found else {}
    if op == "Transpose" and name == node.input[0]:
        perm = attribute(node, "perm", list(reversed(range(len(xs)))))
        return {y: (list(perm).index(pos[0]), pos[1])}
    if op == "Gather":
        axis = attribute(node, "axis", 0) % max(len(shapes.get(node.input[0], [])), 1)
        if name == node.input[1]:
            return {y: (axis + pos[0], pos[1])}
        if name == node.input[0] and pos[0] != axis:
            rank_idx = len(shapes.get(node.input[1], [])) if node.input[1] in shapes else None
            if rank_idx is None:
                return {}
            return {y: (pos[0] if pos[0] < axis else pos[0] - 1 + rank_idx, pos[1])}
        return {}
    if op in ("Shape", "Size"):
        return {}
    if op == "GatherND":
        if len(node.input) > 1 and node.input[1] in positions and node.input[1] in shapes:
            axis, outer = positions[node.input[1]]
            if axis < len(shapes[node.input[1]]) - 1:
                return {y: (axis, outer)}
        if name == node.input[0] and pos[0] < attribute(node, "batch_dims", 0):
            return {y: pos}
        return {}
    if op in ("MatMul", "Gemm", "Conv", "ConvTranspose"):
        return _contraction(node, shapes, ins, y)
    if op.startswith("Reduce") and name == node.input[0]:
        axes = _reduced_axes(node, len(xs), constants)
        if axes is None or pos[0] in axes:
            return {}
        keep = attribute(node, "keepdims", 1)
        return {y: (pos[0] if keep else pos[0] - sum(a < pos[0] for a in axes), pos[1])}
    result: dict[str, Position] = {}
    for out in outs:
        ys = shapes[out]
        for name, pos in ins:
            xs = shapes[name]
            if op in _BROADCAST_OPS:
                axis = pos[0] + len(ys) - len(xs)
            elif len(xs) == len(ys):
                axis = pos[0]
            else:
                continue
            if 0 <= axis < len(ys) and ys[axis] == xs[pos[0]]:
                result[out] = (axis, pos[1])
                break
    return result


def _contraction(node, shapes, ins, y) -> dict[str, Position]:
    """MatMul, Gemm, Conv, ConvTranspose: the batch follows the axis it is on, and is gone when
    it is on the axis they contract (a weight's gradient)."""
    op = node.op_type
    ry = len(shapes[y])
    for name, (axis, outer) in ins:
        rank = len(shapes[name])
        slot = list(node.input).index(name)
        target = None
        if op == "MatMul" and rank >= 2:
            # a 1-D other operand is a vector: its axis is gone from the result (ONNX MatMul)
            vector = len(shapes.get(node.input[1 - slot], [0, 0])) == 1
            if slot == 0:
                target = (ry - 1 if vector else ry - 2) if axis == rank - 2 else \
                    (None if axis == rank - 1 else axis + ry - rank + vector)
            else:
                target = ry - 1 if axis == rank - 1 else (None if axis == rank - 2 else axis + ry - rank + vector)
        elif op == "Gemm":
            if slot == 0:
                target = 0 if axis == (1 if attribute(node, "transA", 0) else 0) else None
            elif slot == 1:
                target = 1 if axis == (0 if attribute(node, "transB", 0) else 1) else None
            else:
                target = axis + 2 - rank
        elif op in ("Conv", "ConvTranspose"):
            if slot == 0:
                target = 0 if axis == 0 else None
            elif slot == 1:
                target = 1 if axis == (0 if op == "Conv" else 1) else None
            else:
                target = 1 if axis == 0 else None
        if target is not None and 0 <= target < ry:
            return {y: (target, outer)}
    return {}


def _backward(node, shapes, positions, movable, full: int) -> dict[str, Position]:
    """Untracked inputs that may take the batch (`movable`: made by a node, or constants that are
    not parameters) of an op whose output or other input is tracked: Gather's and GatherND's
    indices and data, a layout op's input (the reshape rule reversed), and a broadcasting or
    same-rank op's inputs on the aligned axis of the same size."""
    op = node.op_type
    if op == "GatherND" and len(node.input) > 1 and node.output and node.output[0] in positions:
        indices = node.input[1]
        if indices not in positions and indices in movable and indices in shapes:
            out_axis, outer = positions[node.output[0]]
            if out_axis < len(shapes[indices]) - 1:
                return {indices: (out_axis, outer)}
    if op == "Gather" and len(node.input) > 1 and node.output and node.output[0] in positions:
        indices = node.input[1]
        data_rank = len(shapes.get(node.input[0], []))
        if indices not in positions and indices in movable and indices in shapes and data_rank:
            axis = attribute(node, "axis", 0) % data_rank
            out_axis, outer = positions[node.output[0]]
            if axis <= out_axis < axis + len(shapes[indices]):
                return {indices: (out_axis - axis, outer)}
    if op == "Gather" and node.output and node.output[0] in positions and node.input[0] not in positions \
            and node.input[0] in movable and node.input[0] in shapes and node.input[1] in shapes:
        data_rank, index_rank = len(shapes[node.input[0]]), len(shapes[node.input[1]])
        axis = attribute(node, "axis", 0) % data_rank
        out_axis, outer = positions[node.output[0]]
        here = out_axis if out_axis < axis else (out_axis - index_rank + 1 if out_axis >= axis + index_rank
                                                 else -1)
        if 0 <= here < data_rank and here != axis:
            return {node.input[0]: (here, outer)}
        return {}
    if op in _LAYOUT_OPS and node.output and node.output[0] in positions and node.input \
            and node.input[0] not in positions and node.input[0] in movable and node.input[0] in shapes \
            and node.output[0] in shapes:
        found = _linear(positions[node.output[0]], shapes[node.output[0]], shapes[node.input[0]], full)
        return {node.input[0]: found} if found else {}
    if op in _LAYOUT_OPS or op in ("MatMul", "Gemm", "Conv", "ConvTranspose", "Transpose", "Gather", "Shape",
                                   "Size") or op.startswith("Reduce"):
        return {}
    known = [(t, positions[t]) for t in list(node.output) + list(node.input) if t in positions and t in shapes]
    if not known:
        return {}
    found: dict[str, Position] = {}
    for name in node.input:
        if name in positions or name not in movable or name not in shapes:
            continue
        xs = shapes[name]
        for other, (axis, outer) in known:
            os_ = shapes[other]
            here = axis - (len(os_) - len(xs)) if op in _BROADCAST_OPS else (axis if len(os_) == len(xs) else -1)
            if 0 <= here < len(xs) and xs[here] == os_[axis] and xs[here] != 1:
                found[name] = (here, outer)
                break
    return found


TRACK_PASSES = 4   # forward then backward, until nothing changes


def track(model: onnx.ModelProto, shapes: dict[str, list[int]], batch_names: list[str],
          full: int, constants: dict, seeds: dict[str, Position] | None = None,
          keep: frozenset[str] | set[str] = frozenset()) -> dict[str, Position]:
    """Every tensor's batch position (module docstring, step 2); `seeds`: positions known
    already (learned from a twin's inferred shapes)."""
    positions: dict[str, Position] = {n: (0, 1) for n in batch_names}
    positions.update(seeds or {})
    nodes = list(model.graph.node)
    movable = {o for n in nodes if n.op_type not in ("Shape", "Size") for o in n.output if o}
    # a constant that meets the batch (a position table of batch x sequence entries, a mask, the
    # -1s of a loss gradient) is cut with it; the parameters (`keep`) never are
    movable |= {t.name for t in model.graph.initializer if t.name not in keep and len(t.dims) >= 1}
    for _ in range(TRACK_PASSES):
        before = dict(positions)
        for node in nodes:
            for out, pos in _forward(node, shapes, positions, full, constants).items():
                positions.setdefault(out, pos)
        # backward: a tensor made from nothing (ConstantOfShape, an Expand of a batchless value,
        # what is computed from them) holds the batch where it meets a tracked one
        for node in reversed(nodes):
            for name, pos in _backward(node, shapes, positions, movable, full).items():
                positions.setdefault(name, pos)
        if positions == before:
            break
    return positions


def _scaled(shape: list[int], pos: Position | None, full: int, batch: int) -> list[int]:
    if pos is None:
        return list(shape)
    out = list(shape)
    out[pos[0]] = out[pos[0]] // full * batch
    return out


TWIN_PASSES = 4


def make_twin(model: onnx.ModelProto, inputs: dict[str, np.ndarray], batch: int, *,
              state: set[str] | frozenset[str] = frozenset(), keep: set[str] | frozenset[str] = frozenset(),
              shapes: dict[str, list[int]] | None = None, base_dir: str | None = None) -> Twin:
    """`model` at batch `batch` (module docstring, steps 1-3), checked by shape inference. A
    tensor whose shape the graph computes (from a Shape or Size of a tracked tensor) follows the
    batch by itself: where the twin's inferred shape is the full one scaled on one axis, that
    axis is taken as its batch position and the twin is made again (at most TWIN_PASSES).
    `base_dir`: where the data of external initializers is (a constant that holds the batch is
    read from there, cut and written into the twin)."""
    full, names = batch_inputs(model, inputs, state)
    if not 1 <= batch < full:
        raise TwinError(f"a reduced batch must be in 1..{full - 1}, not {batch}")
    shapes = dict(shapes) if shapes is not None else full_shapes(model)
    for n in inputs:
        shapes.setdefault(n, list(np.shape(inputs[n])))
    from .builder.graph_util import small_constants
    constants = small_constants(model)
    learned: dict[str, Position] = {}
    for _ in range(TWIN_PASSES):
        twin = _twin_once(model, inputs, batch, full, names, shapes, constants, learned, frozenset(keep), base_dir)
        found = _learn(twin, shapes)
        if not found:
            break
        learned.update(found)
    _check_inferred(twin, shapes)
    return twin


def _learn(twin: Twin, shapes: dict[str, list[int]]) -> dict[str, Position]:
    """Untracked tensors whose inferred twin shape is the full one scaled on exactly one axis."""
    try:
        inferred = full_shapes(twin.model)
    except TwinError:
        return {}
    producers = _producers(twin.model)
    found: dict[str, Position] = {}
    for name, shape in inferred.items():
        if name in twin.positions or name not in shapes or name not in producers:
            continue
        full_shape = shapes[name]
        if len(shape) != len(full_shape):
            continue
        differ = [j for j, (a, b) in enumerate(zip(shape, full_shape)) if a != b]
        if len(differ) == 1 and full_shape[differ[0]] * twin.batch == shape[differ[0]] * twin.full_batch:
            found[name] = (differ[0], 1)  # a merged axis is taken as batch-major
    return found


def _twin_once(model, inputs, batch, full, names, shapes, constants, learned, keep, base_dir) -> Twin:
    positions = track(model, shapes, names, full, constants, seeds=learned, keep=keep)

    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    g = twin.graph
    del g.value_info[:]
    for out in g.output:
        if out.type.HasField("tensor_type"):
            out.type.tensor_type.ClearField("shape")
    for inp in g.input:
        if inp.name in names and inp.type.tensor_type.HasField("shape"):
            inp.type.tensor_type.shape.dim[0].dim_value = batch
    # constant shapes: by name, the value each user needs
    wanted: dict[tuple[str, tuple], list] = {}
    rewritten = 0
    for node in g.node:
        slot = SHAPE_SLOTS.get(node.op_type)
        if slot is None or len(node.input) <= slot or node.input[slot] not in constants or not node.output:
            continue
        out = node.output[0]
        if out not in positions or out not in shapes:
            continue
        value = [int(v) for v in np.asarray(constants[node.input[slot]]).ravel()]
        ys = shapes[out]
        axis = positions[out][0]
        if node.op_type == "Resize":
            if len(value) != len(ys):
                continue
            index = axis
        else:
            index = axis - (len(ys) - len(value))
        if not 0 <= index < len(value) or value[index] in (0, -1, 1) or value[index] != ys[axis]:
            continue
        value[index] = ys[axis] // full * batch
        wanted.setdefault((node.input[slot], tuple(value)), []).append(node)
        rewritten += 1
    users: dict[str, int] = {}
    for node in g.node:
        for i in node.input:
            users[i] = users.get(i, 0) + 1
    taken = {t.name for t in g.initializer} | {o for n in g.node for o in n.output} | {i.name for i in g.input}
    for (name, value), nodes in wanted.items():
        new = name
        if users.get(name, 0) != len(nodes) or any(k[0] == name and k[1] != value for k in wanted):
            k = 1
            while f"{name}__b{batch}_{k}" in taken:
                k += 1
            new = f"{name}__b{batch}_{k}"
            taken.add(new)
        dtype = np.asarray(constants[name]).dtype
        tensor = numpy_helper.from_array(np.asarray(value, dtype=dtype).reshape(np.shape(constants[name])), new)
        if new == name:
            _replace_constant(g, name, tensor)
        else:
            g.initializer.append(tensor)
            for node in nodes:
                slot = SHAPE_SLOTS[node.op_type]
                node.input[slot] = new
    shaped = constants_rewritten(wanted)
    for i, t in enumerate(g.initializer):
        if t.name in positions and t.name not in keep and t.name not in shaped:
            if t.data_location == onnx.TensorProto.EXTERNAL and base_dir is None:
                raise TwinError(f"constant {t.name!r} holds the batch and its data is not in the graph")
            axis, outer = positions[t.name]
            value = numpy_helper.to_array(t, base_dir or "")
            g.initializer[i].CopyFrom(numpy_helper.from_array(_cut(value, axis, outer, full, batch), t.name))
            rewritten += 1
    for node in g.node:
        if node.op_type == "Constant" and node.output and node.output[0] in positions \
                and node.output[0] not in shaped and node.output[0] not in keep:
            value = None
            for attr in node.attribute:
                if attr.name == "value":
                    value = numpy_helper.to_array(attr.t)
            if value is None or value.ndim == 0:
                continue
            axis, outer = positions[node.output[0]]
            _replace_constant(g, node.output[0], numpy_helper.from_array(_cut(value, axis, outer, full, batch),
                                                                         node.output[0]))
            rewritten += 1
    twin_inputs = {k: (np.ascontiguousarray(v[:batch]) if k in names else v) for k, v in inputs.items()}
    return Twin(twin, twin_inputs, batch, full, rewritten, positions)


def constants_rewritten(wanted: dict) -> set[str]:
    return {name for name, _ in wanted}


def _cut(array: np.ndarray, axis: int, outer: int, full: int, batch: int) -> np.ndarray:
    """The first `batch` of `full` samples of `array` along the batch factor at (axis, outer)."""
    shape = array.shape
    inner = shape[axis] // (outer * full)
    split = array.reshape(shape[:axis] + (outer, full, inner) + shape[axis + 1:])
    cut = np.take(split, np.arange(batch), axis=axis + 1)
    return np.ascontiguousarray(cut.reshape(shape[:axis] + (outer * batch * inner,) + shape[axis + 1:]))


def _replace_constant(g: onnx.GraphProto, name: str, tensor: onnx.TensorProto) -> None:
    for i, t in enumerate(g.initializer):
        if t.name == name:
            g.initializer[i].CopyFrom(tensor)
            return
    for node in g.node:
        if node.op_type == "Constant" and node.output and node.output[0] == name:
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("value", tensor))
            return
    raise TwinError(f"constant {name!r} not found")


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output if o}


def _check_inferred(twin: Twin, shapes: dict[str, list[int]]) -> None:
    """The twin's inferred shapes are the full ones with the batch axis scaled (step 4)."""
    try:
        inferred = full_shapes(twin.model)
    except TwinError as exc:
        raise TwinError(f"the twin at batch {twin.batch} does not pass shape inference: {exc}") from None
    producers = _producers(twin.model)
    for name, shape in inferred.items():
        if name not in shapes or name not in producers:
            continue
        expected = _scaled(shapes[name], twin.positions.get(name), twin.full_batch, twin.batch)
        if shape != expected:
            node = producers[name]
            raise TwinError(
                f"at batch {twin.batch} tensor {name!r} ({node.op_type} node {node.name!r}) has shape {shape}, "
                f"not {expected} (full size {shapes[name]}): graphopt cannot tell where the batch goes there")


def extrapolate(shapes_low: dict[str, list[int]], shapes_high: dict[str, list[int]], low: int, high: int,
                full: int) -> dict[str, list[int]]:
    """Each tensor's shape at batch `full` from its shapes at batches `low` < `high`: every
    dimension affine in the batch. A tensor missing at either, of another rank, or whose
    extrapolated dimension is not a whole number, is left out."""
    out: dict[str, list[int]] = {}
    for name, hi in shapes_high.items():
        lo = shapes_low.get(name)
        if lo is None or len(lo) != len(hi):
            continue
        dims = []
        for a, b in zip(lo, hi):
            num = (b - a) * (full - high)
            if num % (high - low):
                break
            dims.append(b + num // (high - low))
        else:
            out[name] = dims
    return out


def scale_up(shapes: dict[str, list[int]], positions: dict[str, Position], batch: int,
             full: int) -> dict[str, list[int]]:
    """Each tensor's shape at batch `full` from its shape at `batch` alone: the batch axis its
    twin tracked scaled, the others as they are."""
    out = {}
    for name, shape in shapes.items():
        pos = positions.get(name)
        scaled = list(shape)
        if pos is not None and pos[0] < len(scaled):
            scaled[pos[0]] = scaled[pos[0]] // batch * full
        out[name] = scaled
    return out


def full_size_annotations(model: onnx.ModelProto, low, high, low_batch: int | None, high_batch: int,
                          full_batch: int, inferred: dict[str, list[int]],
                          positions: dict[str, Position] | None = None):
    """The annotations of `model` at its full batch from those of its twins at `low_batch` and
    `high_batch` (module docstring, step 4): every shape extrapolated (checked against the
    full-size `inferred` ones: a mismatch raises TwinError), bytes from shape and dtype; the
    order of the larger twin's run; each node's seconds at the larger twin scaled by its work,
    taken as the largest ratio of full to twin bytes among the tensors it reads and writes.
    With one twin (`low` None: only batch 1 ran under the limit), each shape is scaled on the
    axis the twin tracked the batch on (`positions`), checked against `inferred` the same way."""
    from .annotate import Annotations
    if low is None:
        shapes = scale_up(high.tensor_shapes, positions or {}, high_batch, full_batch)
        measured = lambda name: f"{high.tensor_shapes[name]} at batch {high_batch}"  # noqa: E731
    else:
        shapes = extrapolate(low.tensor_shapes, high.tensor_shapes, low_batch, high_batch, full_batch)
        measured = lambda name: (f"{low.tensor_shapes[name]} at batch {low_batch} and "  # noqa: E731
                                 f"{high.tensor_shapes[name]} at batch {high_batch}")
    for name, shape in shapes.items():
        if name in inferred and inferred[name] != shape:
            raise TwinError(f"tensor {name!r} measured {measured(name)}, which does not extend to its full "
                            f"shape {inferred[name]} at batch {full_batch}")
    names = {o for n in model.graph.node for o in n.output if o} | {i.name for i in model.graph.input} \
        | {t.name for t in model.graph.initializer}
    missing = [n for n in high.tensor_shapes if n in names and n not in shapes]
    if missing:
        raise TwinError(f"the shapes of {len(missing)} tensors (first {missing[0]!r}) do not extend from batch "
                        f"{low_batch} and {high_batch} to {full_batch}")
    out = Annotations(provider=high.provider, settings=high.settings)
    for name, shape in shapes.items():
        if name not in names:
            continue  # a constant only the twin has
        dtype = np.dtype(high.tensor_dtypes[name])
        out.tensor_shapes[name] = shape
        out.tensor_dtypes[name] = high.tensor_dtypes[name]
        out.tensor_bytes[name] = int(math.prod(shape)) * dtype.itemsize
    out.execution_order = list(high.execution_order)
    nodes = {n.name: n for n in model.graph.node}
    for name, seconds in high.node_seconds.items():
        node = nodes.get(name)
        ratio = 1.0
        if node is not None:
            for t in list(node.input) + list(node.output):
                if t and high.tensor_bytes.get(t) and t in out.tensor_bytes:
                    ratio = max(ratio, out.tensor_bytes[t] / high.tensor_bytes[t])
        out.node_seconds[name] = seconds * ratio
    return out
