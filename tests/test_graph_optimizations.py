"""ORT's graph optimizations applied offline before planning (graphopt/runtime/offline.py,
pipeline._apply_graph_optimizations): the plan keeps ORT's fused kernels, the file's order is
kept, the outputs are those of the original run by ONNX Runtime itself, and "none" plans the
file as given."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from graphopt.errors import InvalidOptionError
from graphopt.examples import training_example
from graphopt.ingest import follow_order
from graphopt.inputs import save_inputs
from graphopt.optimize import OptimizeOptions, optimize
from graphopt.runtime.measure import measure
from graphopt.runtime.offline import optimize_offline
from graphopt.runtime.session import UNOPTIMIZED_SETTINGS, open_session


def _inversions(names, reference_position):
    seq = [reference_position[n] for n in names if n in reference_position]
    return sum(1 for a, b in zip(seq, seq[1:]) if b < a)


def test_follow_order_keeps_the_files_order_and_its_peak(tmp_path):
    """ORT saves an optimized graph in a topological order of its own; `follow_order` writes it
    back in the order of the file it came from: a topological order, the same nodes, and the
    peak of the original under ORT's order with optimizations off (measured), where ORT's saved
    order measures higher (the full-size example: the small one's peaks are a few KiB, noise)."""
    model, inputs = training_example("resnet")
    onnx.save(model, tmp_path / "original.onnx")
    save_inputs(tmp_path / "inputs.npz", inputs)
    optimize_offline(tmp_path / "original.onnx", tmp_path / "saved.onnx", "extended")
    saved = onnx.load(tmp_path / "saved.onnx")
    assert any(n.op_type == "FusedConv" for n in saved.graph.node)
    position = {n.name: k for k, n in enumerate(model.graph.node)}
    saved_inversions = _inversions([n.name for n in saved.graph.node], position)
    followed = onnx.ModelProto()
    followed.CopyFrom(saved)
    follow_order(followed, model)
    names = [n.name for n in followed.graph.node]
    assert sorted(names) == sorted(n.name for n in saved.graph.node)
    available = {i.name for i in followed.graph.input} | {t.name for t in followed.graph.initializer}
    for node in followed.graph.node:
        assert all(not t or t in available for t in node.input), f"{node.name} reads a value not yet produced"
        available |= set(node.output)
    assert _inversions(names, position) < saved_inversions / 4, (_inversions(names, position), saved_inversions)
    onnx.save(followed, tmp_path / "followed.onnx")
    peaks = {label: measure(tmp_path / f"{label}.onnx", tmp_path / "inputs.npz", UNOPTIMIZED_SETTINGS,
                            repeats=1).peak_bytes for label in ("original", "saved", "followed")}
    assert peaks["followed"] <= 1.05 * peaks["original"], peaks
    assert peaks["saved"] > 1.1 * peaks["followed"], peaks   # why the order is rewritten


def test_plan_keeps_ort_fused_kernels_and_the_original_outputs():
    """The resnet example's Conv+Relu pairs become ORT's FusedConv before planning; the returned
    graph recomputes and keeps them, and its outputs equal the original's under ONNX Runtime's
    own default session (an independent run, not graphopt's check)."""
    model, inputs = training_example("resnet", small=True)
    result = optimize(model, OptimizeOptions(inputs=inputs, objective="least-peak", measure=False))
    applied = result.report.graph_optimizations
    assert applied.level == "extended" and applied.op_types.get("FusedConv", 0) > 0, applied
    fused = [n for n in result.model.graph.node if n.op_type == "FusedConv" and n.domain == "com.microsoft"]
    assert fused and result.report.recompute_nodes > 0
    assert any(any(a.name == "__recompute_id" for a in n.attribute) for n in fused), "no FusedConv recomputed"
    ours = open_session(result.model, threads=1)
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in theirs.get_outputs()]
    assert [o.name for o in ours.get_outputs()] == names
    feeds = {i.name: inputs[i.name] for i in theirs.get_inputs()}
    for name, a, b in zip(names, ours.run(names, feeds), theirs.run(names, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(b).max())), err_msg=name)


def test_none_plans_the_file_as_given():
    model, inputs = training_example("resnet", small=True)
    result = optimize(model, OptimizeOptions(inputs=inputs, graph_optimizations="none", measure=False))
    assert not result.report.graph_optimizations.applied
    assert result.report.to_dict()["graph_optimizations"] == {}
    assert not any(n.domain == "com.microsoft" for n in result.model.graph.node)
    assert result.report.outputs_match


def test_unknown_level_is_refused_before_any_work(tmp_path):
    with pytest.raises(InvalidOptionError, match="'all'.*none.*basic.*extended"):
        OptimizeOptions(graph_optimizations="all").check()
    model, _ = training_example("mlp", small=True)
    onnx.save(model, tmp_path / "m.onnx")
    proc = subprocess.run([sys.executable, "-m", "graphopt.cli", "optimize", str(tmp_path / "m.onnx"), "-o",
                           str(tmp_path / "out.onnx"), "--graph-optimizations", "all"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--graph-optimizations" in proc.stderr
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("reference", ["original", "perturbed"])
def test_the_optimized_graph_is_checked_in_its_annotation_run(tmp_path, reference, caplog):
    """On the CPU provider the graph ONNX Runtime optimized is checked against the original's
    outputs in the run that annotates it (no verification run of its own): with the original's
    outputs it is planned, FusedConv and all; against outputs that differ from what it computes
    (the original's, one gradient scaled by 1.001, saved where the reference is kept) it is
    dropped with a warning naming that output, and the file is planned as given."""
    import logging

    from graphopt import pipeline
    from graphopt.analyze import analyze
    from graphopt.ingest import name_nodes
    from graphopt.runtime.isolated import Workspace
    from graphopt.verify import run_outputs, save_outputs

    model, inputs = training_example("resnet", small=True)
    tasks = []
    real_run_task = pipeline.run_task

    def logged(task, args, *rest, **kw):
        tasks.append(task)
        return real_run_task(task, args, *rest, **kw)

    with Workspace() as workspace:
        working = workspace.copy_keeping_weights_on_disk(model)
        name_nodes(working)
        training = analyze(working, None)
        workspace.save_inputs(inputs)
        original = workspace.save(training.model, "original")
        outputs = run_outputs(original, inputs, UNOPTIMIZED_SETTINGS)
        scaled = next(name for name, value in outputs.items() if value.size > 1)
        if reference == "perturbed":
            outputs[scaled] = outputs[scaled] * np.float32(1.001)
        workspace.reference_path = str(tmp_path / "reference.npz")
        save_outputs(workspace.reference_path, outputs)
        options = OptimizeOptions(inputs=inputs, providers=["CPUExecutionProvider"])
        pipeline.run_task = logged
        try:
            with caplog.at_level(logging.WARNING, logger="graphopt"):
                planned, annotations, summary = pipeline._apply_graph_optimizations(training, None, options,
                                                                                    workspace)
        finally:
            pipeline.run_task = real_run_task
    assert tasks == ["graph-optimize", "annotate"], tasks
    if reference == "original":
        assert summary.op_types.get("FusedConv", 0) > 0 and annotations is not None
        assert any(n.op_type == "FusedConv" for n in planned.model.graph.node)
    else:
        assert not summary.applied and annotations is None and planned is training
        assert f"output {scaled!r} differs from the original's" in caplog.text, caplog.text
