"""Annotate a training graph by measuring it in ONNX Runtime.

Two runs of the model on real inputs:

(a) **Sizes.** A copy of the model with every node output added as a graph output, run
    with all graph optimizations disabled (so every value keeps its name): shapes,
    dtypes and bytes (``ndarray.nbytes``) come from the arrays the run produced, not
    from shape inference. Optional outputs a node did not produce are skipped. This
    run keeps every intermediate alive at once, so it needs the sum of all of them
    in memory.

(b) **Order and time.** The unmodified model, opened with the given ``settings``
    and profiling on, run twice (warm-up, then the profiled run); the kernel events
    of the last run, in timestamp order, give the order ORT really executed and the
    duration of each kernel.

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
are not in ``tensor_bytes`` (only the function node's outputs are).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from graphopt.errors import InvalidModelError, UnsupportedOpError
from graphopt.runtime.session import (
    SessionSettings,
    _set_metadata,
    default_providers,
    open_session,
)

ANNOTATIONS_KEY = "graphopt.annotations"

_KERNEL_SUFFIX = "_kernel_time"


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "settings": self.settings.to_dict(),
            "execution_order": list(self.execution_order),
            "tensor_bytes": dict(self.tensor_bytes),
            "tensor_shapes": {k: list(v) for k, v in self.tensor_shapes.items()},
            "tensor_dtypes": dict(self.tensor_dtypes),
            "node_seconds": dict(self.node_seconds),
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


def _all_outputs_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    existing = {o.name for o in m.graph.output}
    added = []
    for node in m.graph.node:
        for out in node.output:
            if out and out not in existing:
                m.graph.output.append(onnx.ValueInfoProto(name=out))
                existing.add(out)
                added.append(out)
    return m, [o.name for o in m.graph.output]


def _parse_profile(path: str) -> tuple[list[str], dict[str, float]]:
    with open(path) as f:
        events = json.load(f)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    kernels = [
        e for e in events
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith(_KERNEL_SUFFIX)
    ]
    if runs:
        last = max(runs, key=lambda e: e["ts"])
        lo, hi = last["ts"], last["ts"] + last.get("dur", 0)
        kernels = [e for e in kernels if lo <= e["ts"] <= hi]
    kernels.sort(key=lambda e: e["ts"])
    order: list[str] = []
    seconds: dict[str, float] = {}
    for e in kernels:
        name = e["name"][: -len(_KERNEL_SUFFIX)]
        if name not in seconds:
            order.append(name)
            seconds[name] = 0.0
        seconds[name] += float(e.get("dur", 0)) * 1e-6
    return order, seconds


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


def annotate(
    model: onnx.ModelProto,
    inputs: dict[str, np.ndarray],
    settings: SessionSettings,
    *,
    providers: list | None = None,
    threads: int = 1,
) -> Annotations:
    """Measure ``model`` on ``inputs`` (see the module docstring for how)."""
    if providers is None:
        providers = default_providers()
    known = {i.name for i in model.graph.input}
    inputs = {k: v for k, v in inputs.items() if k in known}
    # (a) sizes, every value kept as a graph output, optimizations off.
    sizes_model, out_names = _all_outputs_model(model)
    sizes_settings = SessionSettings(graph_optimization_level="ORT_DISABLE_ALL")
    try:
        sess = open_session(sizes_model, sizes_settings, providers=providers, threads=threads)
    except Exception as e:
        raise _load_error(e) from e
    try:
        results = sess.run(out_names, inputs)
    except Exception as e:
        raise InvalidModelError(f"annotate: the model failed to run: {e}") from e
    del sess
    ann = Annotations(provider="", settings=settings)
    init_names = {t.name for t in model.graph.initializer}

    def record(name: str, arr: Any) -> None:
        if not isinstance(arr, np.ndarray):
            return
        ann.tensor_bytes[name] = int(arr.nbytes)
        ann.tensor_shapes[name] = [int(d) for d in arr.shape]
        ann.tensor_dtypes[name] = arr.dtype.name

    for inp in model.graph.input:
        if inp.name in inputs:
            record(inp.name, np.asarray(inputs[inp.name]))
    for t in model.graph.initializer:
        if t.name in ann.tensor_bytes:
            continue
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        ann.tensor_bytes[t.name] = int(np.prod(t.dims, dtype=np.int64)) * dtype.itemsize
        ann.tensor_shapes[t.name] = [int(d) for d in t.dims]
        ann.tensor_dtypes[t.name] = dtype.name
    for name, arr in zip(out_names, results):
        if name not in init_names:
            record(name, arr)
    del results

    # (b) order and durations, the model as is, with the given settings.
    tmp = tempfile.mkdtemp(prefix="graphopt-profile-")
    try:
        sess = open_session(
            model, settings, providers=providers, threads=threads,
            profile_prefix=os.path.join(tmp, "profile"),
        )
        ann.provider = sess.get_providers()[0]
        sess.run(None, inputs)  # warm-up
        sess.run(None, inputs)  # profiled (the parser keeps the last run only)
        path = sess.end_profiling()
        del sess
        if not path or not os.path.exists(path):
            found = sorted(glob.glob(os.path.join(tmp, "profile*.json")))
            if not found:
                raise InvalidModelError("annotate: onnxruntime wrote no profile")
            path = found[-1]
        ann.execution_order, ann.node_seconds = _parse_profile(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ann


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
