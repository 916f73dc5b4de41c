"""The pipeline, one entry point for the CLI, the service and batch:

    ingest -> analyze -> annotate -> plan -> rewrite -> verify -> deliver

`optimize(model, options)` returns the rewritten model and its report, or raises a typed
error; a rewritten model whose outputs differ from the original's is never returned.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx

from .analyze import TrainingGraph, analyze
from .annotate import Annotations, annotate, write_annotations
from .costgraph import build_cost_graph
from .costmodel import Step, priority_order, simulate
from .errors import BudgetInfeasibleError, InvalidOptionError, VerificationError
from .ingest import name_nodes
from .inputs import save_inputs, synthesize_inputs
from .rewrite import PLANNED_SETTINGS, rewrite
from .runtime.measure import Measurement, measure
from .runtime.session import DEFAULT_SETTINGS, UNOPTIMIZED_SETTINGS
from .search import DEFAULT_STRATEGY, STRATEGIES, Plan
from .verify import compare_outputs, run_outputs

log = logging.getLogger(__name__)

# The original model as graphopt runs it: the strongest fair baseline, and the cost model's rules.
ORIGINAL_UNOPTIMIZED = UNOPTIMIZED_SETTINGS

Progress = Callable[[str, float], None]

# With a budget, how many times a plan whose MEASURED peak is over the budget is planned
# again for a budget lowered by the overshoot (the runtime holds a little more than the
# cost model predicts: allocator rounding, small buffers).
BUDGET_RETRIES = 3


@dataclass
class OptimizeOptions:
    loss: str | None = None
    budget_bytes: int | None = None
    strategy: str = DEFAULT_STRATEGY
    input_dims: dict[str, list[int]] = field(default_factory=dict)
    inputs: dict[str, np.ndarray] | None = None
    providers: list[str] | None = None
    verify: bool = True
    measure: bool = True
    threads: int = 1
    tolerance: float = 1e-5
    progress: Progress | None = None


@dataclass
class OptimizeResult:
    model: onnx.ModelProto
    plan: Plan
    report: dict


def check_options(options: OptimizeOptions) -> None:
    """Reject unknown strategies, unavailable providers and bad numbers before any work."""
    import onnxruntime as ort
    if options.strategy not in STRATEGIES:
        raise InvalidOptionError(f"unknown strategy {options.strategy!r} (known: {sorted(STRATEGIES)})")
    available = ort.get_available_providers()
    for provider in options.providers or []:
        if provider not in available:
            raise InvalidOptionError(f"execution provider {provider!r} is not available here (available: {available})")
    if options.budget_bytes is not None and options.budget_bytes <= 0:
        raise InvalidOptionError(f"budget must be positive, got {options.budget_bytes} bytes")
    if options.threads < 1:
        raise InvalidOptionError(f"threads must be at least 1, got {options.threads}")


def _prepare(model: onnx.ModelProto, options: OptimizeOptions):
    check_options(options)
    working = onnx.ModelProto()
    working.CopyFrom(model)
    name_nodes(working)
    training = analyze(working, options.loss)
    inputs = options.inputs if options.inputs is not None else synthesize_inputs(working, options.input_dims)
    return training, inputs


def _annotate(training: TrainingGraph, inputs, options) -> tuple[Annotations, object]:
    annotations = annotate(training.model, inputs, ORIGINAL_UNOPTIMIZED,
                           providers=options.providers, threads=options.threads)
    graph = build_cost_graph(training, annotations.tensor_bytes, annotations.node_seconds,
                             tensor_shapes=annotations.tensor_shapes)
    return annotations, graph


def _profiled_schedule(graph, order: list[str]) -> list[Step]:
    return [(name, 0) for name in order if name in graph]


def plan_model(graph, options: OptimizeOptions) -> Plan:
    """Run the chosen strategy; with a budget, fail clearly when it cannot be met."""
    if options.strategy not in STRATEGIES:
        raise InvalidOptionError(f"unknown strategy {options.strategy!r} (known: {sorted(STRATEGIES)})")
    plan = STRATEGIES[options.strategy](graph, budget_bytes=options.budget_bytes)
    if options.budget_bytes is not None and plan.peak_bytes > options.budget_bytes:
        least = STRATEGIES[DEFAULT_STRATEGY](graph).peak_bytes
        least = min(least, plan.peak_bytes)
        raise BudgetInfeasibleError(
            f"budget of {options.budget_bytes} bytes cannot be met: the least peak found is "
            f"{least} bytes", least_feasible_peak_bytes=least)
    return plan


def _measure_all(original: onnx.ModelProto, rewritten: onnx.ModelProto, inputs, options) -> dict[str, Measurement]:
    provider = options.providers[0] if options.providers else None
    with tempfile.TemporaryDirectory(prefix="graphopt-") as tmp:
        inputs_path = os.path.join(tmp, "inputs.npz")
        save_inputs(inputs_path, inputs)
        paths = {}
        for label, model in (("original", original), ("optimized", rewritten)):
            paths[label] = os.path.join(tmp, f"{label}.onnx")
            save_model(model, paths[label])
        runs = {
            "original_default_session": (paths["original"], DEFAULT_SETTINGS),
            "original_optimizations_off": (paths["original"], ORIGINAL_UNOPTIMIZED),
            "optimized": (paths["optimized"], None),  # its own metadata settings
        }
        return {label: measure(path, inputs_path, settings, provider=provider, threads=options.threads)
                for label, (path, settings) in runs.items()}


def _measure_one(model: onnx.ModelProto, inputs, options) -> Measurement:
    provider = options.providers[0] if options.providers else None
    with tempfile.TemporaryDirectory(prefix="graphopt-") as tmp:
        inputs_path = os.path.join(tmp, "inputs.npz")
        save_inputs(inputs_path, inputs)
        path = os.path.join(tmp, "optimized.onnx")
        save_model(model, path)
        return measure(path, inputs_path, None, provider=provider, threads=options.threads)


def _order_followed(graph, plan: Plan, rewritten: onnx.ModelProto, inputs, options) -> bool:
    """Whether ONNX Runtime's profile shows the rewritten model ran in the planned order."""
    order = annotate(rewritten, inputs, PLANNED_SETTINGS, threads=options.threads).execution_order
    planned = [op if copy == 0 else f"{op}__rc{copy}" for op, copy in priority_order(graph, plan.schedule)]
    return order == planned


