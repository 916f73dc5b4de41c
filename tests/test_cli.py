"""The `graphopt` command line, run as a real subprocess."""
import json
import subprocess
import sys

import onnx
import pytest

from graphopt.examples import forward_example, training_example
from graphopt.report import Report, summary_text
from graphopt.runtime.session import machine_cores, read_settings


def graphopt(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "graphopt.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr)
    return proc


@pytest.fixture(scope="module")
def small_training(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    model, _ = training_example("mlp", small=True)
    path = folder / "train.onnx"
    onnx.save(model, path)
    return path


def test_optimize_writes_model_and_report(small_training, tmp_path):
    out, report_path = tmp_path / "opt.onnx", tmp_path / "r.json"
    proc = graphopt("optimize", small_training, "-o", out, "--report", report_path)
    assert "outputs identical: True" in proc.stdout
    report = json.loads(report_path.read_text())
    for key in ("checkpoints", "recompute_nodes", "search_seconds", "outputs_match", "predicted", "measured",
                "order_followed", "solver_exact", "measurement_method", "provider", "outcome", "outcome_reason"):
        assert key in report
    assert report["order_followed"] is True and report["provider"] == "CPUExecutionProvider"
    assert report["measurement_method"] == report["measured"]["optimized"]["method"] != ""
    # timed and measured at the machine's cores by default, and said so
    assert report["threads"] == machine_cores()
    assert f"({report['provider']}, {machine_cores()} thread" in proc.stdout
    # the JSON reads back as the typed report, and the summary printed is the one renderer's
    typed = Report.from_dict(report)
    assert typed.to_dict() == report
    assert summary_text(typed) in proc.stdout
    # (this small model's peaks can measure 0: its buffers fit in pages the process already had)
    peaks = {label: report["measured"][label]["peak_bytes"]
             for label in ("original_default_session", "original_optimizations_off", "optimized")}
    assert all(isinstance(p, int) and p >= 0 for p in peaks.values()), peaks
    if report["outcome"] == "optimized":   # returned only below the original in both sessions
        assert peaks["optimized"] < min(peaks["original_default_session"], peaks["original_optimizations_off"]), peaks
    assert report["measured"]["original_default_session"]["step_seconds"] > 0
    assert report["measured"]["optimized"]["step_seconds"] > 0
    # the original with optimizations off is timed only where the original is returned and that
    # session measured a lower peak than the default one (the answer depends on its step time)
    off = report["measured"]["original_optimizations_off"].get("step_seconds")
    measured = report["measured"]
    off_lower = measured["original_optimizations_off"]["peak_bytes"] < measured["original_default_session"]["peak_bytes"]
    assert (off is not None) == (report["outcome"] != "optimized" and off_lower) == (
        report["ratios"].get("step_time_vs_optimizations_off") is not None)
    assert ("step not timed" in proc.stdout) == (off is None)
    model = onnx.load(out)
    keys = {p.key for p in model.metadata_props}
    assert {"graphopt.session", "graphopt.annotations"} <= keys
    # the report's session is the one the returned model carries (the original's lowest one when
    # it is returned), read back typed
    assert typed.session == read_settings(model) is not None
    # a rewritten model carries its plan; a model not improved comes back as the original, said plainly
    assert report["outcome"] in ("optimized", "original")
    if report["outcome"] == "optimized":
        assert "graphopt.plan" in keys and "outcome: optimized" in proc.stdout
    else:
        assert "graphopt.plan" not in keys and "NOT IMPROVED, the original model is returned" in proc.stdout
        assert len(model.graph.node) == report["nodes"]["original"]
    onnx.checker.check_model(model)


def test_measure_prints_peak(tmp_path):
    # activations of 128 KiB: a live set of a few KiB can measure 0 (page resolution)
    model, _ = training_example("mlp", batch=256, width=128, depth=4, d_in=64)
    path = tmp_path / "train.onnx"
    onnx.save(model, path)
    proc = graphopt("measure", path, "--json", "--repeats", "1")
    result = json.loads(proc.stdout)
    assert result["peak_bytes"] > 0 and result["step_seconds"] > 0


def test_train_graph_builds_training_graph(tmp_path):
    forward = forward_example("mlp", small=True)
    fwd, train = tmp_path / "fwd.onnx", tmp_path / "train.onnx"
    onnx.save(forward, fwd)
    graphopt("train-graph", fwd, "-o", train)
    outputs = [o.name for o in onnx.load(train).graph.output]
    assert outputs[0] == forward.graph.output[0].name
    assert all(o.endswith("_grad") for o in outputs[1:]) and len(outputs) > 1


def test_infeasible_budget_names_least_peak(small_training, tmp_path):
    proc = graphopt("optimize", small_training, "-o", tmp_path / "x.onnx", "--budget", "1", check=False)
    assert proc.returncode == 2
    assert "cannot be met" in proc.stderr and "least peak" in proc.stderr
    assert not (tmp_path / "x.onnx").exists()


def test_not_onnx_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01garbage" * 10)
    proc = graphopt("optimize", bad, "-o", tmp_path / "x.onnx", check=False)
    assert proc.returncode == 2 and "error" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_strategies_lists_defaults():
    proc = graphopt("strategies")
    for name in ("greedy", "chen-sqrt", "store-all"):
        assert name in proc.stdout


def test_train_graph_puts_a_loss_on_a_forward_model(tmp_path):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.random.RandomState(0).randn(6, 4).astype(np.float32), "fc.weight")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "fc.weight"], ["logits"], name="fc")], "fwd",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 6])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [3, 4])], [w])
    fwd, train = tmp_path / "fwd.onnx", tmp_path / "train.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), fwd)
    graphopt("train-graph", fwd, "-o", train, "--loss", "cross_entropy", "--labels", "target")
    built = onnx.load(train)
    assert [o.name for o in built.graph.output] == ["loss", "fc.weight_grad"]
    assert [i.name for i in built.graph.input] == ["x", "target"]
    assert built.graph.input[1].type.tensor_type.elem_type == TensorProto.INT64
    proc = graphopt("train-graph", fwd, "-o", train, "--loss", "hinge", check=False)
    assert proc.returncode == 2 and "unknown loss 'hinge'" in proc.stderr
