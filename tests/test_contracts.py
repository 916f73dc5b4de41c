"""Contracts at delivery (issue 11): what `optimize` returns runs in the order it was planned
for, and is never worse than the original.

- ORDER: MobileNetV3's HardSwish has no kernel on ONNX Runtime's CPU provider; ORT inlines it
  at load into HardSigmoid and Mul with node indices after every node of the file, so the
  priority-based order ran them late. The oracle here is ORT's own profile of the returned
  model against its file (`ran_as_written`), not the report's flag.
- NEVER WORSE: a real training graph whose rewritten order is worse than ORT's default walk;
  the returned model is measured in a fresh process against the original in both sessions.
"""
from __future__ import annotations

import io
import os
import sys
import tempfile

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from graphopt.builder.train_graph import build_training_graph
from graphopt.inputs import save_inputs
from graphopt.optimize import ORIGINAL_UNOPTIMIZED, OptimizeOptions, optimize, save_model
from graphopt.pipeline import first_in_order, prepare, rewrite_plan
from graphopt.report import summary_text
from graphopt.rewrite import PLANNED_SETTINGS, rewrite
from graphopt.runtime.measure import measure
from graphopt.runtime.session import DEFAULT_SETTINGS
from graphopt.search import chen_sqrt, store_all
from graphopt.verify import executed_order

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graphopt_zoo import real_zoo  # noqa: E402

RUNS_WHEN_READY = {"Shape", "Size"}   # ORT's priority order runs these as soon as they can


def ran_as_written(model: onnx.ModelProto, inputs) -> bool:
    """ORT's profile of `model` (its metadata session) shows exactly the file's nodes, in the
    file's order (Constant nodes are initializers once loaded; Shape and Size may run early)."""
    executed = executed_order(model, inputs, None)
    written = [n.name for n in model.graph.node if n.op_type != "Constant"]
    if sorted(executed) != sorted(written):
        return False
    kinds = {n.name: n.op_type for n in model.graph.node}
    return ([n for n in executed if kinds[n] not in RUNS_WHEN_READY]
            == [n for n in written if kinds[n] not in RUNS_WHEN_READY])


@pytest.fixture(scope="module")
def mobilenet_v3():
    model = real_zoo.CORPUS["mobilenet_v3_large"]("tiny")
    forward = real_zoo.export(model, "legacy")
    assert any(n.op_type == "HardSwish" for n in forward.graph.node)
    train = build_training_graph(forward, loss=model.loss, class_axis=model.class_axis)
    inputs = {name: t.numpy() for name, t in model.inputs.items()}
    inputs["labels"] = model.labels.numpy()
    return train, inputs


def test_ort_order_deviation_is_caught_and_what_is_returned_runs_as_planned(mobilenet_v3):
    train, feeds = mobilenet_v3
    # the file as given (ORT's own graph optimizations would write HardSwish's body out too)
    options = OptimizeOptions(strategy="chen-sqrt", inputs=feeds, measure=False, graph_optimizations="none")
    # the graph as it came (HardSwish kept): ORT leaves the order of every plan, store-all too
    with prepare(train, options, expand=False) as prepared:
        graph, inputs = prepared.graph, prepared.inputs
        plans = [chen_sqrt(graph), store_all(graph)]
        assert plans[0].recompute_ops > 0
        assert not ran_as_written(prepared.workspace.with_weights(rewrite_plan(prepared, plans[0])), inputs)
        tried = []
        assert first_in_order(prepared, plans, options, tried) is None
    assert [t.entry.order.followed for t in tried] == [False, False]   # the profile check caught both
    deviation = tried[0].entry.order
    assert any("HardSigmoid" in name for name in deviation.not_in_file), deviation

    # what optimize returns: HardSwish written as its function body, a plan with recomputation,
    # and ORT runs the file as written
    result = optimize(train, options)
    assert result.report.functions_expanded == {"HardSwish": sum(
        n.op_type == "HardSwish" for n in train.graph.node)}
    assert result.report.recompute_nodes > 0
    assert result.report.outputs_match
    assert ran_as_written(result.model, inputs)
    assert result.report.order_followed
    assert not any(n.op_type == "HardSwish" for n in result.model.graph.node)
    # by default the graph planned is the one ORT saves after its graph optimizations, with
    # HardSwish already written out by ORT: the same holds
    result = optimize(train, OptimizeOptions(strategy="chen-sqrt", inputs=feeds, measure=False))
    assert result.report.graph_optimizations.applied and result.report.recompute_nodes > 0
    assert result.report.outputs_match and result.report.order_followed
    assert ran_as_written(result.model, inputs)
    assert not any(n.op_type == "HardSwish" for n in result.model.graph.node)


