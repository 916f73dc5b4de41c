"""verify's rules one at a time, each against a value worked out here from its docstring or from
ONNX Runtime run directly: what `compare_outputs` makes of shapes, dtypes, missing and extra
outputs, strings, complex values, NaN and inf, and the tolerance itself; the kind of an output;
the comparison's dict form; what `run_outputs` runs (deterministic, one thread, the settings
given, a provider that exists); which nodes `executed_order` reports (none of a subgraph's, the
model as a file or in memory, nothing left on disk); `compare_order`'s report of where an
executed order leaves the plan. Seconds in all (tests/mutation.py runs them against verify's
mutants)."""
from __future__ import annotations

import math
import os
import tempfile
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.examples import training_example
from graphopt.runtime.session import UNOPTIMIZED_SETTINGS, SessionSettings
from graphopt.verify import (
    OrderCheck,
    OutputComparison,
    compare_order,
    compare_outputs,
    compare_with_saved,
    executed_order,
    output_kind,
    run_outputs,
    save_outputs,
    subgraph_node_names,
)

f32 = np.float32


# -- compare_outputs ---------------------------------------------------------------------------
def test_an_output_of_another_shape_or_dtype_missing_or_extra_differs_infinitely():
    reference = {"a": np.ones((2, 3), f32), "b": np.ones(4, f32)}
    cases = {"shape": dict(reference, a=np.ones((3, 2), f32)),
             "dtype": dict(reference, a=np.ones((2, 3), np.float64)),
             "missing": {"b": reference["b"]},
             "extra": dict(reference, c=np.ones(1, f32))}
    for why, candidate in cases.items():
        comparison = compare_outputs(reference, candidate)
        expected = "c" if why == "extra" else "a"
        assert not comparison.match, why
        assert comparison.per_output[expected] == math.inf, (why, comparison.per_output)
        assert comparison.per_output["b"] == 0.0, why
        assert comparison.max_relative_difference == math.inf and comparison.worst_output() == expected


def test_empty_and_string_outputs_compare_by_equality():
    reference = {"empty": np.zeros((0, 3), f32), "words": np.array(["a", "bc"]),
                 "objects": np.array([b"x", 3], dtype=object)}
    same = compare_outputs(reference, {k: v.copy() for k, v in reference.items()})
    assert same.match and same.per_output == {"empty": 0.0, "words": 0.0, "objects": 0.0}
    for name, other in (("words", np.array(["a", "bd"])), ("objects", np.array([b"x", 4], dtype=object))):
        comparison = compare_outputs(reference, dict(reference, **{name: other}))
        assert not comparison.match and comparison.per_output[name] == math.inf, name


def test_a_complex_output_is_compared_on_both_parts():
    reference = {"z": np.array([3 + 4j, 0 + 0j], np.complex64)}
    imaginary_off = {"z": np.array([3 + 4.5j, 0 + 0j], np.complex64)}
    comparison = compare_outputs(reference, imaginary_off)
    # |(3+4j) - (3+4.5j)| / |3+4j| = 0.5 / 5
    assert not comparison.match
    assert comparison.per_output["z"] == pytest.approx(0.1, rel=1e-7)


