"""Annotate a training graph by measuring it in ONNX Runtime.

(a) **Order and time.** The unmodified model, opened with the given ``settings`` and
    profiling on, run twice (warm-up, then the profiled run); the kernel events of the
    last run, in timestamp order, give the order ORT really executed and the duration of
    each kernel.

(b) **Sizes**, every one measured, none inferred. ORT's profiler records, for each kernel
    it ran, the element type and shape of every output tensor the kernel produced
    (``output_type_shape``: one ``{type: shape}`` per output that exists, in output order;
    ``ort-facts.md`` §3). Those come from a profiled run of the *unmodified* model with
    graph optimizations disabled (so every node keeps its name and its outputs): the run
    of (a) itself when ``settings`` disable optimizations (what ``optimize`` does), else
    one extra run. A kernel event is matched to its node by ``node_index`` (ORT's index of
    the node at load, Constant nodes excluded), checked against the node's name and op type
    and against its number of outputs; bytes = elements x item size.
    What the profile cannot give is measured from real arrays:

    * graph inputs fed and initializers: from the arrays and tensors themselves;
    * ``Constant`` nodes (ORT turns them into initializers at load, no kernel runs): from
      the attribute's tensor;
    * everything left (outputs of function ops ORT inlined at load, a kernel that skipped
      a named optional output, element types numpy has no dtype for): a copy of the model
      with only those values added as graph outputs, run with optimizations off, at most
      ``EXPOSE_CHUNK`` values per run; ``ndarray.nbytes`` of what it returns. Optional
      outputs a node did not produce are skipped.

    Memory: each run holds what the model itself holds in one step, plus at most
    ``EXPOSE_CHUNK`` extra values in an exposing run (the old way, every intermediate
    exposed at once, held all of them: a BERT-base training step at 8x256 tokens passed
    12 GB). ``benchmarks/annotate_memory.py`` measures both.

When ``settings`` enable graph optimizations, ORT may fuse, remove or rename nodes
(for example ``matmul_14/MatmulTransposeFusion/`` for a fused MatMul+Transpose, or a
duplicated node merged by CSE): ``execution_order`` and ``node_seconds`` then hold the
profiled names as they are — the order is that of the *optimized* graph, and some of
its names are not nodes of the model. Compare ``set(execution_order)`` with the model's
node names to detect this; plan with optimizations disabled to get a one-to-one order.

Even with optimizations disabled, an ONNX *function* op that ORT has no kernel for
(SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss, ... on the CPU provider) is inlined
at load: the profile then shows its body nodes under generated names (``LogSoftmax_10``,
``GatherElements_16``, ...) instead of the node itself, and their intermediate values
are not in ``tensor_bytes`` (only the function node's outputs are, measured by exposing
them).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphopt.errors import InvalidModelError, UnsupportedOpError
from graphopt.runtime.profile import KERNEL_SUFFIX, kernel_events, order_and_seconds
from graphopt.runtime.session import (
    SessionSettings,
    _set_metadata,
    default_providers,
    open_session,
)
from graphopt.onnx_ops import STANDARD_DOMAINS

ANNOTATIONS_KEY = "graphopt.annotations"

@dataclass
class Annotations:
    """What one measured run of the model looked like.

    ``tensor_bytes``/``tensor_shapes``/``tensor_dtypes`` cover every graph input fed,
    every initializer, and every node output the run produced (keyed by value name).
    ``execution_order``/``node_seconds`` are keyed by the names ORT's profiler reports
    (node names of the optimized graph; see the module docstring).
    """

    provider: str
    settings: SessionSettings
    execution_order: list[str] = field(default_factory=list)
    tensor_bytes: dict[str, int] = field(default_factory=dict)
    tensor_shapes: dict[str, list[int]] = field(default_factory=dict)
    tensor_dtypes: dict[str, str] = field(default_factory=dict)
    node_seconds: dict[str, float] = field(default_factory=dict)
    node_seconds_from: str = "profile"     # or "replay" (graphopt/runtime/replay.py)
    nodes_not_replayed: int = 0            # nodes whose seconds are the profile's all the same

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "settings": self.settings.to_dict(),
            "execution_order": list(self.execution_order),
            "tensor_bytes": dict(self.tensor_bytes),
            "tensor_shapes": {k: list(v) for k, v in self.tensor_shapes.items()},
            "tensor_dtypes": dict(self.tensor_dtypes),
            "node_seconds": dict(self.node_seconds),
            "node_seconds_from": self.node_seconds_from,
            "nodes_not_replayed": self.nodes_not_replayed,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Annotations":
        if not isinstance(d, dict):
            raise InvalidModelError("annotations: expected a JSON object")
        try:
            return cls(
                provider=str(d["provider"]),
                settings=SessionSettings.from_dict(d["settings"]),
                execution_order=[str(x) for x in d["execution_order"]],
                tensor_bytes={str(k): int(v) for k, v in d["tensor_bytes"].items()},
                tensor_shapes={str(k): [int(x) for x in v] for k, v in d["tensor_shapes"].items()},
                tensor_dtypes={str(k): str(v) for k, v in d["tensor_dtypes"].items()},
                node_seconds={str(k): float(v) for k, v in d.get("node_seconds", {}).items()},
                node_seconds_from=str(d.get("node_seconds_from", "profile")),
                nodes_not_replayed=int(d.get("nodes_not_replayed", 0)),
            )
        except KeyError as e:
            raise InvalidModelError(f"annotations: missing key {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise InvalidModelError(f"annotations: malformed value ({e})") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str | bytes) -> "Annotations":
        try:
            d = json.loads(s)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
            raise InvalidModelError(f"annotations: not valid JSON ({e})") from None
        return cls.from_dict(d)


# At most this many values are added as graph outputs to one run (see the module docstring).
EXPOSE_CHUNK = 32

_SIZES_SETTINGS = SessionSettings(graph_optimization_level="ORT_DISABLE_ALL")

# ORT's names of tensor element types (DataTypeImpl::ToString) -> numpy dtype names.
_ORT_TYPES = {
    "float": "float32", "double": "float64", "float16": "float16",
    "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
    "bool": "bool",
}

SOURCES = ("input", "initializer", "constant", "profile", "exposed")
"""Where a size in :func:`measure_sizes` came from (see the module docstring)."""


class _Sizes:
    """Bytes, shapes, dtypes and the source of each, filled in by the steps of measure_sizes."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.shapes: dict[str, list[int]] = {}
        self.dtypes: dict[str, str] = {}
        self.sources: dict[str, str] = {}

    def add(self, name: str, shape, dtype: np.dtype, source: str) -> None:
        shape = [int(d) for d in shape]
        self.bytes[name] = int(np.prod(shape, dtype=np.int64)) * int(dtype.itemsize)
        self.shapes[name] = shape
        self.dtypes[name] = dtype.name
        self.sources[name] = source

    def add_array(self, name: str, arr: Any, source: str) -> None:
        if not isinstance(arr, np.ndarray):
            return
        self.add(name, arr.shape, arr.dtype, source)
        self.bytes[name] = int(arr.nbytes)


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The value of a Constant node, from its attribute (None for kinds we do not read)."""
    for attr in node.attribute:
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
        if attr.name == "value_float":
            return np.array(attr.f, dtype=np.float32)
        if attr.name == "value_floats":
            return np.array(list(attr.floats), dtype=np.float32)
        if attr.name == "value_int":
            return np.array(attr.i, dtype=np.int64)
        if attr.name == "value_ints":
            return np.array(list(attr.ints), dtype=np.int64)
    return None


def _is_constant(node: onnx.NodeProto) -> bool:
    return node.op_type == "Constant" and node.domain in STANDARD_DOMAINS


def _sizes_from_kernels(model: onnx.ModelProto, kernels: list[dict], sizes: _Sizes,
                        skip: set[str]) -> None:
    """Record the output sizes the profiled kernels report (optimizations off).

    ORT numbers the nodes it loads in file order, Constant nodes excluded (they become
    initializers); the event's ``node_index`` must point at a node of the same op type and
    name (an unnamed node is profiled as ``<op_type>_<index>``), or else its name must be
    unique in the model; and the node must have as many non-empty outputs as the event
    reports. Otherwise the event is left alone (its values are measured by exposing them)."""
    loaded = [n for n in model.graph.node if not _is_constant(n)]
    by_name: dict[str, onnx.NodeProto] = {}
    for n in loaded:
        by_name[n.name] = n if n.name not in by_name else None  # type: ignore[assignment]
    for e in kernels:
        args = e.get("args", {})
        profiled = e["name"][: -len(KERNEL_SUFFIX)]
        try:
            index = int(args.get("node_index", -1))
        except (TypeError, ValueError):
            index = -1
        node = loaded[index] if 0 <= index < len(loaded) else None
        if node is not None and node.name and node.name != profiled:
            node = None  # an unnamed node is profiled as <op_type>_<index>
        if node is None:
            node = by_name.get(profiled) if profiled else None
        if node is None or node.op_type != args.get("op_name"):
            continue
        produced = args.get("output_type_shape")
        outputs = [o for o in node.output if o]
        if not isinstance(produced, list) or len(produced) != len(outputs):
            continue
        for name, entry in zip(outputs, produced):
            if name in skip or name in sizes.bytes or not isinstance(entry, dict) or len(entry) != 1:
                continue
            (ort_type, shape), = entry.items()
            dtype = _ORT_TYPES.get(ort_type)
            if dtype is None or not isinstance(shape, list):
                continue
            sizes.add(name, shape, np.dtype(dtype), "profile")


def _load_error(error: Exception) -> Exception:
    """ONNX Runtime refused the model: a missing kernel is an unsupported operator (a graph from
    the deprecated onnxruntime-training, whose *Grad ops stock wheels lack, ends here)."""
    message = str(error)
    if any(sign in message for sign in ("Could not find an implementation", "NOT_IMPLEMENTED",
                                        "is not a registered function/op")):
        return UnsupportedOpError(
            f"this ONNX Runtime has no kernel for an operator of the model: {message.strip()} "
            "(training artifacts of onnxruntime-training need its own kernels; build the training graph "
            "from the forward model with `graphopt train-graph` instead)")
    return error if isinstance(error, InvalidModelError) else InvalidModelError(
        f"ONNX Runtime cannot load the model: {message.strip()}")


def _open_exposing(model: onnx.ModelProto, names: list[str], providers: list, threads: int,
                   cap_bytes: int | None = None, model_path: str | None = None):
    """A session (optimizations off) of ``model`` with ``names`` added as graph outputs. The
    outputs are added to ``model`` itself only while the session is made, then removed (a copy
    of the model would duplicate its initializers). With ``model_path`` (the file ``model`` was
    loaded from, its weights left on disk), the session opens from a file written beside it."""
    outputs = model.graph.output
    before = len(outputs)
    existing = {o.name for o in outputs}
    written = None
    try:
        for name in names:
            if name not in existing:
                outputs.append(onnx.ValueInfoProto(name=name))
                existing.add(name)
        source = model
        if model_path is not None:
            fd, written = tempfile.mkstemp(prefix=".exposing-", suffix=".onnx",
                                           dir=os.path.dirname(os.path.abspath(model_path)))
            os.close(fd)
            onnx.save(model, written)
            source = written
        return open_session(source, _SIZES_SETTINGS, providers=providers, threads=threads, cap_bytes=cap_bytes,
                            spinning=False)
    except Exception as e:
        raise _load_error(e) from e
    finally:
        while len(outputs) > before:
            outputs.pop()
        if written is not None:
            os.unlink(written)


def measure_exposed(model: onnx.ModelProto, inputs: dict[str, np.ndarray], names: list[str], *,
                    providers: list | None = None, threads: int = 1,
                    chunk: int | None = None, cap_bytes: int | None = None,
                    model_path: str | None = None) -> dict[str, np.ndarray]:
    """Run ``model`` (optimizations off) with ``names`` added as graph outputs, ``chunk``
    values per run (default :data:`EXPOSE_CHUNK`; 0 = all in one run), and return the arrays
    produced (optional outputs a node did not produce are left out). The real arrays, one
    chunk at a time: what ``annotate`` measures sizes with where the profile says nothing,
    and the oracle its tests compare the profile's sizes with."""
    if providers is None:
        providers = default_providers()
    chunk = EXPOSE_CHUNK if chunk is None else chunk
    names = list(dict.fromkeys(names))
    step = len(names) if chunk <= 0 else chunk
    out: dict[str, np.ndarray] = {}
    for lo in range(0, len(names), max(step, 1)):
        part = names[lo:lo + step]
        sess = _open_exposing(model, part, providers, threads, cap_bytes, model_path)
        try:
            results = sess.run(part, inputs)
        except Exception as e:
            raise InvalidModelError(f"annotate: the model failed to run: {e}") from e
        del sess
        for name, arr in zip(part, results):
            if isinstance(arr, np.ndarray):
                out[name] = arr
        del results
    return out


