"""verify's comparison of a rewritten graph's outputs with the original's (`compare_outputs`, and
`compare_with_saved`, the one the pipeline uses), on real ONNX graphs run in ONNX Runtime: rounding
noise on a gradient that is zero in exact arithmetic does not refuse a rewrite that only changes
rounding, real differences are refused, and the tolerance's boundary is where the docs put it
(relative to each output's largest value, floored at 1% of the largest value of its kind)."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.examples import training_example
from graphopt.optimize import save_model
from graphopt.runtime.offline import optimize_offline
from graphopt.runtime.session import UNOPTIMIZED_SETTINGS
from graphopt.verify import compare_outputs, compare_with_saved, run_outputs, save_outputs

TOLERANCE = 1e-5                      # the default (OptimizeOptions.tolerance)
FLOOR = 1e-2                          # the documented floor: 1% of the largest value of a kind
EPS32 = float(np.finfo(np.float32).eps)
# the transformer example with one layer at 2 x 64 tokens: ONNX Runtime's extended graph
# optimizations (MatMul + Add into Gemm, Transpose + MatMul into FusedMatMul) change the rounding of
# its key bias's gradient, which is zero in exact arithmetic (softmax ignores a shift that every
# key shares); measured: 1.03 times that gradient's own largest value apart
TRANSFORMER = dict(layers=1, batch=2, seq=64)
ZERO_GRADIENT = "l0.k.bias_grad"


def _max_abs(a) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64))))


def _difference(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """(the training graph, the graph ONNX Runtime optimized at the extended level, the inputs,
    the original's outputs, the optimized graph's outputs, the folder), both run as the pipeline
    checks them: optimizations off, one thread."""
    folder = tmp_path_factory.mktemp("verify")
    model, inputs = training_example("transformer", **TRANSFORMER)
    original, optimized = folder / "train.onnx", folder / "extended.onnx"
    save_model(model, original)
    optimize_offline(original, optimized, "extended")
    reference = run_outputs(str(original), inputs, UNOPTIMIZED_SETTINGS)
    candidate = run_outputs(str(optimized), inputs, UNOPTIMIZED_SETTINGS)
    return model, onnx.load(str(optimized)), inputs, reference, candidate, folder


def test_rounding_noise_on_a_zero_gradient_does_not_refuse_a_fusion(fused):
    model, optimized, _, reference, candidate, folder = fused
    fusions = Counter(n.op_type for n in optimized.graph.node) - Counter(n.op_type for n in model.graph.node)
    assert fusions["Gemm"] > 0 and fusions["FusedMatMul"] > 0, fusions
    gradients = [name for name in reference if name.endswith("_grad")]
    largest = max(_max_abs(reference[name]) for name in gradients)
    # the case: the key bias's gradient is rounding noise (far under float32's resolution of the
    # step's gradients), both graphs' noise differs by about its own size (the per-output relative
    # difference the comparison used to take: ~1, refused), yet by less than one float32 rounding
    # of the largest gradient; every other output differs in rounding only
    noise = reference[ZERO_GRADIENT]
    assert _max_abs(noise) < 1e-6 * largest
    assert _difference(noise, candidate[ZERO_GRADIENT]) > 0.5 * _max_abs(noise)
    assert _difference(noise, candidate[ZERO_GRADIENT]) < EPS32 * largest
    for name in reference:
        if name != ZERO_GRADIENT:
            assert _difference(reference[name], candidate[name]) <= 1e-6 * _max_abs(reference[name]), name
    in_memory = compare_outputs(reference, candidate, TOLERANCE)
    assert in_memory.match, (in_memory.worst_output(), in_memory.max_relative_difference)
    assert in_memory.per_output[ZERO_GRADIENT] == pytest.approx(
        _difference(noise, candidate[ZERO_GRADIENT]) / (FLOOR * largest), rel=1e-9)
    save_outputs(folder / "reference.npz", reference)
    from_disk = compare_with_saved(folder / "reference.npz", candidate, TOLERANCE)
    assert from_disk.match and from_disk.per_output == in_memory.per_output


def test_optimize_keeps_ort_graph_optimizations_whose_only_change_is_rounding():
    """The user's view of the test above: `optimize` plans the graph ONNX Runtime optimized
    instead of warning that the key bias's gradient differs and planning the file as given."""
    from graphopt.optimize import OptimizeOptions, optimize
    model, inputs = training_example("transformer", **TRANSFORMER)
    report = optimize(model, OptimizeOptions(inputs=inputs, measure=False)).report
    assert report.graph_optimizations.level == "extended", report.graph_optimizations
    assert report.graph_optimizations.op_types.get("Gemm", 0) > 0
    assert report.outputs_match and report.max_relative_difference <= TOLERANCE