def test_nan_and_inf_must_sit_at_the_same_places_with_the_same_values():
    reference = {"x": np.array([np.nan, 1.0, np.inf, -np.inf, 4.0], f32)}
    # the same non-finite places: measured on the finite ones alone (|4.5 - 4| / 4)
    near = {"x": np.array([np.nan, 1.0, np.inf, -np.inf, 4.5], f32)}
    comparison = compare_outputs(reference, near)
    assert comparison.per_output["x"] == 0.125 and not comparison.match
    assert compare_outputs(reference, {"x": reference["x"].copy()}).per_output["x"] == 0.0
    for wrong in ([1.0, 1.0, np.inf, -np.inf, 4.0],          # NaN gone
                  [np.nan, np.nan, np.inf, -np.inf, 4.0],     # NaN elsewhere
                  [np.nan, 1.0, 7.0, -np.inf, 4.0],           # an inf gone
                  [np.nan, 1.0, -np.inf, -np.inf, 4.0],       # the sign of an inf
                  [np.nan, np.inf, np.inf, -np.inf, 4.0]):    # an inf more
        comparison = compare_outputs(reference, {"x": np.array(wrong, f32)})
        assert comparison.per_output["x"] == math.inf and not comparison.match, wrong
    # an inf the reference alone holds: that output differs infinitely, and its inf is no part of
    # the floor of its kind (b_grad: 0.5 over its own largest value, 1)
    reference = {"w_grad": np.array([np.inf, 100.0], f32), "b_grad": np.array([1.0, 0.0], f32)}
    comparison = compare_outputs(reference, {"w_grad": np.array([1.0, 100.0], f32),
                                             "b_grad": np.array([1.0, 0.5], f32)})
    assert comparison.per_output == {"w_grad": math.inf, "b_grad": 0.5}


def test_the_difference_is_over_the_outputs_own_largest_value_and_the_tolerance_is_inclusive():
    reference = {"x": np.array([4.0, -1.0], f32), "loss": f32(2.0)}
    candidate = {"x": np.array([3.0, -1.0], f32), "loss": f32(2.0)}
    # |3 - 4| = 1 over max |x| = 4: exactly 0.25, at the tolerance (match) and over a smaller one
    at = compare_outputs(reference, candidate, tolerance=0.25)
    assert at.match and at.per_output == {"x": 0.25, "loss": 0.0} and at.max_relative_difference == 0.25
    assert not compare_outputs(reference, candidate, tolerance=0.2499).match


def test_no_outputs_match_with_a_zero_difference():
    comparison = compare_outputs({}, {})
    assert comparison.match and comparison.max_relative_difference == 0.0 and comparison.per_output == {}
    assert comparison.worst_output() == ""


def test_compare_with_saved_takes_the_default_tolerance_1e_5(tmp_path):
    reference = {"x": np.array([1.0, 2.0], np.float64)}
    save_outputs(tmp_path / "reference.npz", reference)
    assert compare_with_saved(tmp_path / "reference.npz", {"x": np.array([1.0, 2.0 + 1.6e-5])}).match
    assert not compare_with_saved(tmp_path / "reference.npz", {"x": np.array([1.0, 2.0 + 2.4e-5])}).match
    assert compare_outputs(reference, {"x": np.array([1.0, 2.0 + 1.6e-5])}).match
    assert not compare_outputs(reference, {"x": np.array([1.0, 2.0 + 2.4e-5])}).match


def test_the_kind_of_an_output():
    grad = np.ones((2, 2), f32)
    assert output_kind("w_grad", grad) == "_grad float32"
    assert output_kind("w_grad", np.ones(2, f32)) == "_grad float32"         # two values: a kind
    assert output_kind("w_grad", np.ones(2, np.complex64)) == "_grad complex64"
    assert output_kind("w.exp_avg_sq_updated", grad) == ".exp_avg_sq_updated float32"
    assert output_kind("w.exp_avg_updated", grad) == ".exp_avg_updated float32"
    assert output_kind("w_updated", grad) == "_updated float32"
    assert output_kind("w_grad", np.ones(1, f32)) is None                    # one value: itself alone
    assert output_kind("w_grad", np.ones((2, 2), np.int64)) is None          # not floating
    assert output_kind("counts", grad) is None                               # no kind's ending