class Branches(nn.Module):
    """Every branch's activation is computed before any is reduced: the file's order holds all
    four at once, ORT's default walk (depth first from the outputs) one at a time. Nothing is
    stashed for the backward, so recomputation cannot help: the plan, run in the file's order,
    is worse than the original."""

    def __init__(self, branches: int = 4):
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.randn(1)) for _ in range(branches)])

    def forward(self, x):
        heads = [x * w for w in self.w]
        return torch.stack([h.sum(dim=1) for h in heads], dim=1)


def test_never_worse_returns_the_best_measured_original(monkeypatch):
    """The plan is made to start from the file's order alone (ORT's order, which the planner now
    also searches, is the better one here: see test_base_order.py), so that it is worse than the
    original: the contract must then return the original."""
    import graphopt.pipeline as pipeline
    monkeypatch.setattr(pipeline, "base_order_graphs", lambda graph, execution_order: {"file": graph})
    torch.manual_seed(0)
    x = torch.randn(8, 1 << 16)                      # each branch's activation: 2 MiB
    buffer = io.BytesIO()
    torch.onnx.export(Branches().eval(), (x,), buffer, input_names=["x"], output_names=["logits"],
                      dynamo=False, opset_version=17)
    train = build_training_graph(onnx.load_from_string(buffer.getvalue()), loss="cross_entropy")
    inputs = {"x": x.numpy(), "labels": np.arange(8, dtype=np.int64) % 4}
    # least peak: this contract is about the peak (a step-time limit could also reject the plan)
    result = optimize(train, OptimizeOptions(inputs=inputs, objective="least-peak"))
    report = result.report

    with tempfile.TemporaryDirectory(prefix="contracts-") as tmp:
        inputs_path = os.path.join(tmp, "inputs.npz")
        save_inputs(inputs_path, inputs)
        paths = {}
        for label, model in (("train", train), ("returned", result.model)):
            paths[label] = os.path.join(tmp, f"{label}.onnx")
            save_model(model, paths[label])
        peak = {
            "default": measure(paths["train"], inputs_path, DEFAULT_SETTINGS).peak_bytes,
            "off": measure(paths["train"], inputs_path, ORIGINAL_UNOPTIMIZED).peak_bytes,
            "returned": measure(paths["returned"], inputs_path, None).peak_bytes,  # its metadata session
        }
    best_original = min(peak["default"], peak["off"])
    # a case where the plan is worse: its measured peak (optimize's own run of the rewritten file)
    assert report.rejected.measured.peak_bytes > 1.5 * best_original, (peak, report.rejected)
    # what came back is the original graph, no worse than the original in either session
    assert peak["returned"] <= 1.05 * best_original + (64 << 10), peak
    assert len(result.model.graph.node) == len(train.graph.node)
    assert not any("__rc" in n.name for n in result.model.graph.node)
    assert report.outcome == "original"
    # its annotations are its own graph's (annotated when it is returned: the graph planned was the
    # one ORT's graph optimizations made, whose nodes are not all the original's)
    from graphopt.annotate import read_annotations
    annotations = read_annotations(result.model)
    assert report.graph_optimizations.applied, "ORT's graph optimizations were expected to apply here"
    assert set(annotations.execution_order) == {n.name for n in result.model.graph.node if n.op_type != "Constant"}
    assert report.rejected.measured.peak_bytes > report.measured.optimized.peak_bytes
    # every plan measured says why it was not returned (graphopt/delivery.py); the rejected plan, by
    # its measured figures, that it measured not below the original
    measured = report.plans_measured
    assert measured and all(p.rejected_because for p in measured), measured
    (rejected,) = [p for p in measured if (p.measured_peak_bytes, p.measured_step_seconds)
                   == (report.rejected.measured.peak_bytes, report.rejected.measured.step_seconds)]
    assert "not below the original" in rejected.rejected_because, rejected
    assert report.measured.optimized.peak_bytes == min(report.measured.original_default_session.peak_bytes,
                                                       report.measured.original_optimizations_off.peak_bytes)
    # the returned session's step is timed, the one with optimizations off where it is returned
    # (`optimizations_off_overhead`: timed only where the answer depends on it)
    assert report.measured.optimized.step_seconds > 0
    assert report.ratios.step_time_vs_default_session == pytest.approx(
        report.measured.optimized.step_seconds / report.measured.original_default_session.step_seconds)
    text = summary_text(report)
    assert "NOT IMPROVED, the original model is returned" in text and "not below the original" in text