def _with_output_scaled(model: onnx.ModelProto, output: str, factor: float) -> onnx.ModelProto:
    """`model` with graph output `output` multiplied by `factor` (float32) in the graph itself."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    raw = output + "__unscaled"
    for node in changed.graph.node:
        node.output[:] = [raw if t == output else t for t in node.output]
    changed.graph.initializer.append(numpy_helper.from_array(np.array(factor, np.float32), output + "__factor"))
    changed.graph.node.append(helper.make_node("Mul", [raw, output + "__factor"], [output], name=output + "__scale"))
    return changed


@pytest.mark.parametrize("output", ["l0.q.bias_grad", "l0.fc2.weight_grad"])
def test_a_one_percent_error_in_a_nonzero_gradient_beside_the_noise_is_refused(fused, output):
    """The same fused graph with one non-zero gradient 1% off (the smallest gradient that is not
    noise, at 9% of the largest, and the largest): refused, naming that output."""
    _, optimized, inputs, reference, _, folder = fused
    wrong = run_outputs(_with_output_scaled(optimized, output, 1.01), inputs, UNOPTIMIZED_SETTINGS)
    largest = max(_max_abs(v) for name, v in reference.items() if name.endswith("_grad"))
    assert _max_abs(reference[output]) > 0.05 * largest
    save_outputs(folder / "reference.npz", reference)
    for comparison in (compare_outputs(reference, wrong, TOLERANCE),
                       compare_with_saved(folder / "reference.npz", wrong, TOLERANCE)):
        assert not comparison.match
        assert comparison.worst_output() == output
        assert comparison.max_relative_difference == pytest.approx(0.01, rel=0.01)


# -- the boundary: a rewrite off by 2x the tolerance is refused, one off by half of it accepted --
def _boundary_graph(scale: float = 1.0, shift: float = 0.0) -> onnx.ModelProto:
    """y = x W; outputs: loss = sum(y), W_grad = x^T tanh(y) scaled by `scale`, and b_grad = s - s
    (s = y summed over the batch: exactly zero) plus `shift`, the last two in float32 in the graph."""
    rng = np.random.default_rng(7)
    f32 = lambda v: np.asarray(v, np.float32)  # noqa: E731
    n = helper.make_node
    nodes = [n("MatMul", ["x", "W"], ["y"], name="mm"),
             n("ReduceSum", ["y"], ["loss"], name="loss", keepdims=0),
             n("Transpose", ["x"], ["xt"], name="xt", perm=[1, 0]),
             n("Tanh", ["y"], ["ty"], name="tanh"),
             n("MatMul", ["xt", "ty"], ["W_raw"], name="w_grad"),
             n("Mul", ["W_raw", "scale"], ["W_grad"], name="scale"),
             n("ReduceSum", ["y", "axis0"], ["s"], name="s", keepdims=0),
             n("Sub", ["s", "s"], ["zero"], name="zero"),
             n("Add", ["zero", "shift"], ["b_grad"], name="shift")]
    graph = helper.make_graph(
        nodes, "boundary", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("W_grad", TensorProto.FLOAT, [8, 3]),
         helper.make_tensor_value_info("b_grad", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(f32(rng.standard_normal((8, 3))), "W"),
         numpy_helper.from_array(f32(scale), "scale"), numpy_helper.from_array(f32(shift), "shift"),
         numpy_helper.from_array(np.array([0], np.int64), "axis0")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


BOUNDARY_INPUTS = {"x": np.random.default_rng(8).standard_normal((4, 8)).astype(np.float32)}


@pytest.mark.parametrize("times", [2.0, 0.5])
def test_compare_with_saved_at_the_tolerance_boundary(tmp_path, times):
    """A rewrite off by `times` x the tolerance, on an output's own scale (W_grad, the largest of
    the gradients, scaled by 1 + times x tolerance) and on the floor (b_grad, exactly zero in the
    original, shifted by times x tolerance x 1% of W_grad's largest value): refused at 2x,
    accepted at 0.5x, the figure reported being times x tolerance; `compare_outputs` agrees."""
    reference = run_outputs(_boundary_graph(), BOUNDARY_INPUTS)
    assert not reference["b_grad"].any() and _max_abs(reference["W_grad"]) > 1.0
    path = tmp_path / "reference.npz"
    save_outputs(path, reference)
    largest = _max_abs(reference["W_grad"])
    rewrites = {"W_grad": _boundary_graph(scale=1.0 + times * TOLERANCE),
                "b_grad": _boundary_graph(shift=times * TOLERANCE * FLOOR * largest)}
    for output, rewritten in rewrites.items():
        outputs = run_outputs(rewritten, BOUNDARY_INPUTS)
        comparison = compare_with_saved(path, outputs, TOLERANCE)
        assert comparison.match is (times < 1), (output, comparison.per_output)
        assert comparison.worst_output() == output
        assert comparison.per_output[output] == pytest.approx(times * TOLERANCE, rel=0.02), output
        assert comparison.per_output["loss"] == 0.0
        assert compare_outputs(reference, outputs, TOLERANCE) == comparison   # the same rule in memory


def test_the_floor_comes_from_outputs_of_the_same_kind():
    """Gradients floor gradients; an optimizer state, a scalar (the loss, a step count) and an
    output of no kind are measured on their own scale, whatever the gradients' size."""
    rng = np.random.default_rng(3)
    reference = {"loss": np.float32(3.0), "optimizer.step_updated": np.float32(0.0),
                 "w_grad": rng.standard_normal((4, 4)).astype(np.float32) * 10,
                 "b_grad": np.full(4, 1e-10, np.float32),
                 "w.exp_avg_sq_updated": np.full((4, 4), 1e-9, np.float32),
                 "counts": np.zeros(4, np.float32)}
    noisy = dict(reference, b_grad=np.full(4, -3e-10, np.float32))
    assert compare_outputs(reference, noisy).match
    for name, wrong in (("w.exp_avg_sq_updated", reference["w.exp_avg_sq_updated"] * np.float32(1.01)),
                        ("optimizer.step_updated", np.float32(1e-6)),
                        ("counts", np.full(4, 1e-9, np.float32))):
        comparison = compare_outputs(reference, dict(reference, **{name: wrong}))
        assert not comparison.match and comparison.worst_output() == name, (name, comparison.per_output)
    # float64 gradients are a kind apart from float32 ones
    apart = dict(reference, b_grad=np.full(4, 1e-10, np.float64))
    comparison = compare_outputs(apart, dict(apart, b_grad=np.full(4, -3e-10, np.float64)))
    assert not comparison.match and math.isclose(comparison.per_output["b_grad"], 4.0, rel_tol=1e-6)
