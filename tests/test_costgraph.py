"""The cost graph (graphopt/costgraph.py) on one small training graph written out by hand, with
one op or tensor of every kind the module docstring names (a folded constant, an op that runs
first, an alias, a random op, an op that overwrites its input, a kept output, a bound one, a
droppable one, a tensor of no size and one of one byte): every derived fact is checked against
what the docstrings' rules give, worked out by hand below; the plain-data form, the base order
and the errors on malformed graphs likewise. This file is what mutation testing runs against
the cost graph (with tests/test_costmodel.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from graphopt.costgraph import BACKWARD, FORWARD, CostGraph, Op

FORWARD_OPS = [
    Op("c1", "Constant", (), ("k",), folded=True),
    Op("mm", "MatMul", ("x", "w"), ("h",), seconds=2, workspace_bytes=64),
    Op("shape", "Shape", ("h",), ("s",), runs_first=True),
    Op("view", "Reshape", ("h", "s"), ("hv",), seconds=0.5, alias=True),
    Op("drop", "Dropout", ("hv",), ("d", "mask"), recomputable=False),
    Op("relu", "Relu", ("d",), ("r",), seconds=1.5),
    Op("add", "Add", ("r", "k"), ("a",), clobbers=("r",)),
    Op("c2", "Constant", (), ("k2",), folded=True, alias=True),   # an alias with no input aliases nothing
    Op("mul", "Mul", ("a", "k2"), ("y", "tiny", "unused")),
    Op("loss", "ReduceSum", ("y",), ("loss",)),
    Op("side", "Neg", ("w",), ("nw",)),
]
BACKWARD_OPS = [
    Op("loss_grad", "Identity", ("loss",), ("gy",)),
    Op("mul_grad", "Mul", ("gy", "k2", "tiny"), ("ga",), seconds=3.0),
    Op("drop_grad", "Mul", ("ga", "mask"), ("gd",)),
    Op("mm_grad", "MatMul", ("gd", "x", "h"), ("gw",)),
]
# "mask" and "unused" have no size given (0 bytes); "orphan" is read and written by no op
TENSOR_BYTES = {"x": 100, "w": 200, "k": 8, "h": 400, "s": 0, "hv": 400, "d": 400, "r": 400, "a": 400,
                "k2": 8, "y": 300, "tiny": 1, "loss": 4, "nw": 200, "gy": 300, "ga": 400, "gd": 400,
                "gw": 200, "orphan": 50}
RESIDENT = {"x", "w"}
KEPT = {"loss", "nw", "gw"}
BOUND = {"gw"}
DROPPABLE = {"unused"}


def make(**changes) -> CostGraph:
    arguments = dict(forward=FORWARD_OPS, backward=BACKWARD_OPS, tensor_bytes=TENSOR_BYTES, resident=RESIDENT,
                     kept=KEPT, droppable=DROPPABLE, bound=BOUND)
    return CostGraph(**{**arguments, **changes})


# -- worked out by hand from the rules in costgraph.py's docstrings -----------------------------
OP_NAMES = ("c1", "mm", "shape", "view", "drop", "relu", "add", "c2", "mul", "loss", "side",
            "loss_grad", "mul_grad", "drop_grad", "mm_grad")
# first appearance over each op's inputs, outputs and overwritten inputs, ops in order; then the
# tensors only `tensor_bytes` names
TENSOR_NAMES = ("k", "x", "w", "h", "s", "hv", "d", "mask", "r", "a", "k2", "y", "tiny", "unused", "loss",
                "nw", "gy", "ga", "gd", "gw", "orphan")
FORWARD_TENSORS = {"k": "c1", "h": "mm", "s": "shape", "hv": "view", "d": "drop", "mask": "drop", "r": "relu",
                   "a": "add", "k2": "c2", "y": "mul", "tiny": "mul", "unused": "mul", "loss": "loss", "nw": "side"}
# a random op's outputs and the kept ones
FORCED = {"d", "mask", "loss", "nw"}
# the other forward tensors in order, but for the overwritten "r" and the sizeless "s" and "unused"
CANDIDATES = ("k", "h", "hv", "a", "k2", "y", "tiny")
# forward tensors the backward reads
STASHED = {"loss", "k2", "tiny", "mask", "h"}
# residents (x, w and the constants k, k2) and the bound gradient gw
OUTSIDE_PEAK_BYTES = 100 + 200 + 8 + 8 + 200


@pytest.fixture
def graph() -> CostGraph:
    # made anew for each test (a millisecond): mutation testing runs a test against a mutant of
    # CostGraph.__init__ only if that test itself makes a graph
    return make()


def test_ops_are_kept_as_given_with_plain_types(graph):
    assert tuple(graph) == OP_NAMES and len(graph) == len(OP_NAMES)
    assert graph.forward_order == OP_NAMES[:11] and graph.backward_order == OP_NAMES[11:]
    for op in FORWARD_OPS + BACKWARD_OPS:
        kept = graph.ops[op.name]
        assert kept == op, op.name
        assert type(kept.seconds) is float and type(kept.workspace_bytes) is int
        assert all(type(getattr(kept, f)) is bool for f in ("alias", "recomputable", "runs_first", "folded"))
        assert op.name in graph
    assert "x" not in graph and "nothing" not in graph
    assert graph.ops["mm"].seconds == 2.0 and graph.ops["mm"].workspace_bytes == 64
    assert graph.phase("mm") == graph.phase("side") == FORWARD == "forward"
    assert graph.phase("mm_grad") == graph.phase("loss_grad") == BACKWARD == "backward"
    assert repr(graph) == "CostGraph(11 forward + 4 backward ops, 21 tensors)"


def test_flags_are_booleans_even_when_given_as_numbers():
    numbered = [Op("a", "Relu", ("x",), ("y",), alias=1, recomputable=0, runs_first=1, folded=0),
                Op("b", "Relu", ("y",), ("z",), alias=0, recomputable=1, runs_first=0, folded=1)]
    graph = CostGraph(numbered, [], {"x": 4, "y": 4, "z": 4})
    assert [(o.alias, o.recomputable, o.runs_first, o.folded) for o in graph.ops.values()] == \
        [(True, False, True, False), (False, True, False, True)]


def test_sets_of_tensors_and_ops(graph):
    assert graph.resident == RESIDENT | {"k", "k2"}        # the folded constants' outputs too
    assert graph.kept == KEPT and graph.bound == BOUND and graph.droppable == DROPPABLE
    assert graph.clobbered == {"r"}
    assert graph.folded_ops == {"c1", "c2"}
    assert graph.runs_first_ops == {"shape"} and graph.runs_first_inputs == {"h"}
    assert dict(graph.forward_tensors) == FORWARD_TENSORS
    assert graph.forced_checkpoints == FORCED
    assert graph.candidate_checkpoints == CANDIDATES
    assert graph.stashed_tensors == STASHED
    assert graph.recompute_factor == 1.0 and type(graph.recompute_factor) is float
    assert make(recompute_factor=2).recompute_factor == 2.0
    assert graph.order == OP_NAMES


def test_producers_and_readers(graph):
    assert dict(graph.producer) == {t: op.name for op in FORWARD_OPS + BACKWARD_OPS for t in op.outputs}
    assert graph.readers("h") == ("shape", "view", "mm_grad")
    assert graph.readers("k2") == ("mul", "mul_grad")
    assert graph.readers("x") == ("mm", "mm_grad")
    assert graph.readers("gw") == () and graph.readers("orphan") == () and graph.readers("nothing") == ()


def test_ids_and_arrays_say_what_the_ops_and_tensors_say(graph):
    assert graph.tensor_names == TENSOR_NAMES
    assert dict(graph.tensor_id) == {t: i for i, t in enumerate(TENSOR_NAMES)}
    assert graph.op_names == OP_NAMES and dict(graph.op_id) == {n: i for i, n in enumerate(OP_NAMES)}
    ops = [graph.ops[n] for n in OP_NAMES]
    assert graph.op_seconds.tolist() == [op.seconds for op in ops]
    assert graph.op_workspace_bytes.tolist() == [64 if op.name == "mm" else 0 for op in ops]
    assert graph.op_alias.tolist() == [op.name == "view" for op in ops]
    assert graph.op_folded.tolist() == [op.name in ("c1", "c2") for op in ops]
    for k, op in enumerate(ops):
        reads = graph.op_input_tensor[graph.op_input_ptr[k]:graph.op_input_ptr[k + 1]]
        writes = graph.op_output_tensor[graph.op_output_ptr[k]:graph.op_output_ptr[k + 1]]
        assert [TENSOR_NAMES[i] for i in reads] == list(op.inputs), op.name
        assert [TENSOR_NAMES[i] for i in writes] == list(op.outputs), op.name
    assert graph.tensor_bytes_by_id.tolist() == [TENSOR_BYTES.get(t, 0) for t in TENSOR_NAMES]
    assert graph.tensor_resident.tolist() == [t in RESIDENT | {"k", "k2"} for t in TENSOR_NAMES]
    assert graph.tensor_kept.tolist() == [t in KEPT for t in TENSOR_NAMES]
    assert graph.tensor_bound.tolist() == [t in BOUND for t in TENSOR_NAMES]
    assert graph.tensor_droppable.tolist() == [t in DROPPABLE for t in TENSOR_NAMES]
    assert graph.outside_peak_bytes == OUTSIDE_PEAK_BYTES and type(graph.outside_peak_bytes) is int


def _arrays(graph):
    return {name: value for name, value in vars(graph).items() if isinstance(value, np.ndarray)}


@pytest.mark.parametrize("empty", [False, True], ids=["graph", "empty graph"])
def test_the_arrays_are_typed_and_read_only(graph, empty):
    """Bytes and ids are integers, seconds floats, flags booleans (masks), also when there is no
    op or tensor; and the graph never changes after it is made."""
    graph = CostGraph([], [], {}) if empty else graph
    arrays = _arrays(graph)
    expected = {"op_seconds": np.float64, "op_workspace_bytes": np.int64, "op_alias": np.bool_,
                "op_folded": np.bool_, "op_input_ptr": np.int64, "op_input_tensor": np.int64,
                "op_output_ptr": np.int64, "op_output_tensor": np.int64, "tensor_bytes_by_id": np.int64,
                "tensor_resident": np.bool_, "tensor_kept": np.bool_, "tensor_bound": np.bool_,
                "tensor_droppable": np.bool_}
    assert {name: a.dtype.type for name, a in arrays.items()} == expected
    for name, array in arrays.items():
        assert not array.flags.writeable, name
        if array.size:
            with pytest.raises(ValueError, match="read-only"):
                array[0] = array[0]
    if empty:
        assert graph.outside_peak_bytes == 0 and graph.candidate_checkpoints == () and len(graph) == 0
        assert graph.op_input_ptr.tolist() == [0] and graph.op_input_tensor.tolist() == []


def test_a_given_base_order_is_kept():
    interleaved = ("c1", "c2", "mm", "shape", "side", "view", "drop", "relu", "add", "mul", "loss",
                   "loss_grad", "mul_grad", "drop_grad", "mm_grad")
    graph = make(order=list(interleaved))
    assert graph.order == interleaved and graph.forward_order == OP_NAMES[:11]


@pytest.mark.parametrize("order", [OP_NAMES[:-1], OP_NAMES + ("mm",), OP_NAMES[:-1] + ("mm",),
                                   OP_NAMES[:-1] + ("ghost",)],
                         ids=["an op left out", "an op twice", "an op twice, one left out", "an unknown op"])
def test_an_order_that_does_not_name_every_op_once_is_refused(order):
    with pytest.raises(ValueError, match="^the order must name every op of the graph once$"):
        make(order=list(order))


def test_two_ops_of_one_name_are_refused():
    with pytest.raises(ValueError, match="^two ops are named 'relu'$"):
        make(backward=BACKWARD_OPS + [Op("relu", "Relu", ("gd",), ("g2",))])


def test_a_tensor_with_two_producers_is_refused():
    with pytest.raises(ValueError, match="^tensor 'gd' is written by two ops: 'drop_grad' and 'again'$"):
        make(backward=BACKWARD_OPS + [Op("again", "Relu", ("gy",), ("gd",))])


def test_a_bound_tensor_must_be_kept():
    assert make(bound=KEPT).bound == KEPT          # every kept tensor may be bound
    with pytest.raises(ValueError) as refused:
        make(bound=BOUND | {"h", "a", "y", "hv", "d", "r", "s"})
    message = str(refused.value)
    assert message.startswith("bound tensors must be kept (graph outputs): ")
    named = [t for t in ("h", "a", "y", "hv", "d", "r", "s") if repr(t) in message]
    assert 1 <= len(named) <= 5 and "'gw'" not in message     # names the problem, briefly


# -- the plain-data form ------------------------------------------------------------------------
def _everything(graph: CostGraph) -> dict:
    return {"ops": dict(graph.ops), "forward": graph.forward_order, "backward": graph.backward_order,
            "tensor_bytes": dict(graph.tensor_bytes), "resident": graph.resident, "kept": graph.kept,
            "bound": graph.bound, "droppable": graph.droppable, "clobbered": graph.clobbered,
            "recompute_factor": graph.recompute_factor, "order": graph.order}


def test_the_plain_data_form_is_json_and_gives_the_same_graph_back():
    interleaved = ("c1", "c2", "mm", "shape", "side", "view", "drop", "relu", "add", "mul", "loss",
                   "loss_grad", "mul_grad", "drop_grad", "mm_grad")
    graph = make(recompute_factor=1.25, order=list(interleaved))
    data = json.loads(json.dumps(graph.to_dict()))
    assert set(data) == {"forward", "backward", "tensor_bytes", "resident", "kept", "droppable",
                         "recompute_factor", "bound", "order"}
    back = CostGraph.from_dict(data)
    assert _everything(back) == {"ops": {op.name: op for op in FORWARD_OPS + BACKWARD_OPS},
                                 "forward": OP_NAMES[:11], "backward": OP_NAMES[11:], "tensor_bytes": TENSOR_BYTES,
                                 "resident": RESIDENT | {"k", "k2"}, "kept": KEPT, "bound": BOUND,
                                 "droppable": DROPPABLE, "clobbered": {"r"}, "recompute_factor": 1.25,
                                 "order": interleaved}
    assert back.tensor_names == TENSOR_NAMES and back.candidate_checkpoints == CANDIDATES
    assert data["resident"] == sorted(RESIDENT | {"k", "k2"}) and data["kept"] == sorted(KEPT)
    assert data["forward"][3] == {"name": "view", "op_type": "Reshape", "inputs": ["h", "s"], "outputs": ["hv"],
                                  "seconds": 0.5, "alias": True, "recomputable": True, "runs_first": False,
                                  "folded": False, "clobbers": [], "workspace_bytes": 0}


def test_the_plain_data_form_may_leave_out_what_has_a_default():
    """Older saved graphs have no clobbers, bound, order, ...: each takes its default."""
    data = {"forward": [{"name": "f", "op_type": "Relu", "inputs": ["x"], "outputs": ["y"], "seconds": 1.0}],
            "backward": [{"name": "b", "op_type": "Relu", "inputs": ["y"], "outputs": ["g"]}],
            "tensor_bytes": {"x": 4, "y": 8, "g": 4}}
    graph = CostGraph.from_dict(data)
    assert _everything(graph) == {
        "ops": {"f": Op("f", "Relu", ("x",), ("y",), seconds=1.0), "b": Op("b", "Relu", ("y",), ("g",))},
        "forward": ("f",), "backward": ("b",), "tensor_bytes": {"x": 4, "y": 8, "g": 4}, "resident": set(),
        "kept": set(), "bound": set(), "droppable": set(), "clobbered": set(), "recompute_factor": 1.0,
        "order": ("f", "b")}
    full = dict(data, resident=["x"], kept=["g"], bound=["g"], droppable=["y"], recompute_factor=3.0,
                order=["f", "b"])
    full["forward"] = [dict(data["forward"][0], clobbers=["x"], workspace_bytes=16, alias=True)]
    graph = CostGraph.from_dict(full)
    assert graph.resident == {"x"} and graph.kept == {"g"} and graph.bound == {"g"} and graph.droppable == {"y"}
    assert graph.recompute_factor == 3.0 and graph.clobbered == {"x"}
    assert graph.ops["f"] == Op("f", "Relu", ("x",), ("y",), seconds=1.0, alias=True, clobbers=("x",),
                                workspace_bytes=16)


# -- the base order from a run ------------------------------------------------------------------
# the order ONNX Runtime might run the graph in: no constant (they never run), `side` late
RUN_ORDER = ["mm", "shape", "view", "drop", "relu", "add", "mul", "loss", "loss_grad", "side", "mul_grad",
             "drop_grad", "mm_grad"]


def test_in_order_takes_the_run_order_and_puts_what_it_does_not_name_first(graph):
    ordered = graph.in_order(RUN_ORDER + ["ghost"])      # a name the graph does not have is ignored
    assert ordered.order == ("c1", "c2", *RUN_ORDER)      # the constants first, in their own order
    assert ordered.forward_order == ("c1", "c2", "mm", "shape", "view", "drop", "relu", "add", "mul", "loss",
                                     "side")
    assert ordered.backward_order == OP_NAMES[11:]
    assert _everything(ordered) == {**_everything(graph), "forward": ordered.forward_order,
                                    "order": ordered.order}
    assert graph.order == OP_NAMES      # the graph it was made from is unchanged
    again = make(recompute_factor=1.5).in_order(RUN_ORDER)
    assert again.recompute_factor == 1.5 and again.bound == BOUND


def test_in_order_puts_an_unnamed_op_first_even_when_declared_late(graph):
    order = [n for n in RUN_ORDER if n != "side"]     # `side` reads only a resident: it may run first
    assert graph.in_order(order).order == ("c1", "c2", "side", *order)


def test_in_order_refuses_an_order_that_is_not_topological(graph):
    swapped = ["mm", "view", "shape", *RUN_ORDER[3:]]
    with pytest.raises(ValueError, match="^op 'view' would read 's' before its producer 'shape' runs: "
                                         "the order is not topological$"):
        graph.in_order(swapped)
    backward_first = ["mm_grad", *RUN_ORDER[:-1]]
    with pytest.raises(ValueError, match="^op 'mm_grad' would read 'gd' before its producer 'drop_grad' runs"):
        graph.in_order(backward_first)