# -- OutputComparison --------------------------------------------------------------------------
def test_the_comparison_as_a_dict_and_back():
    comparison = OutputComparison(False, 0.5, {"a": 0.5, "b": 0.0})
    assert comparison.to_dict() == {"match": False, "max_relative_difference": 0.5,
                                    "per_output": {"a": 0.5, "b": 0.0}}
    assert comparison.to_dict()["per_output"] is not comparison.per_output
    assert OutputComparison.from_dict(comparison.to_dict()) == comparison
    loose = OutputComparison.from_dict({"match": 1, "max_relative_difference": "0.25", "per_output": {3: "0.25"}})
    assert loose == OutputComparison(True, 0.25, {"3": 0.25})
    assert type(loose.match) is bool and type(loose.max_relative_difference) is float
    assert all(type(k) is str and type(v) is float for k, v in loose.per_output.items())


# -- run_outputs -------------------------------------------------------------------------------
def _scatter_add_graph(rows: int, width: int, n: int) -> onnx.ModelProto:
    """y = ScatterND(zeros, i, u, reduction=add), the gradient of an embedding Gather; y2 = y + 0."""
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("ScatterND", ["d", "i", "u"], ["y"], reduction="add", name="scatter"),
         helper.make_node("Add", ["y", "d"], ["y2"], name="again")],
        "scatter", [vi("d", TensorProto.FLOAT, [rows, width]), vi("i", TensorProto.INT64, [n, 1]),
                    vi("u", TensorProto.FLOAT, [n, width])],
        [vi("y", TensorProto.FLOAT, [rows, width]), vi("y2", TensorProto.FLOAT, [rows, width])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_run_outputs_is_deterministic_where_threads_would_race():
    """ONNX Runtime's CPU ScatterND with reduction add loses updates to races when indices repeat
    and it has two threads or more (docs/ort-facts.md section 6; measured here at this size: about
    half the runs wrong at two threads). run_outputs runs one thread: thirty runs out of thirty are
    the sequential sum,
    bit for bit (numpy's np.add.at in float32, update by update as ONNX Runtime's loop adds)."""
    rows, width, n = 2, 256, 1 << 16
    rng = np.random.default_rng(0)
    feeds = {"d": np.zeros((rows, width), f32), "i": rng.integers(0, rows, (n, 1)),
             "u": rng.standard_normal((n, width)).astype(f32)}
    expected = np.zeros((rows, width), f32)
    np.add.at(expected, feeds["i"][:, 0], feeds["u"])
    model = _scatter_add_graph(rows, width, n)
    for _ in range(30):
        out = run_outputs(model, dict(feeds, extra=np.ones(1, f32)))   # an input the model lacks is left out
        assert list(out) == ["y", "y2"]
        assert np.array_equal(out["y"], expected) and np.array_equal(out["y2"], expected)


def _session_outputs(model: onnx.ModelProto, inputs: dict, level) -> dict:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs)))