def test_the_plan_of_branches_starts_from_ort_order_and_is_not_above_the_original():
    """The same graph, planned as it comes: the plan starts from ORT's order, where one branch's
    activation is alive at a time, and is predicted at or below the original's peak there."""
    from graphopt.pipeline import plan, prepare
    torch.manual_seed(0)
    x = torch.randn(8, 1 << 16)
    buffer = io.BytesIO()
    torch.onnx.export(Branches().eval(), (x,), buffer, input_names=["x"], output_names=["logits"],
                      dynamo=False, opset_version=17)
    train = build_training_graph(onnx.load_from_string(buffer.getvalue()), loss="cross_entropy")
    inputs = {"x": x.numpy(), "labels": np.arange(8, dtype=np.int64) % 4}
    options = OptimizeOptions(inputs=inputs, objective="least-peak", measure=False, verify=False)
    with prepare(train, options) as prepared:
        chosen = plan(prepared, options)
        assert chosen.notes["base_order"] == "onnxruntime"
        assert chosen.peak_bytes <= prepared.predicted_original.peak_bytes
        assert prepared.base_order_peaks["file"] > 1.5 * prepared.predicted_original.peak_bytes


def _corrupting(real_rewrite, when):
    """The real rewrite, then (for plans where `when(plan)`) the first gradient scaled by 1.5:
    a rewritten model whose outputs differ, as a wrong plan's would."""
    from onnx import helper, numpy_helper

    def corrupt(training, graph, plan, settings=PLANNED_SETTINGS):
        model = real_rewrite(training, graph, plan, settings)
        if when(plan):
            name = model.graph.output[1].name
            producer = next(n for n in model.graph.node if name in n.output)
            producer.output[list(producer.output).index(name)] = name + "__raw"
            model.graph.initializer.append(numpy_helper.from_array(np.array(1.5, np.float32), "corrupt_by"))
            model.graph.node.append(helper.make_node("Mul", [name + "__raw", "corrupt_by"], [name],
                                                     name="corrupt"))
        return model
    return corrupt


def test_a_plan_whose_outputs_differ_is_rejected_for_the_next_one(monkeypatch, caplog):
    """OUTPUTS: the chosen plan's outputs differ -> a warning, store-all (no recomputation)
    is delivered, and the report names the rejected plan's output and difference."""
    import graphopt.pipeline as pipeline
    from test_rewrite import batchnorm_training_graph
    model, feeds = batchnorm_training_graph()
    monkeypatch.setattr(pipeline, "rewrite", _corrupting(rewrite, lambda plan: plan.recompute_ops > 0))
    with caplog.at_level("WARNING", logger="graphopt.pipeline"):
        result = optimize(model, OptimizeOptions(strategy="chen-sqrt", inputs=feeds, measure=False))
    report = result.report
    gradient = model.graph.output[1].name
    assert [t.outputs_match for t in report.order.plans_tried] == [False, True]
    assert report.strategy == "store-all" and report.recompute_nodes == 0 and report.outputs_match
    rejected = report.rejected_for_outputs
    assert len(rejected) == 1 and rejected[0].strategy == "chen-sqrt" and rejected[0].output == gradient
    assert rejected[0].relative_difference > 0.3
    assert repr(gradient) in report.outcome_reason and "rejected" in report.outcome_reason
    assert any("rejected" in r.getMessage() and gradient in r.getMessage() for r in caplog.records)
    assert not any(n.name == "corrupt" for n in result.model.graph.node)


