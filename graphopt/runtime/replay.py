"""Node seconds on any provider: each distinct node of the graph replayed on the device.

ONNX Runtime's profile times a node's kernel where the kernel runs on the host (the CPU
provider). Where it only launches work on a device (CUDA in the stock wheel, built without
CUPTI), the profile's durations are launch times, and a plan built on them is built on the
wrong seconds (docs/gpu.md). There, graphopt times the nodes by replaying them:

* the graph's nodes are grouped by what their kernel does: (domain, op type, attributes, every
  input's element type and shape, and the values of the inputs replayed with their real values);
  a node the planner cloned (its ``__``-attributes) is in its original's group;
* each group's first node runs alone in a session of its own on the provider (graph
  optimizations off), its inputs already on the device and its outputs bound there (IOBinding),
  warmed up, then run until it has `MIN_REPEATS` runs and `MIN_TOTAL_SECONDS` (at most
  `MAX_REPEATS`, and fewer, at least `LEAST_REPEATS`, past `MAX_GROUP_SECONDS`); each run
  returns when the device has finished (ONNX Runtime synchronizes the provider at the end of
  `Run`);
* the mean of its medians over `PASSES` passes over all groups, less the same replay's cost for a node
  that does nothing (a Neg of one element: the call into ONNX Runtime, binding and
  synchronizing), is every node of the group's seconds.

Inputs: integer and boolean values and small float ones (at most `REAL_MAX_ELEMENTS`) are the
real ones (shapes, axes, indices, masks decide what a kernel does), given by the caller
(`real_value_names` says which; graphopt/annotate.py reads them from the graph and from one run
of the model with them added as outputs); larger integer ones are zeros (a valid index everywhere), larger float ones uniform in [0.5, 1.5)
(no zero, no negative, no denormal: a value no kernel takes a slow path for).

Nodes that cannot be replayed alone (a subgraph reads the enclosing graph's values; an input of
a type numpy has no array for; a kernel that refuses the synthesized values) are left out of the
result: the caller keeps the profile's seconds for them and says how many.
"""
from __future__ import annotations

import hashlib
import logging
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

log = logging.getLogger(__name__)

MIN_REPEATS = 5
MAX_REPEATS = 200
LEAST_REPEATS = 3
MIN_TOTAL_SECONDS = 0.02
MAX_GROUP_SECONDS = 1.0
WARM_UP_RUNS = 2
# every group is replayed in this many passes over all of them, the mean of its medians kept: a
# load that comes and goes on the machine moves one group's replay, rarely both passes (on the
# CPU; one pass on a device)
PASSES = 2
# inputs of at most this many elements are replayed with their real values, whatever their type
REAL_MAX_ELEMENTS = 4096
# integer and boolean inputs up to this many bytes are replayed with their real values
REAL_MAX_NONFLOAT_BYTES = 16 << 20
# A node of the graph reads inputs another node has just written, mostly no longer in the caches;
# replayed on one set of inputs, they stay in the caches (the CPU's 32 MiB L3 here, an H100's
# 50 MiB L2) and elementwise nodes measured 0.5-0.7x their profiled seconds. Each run takes the
# next of several copies of the inputs and outputs, as many as make this many bytes (at most
# COLD_MAX_SETS).
COLD_BYTES = 64 << 20
COLD_MAX_SETS = 64

_STANDARD = ("", "ai.onnx")
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16}


def device_of(provider: str | None) -> str:
    """The device ONNX Runtime's OrtValues live on for `provider`'s inputs and outputs."""
    return "cuda" if provider == "CUDAExecutionProvider" else "cpu"


@dataclass
class Replayed:
    """What `replay_node_seconds` measured."""
    node_seconds: dict[str, float] = field(default_factory=dict)   # node name -> seconds
    groups: int = 0                                                 # distinct nodes replayed
    call_seconds: float = 0.0                                       # a replay's own cost, subtracted
    skipped: dict[str, str] = field(default_factory=dict)           # node name -> why it was not replayed


def _group_attributes(node: onnx.NodeProto) -> bytes:
    parts = [a.SerializeToString() for a in sorted(node.attribute, key=lambda a: a.name)
             if not a.name.startswith("__")]
    return b"".join(parts)


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def _real(elem_type: int, shape: list[int]) -> bool:
    """Whether an input of this type and shape is replayed with its real value."""
    elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if elements <= REAL_MAX_ELEMENTS:
        return True
    if elem_type in _FLOAT_TYPES:
        return False
    itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
    return elements * itemsize <= REAL_MAX_NONFLOAT_BYTES


