"""Check that a rewritten graph reproduces the original's outputs, and read the order
ONNX Runtime really executes it in (`executed_order`, from its profile).

Runs are deterministic: one thread, ``use_deterministic_compute``, CPU arena off.
(ORT's CPU ScatterND with ``reduction="add"`` — the gradient of an embedding Gather —
gives wrong, run-to-run different results with two or more threads when indices
repeat; see docs/ort-facts.md section 6.)
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np
import onnx

from graphopt.runtime.arrays import save_arrays, saved_arrays
from graphopt.runtime.profile import KERNEL_SUFFIX, kernel_events
from graphopt.runtime.step_state import UPDATED_SUFFIX
from graphopt.ingest import subgraphs
from graphopt.runtime.session import SessionSettings, open_session


@dataclass
class OutputComparison:
    match: bool
    max_relative_difference: float
    # relative difference per output name (`compare_outputs`: against the output's scale, floored
    # by its kind's largest value)
    per_output: dict[str, float] = field(default_factory=dict)

    def worst_output(self) -> str:
        """Name of the output with the largest relative difference ("" when there are none)."""
        if not self.per_output:
            return ""
        return max(self.per_output, key=lambda k: self.per_output[k])

    def to_dict(self) -> dict:
        return {"match": self.match, "max_relative_difference": self.max_relative_difference,
                "per_output": dict(self.per_output)}

    @classmethod
    def from_dict(cls, d: dict) -> "OutputComparison":
        return cls(bool(d["match"]), float(d["max_relative_difference"]),
                   {str(k): float(v) for k, v in d["per_output"].items()})


def run_outputs(
    model: onnx.ModelProto | str | os.PathLike,
    inputs: dict[str, np.ndarray],
    settings: SessionSettings | None = None,
    *,
    threads: int = 1,
    providers: list | None = None,
) -> dict[str, np.ndarray]:
    """Every graph output of one deterministic run, by name.

    ``settings=None``: the model's metadata, else the defaults. ``providers=None``: CPU.
    """
    sess = open_session(
        model, settings, providers=providers or ["CPUExecutionProvider"], threads=threads,
        arena=False, deterministic=True,
    )
    names = [o.name for o in sess.get_outputs()]
    known = {i.name for i in sess.get_inputs()}
    feeds = {k: v for k, v in inputs.items() if k in known}
    values = sess.run(names, feeds)
    return dict(zip(names, values))


# Elements compared at a time: the float64 copies and masks are of a block, not of a whole output
# (a 32 MiB float32 gradient compared whole took 4x its size more: llama's embedding in the
# verifying child)
COMPARE_BLOCK_ELEMENTS = 1 << 20

# The scale an output's difference is measured against: its own largest magnitude, but never less
# than NOISE_FLOOR x the largest magnitude among the reference's outputs of its kind (below). A
# value that is zero in exact arithmetic (the gradient of an attention key bias: softmax ignores
# a shift shared by every key) comes out of float32 as rounding noise of the values it was summed
# from, the step's own, so its size relative to itself says nothing. At the default tolerance
# 1e-5 the floor accepts in such an output an absolute difference up to 1e-7 x its kind's
# largest value, under float32's epsilon (1.19e-7): less than one rounding of those values.
# Measured (max |a - b| between ONNX Runtime's extended graph optimizations and the graph as
# given, over the largest gradient): key-bias gradients 0.003-0.04 epsilon on ALBERT-base,
# BERT-base and BART-base, 0.09-0.15 epsilon on the transformer example (a 5x margin there).
NOISE_FLOOR = 1e-2

# Kinds of outputs whose values share one scale, by the ending of their names (graphopt's builder
# and ONNX Runtime's training name them so): the gradients, each optimizer state (AdamW's second
# moment is on the square of the gradients' scale), the updated parameters and statistics. The
# first ending that matches counts. An output of no kind, or a scalar (the loss, a step count),
# is measured against itself alone.
OUTPUT_KINDS = ("_grad", ".exp_avg_sq" + UPDATED_SUFFIX, ".exp_avg" + UPDATED_SUFFIX,
                ".momentum_buffer" + UPDATED_SUFFIX, UPDATED_SUFFIX)


def output_kind(name: str, value: np.ndarray) -> str | None:
    """The kind (`OUTPUT_KINDS`, with the dtype) whose largest value floors the scale the output's
    difference is measured against; None for an output measured against itself alone: not
    floating, a scalar, or a name of no kind."""
    if value.dtype.kind not in "fc" or value.size <= 1:
        return None
    ending = next((e for e in OUTPUT_KINDS if name.endswith(e)), None)
    return None if ending is None else f"{ending} {value.dtype}"


@dataclass(frozen=True)
class _Measured:
    """One output against its reference: max |a - b| over the places both hold finite values
    (inf: they differ in name, shape, dtype, NaN or inf places, or strings), max |a| there, its kind."""
    difference: float
    largest: float = 0.0
    kind: str | None = None


def _measure(name: str, ref, candidate) -> _Measured:
    a, b = np.asarray(ref), np.asarray(candidate)
    if a.shape != b.shape or a.dtype != b.dtype:
        return _Measured(math.inf)
    if a.size == 0:
        return _Measured(0.0)
    if a.dtype.kind in "OUS":
        return _Measured(0.0 if np.array_equal(a, b) else math.inf)
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    largest = worst = 0.0
    for start in range(0, flat_a.size, COMPARE_BLOCK_ELEMENTS):
        a64 = flat_a[start:start + COMPARE_BLOCK_ELEMENTS].astype(wide)
        b64 = flat_b[start:start + COMPARE_BLOCK_ELEMENTS].astype(wide)
        nan_a, nan_b = np.isnan(a64), np.isnan(b64)
        if not np.array_equal(nan_a, nan_b):
            return _Measured(math.inf)
        if nan_a.any():
            a64, b64 = a64[~nan_a], b64[~nan_a]
        inf_a, inf_b = np.isinf(a64), np.isinf(b64)
        if inf_a.any() or inf_b.any():
            either = inf_a | inf_b
            if not np.array_equal(a64[either], b64[either]):
                return _Measured(math.inf)
            a64, b64 = a64[~either], b64[~either]
        if a64.size:
            largest = max(largest, float(np.max(np.abs(a64))))
            worst = max(worst, float(np.max(np.abs(a64 - b64))))
    return _Measured(worst, largest, output_kind(name, a))


def _compare(references, candidate: dict[str, np.ndarray], tolerance: float) -> OutputComparison:
    """The one comparison (`compare_outputs`, `compare_with_saved`): `references` yields (name,
    reference array) pairs, one at a time."""
    measured: dict[str, _Measured] = {}
    for name, reference in references:
        measured[name] = _measure(name, reference, candidate[name]) if name in candidate else _Measured(math.inf)
    for name in candidate:
        if name not in measured:
            measured[name] = _Measured(math.inf)
    kind_largest: dict[str, float] = {}
    for m in measured.values():
        if m.kind is not None:
            kind_largest[m.kind] = max(kind_largest.get(m.kind, 0.0), m.largest)
    per: dict[str, float] = {}
    for name, m in measured.items():
        if m.difference == 0.0 or math.isinf(m.difference):
            per[name] = m.difference
            continue
        floor = NOISE_FLOOR * kind_largest[m.kind] if m.kind is not None else 0.0
        per[name] = m.difference / max(m.largest, floor, 1e-12)
    worst = max(per.values(), default=0.0)
    return OutputComparison(match=worst <= tolerance, max_relative_difference=worst, per_output=per)


def compare_outputs(
    reference: dict[str, np.ndarray],
    candidate: dict[str, np.ndarray],
    tolerance: float = 1e-5,
) -> OutputComparison:
    """Relative difference per output: max|a−b| / max(max|a|, NOISE_FLOOR x the largest |a| among
    the outputs of its kind (`output_kind`), 1e-12), `a` the reference. An output's own scale
    counts, unless it is below a hundredth of its kind's largest value: then the rounding noise
    of the step's values, not the output, sets what a difference means (`NOISE_FLOOR`).

    Output names, shapes and dtypes must agree: a missing, extra or misshapen output
    (or a different dtype) gets difference ``inf``. NaN/inf must sit at the same
    places with the same values. ``match`` is every difference ≤ ``tolerance``.
    """
    return _compare(reference.items(), candidate, tolerance)


def save_outputs(path: str | os.PathLike, outputs: dict[str, np.ndarray]) -> None:
    """Write a run's outputs to ``path`` (.npz, any names), for :func:`compare_with_saved`."""
    save_arrays(path, outputs)