def test_verification_error_when_even_the_plan_without_recomputation_differs(monkeypatch):
    import graphopt.pipeline as pipeline
    from graphopt.errors import VerificationError
    from test_rewrite import batchnorm_training_graph
    model, feeds = batchnorm_training_graph()
    monkeypatch.setattr(pipeline, "rewrite", _corrupting(rewrite, lambda plan: True))
    with pytest.raises(VerificationError, match=model.graph.output[1].name):
        optimize(model, OptimizeOptions(strategy="chen-sqrt", inputs=feeds, measure=False))


def test_optimize_runs_onnx_runtime_only_in_child_processes(monkeypatch):
    """BOUNDED MEMORY (structure): optimize's own process opens no ONNX Runtime session, so it
    never holds a training step; annotate, the outputs comparison, the order check and the
    measurements run in children, one at a time (benchmarks/annotate_memory.py --modes
    step,optimize measures the peaks). The result is still verified and measured."""
    import onnxruntime as ort
    from test_rewrite import batchnorm_training_graph
    model, feeds = batchnorm_training_graph()
    opened = []

    def no_session_here(*args, **kwargs):
        opened.append(args[:1])
        raise AssertionError("an ONNX Runtime session was opened in optimize's own process")

    monkeypatch.setattr(ort, "InferenceSession", no_session_here)
    result = optimize(model, OptimizeOptions(strategy="chen-sqrt", inputs=feeds))
    assert opened == []
    report = result.report
    assert report.outputs_match and report.order.plans_tried
    # measured all the same, in children: each peak says how it was taken (not its figure: with
    # optimizations off it read 0 in three runs of this model on the CPU, VmHWM moved by no page),
    # and the default session's step was timed
    off, default = report.measured.original_optimizations_off, report.measured.original_default_session
    assert off.method and default.method and off.provider == default.provider == report.provider
    assert default.step_seconds > 0
    assert report.outcome in ("optimized", "original")


def test_outputs_compared_from_disk_equal_the_in_memory_comparison():
    """The reference outputs are written once and compared one array at a time
    (`verify.compare_with_saved`): the same verdicts as `compare_outputs`, including a missing,
    an extra and a misshapen output, and NaNs at different places."""
    from graphopt.verify import compare_outputs, compare_with_saved, save_outputs
    rng = np.random.default_rng(0)
    reference = {"loss": np.float32(2.5), "w/grad:0": rng.standard_normal((3, 4)).astype(np.float32),
                 "b_grad": rng.standard_normal(4).astype(np.float32), "gone": np.zeros(2, np.float32),
                 "nan": np.array([1.0, np.nan], np.float32)}
    candidate = {"loss": np.float32(2.5), "w/grad:0": reference["w/grad:0"] * np.float32(1 + 1e-3),
                 "b_grad": reference["b_grad"].reshape(1, 4), "extra": np.ones(1, np.float32),
                 "nan": np.array([np.nan, 1.0], np.float32)}
    with tempfile.TemporaryDirectory(prefix="contracts-") as tmp:
        path = os.path.join(tmp, "reference.npz")
        save_outputs(path, reference)
        from_disk = compare_with_saved(path, candidate, 1e-5)
        same = compare_with_saved(path, dict(reference), 1e-5)
    in_memory = compare_outputs(reference, candidate, 1e-5)
    assert from_disk.per_output == in_memory.per_output
    assert from_disk.match is False and from_disk.worst_output() in ("gone", "b_grad", "extra", "nan")
    assert 9e-4 < from_disk.per_output["w/grad:0"] < 1.1e-3
    assert same.match and same.max_relative_difference == 0.0