def test_run_outputs_opens_the_session_with_the_settings_given_and_a_provider_that_exists():
    """The transformer example's step (its metadata: graph optimizations off) run with the
    optimizations on (SessionSettings()) equals ONNX Runtime's own session at ORT_ENABLE_ALL bit
    for bit, with UNOPTIMIZED_SETTINGS or no settings (the metadata's) its session at
    ORT_DISABLE_ALL; the two differ (the fusions change the rounding), so the settings given are
    the ones used. No warning of a provider ONNX Runtime does not have."""
    model, inputs = training_example("transformer", layers=1, batch=2, seq=16)
    off = _session_outputs(model, inputs, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    on = _session_outputs(model, inputs, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert any(not np.array_equal(off[k], on[k]) for k in off)
    for settings, expected in ((SessionSettings(), on), (UNOPTIMIZED_SETTINGS, off), (None, off)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = run_outputs(model, inputs, settings)
        assert list(got) == list(expected)
        assert all(np.array_equal(got[k], expected[k]) for k in expected), (
            settings, [k for k in expected if not np.array_equal(got[k], expected[k])])


# -- executed_order ----------------------------------------------------------------------------
def _graph_with_a_subgraph() -> onnx.ModelProto:
    """S, G, A, then IF (its then-branch: T1, T2, which run; its else-branch: E1, holding an If of
    its own, E2, whose branches hold E3 and E4), then C after it."""
    n, vi = helper.make_node, helper.make_tensor_value_info
    leaf = lambda name, op: helper.make_graph(  # noqa: E731
        [n(op, ["a"], [name.lower()], name=name)], name, [], [vi(name.lower(), TensorProto.FLOAT, [4])])
    then_branch = helper.make_graph([n("Neg", ["a"], ["t1"], name="T1"), n("Neg", ["t1"], ["t2"], name="T2")],
                                    "then", [], [vi("t2", TensorProto.FLOAT, [4])])
    else_branch = helper.make_graph(
        [n("Abs", ["a"], ["e1"], name="E1"),
         n("If", ["c"], ["e2"], name="E2", then_branch=leaf("E3", "Neg"), else_branch=leaf("E4", "Abs"))],
        "else", [], [vi("e2", TensorProto.FLOAT, [4])])
    nodes = [n("Relu", ["x"], ["a"], name="A"),
             n("ReduceSum", ["x"], ["s"], name="S", keepdims=0),
             n("Greater", ["s", "zero"], ["c"], name="G"),
             n("If", ["c"], ["b"], name="IF", then_branch=then_branch, else_branch=else_branch),
             n("Add", ["b", "a"], ["y"], name="C")]
    graph = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [4])], [vi("y", TensorProto.FLOAT, [4])],
                              [numpy_helper.from_array(np.array(0, f32), "zero")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_the_nodes_of_subgraphs_at_any_depth():
    assert subgraph_node_names(_graph_with_a_subgraph()) == {"T1", "T2", "E1", "E2", "E3", "E4"}


def test_executed_order_leaves_out_the_nodes_a_subgraph_ran_and_keeps_the_ones_after(tmp_path, monkeypatch):
    """ONNX Runtime's profile lists T1 and T2 (the then-branch ran) right after IF: left out, and C
    after them kept. The same order from the model as a file; its temporary folder and profile are
    gone afterwards, and nothing is written where the process runs."""
    model = _graph_with_a_subgraph()
    feeds = {"x": np.ones(4, f32)}
    own = tmp_path / "own"
    own.mkdir()
    onnx.save(model, own / "model.onnx")
    work, temp = tmp_path / "work", tmp_path / "temp"
    work.mkdir()
    temp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    expected = ["S", "G", "A", "IF", "C"]
    assert executed_order(model, feeds, UNOPTIMIZED_SETTINGS) == expected
    assert executed_order(str(own / "model.onnx"), feeds, UNOPTIMIZED_SETTINGS) == expected
    assert os.listdir(temp) == [] and os.listdir(work) == []


# -- compare_order -----------------------------------------------------------------------------
def test_compare_order_says_where_the_executed_order_first_leaves_the_plan():
    planned = list("abcdefgh")
    assert compare_order(planned, list(planned)) == OrderCheck(True)
    check = compare_order(planned, list("abdcefgxh"))
    assert check == OrderCheck(False, 2, list("cdef"), list("dcef"), ["x"])
    assert check.followed is False
    # one a prefix of the other: they part where the shorter ends
    assert compare_order(planned, planned[:5]) == OrderCheck(False, 5, list("fgh"), [], [])
    assert compare_order(planned[:3], planned + ["y"]) == OrderCheck(False, 3, [], list("defg"), list("defghy"))
    assert compare_order(planned, list("abcxdefgh"), context=2) == OrderCheck(False, 3, list("de"), list("xd"), ["x"])


def test_the_order_check_as_a_dict():
    assert OrderCheck(True).to_dict() == {"followed": True}
    strays = [f"n{i}" for i in range(12)]
    check = OrderCheck(False, 3, ["a", "b"], ["c", "a"], strays)
    assert check.to_dict() == {"followed": False,
                               "first_deviation": {"position": 3, "planned": ["a", "b"], "executed": ["c", "a"]},
                               "not_in_file": strays[:10], "not_in_file_count": 12}