def compare_with_saved(
    reference_path: str | os.PathLike,
    candidate: dict[str, np.ndarray],
    tolerance: float = 1e-5,
) -> OutputComparison:
    """:func:`compare_outputs` against outputs saved by :func:`save_outputs`, reading one
    reference array at a time (the reference run's outputs are never all in memory)."""
    return _compare(saved_arrays(reference_path), candidate, tolerance)


# Nodes ONNX Runtime inserts at load between nodes of the file, which run what the file says in
# another place or type (op type -> the prefix of the names ORT gives them): copies between the
# host and a device where the provider leaves a node on the CPU (MemcpyTransformer, "Memcpy",
# "Memcpy_token_N"), casts around a float16 node the CPU has no float16 kernel for
# (InsertCastTransformer: "InsertedPrecisionFreeCast_<value>").
INSERTED_AT_LOAD = {"MemcpyFromHost": "Memcpy", "MemcpyToHost": "Memcpy", "Cast": "InsertedPrecisionFreeCast_"}


def inserted_at_load(name: str, op_type: str) -> bool:
    """Whether a node ONNX Runtime ran is one it inserted at load (`INSERTED_AT_LOAD`)."""
    prefix = INSERTED_AT_LOAD.get(op_type)
    return prefix is not None and name.startswith(prefix)