def _check_outputs(training: TrainingGraph, rewritten: onnx.ModelProto, inputs, options, report: dict) -> None:
    """Raise VerificationError unless the rewritten model's outputs equal the original's."""
    reference = run_outputs(training.model, inputs, ORIGINAL_UNOPTIMIZED, threads=1)
    candidate = run_outputs(rewritten, inputs, None, threads=1)
    comparison = compare_outputs(reference, candidate, options.tolerance)
    report["outputs_match"] = comparison.match
    report["max_relative_difference"] = comparison.max_relative_difference
    if not comparison.match:
        raise VerificationError(
            f"the rewritten model's output {comparison.worst_output()!r} differs from the original "
            f"(relative difference {comparison.max_relative_difference:.3g} > {options.tolerance}); "
            "nothing was returned")


def save_model(model: onnx.ModelProto, path) -> None:
    """Save a model; one over protobuf's 2 GB limit gets its weights as external data."""
    path = str(path)
    if model.ByteSize() > 2**31 - 2**24:
        onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                  location=os.path.basename(path) + ".data")
    else:
        onnx.save(model, path)


def analyze_model(model: onnx.ModelProto, options: OptimizeOptions | None = None, plan: bool = False) -> dict:
    """Annotate `model` in ONNX Runtime and predict its peak; with `plan`, also run the search
    and predict the plan's peak. Rewrites nothing. Returns plain data (JSON-ready)."""
    options = options or OptimizeOptions()
    progress = options.progress or (lambda stage, fraction: None)
    progress("analyze", 0.0)
    training, inputs = _prepare(model, options)
    progress("annotate", 0.2)
    annotations, graph = _annotate(training, inputs, options)
    predicted_original = simulate(graph, _profiled_schedule(graph, annotations.execution_order))
    result = {
        "loss": training.loss,
        "nodes": {"total": len(training.model.graph.node), "forward": len(training.forward),
                  "backward": len(training.backward)},
        "stashed_tensors": sorted(training.stashed),
        "provider": annotations.provider,
        "predicted_peak_bytes": {"original_optimizations_off": predicted_original.peak_bytes},
        "tensor_bytes": annotations.tensor_bytes,
        "node_seconds": annotations.node_seconds,
        "execution_order": annotations.execution_order,
    }
    if plan:
        progress("plan", 0.6)
        chosen = plan_model(graph, options)
        result["predicted_peak_bytes"]["planned"] = chosen.peak_bytes
        result["plan"] = {"strategy": chosen.strategy, "checkpoints": sorted(chosen.checkpoints),
                          "recompute_nodes": chosen.recompute_ops,
                          "recompute_seconds": chosen.recompute_seconds}
    progress("done", 1.0)
    return result