def _synthesized(dtype: np.dtype, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    if dtype.kind == "f":
        return rng.uniform(0.5, 1.5, size=shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    return np.zeros(shape, dtype=dtype)


def _one_node_model(model: onnx.ModelProto, node: onnx.NodeProto, types: dict[str, tuple[int, list[int]]],
                    views: frozenset = frozenset()) -> onnx.ModelProto:
    """`node` alone: its inputs graph inputs, its outputs graph outputs (same opsets, functions).
    A node ONNX Runtime runs as a view of its input (an op type in `views`: Reshape, Squeeze, ...)
    has the shapes of its outputs as the graph's outputs instead: a graph output that aliases a
    graph input is copied."""
    names = list(dict.fromkeys(i for i in node.input if i))
    graph_inputs = [helper.make_tensor_value_info(n, types[n][0], types[n][1]) for n in names]
    nodes = [node]
    outputs = [o for o in node.output if o]
    if node.domain in _STANDARD and node.op_type in views:
        nodes += [helper.make_node("Shape", [o], [f"{o}__shape"]) for o in outputs]
        outputs = [f"{o}__shape" for o in outputs]
    graph_outputs = [onnx.ValueInfoProto(name=o) for o in outputs]
    one = helper.make_graph(nodes, "replay", graph_inputs, graph_outputs)
    replay = helper.make_model(one, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    replay.functions.extend(model.functions)
    return replay


class _Runner:
    """One session on the provider, copies of its inputs on the device (`COLD_BYTES`), its
    outputs bound there."""

    def __init__(self, model: onnx.ModelProto, feeds: dict[str, np.ndarray], providers: list, threads: int,
                 sets: int = 1, outputs: dict[str, tuple[list[int], np.dtype]] | None = None):
        import onnxruntime as ort
        from graphopt.runtime.session import UNOPTIMIZED_SETTINGS, open_session
        provider = providers[0] if isinstance(providers[0], str) else providers[0][0]
        device = device_of(provider)
        self.session = open_session(model, UNOPTIMIZED_SETTINGS, providers=providers, threads=threads, arena=True)
        self.bindings = []
        self._held = []
        for _ in range(sets):
            binding = self.session.io_binding()
            for name, array in feeds.items():
                value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), device, 0)
                self._held.append(value)
                binding.bind_ortvalue_input(name, value)
            for output in self.session.get_outputs():
                if outputs and output.name in outputs:   # a buffer of its own per set, as cold as the inputs
                    shape, dtype = outputs[output.name]
                    value = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, 0)
                    self._held.append(value)
                    binding.bind_ortvalue_output(output.name, value)
                else:
                    binding.bind_output(output.name, device, 0)
            self.bindings.append(binding)
        self._next = 0

    def run(self) -> None:
        binding = self.bindings[self._next]
        self._next = (self._next + 1) % len(self.bindings)
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()

    def median_seconds(self) -> float:
        for _ in range(max(WARM_UP_RUNS, len(self.bindings))):   # every set's outputs allocated once
            self.run()
        times: list[float] = []
        while len(times) < MAX_REPEATS:
            t0 = time.perf_counter()
            self.run()
            times.append(time.perf_counter() - t0)
            total = sum(times)
            if len(times) >= MIN_REPEATS and total >= MIN_TOTAL_SECONDS:
                break
            if len(times) >= LEAST_REPEATS and total >= MAX_GROUP_SECONDS:
                break
        return float(statistics.median(times))


