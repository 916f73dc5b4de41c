"""The peak explained (graphopt/explain.py): what is alive at a schedule's peak, by kind, against a
step-by-step reference walk of the schedule; the kinds on a graph built by hand where each is
known; the floor's words; the report and `analyze` carrying it."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import onnx
import pytest

from graphopt.costgraph import FORWARD, CostGraph, Op
from graphopt.costmodel import priority_order, simulate
from graphopt.explain import explain_floor, explain_peak, module_path
from graphopt.report import PEAK_KINDS, Report
from graphopt.search.plan import peak_floor_bytes, schedule_for

from graphopt_zoo.synthetic import branching_cost_graph, training_cost_graph


def reference_alive(graph: CostGraph, schedule, step: int) -> list[dict]:
    """The buffers alive while `schedule[step]` runs, by walking the schedule one step at a time
    (costmodel's rules: a buffer per write, an alias's output 0 sharing its input's; freed after
    its last read unless a graph output or never read; a droppable output never read: none)."""
    latest: dict[str, int | None] = {}
    buffers: list[dict] = []
    for i, (name, copy) in enumerate(schedule):
        op = graph.ops[name]
        for t in op.inputs:
            b = latest.get(t)
            if b is not None:
                buffers[b]["last"] = i
        for k, t in enumerate(op.outputs):
            if op.folded or (copy == 0 and t in graph.bound):
                latest[t] = None
                continue
            if k == 0 and op.alias and op.inputs and (op.inputs[0] in latest or op.inputs[0] in graph.resident):
                b = latest.get(op.inputs[0])
                latest[t] = b
                if b is not None and copy == 0 and t in graph.kept:
                    buffers[b]["kept"] = True
                continue
            latest[t] = len(buffers)
            buffers.append({"tensor": t, "bytes": graph.tensor_bytes.get(t, 0), "born": i, "last": i, "copy": copy,
                            "producer": name, "kept": copy == 0 and t in graph.kept,
                            "droppable": t in graph.droppable})
    alive = []
    for b in buffers:
        never_read = b["last"] == b["born"]
        if b["born"] > step or (never_read and b["droppable"]):
            continue
        if never_read or b["kept"] or b["last"] >= step:
            alive.append(b)
    return alive


def reference_kinds(graph: CostGraph, schedule, step: int) -> dict[str, int]:
    """Each alive buffer's kind by the definitions of report.PEAK_KINDS."""
    kinds = dict.fromkeys(PEAK_KINDS, 0)
    kinds["running"] += graph.ops[schedule[step][0]].workspace_bytes
    for b in reference_alive(graph, schedule, step):
        if b["born"] == step:
            kind = "running"
        elif b["copy"] > 0:
            kind = "recomputed"
        elif b["kept"]:       # a graph output is written in it (perhaps through a view)
            kind = "outputs"
        elif b["last"] == b["born"]:
            kind = "unread"
        else:
            kind = "activations" if graph.phase(b["producer"]) == FORWARD else "backward"
        kinds[kind] += b["bytes"]
    return kinds


GRAPHS = [training_cost_graph(30, seed=s) for s in range(3)] + [branching_cost_graph(40, seed=s) for s in range(4)]


@pytest.mark.parametrize("graph", GRAPHS)
def test_the_bytes_by_kind_add_up_to_the_peak_and_match_a_step_by_step_walk(graph):
    rng = random.Random(7)
    candidates = sorted(graph.candidate_checkpoints)
    for trial in range(6):
        checkpoints = set(rng.sample(candidates, k=rng.randint(0, len(candidates)))) if trial else set(candidates)
        executed = priority_order(graph, schedule_for(graph, frozenset(checkpoints)), distinct_steps=True)
        explained = explain_peak(graph, executed)
        simulation = simulate(graph, executed)
        assert explained.peak_bytes == simulation.peak_bytes
        assert sum(explained.bytes_by_kind.values()) == explained.peak_bytes
        assert explained.node == executed[simulation.peak_step][0]
        assert explained.bytes_by_kind == reference_kinds(graph, executed, simulation.peak_step)
        largest = sorted((b["bytes"] for b in reference_alive(graph, executed, simulation.peak_step)), reverse=True)
        assert [t.bytes for t in explained.largest] == [b for b in largest if b > 0][:len(explained.largest)]