def _profile(model: onnx.ModelProto, inputs: dict[str, np.ndarray], settings: SessionSettings,
             runs: int, providers: list, threads: int, cap_bytes: int | None = None,
             model_path: str | None = None, outputs_into: dict | None = None,
             spinning: bool = True) -> tuple[str, list[dict]]:
    """Open ``model`` (from ``model_path`` when given) with ``settings`` and profiling on, run it
    ``runs`` times; the provider and the kernel events of the last run (its outputs by name put
    into ``outputs_into`` when given)."""
    tmp = tempfile.mkdtemp(prefix="graphopt-profile-")
    try:
        try:
            sess = open_session(
                model if model_path is None else model_path, settings, providers=providers, threads=threads,
                profile_prefix=os.path.join(tmp, "profile"), cap_bytes=cap_bytes, spinning=spinning,
            )
        except Exception as e:
            raise _load_error(e) from e
        provider = sess.get_providers()[0]
        try:
            for k in range(runs):  # warm-up first; the parser keeps the last run only
                values = sess.run(None, inputs)
                if outputs_into is not None and k == runs - 1:
                    outputs_into.update(zip((o.name for o in sess.get_outputs()), values))
                del values
        except Exception as e:
            raise InvalidModelError(f"annotate: the model failed to run: {e}") from e
        path = sess.end_profiling()     # the file it wrote (profiling is on)
        del sess
        return provider, kernel_events(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _static_sizes(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> tuple[_Sizes, list[str]]:
    """Sizes of the fed inputs, initializers and Constant outputs; the node outputs left."""
    sizes = _Sizes()
    for inp in model.graph.input:
        if inp.name in inputs:
            sizes.add_array(inp.name, np.asarray(inputs[inp.name]), "input")
    for t in model.graph.initializer:
        if t.name in sizes.bytes:
            continue
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        sizes.add(t.name, t.dims, dtype, "initializer")
    init_names = {t.name for t in model.graph.initializer}
    left: list[str] = []
    for node in model.graph.node:
        value = _constant_value(node) if _is_constant(node) else None
        for out in node.output:
            if not out or out in init_names:
                continue
            if value is not None and out == node.output[0]:
                sizes.add_array(out, value, "constant")
            else:
                left.append(out)
    return sizes, left


def measure_sizes(model: onnx.ModelProto, inputs: dict[str, np.ndarray], *,
                  kernels: list[dict] | None = None, providers: list | None = None,
                  threads: int = 1, cap_bytes: int | None = None, model_path: str | None = None) -> _Sizes:
    """Every value's size (module docstring, (b)). ``kernels``: the kernel events of a
    profiled run of ``model`` with optimizations off, if the caller has one (else one is
    made). The result's ``sources[name]`` says where each size came from (:data:`SOURCES`)."""
    if providers is None:
        providers = default_providers()
    sizes, left = _static_sizes(model, inputs)
    if kernels is None:
        _, kernels = _profile(model, inputs, _SIZES_SETTINGS, 1, providers, threads, cap_bytes, model_path,
                              spinning=False)   # sizes only: its time is not read
    skip = {t.name for t in model.graph.initializer}
    _sizes_from_kernels(model, kernels, sizes, skip)
    unknown = [n for n in left if n not in sizes.bytes]
    if unknown:
        for name, arr in measure_exposed(model, inputs, unknown, providers=providers,
                                         threads=threads, cap_bytes=cap_bytes, model_path=model_path).items():
            sizes.add_array(name, arr, "exposed")
    return sizes


def annotate(
    model: onnx.ModelProto,
    inputs: dict[str, np.ndarray],
    settings: SessionSettings,
    *,
    providers: list | None = None,
    threads: int = 1,
    cap_bytes: int | None = None,
    model_path: str | None = None,
    outputs_into: dict | None = None,
    node_times: str = "profile",
) -> Annotations:
    """Measure ``model`` on ``inputs`` (see the module docstring for how). ``outputs_into``: the
    timed run's outputs by name are put into it (a caller that checks them saves a run of its
    own). ``cap_bytes``: every
    session ONNX Runtime opens for it may hold at most that many bytes (`open_session`); a run
    that needs more fails with its out-of-memory error. ``model_path``: the file ``model`` was
    loaded from, which the sessions open, so that ``model`` need not hold the weights
    (``onnx.load(..., load_external_data=False)``) nor be serialized for each session.
    ``node_times="replay"``: the seconds of the model's nodes from replaying each distinct node
    alone on the provider (graphopt/runtime/replay.py), for a provider whose profile times launches
    rather than kernels; the profile's seconds are kept for the nodes not replayed (and for nodes
    ONNX Runtime made at load)."""
    if providers is None:
        providers = default_providers()
    known = {i.name for i in model.graph.input}
    inputs = {k: v for k, v in inputs.items() if k in known}
    same_run = settings.graph_optimization_level == "ORT_DISABLE_ALL"
    sizes = None
    if not same_run:
        # Sizes first, from one profiled run with optimizations off (its session closed
        # before the timed one opens).
        sizes = measure_sizes(model, inputs, providers=providers, threads=threads, cap_bytes=cap_bytes,
                              model_path=model_path)
    provider, kernels = _profile(model, inputs, settings, 2, providers, threads, cap_bytes, model_path,
                                 outputs_into)
    if sizes is None:
        sizes = measure_sizes(model, inputs, kernels=kernels, providers=providers, threads=threads,
                              cap_bytes=cap_bytes, model_path=model_path)
    ann = Annotations(provider=provider, settings=settings)
    ann.execution_order, ann.node_seconds = order_and_seconds(kernels)
    ann.tensor_bytes, ann.tensor_shapes, ann.tensor_dtypes = sizes.bytes, sizes.shapes, sizes.dtypes
    if node_times == "replay":
        replayed = replay(model, inputs, sizes.shapes, sizes.dtypes, providers=providers, threads=threads,
                          model_path=model_path)
        ann.node_seconds.update(replayed.node_seconds)
        ann.node_seconds_from = "replay"
        ann.nodes_not_replayed = len(replayed.skipped)
    elif node_times != "profile":
        raise ValueError(f"node_times must be 'profile' or 'replay', got {node_times!r}")
    return ann


def replay(model: onnx.ModelProto, inputs: dict[str, np.ndarray], tensor_shapes: dict[str, list[int]],
           tensor_dtypes: dict[str, str], *, providers: list | None = None, threads: int = 1,
           model_path: str | None = None):
    """Each node's seconds from replaying the distinct nodes of `model` alone on the provider
    (graphopt/runtime/replay.py), on the measured shapes and types; the inputs it replays with
    their real values read from the graph (fed inputs, initializers, Constant nodes) or, computed
    while the step runs, from one run of the model with them added as outputs. A `Replayed`."""
    from graphopt.onnx_ops import ALIAS_OPS
    from graphopt.runtime.replay import real_value_names, replay_node_seconds
    if providers is None:
        providers = default_providers()
    wanted = set(real_value_names(model, tensor_shapes, tensor_dtypes))
    values = {name: np.asarray(inputs[name]) for name in wanted if name in inputs}
    base_dir = os.path.dirname(os.path.abspath(model_path)) if model_path else ""
    for t in model.graph.initializer:
        if t.name in wanted and t.name not in values:
            values[t.name] = numpy_helper.to_array(t, base_dir)
    for node in model.graph.node:
        if _is_constant(node) and node.output and node.output[0] in wanted:
            value = _constant_value(node)
            if value is not None:
                values[node.output[0]] = value
    computed = sorted(wanted - set(values))
    if computed:
        values.update(measure_exposed(model, inputs, computed, providers=providers, threads=threads, chunk=0,
                                      model_path=model_path))
    return replay_node_seconds(model, tensor_shapes, tensor_dtypes, values, providers=providers, threads=threads,
                               views=ALIAS_OPS)


def write_annotations(model: onnx.ModelProto, ann: Annotations) -> None:
    """Store ``ann`` as JSON in ``model.metadata_props[ANNOTATIONS_KEY]`` (replacing an
    existing entry) and add ``value_info`` (measured dtype and shape) for every
    intermediate value that has none."""
    _set_metadata(model, ANNOTATIONS_KEY, ann.to_json())
    g = model.graph
    have = {v.name for v in g.value_info} | {v.name for v in g.input} | {v.name for v in g.output}
    have |= {t.name for t in g.initializer}
    for node in g.node:
        for out in node.output:
            if not out or out in have or out not in ann.tensor_shapes:
                continue
            try:
                elem = helper.np_dtype_to_tensor_dtype(np.dtype(ann.tensor_dtypes[out]))
            except Exception:
                continue
            g.value_info.append(helper.make_tensor_value_info(out, elem, ann.tensor_shapes[out]))
            have.add(out)


def read_annotations(model: onnx.ModelProto) -> Annotations | None:
    """The annotations stored in the model's metadata, or None."""
    for prop in model.metadata_props:
        if prop.key == ANNOTATIONS_KEY:
            return Annotations.from_json(prop.value)
    return None