def _replay_group(model, node, types, values, rng, providers, threads, views) -> float:
    """The median seconds of one replay of `node` (inputs: `values` where known, else synthesized)."""
    feeds = {}
    for name in dict.fromkeys(i for i in node.input if i):
        elem, shape = types[name]
        value = values.get(name)
        feeds[name] = value if value is not None else _synthesized(
            np.dtype(helper.tensor_dtype_to_np_dtype(elem)), shape, rng)
    outputs = {}
    for name in node.output:
        if name and name in types:
            elem, shape = types[name]
            outputs[name] = (shape, np.dtype(helper.tensor_dtype_to_np_dtype(elem)))
    set_bytes = sum(int(np.asarray(v).nbytes) for v in feeds.values())
    set_bytes += sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in outputs.values())
    sets = int(min(COLD_MAX_SETS, max(1, -(-COLD_BYTES // max(set_bytes, 1)))))
    runner = _Runner(_one_node_model(model, node, types, views), feeds, providers, threads, sets, outputs)
    return runner.median_seconds()


def call_seconds(providers: list, threads: int) -> float:
    """What one replay costs beyond its kernel: the median replay of a Neg of one float."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    model = helper.make_model(helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "call", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    runner = _Runner(model, {"x": np.ones([1], np.float32)}, providers, threads)
    return runner.median_seconds()


def _types(tensor_shapes: dict[str, list[int]], tensor_dtypes: dict[str, str]) -> dict[str, tuple[int, list[int]]]:
    types: dict[str, tuple[int, list[int]]] = {}
    for name, shape in tensor_shapes.items():
        try:
            types[name] = (helper.np_dtype_to_tensor_dtype(np.dtype(tensor_dtypes[name])), list(shape))
        except (KeyError, TypeError, ValueError):
            continue
    return types


def _candidates(model: onnx.ModelProto, types: dict, skipped: dict[str, str]) -> list[onnx.NodeProto]:
    """The nodes that can be replayed (the others in `skipped`, with why); Constants are not nodes
    ONNX Runtime runs."""
    candidates = []
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in _STANDARD:
            continue
        if _has_subgraph(node):
            skipped[node.name] = "it has a subgraph"
            continue
        missing = [i for i in node.input if i and i not in types]
        if missing:
            skipped[node.name] = f"no measured type for its input {missing[0]!r}"
            continue
        candidates.append(node)
    return candidates


def real_value_names(model: onnx.ModelProto, tensor_shapes: dict[str, list[int]],
                     tensor_dtypes: dict[str, str]) -> list[str]:
    """The values the nodes to replay read that are replayed with their real values (module
    docstring): what the caller gives `replay_node_seconds` as `values`."""
    types = _types(tensor_shapes, tensor_dtypes)
    names = {i for n in _candidates(model, types, {}) for i in n.input if i and _real(*types[i])}
    return sorted(names)


def replay_node_seconds(model: onnx.ModelProto, tensor_shapes: dict[str, list[int]],
                        tensor_dtypes: dict[str, str], values: dict[str, np.ndarray], *,
                        providers: list, threads: int = 1, views: frozenset = frozenset()) -> Replayed:
    """Each node's seconds on `providers[0]`, by replaying each distinct node (module docstring).
    `tensor_shapes`/`tensor_dtypes`: every value's measured shape and numpy dtype name (an
    annotation's); `values`: the real values of the inputs `real_value_names` names; `views`: the
    op types ONNX Runtime runs as a view of their input."""
    out = Replayed()
    types = _types(tensor_shapes, tensor_dtypes)
    candidates = _candidates(model, types, out.skipped)
    real_names = set(real_value_names(model, tensor_shapes, tensor_dtypes))

    groups: dict[tuple, list[onnx.NodeProto]] = {}
    for node in candidates:
        signature = []
        for name in node.input:
            if not name:
                signature.append(None)
                continue
            elem, shape = types[name]
            digest = None
            if name in real_names:
                value = values.get(name)
                digest = None if value is None else hashlib.sha1(np.ascontiguousarray(value).tobytes()).hexdigest()
            signature.append((elem, tuple(shape), digest))
        key = (node.domain, node.op_type, _group_attributes(node), tuple(signature), len(node.output))
        groups.setdefault(key, []).append(node)

    out.call_seconds = call_seconds(providers, threads)
    rng = np.random.default_rng(0)
    medians: dict[int, list[float]] = {}
    keys = list(groups)
    provider = providers[0] if isinstance(providers[0], str) else providers[0][0]
    # a device's sessions cost more to make (CUDA: each Conv's algorithm search), and nothing else
    # runs on it: one pass there
    for _ in range(PASSES if device_of(provider) == "cpu" else 1):
        for index, key in enumerate(keys):
            members = groups[key]
            if members[0].name in out.skipped:
                continue
            try:
                seconds = _replay_group(model, members[0], types, values, rng, providers, threads, views)
            except Exception as exc:   # noqa: BLE001 (a kernel that refuses synthesized values, ...)
                text = str(exc).strip()
                why = f"it did not run alone: {text.splitlines()[0][:200] if text else repr(exc)}"
                for member in members:
                    out.skipped[member.name] = why
                continue
            medians.setdefault(index, []).append(seconds)
    for index, passes in medians.items():
        seconds = float(np.mean(passes))
        out.groups += 1
        for member in groups[keys[index]]:
            out.node_seconds[member.name] = max(seconds - out.call_seconds, 0.0)
    if out.skipped:
        log.info("replay: %d nodes not replayed (e.g. %s: %s)", len(out.skipped), *next(iter(out.skipped.items())))
    return out


def median_run_seconds(model: onnx.ModelProto, feeds: dict[str, np.ndarray], providers: list,
                       threads: int = 1) -> float:
    """The median seconds of one run of `model` on `providers[0]`, `feeds` already on the device and
    its outputs bound there, warmed up and repeated as a replayed node is (`_Runner`)."""
    return _Runner(model, feeds, providers, threads).median_seconds()