def _by_hand() -> tuple[CostGraph, list]:
    """x -> f1 -> a (forward, 1 KiB) -> f2 -> b (2 KiB) -> loss; backward: g_b (4 KiB), three
    contributions c1..c3 (8 KiB each) to one weight gradient summed by one Sum into w_grad (16
    KiB, a graph output), and g_a (1 KiB) read by the last op."""
    ops_f = [Op("f1", "MatMul", ("x", "w"), ("a",)), Op("f2", "Relu", ("a",), ("b",)),
             Op("f3", "ReduceSum", ("b",), ("loss",))]
    ops_b = [Op("b1", "Expand", ("loss",), ("g_b",)),
             Op("b2", "Mul", ("g_b", "a"), ("c1",)), Op("b3", "Mul", ("g_b", "b"), ("c2",)),
             Op("b4", "Mul", ("g_b", "x"), ("c3",)),
             Op("b5", "Sum", ("c1", "c2", "c3"), ("w_grad",)),
             Op("b6", "Mul", ("g_b", "w_grad"), ("g_a",)), Op("b7", "Neg", ("g_a",), ("x_grad",))]
    sizes = {"x": 512, "w": 512, "a": 1024, "b": 2048, "loss": 4, "g_b": 4096, "c1": 8192, "c2": 8192,
             "c3": 8192, "w_grad": 16384, "g_a": 1024, "x_grad": 512}
    graph = CostGraph(ops_f, ops_b, sizes, resident={"x", "w"}, kept={"loss", "w_grad", "x_grad"})
    return graph, [(op.name, 0) for op in ops_f + ops_b]


def test_each_kind_where_it_is_known():
    graph, executed = _by_hand()
    explained = explain_peak(graph, executed)
    # at b5 (the Sum): loss (output) 4; a and b still read later? a: last read b2, b: b3 -> freed;
    # g_b read by b6: backward 4096; c1..c3 read now: backward 24576; w_grad written now: running
    assert explained.node == "b5" and explained.op_type == "Sum"
    assert explained.bytes_by_kind == {"outputs": 4, "activations": 0, "recomputed": 0, "backward": 4096 + 3 * 8192,
                                       "unread": 0, "running": 16384}
    assert explained.peak_bytes == 4 + 4096 + 3 * 8192 + 16384
    assert explained.largest[0].name == "w_grad" and explained.largest[0].kind == "running"


def test_the_floor_names_what_bounds_it():
    graph, _ = _by_hand()
    floor = explain_floor(graph)
    assert floor.floor_bytes == peak_floor_bytes(graph)
    assert sum(floor.bytes_by_kind.values()) == floor.floor_bytes
    assert floor.bound_by == "backward"
    assert "one Sum" in floor.advice and "c1" in floor.advice or "c2" in floor.advice or "c3" in floor.advice


def test_a_floor_of_gradients_says_to_fuse_the_optimizer():
    # one forward op, a gradient output eight times its input
    ops_f = [Op("f", "Relu", ("x",), ("y",)), Op("l", "ReduceSum", ("y",), ("loss",))]
    ops_b = [Op("g", "Expand", ("loss",), ("gy",)), Op("h", "Mul", ("gy", "y"), ("w_grad",)),
             Op("k", "Mul", ("gy", "w_grad"), ("v_grad",))]
    sizes = {"x": 64, "y": 64, "loss": 4, "gy": 64, "w_grad": 4096, "v_grad": 4096}
    graph = CostGraph(ops_f, ops_b, sizes, resident={"x"}, kept={"loss", "w_grad", "v_grad"})
    floor = explain_floor(graph)
    assert floor.bound_by == "outputs"
    assert "--optimizer" in floor.advice


@pytest.mark.parametrize("name, path", [
    ("/layer1/layer1.0/conv2/Conv", "layer1.0.conv2"),
    ("/albert/encoder/albert_layer_groups.0/albert_layers.0/attention/query/MatMul",
     "albert.encoder.albert_layer_groups.0.albert_layers.0.attention.query"),
    ("/fc/Gemm", "fc"),
    ("Gemm_83", None),
    ("n_stem_relu", None),
])
def test_module_path(name, path):
    assert module_path(name) == path


