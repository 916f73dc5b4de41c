"""The entry points for the CLI, the service and batch, composed of the pipeline's stages
(graphopt/pipeline.py: prepare -> plan, graphopt/delivery.py: deliver; pipeline's docstring states the contracts at
delivery: OUTPUTS, ORDER, NEVER WORSE, budgets met by measurement).

`optimize(model, options)` returns the rewritten model, its plan and its typed report
(graphopt/report.py), or raises a typed error; a rewritten model whose outputs differ from the
original's is never returned. `analyze_model` annotates and predicts without rewriting.
"""
from __future__ import annotations

import dataclasses
import os
import time

import onnx

from .options import OptimizeOptions, Progress
from .costmodel import priority_order
from .delivery import BUDGET_RETRIES, deliver
from .explain import explain_peak, explain_peaks, timeline
from .pipeline import ORIGINAL_UNOPTIMIZED, OptimizeResult, Prepared, plan, prepare, solver_exact
from .pipeline import plan as _plan   # analyze_model's argument `plan` is a flag
from .report import (OUTCOME_OPTIMIZED, OUTCOME_ORIGINAL, OUTCOME_UNMEASURED, OWN_MEMORY_FACTOR, Analysis,
                     AnalysisBaseOrder, AnalysisNodes, AnalysisPeaks, AnalysisPlan, GraphoptMemory, Report,
                     StageSeconds, summary_text)
from .runtime.rss import ChildPeaks, peak_rss_bytes, process_peak_bytes, reset_peak_rss, rss_bytes, tracking_children
from .runtime.isolated import save_model as save_model
from .runtime.warm import children_cpu_seconds
from .runtime.weights import Weights


def optimize(model: onnx.ModelProto, options: OptimizeOptions | None = None, weights: Weights | None = None
             ) -> OptimizeResult:
    """Annotate, plan, rewrite, verify and measure `model` (left untouched); deliver under the
    contracts of graphopt/pipeline.py. `weights`: the caller keeps the weights on disk (a model
    loaded with `ingest.load_model(path, weights_on_disk=True)`, `Weights(folder=its folder)`): no
    process of graphopt's holds them whole, at any size, and the result's model references them
    (write it with `graphopt.runtime.weights.save_model(result.model, path, result.weights)`)."""
    options = options or OptimizeOptions()
    clock = StageClock(options.progress)
    options = dataclasses.replace(options, progress=clock)
    started = time.perf_counter()
    reset_peak_rss()
    main_start_bytes = rss_bytes()
    # every ONNX Runtime run in a fresh process, one at a time, models and outputs on disk
    with tracking_children() as children, prepare(model, options, early_peaks=True, weights=weights) as prepared:
        clock("plan", 0.3)
        chosen = plan(prepared, options)
        result = deliver(prepared, chosen, options)
    result.report.graphopt_memory = _own_memory(result.report, children, main_start_bytes)
    result.report.total_seconds = time.perf_counter() - started
    result.report.stages = clock.stages()
    return result


class StageClock:
    """A progress callback that passes each stage on to `progress` and times it: wall seconds,
    and CPU seconds of this process and of the children it waited for (`os.times`, and
    `warm.children_cpu_seconds` for those forked by the warm parent), from one
    stage's message to the next (`stages`: the last one ends when it is called)."""

    def __init__(self, progress=None) -> None:
        self.progress = progress
        self._marks: list[tuple[str, float, float]] = []   # (stage, wall, cpu) at its start

    @staticmethod
    def _cpu_seconds() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system + children_cpu_seconds()

    def __call__(self, stage: str, fraction: float) -> None:
        self._marks.append((stage, time.perf_counter(), self._cpu_seconds()))
        if self.progress is not None:
            self.progress(stage, fraction)

    def stages(self) -> list[StageSeconds]:
        ends = self._marks[1:] + [("", time.perf_counter(), self._cpu_seconds())]
        return [StageSeconds(stage, wall_seconds=end_wall - wall, cpu_seconds=end_cpu - cpu)
                for (stage, wall, cpu), (_, end_wall, end_cpu) in zip(self._marks, ends)]


def _own_memory(report: Report, children: ChildPeaks, main_start_bytes: int | None) -> GraphoptMemory:
    by_kind = children.by_kind
    largest = max(by_kind, key=by_kind.get) if by_kind else None
    measured = report.measured
    steps = [] if measured is None else [r.peak_bytes for r in (measured.original_default_session,
                                                                  measured.original_optimizations_off,
                                                                  measured.optimized)]
    own = GraphoptMemory(main_process_bytes=process_peak_bytes(), largest_child_bytes=by_kind.get(largest),
                         largest_child=largest, children_bytes=dict(by_kind),
                         largest_step_bytes=max(steps) if steps else None,
                         main_process_start_bytes=main_start_bytes)
    if children.largest_session_bytes and children.baseline_bytes:
        own.largest_session_bytes = children.largest_session_bytes
        own.largest_session = children.largest_session
        own.baseline_bytes = children.baseline_bytes
        own.bound_bytes = int(OWN_MEMORY_FACTOR * children.largest_session_bytes + children.baseline_bytes)
    _judge_bound(own)
    return own


