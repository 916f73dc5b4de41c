"""Synthetic inputs for a training graph: one feed dict for ``session.run``.

Floating inputs are N(0, 1); integer inputs get values that are valid for the
operators they feed (indices of a Gather, labels of a loss, ...), found by following
the input forward through value-preserving ops (Cast, Reshape, Identity, ...).
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from graphopt.errors import InvalidModelError, LimitExceededError
from graphopt.runtime.arrays import load_arrays, save_arrays


class InputSpecError(InvalidModelError, ValueError):
    """A malformed ``name=d0,d1,...`` input-dimension spec, or dims that do not fit the model."""


def parse_input_dims(specs: Iterable[str]) -> dict[str, list[int]]:
    """Parse ``["name=4,3,224,224", ...]`` into ``{"name": [4, 3, 224, 224]}``.

    ``"name="`` gives a scalar (``[]``). Dims must be non-negative integers.
    """
    out: dict[str, list[int]] = {}
    for spec in specs or ():
        if not isinstance(spec, str) or "=" not in spec:
            raise InputSpecError(f"input dims {spec!r}: expected NAME=D0,D1,... (for example x=8,3,32,32)")
        name, _, dims_s = spec.rpartition("=")
        name = name.strip()
        if not name:
            raise InputSpecError(f"input dims {spec!r}: the input name is empty")
        if name in out:
            raise InputSpecError(f"input dims: input {name!r} is given twice")
        dims: list[int] = []
        dims_s = dims_s.strip()
        if dims_s:
            for part in dims_s.split(","):
                part = part.strip()
                try:
                    d = int(part)
                except ValueError:
                    raise InputSpecError(
                        f"input dims {spec!r}: dimension {part!r} is not an integer"
                    ) from None
                if d < 0:
                    raise InputSpecError(f"input dims {spec!r}: dimension {d} is negative")
                dims.append(d)
        out[name] = dims
    return out


# Ops whose output holds the same values as input 0 (so index bounds carry through).
_PASS_THROUGH = {"Cast", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Expand",
                 "Transpose", "CastLike", "Tile"}


def _static_shape(type_proto: onnx.TypeProto) -> list[int | str | None] | None:
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    dims: list[int | str | None] = []
    for d in type_proto.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def _resolve_shapes(model: onnx.ModelProto, input_dims: dict[str, list[int]]) -> dict[str, list[int]]:
    init_names = {t.name for t in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in init_names]
    known_inputs = {i.name for i in graph_inputs}
    for name in input_dims:
        if name not in known_inputs:
            raise InputSpecError(
                f"input dims given for {name!r}, which is not a graph input "
                f"(inputs: {sorted(known_inputs)})"
            )
    # Symbols bound by the inputs whose dims were given.
    symbols: dict[str, int] = {}
    for inp in graph_inputs:
        if inp.name not in input_dims:
            continue
        shape = _static_shape(inp.type)
        given = input_dims[inp.name]
        if shape is None:
            continue
        if len(shape) != len(given):
            raise InputSpecError(
                f"input {inp.name!r}: {len(given)} dims given, the model declares rank {len(shape)}"
            )
        for k, (decl, val) in enumerate(zip(shape, given)):
            if isinstance(decl, int) and decl != val:
                raise InputSpecError(
                    f"input {inp.name!r}: dim {k} given as {val}, the model fixes it to {decl}"
                )
            if isinstance(decl, str):
                if decl in symbols and symbols[decl] != val:
                    raise InputSpecError(
                        f"input {inp.name!r}: dim {k} ({decl!r}) given as {val}, "
                        f"but {decl!r} = {symbols[decl]} from another input"
                    )
                symbols[decl] = val
    shapes: dict[str, list[int]] = {}
    for inp in graph_inputs:
        if inp.name in input_dims:
            shapes[inp.name] = list(input_dims[inp.name])
            continue
        shape = _static_shape(inp.type)
        if shape is None:
            raise InputSpecError(
                f"input {inp.name!r} has no declared shape: give it, e.g. {inp.name}=D0,D1,..."
            )
        dims = []
        for k, d in enumerate(shape):
            if isinstance(d, int):
                dims.append(d)
            elif isinstance(d, str) and d in symbols:
                dims.append(symbols[d])
            else:
                what = f"symbolic dim {d!r}" if d else "an unknown dim"
                raise InputSpecError(
                    f"input {inp.name!r}: dim {k} is {what} with no value; give it, "
                    f"e.g. {inp.name}=" + ",".join(str(x) if isinstance(x, int) else "N" for x in shape)
                )
        shapes[inp.name] = dims
    return shapes


def _inferred_shapes(model: onnx.ModelProto, input_shapes: dict[str, list[int]]) -> dict[str, list]:
    """Static shapes of every value we can find (initializers, inputs, inferred)."""
    from .builder.graph_util import shape_skeleton
    out: dict[str, list] = {}
    m = shape_skeleton(model)      # the graph without its weights' data: any size, no copy of them
    for inp in m.graph.input:
        if inp.name in input_shapes and inp.type.HasField("tensor_type"):
            shp = inp.type.tensor_type.shape
            shp.Clear()
            for d in input_shapes[inp.name]:
                shp.dim.add().dim_value = d
    try:
        m = shape_inference.infer_shapes(m, strict_mode=False)
    except Exception:  # shape inference is a help here, not a requirement
        pass
    for vi in list(m.graph.value_info) + list(m.graph.output) + list(m.graph.input):
        s = _static_shape(vi.type)
        if s is not None:
            out[vi.name] = s
    for t in model.graph.initializer:
        out[t.name] = list(t.dims)
    for n in m.graph.node:
        if n.op_type == "Constant" and n.output:
            for a in n.attribute:
                if a.name == "value":
                    out[n.output[0]] = list(a.t.dims)
    out.update({k: list(v) for k, v in input_shapes.items()})
    return out


def _constant_value(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    for t in model.graph.initializer:
        if t.name == name:   # (one whose data lies in a file is not a small constant)
            return None if t.data_location == onnx.TensorProto.EXTERNAL else numpy_helper.to_array(t)
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output and n.output[0] == name:
            for a in n.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name == "value_int":
                    return np.array(a.i)
                if a.name == "value_ints":
                    return np.array(list(a.ints))
    return None


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _dim(shapes: dict[str, list], value: str, axis: int) -> int | None:
    s = shapes.get(value)
    if s is None or not s:
        return None
    if axis < 0:
        axis += len(s)
    if not 0 <= axis < len(s):
        return None
    d = s[axis]
    return d if isinstance(d, int) and d > 0 else None


def _index_bounds(model: onnx.ModelProto, name: str, shapes: dict[str, list]) -> tuple[int | list[int] | None, bool]:
    """(upper bound(s), is_index) for the integer input ``name``.

    The bound is an int (exclusive) or, for GatherND, a list of per-last-axis bounds.
    ``is_index`` is True when some consumer uses the values as indices/labels.
    """
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in model.graph.node:
        for k, i in enumerate(n.input):
            if i:
                consumers.setdefault(i, []).append((n, k))
    bounds: list[int | list[int]] = []
    is_index = False
    seen = set()
    stack = [name]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        for node, k in consumers.get(v, []):
            op = node.op_type
            if op in _PASS_THROUGH and k == 0:
                stack.extend(o for o in node.output[:1] if o)
            elif op == "Gather" and k == 1:
                is_index = True
                b = _dim(shapes, node.input[0], int(_attr(node, "axis", 0)))
                if b is not None:
                    bounds.append(b)
            elif op == "GatherElements" and k == 1:
                is_index = True
                b = _dim(shapes, node.input[0], int(_attr(node, "axis", 0)))
                if b is not None:
                    bounds.append(b)
            elif op == "GatherND" and k == 1:
                is_index = True
                data = shapes.get(node.input[0])
                idx = shapes.get(v)
                bd = int(_attr(node, "batch_dims", 0))
                if data and idx and isinstance(idx[-1], int):
                    per = [data[bd + j] if bd + j < len(data) else None for j in range(idx[-1])]
                    if all(isinstance(x, int) and x > 0 for x in per):
                        bounds.append(per)
            elif op == "OneHot" and k == 0:
                is_index = True
                depth = _constant_value(model, node.input[1]) if len(node.input) > 1 else None
                if depth is not None and depth.size == 1:
                    bounds.append(int(depth.reshape(())))
            elif op in ("NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss") and k == 1:
                is_index = True
                b = _dim(shapes, node.input[0], 1)
                if b is not None:
                    bounds.append(b)
    if not bounds:
        return None, is_index
    # Several constraints: the tightest bound satisfies all of them.
    scalars = [b for b in bounds if isinstance(b, int)]
    vectors = [b for b in bounds if isinstance(b, list)]
    if vectors:
        vec = [min(x) for x in zip(*vectors)] if len({len(v) for v in vectors}) == 1 else vectors[0]
        if scalars:
            vec = [min(x, min(scalars)) for x in vec]
        return vec, is_index
    return min(scalars), is_index


def memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _human_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _check_input_bytes(model: onnx.ModelProto, input_shapes: dict[str, list[int]], init_names: set[str]) -> None:
    """LimitExceededError naming the input when the synthesized inputs could not fit in this
    machine's memory (a declared shape of [1000000, 1000000, 10] would otherwise be numpy's
    allocation error, or the OOM killer)."""
    limit = memory_bytes()
    if limit is None:
        return
    total = 0
    for inp in model.graph.input:
        if inp.name in init_names or not inp.type.HasField("tensor_type"):
            continue
        try:
            itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type)).itemsize
        except Exception:
            continue   # the loop below names an unsupported element type
        shape = [int(d) for d in input_shapes[inp.name]]
        count = 1
        for d in shape:
            count *= d
        nbytes = count * itemsize
        total += nbytes
        if nbytes > limit:
            raise LimitExceededError(
                f"input {inp.name!r} of shape {shape} would need {_human_bytes(nbytes)} ({nbytes} bytes), more "
                f"than this machine's memory ({_human_bytes(limit)}); give smaller dimensions with input_dims "
                "(--input-dims NAME=D1,D2,...)")
    if total > limit:
        raise LimitExceededError(
            f"the model's inputs would need {_human_bytes(total)} ({total} bytes) in all, more than this "
            f"machine's memory ({_human_bytes(limit)}); give smaller dimensions with input_dims")


def synthesize_inputs(
    model: onnx.ModelProto,
    input_dims: dict[str, list[int]] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """One array for every graph input that is not an initializer.

    - shapes: declared static dims; symbolic dims from ``input_dims`` (a symbol given
      for one input resolves it for all inputs); otherwise :class:`InputSpecError`.
    - floating inputs: N(0, 1) in the input's dtype.
    - integer inputs used as indices/labels (directly or through Cast/Reshape/...):
      Gather/GatherElements → [0, data.shape[axis]); GatherND → per-component bounds;
      OneHot → [0, depth) for a constant depth; NegativeLogLikelihoodLoss /
      SoftmaxCrossEntropyLoss → [0, classes = scores dim 1). Several uses → the
      tightest bound. An index whose bound cannot be found statically gets zeros.
      Other integer inputs: [0, 2).
    - bool: random.
    """
    input_dims = dict(input_dims or {})
    rng = np.random.default_rng(seed)
    input_shapes = _resolve_shapes(model, input_dims)
    shapes: dict[str, list] | None = None
    init_names = {t.name for t in model.graph.initializer}
    _check_input_bytes(model, input_shapes, init_names)
    feeds: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        if inp.name in init_names:
            continue
        if not inp.type.HasField("tensor_type"):
            raise InvalidModelError(f"input {inp.name!r}: only tensor inputs are supported")
        elem = inp.type.tensor_type.elem_type
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
        except Exception:
            raise InvalidModelError(
                f"input {inp.name!r}: element type {onnx.TensorProto.DataType.Name(elem)} is not supported"
            ) from None
        shape = tuple(input_shapes[inp.name])
        if dtype == np.bool_:
            arr = rng.random(shape) < 0.5
        elif np.issubdtype(dtype, np.floating):
            arr = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        elif np.issubdtype(dtype, np.integer):
            if shapes is None:
                shapes = _inferred_shapes(model, input_shapes)
            bound, is_index = _index_bounds(model, inp.name, shapes)
            if bound is None:
                bound = 1 if is_index else 2
            if isinstance(bound, list):
                if not shape or shape[-1] != len(bound):
                    raise InvalidModelError(f"input {inp.name!r}: GatherND indices of unexpected shape {shape}")
                arr = np.stack([rng.integers(0, b, size=shape[:-1]) for b in bound], axis=-1).astype(dtype)
            else:
                arr = rng.integers(0, bound, size=shape).astype(dtype)
        elif np.issubdtype(dtype, np.complexfloating):
            arr = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
        else:
            raise InvalidModelError(f"input {inp.name!r}: cannot synthesize values of dtype {dtype}")
        feeds[inp.name] = np.ascontiguousarray(arr)
    return feeds


# a step's inputs as a file (the format of `runtime.arrays`)
save_inputs = save_arrays
load_inputs = load_arrays