def executed_order(
    model: onnx.ModelProto | str | os.PathLike,
    inputs: dict[str, np.ndarray],
    settings: SessionSettings | None = None,
    *,
    threads: int = 1,
    providers: list | None = None,
    inserted_into: list | None = None,
) -> list[str]:
    """The node names ONNX Runtime ran, in execution order, in one profiled run of `model`
    (``settings=None``: its metadata). Nodes ORT made at load (inlined function bodies) appear
    under the names ORT gave them; nodes inside the model's subgraphs (If branches, Loop and
    Scan bodies: run by their parent node) are left out. The copies and casts ORT inserted at load
    (`inserted_at_load`, not nodes of the file) are left out too, and appended to `inserted_into`
    when given, as "name (op type)"."""
    tmp = tempfile.mkdtemp(prefix="graphopt-order-")
    try:
        sess = open_session(model, settings, providers=providers, threads=threads,
                            profile_prefix=os.path.join(tmp, "profile"))
        known = {i.name for i in sess.get_inputs()}
        sess.run(None, {k: v for k, v in inputs.items() if k in known})
        path = sess.end_profiling()     # the file it wrote (profiling is on)
        del sess
        loaded = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
        inner = subgraph_node_names(loaded)
        in_file = {n.name for n in loaded.graph.node}
        order: list[str] = []
        seen: set[str] = set()
        for event in kernel_events(path):
            name = event["name"][: -len(KERNEL_SUFFIX)]
            if name in inner or name in seen:
                continue
            seen.add(name)
            op_type = str(event.get("args", {}).get("op_name", ""))
            if name not in in_file and inserted_at_load(name, op_type):
                if inserted_into is not None:
                    inserted_into.append(f"{name} ({op_type})")
                continue
            order.append(name)
        return order
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def subgraph_node_names(model: onnx.ModelProto) -> set[str]:
    """Names of the nodes inside the model's subgraphs, at any depth."""
    names: set[str] = set()

    def visit(graph: onnx.GraphProto, inside: bool) -> None:
        for node in graph.node:
            if inside:
                names.add(node.name)
            for body in subgraphs(node):
                visit(body, True)
    visit(model.graph, False)
    return names


@dataclass
class OrderCheck:
    followed: bool
    position: int | None = None         # first step where the executed order leaves the plan
    planned: list[str] = field(default_factory=list)    # planned steps from there (a few)
    executed: list[str] = field(default_factory=list)   # what ran instead (a few)
    not_in_file: list[str] = field(default_factory=list)  # nodes ORT ran that the file lacks

    def to_dict(self) -> dict:
        out = {"followed": self.followed}
        if not self.followed:
            out.update(first_deviation={"position": self.position, "planned": self.planned,
                                        "executed": self.executed},
                       not_in_file=self.not_in_file[:10], not_in_file_count=len(self.not_in_file))
        return out


def compare_order(planned: list[str], executed: list[str], context: int = 4) -> OrderCheck:
    """Whether `executed` is exactly `planned`; if not, where and how it first differs."""
    if planned == executed:
        return OrderCheck(True)
    position = next((i for i, (a, b) in enumerate(zip(planned, executed)) if a != b),
                    min(len(planned), len(executed)))
    in_file = set(planned)
    return OrderCheck(False, position, planned[position:position + context],
                      executed[position:position + context],
                      [name for name in executed if name not in in_file])