def _judge_bound(own: GraphoptMemory) -> None:
    """within_bound: every child's peak, and what the calling process grew by since the call
    began plus the baseline, at most bound_bytes (GraphoptMemory)."""
    if own.bound_bytes is None:
        return
    held = list(own.children_bytes.values())
    during_call = peak_rss_bytes()   # this process's peak counter was reset when the call began
    if during_call is not None and own.main_process_start_bytes is not None:
        held.append(max(0, during_call - own.main_process_start_bytes) + (own.baseline_bytes or 0))
    own.within_bound = max(held) <= own.bound_bytes


def restate_own_memory(report: Report) -> None:
    """The report's account of the calling process again, after the caller's own work on the
    result (the CLI saving the returned model): its peak so far, and the bound judged again."""
    own = report.graphopt_memory
    if own is not None:
        own.main_process_bytes = process_peak_bytes()
        _judge_bound(own)


def analyze_model(model: onnx.ModelProto, options: OptimizeOptions | None = None, plan: bool = False,
                  weights: Weights | None = None) -> Analysis:
    """Annotate `model` in ONNX Runtime and predict its peak; with `plan`, also run the search
    and predict the plan's peak. Rewrites nothing. Returns an `Analysis` (`to_dict()`: its JSON).
    `weights`: as for `optimize` (the weights kept on disk)."""
    options = options or OptimizeOptions()
    with_plan = plan
    progress = options.progress or _no_progress
    # the step times (the time model's seconds, the baseline of max_overhead) only for a plan
    timed = dataclasses.replace(options, measure=options.measure and with_plan)
    with prepare(model, timed, reference=False, weights=weights) as prepared:
        training, annotations = prepared.training, prepared.annotations
        result = Analysis(
            loss=training.loss,
            nodes=AnalysisNodes(total=len(training.model.graph.node), forward=len(training.forward),
                                backward=len(training.backward)),
            stashed_tensors=sorted(training.stashed),
            provider=annotations.provider,
            predicted_peak_bytes=AnalysisPeaks(original_optimizations_off=prepared.predicted_original.peak_bytes),
            tensor_bytes=annotations.tensor_bytes,
            node_seconds=annotations.node_seconds,
            execution_order=annotations.execution_order,
            functions_expanded=prepared.functions_expanded,
            graph_optimizations=prepared.graph_optimizations,
            base_order=AnalysisBaseOrder(chosen=prepared.base_order,
                                         store_all_peak_bytes=dict(prepared.base_order_peaks)),
            peaks_explained=explain_peaks(prepared.graph, annotations.execution_order,
                                          prepared.base_graphs.values()))
        if with_plan:
            progress("plan", 0.6)
            chosen = _plan(prepared, options)
            result.predicted_peak_bytes.planned = chosen.peak_bytes
            result.plan = AnalysisPlan(strategy=chosen.strategy, checkpoints=sorted(chosen.checkpoints),
                                       recompute_nodes=chosen.recompute_ops,
                                       recompute_seconds=chosen.recompute_seconds,
                                       predicted_step_seconds=chosen.simulation.compute_seconds,
                                       objective=options.effective_objective,
                                       max_overhead=options.overhead_limit,
                                       baseline_step_seconds=prepared.baseline_step_seconds,
                                       solver_exact=solver_exact(chosen))
            result.base_order.chosen = chosen.notes.get("base_order", prepared.base_order)
            result.base_order.plan_peak_bytes = dict(chosen.notes.get("base_order_peak_bytes", {}))
            result.peaks_explained.returned = explain_peak(
                prepared.graph, priority_order(prepared.graph, chosen.schedule, distinct_steps=True))
        # (not in the JSON) the predicted bytes alive over the schedules: what `--plot` draws
        graph = prepared.graph
        result.timelines = (timeline(graph, [(n, 0) for n in annotations.execution_order if n in graph]),
                            None if not with_plan else
                            timeline(graph, priority_order(graph, chosen.schedule, distinct_steps=True)))
    progress("done", 1.0)
    return result


def _no_progress(stage: str, fraction: float) -> None:
    pass


__all__ = ["optimize", "analyze_model", "Analysis", "OptimizeOptions", "OptimizeResult", "Progress", "Prepared", "prepare",
           "plan", "deliver", "save_model", "summary_text", "Report", "ORIGINAL_UNOPTIMIZED", "BUDGET_RETRIES",
           "OUTCOME_OPTIMIZED", "OUTCOME_ORIGINAL", "OUTCOME_UNMEASURED"]