def optimize(model: onnx.ModelProto, options: OptimizeOptions | None = None) -> OptimizeResult:
    """Annotate, plan, rewrite, verify and measure `model` (left untouched)."""
    options = options or OptimizeOptions()
    progress = options.progress or (lambda stage, fraction: None)
    started = time.perf_counter()

    progress("analyze", 0.0)
    training, inputs = _prepare(model, options)
    progress("annotate", 0.1)
    annotations, graph = _annotate(training, inputs, options)
    predicted_original = simulate(graph, _profiled_schedule(graph, annotations.execution_order))

    progress("plan", 0.3)
    search_started = time.perf_counter()
    plan = plan_model(graph, options)
    search_seconds = time.perf_counter() - search_started

    progress("rewrite", 0.5)
    rewritten = rewrite(training, graph, plan, PLANNED_SETTINGS)
    write_annotations(rewritten, annotations)
    report = {
        "loss": training.loss,
        "strategy": plan.strategy,
        "budget_bytes": options.budget_bytes,
        "nodes": {"original": len(training.model.graph.node), "optimized": len(rewritten.graph.node),
                  "forward": len(training.forward), "backward": len(training.backward)},
        "stashed_tensors": len(training.stashed),
        "checkpoints": sorted(plan.checkpoints),
        "recompute_nodes": plan.recompute_ops,
        "search_seconds": search_seconds,
        "predicted": {
            "original_optimizations_off": {"peak_bytes": predicted_original.peak_bytes,
                                           "step_seconds": predicted_original.compute_seconds},
            "optimized": {"peak_bytes": plan.peak_bytes,
                          "step_seconds": plan.simulation.compute_seconds,
                          "recompute_seconds": plan.recompute_seconds},
        },
        "annotations": {"provider": annotations.provider,
                        "tensors": len(annotations.tensor_bytes),
                        "nodes_timed": len(annotations.node_seconds)},
        "session": PLANNED_SETTINGS.to_dict(),
    }

    if options.verify:
        progress("verify", 0.6)
        _check_outputs(training, rewritten, inputs, options, report)
        report["order_followed"] = _order_followed(graph, plan, rewritten, inputs, options)

    if options.measure:
        progress("measure", 0.7)
        measured = _measure_all(training.model, rewritten, inputs, options)
        attempts = [{"planned_for_bytes": options.budget_bytes, "predicted_peak_bytes": plan.peak_bytes,
                     "measured_peak_bytes": measured["optimized"].peak_bytes}]
        while (options.budget_bytes is not None and measured["optimized"].peak_bytes > options.budget_bytes
               and len(attempts) <= BUDGET_RETRIES):
            # the runtime held more than predicted: plan again for a budget lower by the overshoot
            overshoot = measured["optimized"].peak_bytes - plan.peak_bytes
            target = options.budget_bytes - max(overshoot, 0) - (len(attempts) - 1) * max(overshoot, 1 << 16)
            progress(f"budget missed by measurement ({measured['optimized'].peak_bytes} > "
                     f"{options.budget_bytes} bytes): planning for {target}", 0.75)
            retry = STRATEGIES[options.strategy](graph, budget_bytes=target)
            if retry.peak_bytes > target or retry.checkpoints == plan.checkpoints:
                break
            plan = retry
            rewritten = rewrite(training, graph, plan, PLANNED_SETTINGS)
            write_annotations(rewritten, annotations)
            if options.verify:
                _check_outputs(training, rewritten, inputs, options, report)
                report["order_followed"] = _order_followed(graph, plan, rewritten, inputs, options)
            measured["optimized"] = _measure_one(rewritten, inputs, options)
            attempts.append({"planned_for_bytes": target, "predicted_peak_bytes": plan.peak_bytes,
                             "measured_peak_bytes": measured["optimized"].peak_bytes})
        if options.budget_bytes is not None:
            report["budget_attempts"] = attempts
            report.update(checkpoints=sorted(plan.checkpoints), recompute_nodes=plan.recompute_ops,
                          strategy=plan.strategy)
            report["predicted"]["optimized"] = {"peak_bytes": plan.peak_bytes,
                                                "step_seconds": plan.simulation.compute_seconds,
                                                "recompute_seconds": plan.recompute_seconds}
            report["nodes"]["optimized"] = len(rewritten.graph.node)
            if measured["optimized"].peak_bytes > options.budget_bytes:
                least = min(a["measured_peak_bytes"] for a in attempts)
                raise BudgetInfeasibleError(
                    f"budget of {options.budget_bytes} bytes is not met by measurement: the plans for it "
                    f"measured {[a['measured_peak_bytes'] for a in attempts]} bytes (predicted "
                    f"{[a['predicted_peak_bytes'] for a in attempts]}); the least measured was {least} bytes",
                    least_feasible_peak_bytes=least)
        report["measured"] = {k: {"peak_bytes": m.peak_bytes, "step_seconds": m.step_seconds,
                                  "provider": m.provider, "method": m.method}
                              for k, m in measured.items()}
        opt = measured["optimized"]
        report["ratios"] = {
            "peak_vs_default_session": opt.peak_bytes / max(1, measured["original_default_session"].peak_bytes),
            "peak_vs_optimizations_off": opt.peak_bytes / max(1, measured["original_optimizations_off"].peak_bytes),
            "step_time_vs_default_session": opt.step_seconds / measured["original_default_session"].step_seconds,
            "step_time_vs_optimizations_off": opt.step_seconds / measured["original_optimizations_off"].step_seconds,
        }
        report["prediction_error"] = {
            "optimized": plan.peak_bytes / max(1, opt.peak_bytes) - 1,
            "original_optimizations_off":
                predicted_original.peak_bytes / max(1, measured["original_optimizations_off"].peak_bytes) - 1,
        }
        if options.budget_bytes is not None:
            report["budget_met"] = opt.peak_bytes <= options.budget_bytes
    report["total_seconds"] = time.perf_counter() - started
    progress("done", 1.0)
    return OptimizeResult(rewritten, plan, report)
