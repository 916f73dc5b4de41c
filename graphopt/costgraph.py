"""The cost graph: what the solvers and the one cost model see of a training graph.

Ops and tensors, each with a name and an integer id; measured seconds per op and bytes per
tensor; the forward and backward orders and the base order plans run the graph in (forward
and backward ops may interleave); which tensors exist before the step (``resident``:
graph inputs, initializers, folded constants), which are kept to its end (``kept``: graph
outputs), which of those are written into buffers the caller provides (``bound``: the state a
training step returns and a trainer feeds back, see analyze.fed_back_outputs), which the
rewrite may drop (``droppable``: unused optional outputs) and which an op overwrites in place
(``clobbered``). Derived facts (producers, readers, the forward tensors,
the forced and candidate checkpoints, the tensors the backward reads) are computed once when
the graph is made; the graph never changes after that.

The integer ids and arrays (``op_input_ptr``/``op_input_tensor``, ``tensor_bytes_by_id``, ...)
serve the inner loop (`costmodel.simulate`); solvers read ops by name. Built from ONNX by
`op_rules.build_cost_graph`; this module imports no ONNX.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

import numpy as np

FORWARD = "forward"
BACKWARD = "backward"


@dataclass(frozen=True)
class Op:
    """One op of the training graph, as the cost model sees it."""
    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    seconds: float = 0.0            # measured time of one run
    alias: bool = False             # output 0 shares input 0's buffer (Reshape, Identity, ...)
    recomputable: bool = True       # False: random ops, ops with subgraphs, ops that overwrite residents
    runs_first: bool = False        # ORT's priority order runs it as soon as it is ready (Shape, Size)
    folded: bool = False            # never runs (a Constant: an initializer once loaded)
    clobbers: tuple[str, ...] = ()  # inputs whose buffers the op overwrites with an output
    workspace_bytes: int = 0        # the kernel's own work buffer while it runs


class CostGraph:
    """An immutable training cost graph (see the module docstring)."""

    def __init__(self, forward: Sequence[Op], backward: Sequence[Op], tensor_bytes: Mapping[str, int],
                 resident: Iterable[str] = (), kept: Iterable[str] = (), droppable: Iterable[str] = (),
                 recompute_factor: float = 1.0, bound: Iterable[str] = (), order: Sequence[str] | None = None):
        ops: dict[str, Op] = {}
        for op in list(forward) + list(backward):
            if op.name in ops:
                raise ValueError(f"two ops are named {op.name!r}")
            ops[op.name] = Op(op.name, op.op_type, tuple(op.inputs), tuple(op.outputs), float(op.seconds),
                              bool(op.alias), bool(op.recomputable), bool(op.runs_first), bool(op.folded),
                              tuple(op.clobbers), int(op.workspace_bytes))
        self.ops: Mapping[str, Op] = MappingProxyType(ops)
        self.forward_order: tuple[str, ...] = tuple(op.name for op in forward)
        self.backward_order: tuple[str, ...] = tuple(op.name for op in backward)
        self._forward_set = frozenset(self.forward_order)
        # the base order plans run the graph in (forward and backward ops may interleave, as in
        # the order ONNX Runtime runs the original); default: the forward ops, then the backward
        self.order: tuple[str, ...] = (self.forward_order + self.backward_order if order is None
                                       else tuple(order))
        if order is not None and (len(self.order) != len(ops) or set(self.order) != set(ops)):
            raise ValueError("the order must name every op of the graph once")
        folded_outputs = {t for op in ops.values() if op.folded for t in op.outputs}
        self.resident: frozenset[str] = frozenset(resident) | frozenset(folded_outputs)
        self.kept: frozenset[str] = frozenset(kept)
        self.bound: frozenset[str] = frozenset(bound)
        if not self.bound <= self.kept:
            raise ValueError(f"bound tensors must be kept (graph outputs): {sorted(self.bound - self.kept)[:5]}")
        self.droppable: frozenset[str] = frozenset(droppable)
        self.clobbered: frozenset[str] = frozenset(t for op in ops.values() for t in op.clobbers)
        self.tensor_bytes: Mapping[str, int] = MappingProxyType({t: int(b) for t, b in tensor_bytes.items()})
        # a recomputed copy of an op takes this many times the op's seconds (its inputs are
        # checkpoints made long before, no longer in cache; see op_rules.RECOMPUTE_FACTOR)
        self.recompute_factor: float = float(recompute_factor)

        # ids: ops in order (forward, then backward); tensors in order of first appearance
        self.op_names: tuple[str, ...] = tuple(ops)
        self.op_id: Mapping[str, int] = MappingProxyType({name: i for i, name in enumerate(self.op_names)})
        tensor_id: dict[str, int] = {}
        for op in ops.values():
            for t in op.inputs + op.outputs + op.clobbers:
                tensor_id.setdefault(t, len(tensor_id))
        for t in self.tensor_bytes:
            tensor_id.setdefault(t, len(tensor_id))
        self.tensor_id: Mapping[str, int] = MappingProxyType(tensor_id)
        self.tensor_names: tuple[str, ...] = tuple(tensor_id)
        # per op id: measured facts and flags, and the tensor ids it reads and writes (CSR:
        # op k reads op_input_tensor[op_input_ptr[k]:op_input_ptr[k + 1]])
        op_list = list(ops.values())
        self.op_seconds: np.ndarray = _array([op.seconds for op in op_list], np.float64)
        self.op_workspace_bytes: np.ndarray = _array([op.workspace_bytes for op in op_list], np.int64)
        self.op_alias: np.ndarray = _array([op.alias and bool(op.inputs) for op in op_list], bool)
        self.op_folded: np.ndarray = _array([op.folded for op in op_list], bool)
        self.op_input_ptr, self.op_input_tensor = _csr([[tensor_id[t] for t in op.inputs] for op in op_list])
        self.op_output_ptr, self.op_output_tensor = _csr([[tensor_id[t] for t in op.outputs] for op in op_list])
        # per tensor id
        self.tensor_bytes_by_id: np.ndarray = _array([self.tensor_bytes.get(t, 0) for t in self.tensor_names],
                                                     np.int64)
        self.tensor_resident: np.ndarray = _array([t in self.resident for t in self.tensor_names], bool)
        self.tensor_kept: np.ndarray = _array([t in self.kept for t in self.tensor_names], bool)
        self.tensor_bound: np.ndarray = _array([t in self.bound for t in self.tensor_names], bool)
        self.tensor_droppable: np.ndarray = _array([t in self.droppable for t in self.tensor_names], bool)

        producer: dict[str, str] = {}
        readers: dict[str, list[str]] = {}
        for op in ops.values():
            for t in op.inputs:
                readers.setdefault(t, []).append(op.name)
            for t in op.outputs:
                if t in producer:
                    raise ValueError(f"tensor {t!r} is written by two ops: {producer[t]!r} and {op.name!r}")
                producer[t] = op.name
        self.producer: Mapping[str, str] = MappingProxyType(producer)
        self._readers = {t: tuple(r) for t, r in readers.items()}

        forward_tensors: dict[str, str] = {}
        for name in self.forward_order:
            for t in ops[name].outputs:
                forward_tensors[t] = name
        self.forward_tensors: Mapping[str, str] = MappingProxyType(forward_tensors)
        self.forced_checkpoints: frozenset[str] = frozenset(
            t for t, name in forward_tensors.items() if not ops[name].recomputable or t in self.kept)
        self.candidate_checkpoints: tuple[str, ...] = tuple(
            t for t in forward_tensors
            if t not in self.forced_checkpoints and t not in self.clobbered and self.tensor_bytes.get(t, 0) > 0)
        self.folded_ops: frozenset[str] = frozenset(name for name, op in ops.items() if op.folded)
        self.runs_first_ops: frozenset[str] = frozenset(name for name, op in ops.items() if op.runs_first)
        self.runs_first_inputs: frozenset[str] = frozenset(
            t for name in self.runs_first_ops for t in ops[name].inputs)
        self.stashed_tensors: frozenset[str] = frozenset(
            t for name in self.backward_order for t in ops[name].inputs if t in forward_tensors)

    # ---- reading

    def __contains__(self, name: object) -> bool:
        return name in self.ops

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self):
        """Op names, forward then backward."""
        return iter(self.op_names)

    def __repr__(self) -> str:
        return (f"CostGraph({len(self.forward_order)} forward + {len(self.backward_order)} backward ops, "
                f"{len(self.tensor_names)} tensors)")

    def phase(self, op: str) -> str:
        return FORWARD if op in self._forward_set else BACKWARD

    def readers(self, tensor: str) -> tuple[str, ...]:
        """Ops that read `tensor`, in order (forward, then backward)."""
        return self._readers.get(tensor, ())

    @property
    def outside_peak_bytes(self) -> int:
        """Bytes the predicted peak leaves out: the residents (weights, inputs, folded constants)
        and the bound outputs (state written into buffers the caller holds)."""
        return int(self.tensor_bytes_by_id[self.tensor_resident | self.tensor_bound].sum())

    def in_order(self, order: Sequence[str]) -> "CostGraph":
        """This graph with its base order taken from `order` (op names, e.g. the order ONNX
        Runtime ran the graph in; forward and backward ops may interleave). Ops `order` does
        not name (folded constants, which never run) go first, in their own order. ValueError
        unless the result is topological (every op after the producers of what it reads)."""
        position = {name: k for k, name in enumerate(order) if name in self.ops}
        full = sorted(self.ops, key=lambda name: (position.get(name, -1), self.op_id[name]))
        done: set[str] = set()
        for name in full:
            late = [t for t in self.ops[name].inputs if t in self.producer and self.producer[t] not in done]
            if late:
                raise ValueError(f"op {name!r} would read {late[0]!r} before its producer "
                                 f"{self.producer[late[0]]!r} runs: the order is not topological")
            done.add(name)
        forward = [n for n in full if n in self._forward_set]
        backward = [n for n in full if n not in self._forward_set]
        return CostGraph([self.ops[n] for n in forward], [self.ops[n] for n in backward], self.tensor_bytes,
                         self.resident, self.kept, self.droppable, self.recompute_factor, self.bound, full)

    # ---- plain data (JSON-ready), e.g. to keep real graphs for benchmarks

    def to_dict(self) -> dict:
        def op_dict(op: Op) -> dict:
            d = dict(vars(op))
            d["inputs"], d["outputs"], d["clobbers"] = list(op.inputs), list(op.outputs), list(op.clobbers)
            return d
        return {"forward": [op_dict(self.ops[n]) for n in self.forward_order],
                "backward": [op_dict(self.ops[n]) for n in self.backward_order],
                "tensor_bytes": dict(self.tensor_bytes), "resident": sorted(self.resident),
                "kept": sorted(self.kept), "droppable": sorted(self.droppable),
                "recompute_factor": self.recompute_factor, "bound": sorted(self.bound),
                "order": list(self.order)}

    @classmethod
    def from_dict(cls, d: dict) -> "CostGraph":
        def op(o: dict) -> Op:
            return Op(**{**o, "inputs": tuple(o["inputs"]), "outputs": tuple(o["outputs"]),
                         "clobbers": tuple(o.get("clobbers", ()))})
        return cls([op(o) for o in d["forward"]], [op(o) for o in d["backward"]], d["tensor_bytes"],
                   d.get("resident", ()), d.get("kept", ()), d.get("droppable", ()),
                   d.get("recompute_factor", 1.0), d.get("bound", ()), d.get("order"))


def _array(values, dtype) -> np.ndarray:
    return _frozen(np.array(values, dtype=dtype))


def _csr(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(r) for r in rows])
    flat = np.fromiter((x for r in rows for x in r), dtype=np.int64, count=int(ptr[-1]))
    return _frozen(ptr), _frozen(flat)


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array