def test_optimize_and_analyze_carry_the_explanation(tmp_path):
    from graphopt.examples import training_example
    model, _ = training_example("mlp", small=True)
    onnx.save(model, tmp_path / "mlp.onnx")
    run = subprocess.run([sys.executable, "-m", "graphopt.cli", "optimize", str(tmp_path / "mlp.onnx"), "-o",
                          str(tmp_path / "out.onnx"), "--report", str(tmp_path / "report.json")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = Report.from_dict(json.loads((tmp_path / "report.json").read_text()))
    peaks = report.peaks_explained
    assert peaks.original.peak_bytes == report.predicted.original_optimizations_off.peak_bytes
    assert sum(peaks.original.bytes_by_kind.values()) == peaks.original.peak_bytes
    if report.outcome == "optimized":
        assert peaks.returned.peak_bytes == report.predicted.optimized.peak_bytes
    assert peaks.floor.advice
    assert "least peak the search can reach" in run.stdout and f"at step {peaks.original.step + 1}" in run.stdout
    analyzed = subprocess.run([sys.executable, "-m", "graphopt.cli", "analyze", str(tmp_path / "mlp.onnx")],
                              capture_output=True, text=True, timeout=600)
    assert analyzed.returncode == 0, analyzed.stderr[-2000:]
    analysis = json.loads(analyzed.stdout)
    assert analysis["peaks_explained"]["original"]["peak_bytes"] == \
        analysis["predicted_peak_bytes"]["original_optimizations_off"]
    assert "least peak the search can reach" in analyzed.stderr


@pytest.mark.parametrize("name", ["mlp", "resnet", "densenet", "unet", "transformer", "randwire"])
def test_the_timeline_drawn_peaks_where_the_report_says(name, tmp_path):
    """The plotted series read back (not pixels): the total's maximum is the predicted peak, at its
    step; the kinds at the peak are the explanation's; the original's line peaks at its peak."""
    from graphopt.examples import training_example
    from graphopt.optimize import OptimizeOptions, analyze_model
    from graphopt.plot import plot_timeline
    model, _ = training_example(name, small=True)
    analysis = analyze_model(model, OptimizeOptions(), plan=True)
    original, planned = analysis.timelines
    data = plot_timeline(original, planned, tmp_path / "timeline.svg")
    assert (tmp_path / "timeline.svg").stat().st_size > 0
    explained = analysis.peaks_explained
    steps, total = data["total"]
    assert max(total) * 2**20 == pytest.approx(explained.returned.peak_bytes, abs=1)
    assert total.index(max(total)) == explained.returned.step
    assert max(data["original"][1]) * 2**20 == pytest.approx(explained.original.peak_bytes, abs=1)
    assert explained.original.peak_bytes == analysis.predicted_peak_bytes.original_optimizations_off
    at_peak = {kind: int(round(data[kind][1][explained.returned.step] * 2**20)) for kind in data
               if kind in PEAK_KINDS}
    assert at_peak == {k: v for k, v in explained.returned.bytes_by_kind.items() if k in at_peak}
    assert sum(at_peak.values()) == explained.returned.peak_bytes


def test_plot_refuses_what_it_cannot_draw(tmp_path):
    from graphopt.examples import training_example
    model, _ = training_example("mlp", small=True)
    onnx.save(model, tmp_path / "mlp.onnx")
    for extra, message in ((["--plot", str(tmp_path / "t.pdf")], "must end in .png or .svg"),
                           (["--plot", str(tmp_path / "t.png"), "--server", "127.0.0.1:1"], "in-process")):
        done = subprocess.run([sys.executable, "-m", "graphopt.cli", "optimize", str(tmp_path / "mlp.onnx"), "-o",
                               str(tmp_path / "o.onnx"), *extra], capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr
        assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("name", ["gpt2", "t5", "llama", "albert", "swin_t"])
def test_corpus_models_explain_their_peak(name):
    """A real architecture's training graph (zoo/real_zoo.py, tiny): the peak named, its kinds
    adding up to the predicted peak, the floor's words."""
    from graphopt_zoo import real_zoo
    from graphopt.builder.train_graph import build_training_graph
    from graphopt.optimize import OptimizeOptions, analyze_model
    real = real_zoo.CORPUS[name]("tiny")
    forward = real_zoo.export(real, "legacy")
    train = build_training_graph(forward, loss=real.loss, class_axis=real.class_axis)
    analysis = analyze_model(train, OptimizeOptions(inputs=real_zoo.model_feeds(real)), plan=True)
    peaks = analysis.peaks_explained
    assert peaks.original.peak_bytes == analysis.predicted_peak_bytes.original_optimizations_off
    assert peaks.returned.peak_bytes == analysis.predicted_peak_bytes.planned
    node_names = set(analysis.node_seconds) | {n.name for n in train.graph.node}
    for explained in (peaks.original, peaks.returned):
        assert sum(explained.bytes_by_kind.values()) == explained.peak_bytes
        assert explained.node in node_names
        assert set(explained.bytes_by_kind) == set(PEAK_KINDS)
    assert peaks.floor.floor_bytes <= peaks.returned.peak_bytes
    assert peaks.floor.bound_by in PEAK_KINDS and peaks.floor.advice
