"""The pipeline, one entry point for the CLI, the service and batch:

    ingest -> analyze -> annotate -> plan -> rewrite -> verify -> deliver

`optimize(model, options)` returns the rewritten model and its report, or raises a typed
error; a rewritten model whose outputs differ from the original's is never returned.

Contracts at delivery (checked, never assumed):
- OUTPUTS: a plan whose rewritten model's outputs differ from the original's is rejected
  (a warning is logged and `report["rejected_for_outputs"]` and `outcome_reason` name the
  output and the difference); the next plan is tried as below. VerificationError only when
  even the plan without recomputation differs (the rewrite itself is broken).
- ORDER: a rewritten model is returned only if ONNX Runtime's profile shows it ran the planned
  order. Otherwise the next plan is tried (store-all: no recomputation, only the order is
  ours), then none: the original is returned.
- NEVER WORSE: with measurement on, a rewritten model is returned only if its measured peak
  is below the original's under both sessions (default session, optimizations off); otherwise
  the original graph is returned with the session settings that measured lowest (in its
  metadata, so `open_session` applies them). `report["outcome"]` says which, and why.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx

from .analyze import TrainingGraph, analyze
from .annotate import Annotations, write_annotations
from .op_rules import build_cost_graph
from .op_rules import FOLDED_AT_LOAD_OPS, opset_of
from .costmodel import Step, priority_order, simulate
from .errors import BudgetInfeasibleError, InvalidOptionError, VerificationError
from .ingest import name_nodes
from .inputs import synthesize_inputs
from .rewrite import PLANNED_SETTINGS, expand_functions, has_function, rewrite
from .runtime.isolated import Workspace, run_task
from .runtime.isolated import save_model as save_model
from .runtime.measure import Measurement, measure
from .runtime.session import (DEFAULT_SETTINGS, UNOPTIMIZED_SETTINGS, SessionSettings, read_settings,
                              write_settings)
from .search import DEFAULT_STRATEGY, STRATEGIES, Plan, store_all
from .verify import OutputComparison, compare_order

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


def _annotate(training: TrainingGraph, inputs, options, workspace: Workspace | None = None,
              label: str = "annotated") -> tuple[Annotations, object]:
    """`annotate` `training.model` (saved in `workspace` as `label`) in a fresh process; the
    annotations and the cost graph."""
    if workspace is None:
        with Workspace(inputs) as temporary:
            return _annotate(training, inputs, options, temporary, label)
    path = workspace.save(training.model, label)
    out = os.path.join(workspace.folder, label + ".annotations.json")
    run_task("annotate", {"model": path, "inputs": workspace.inputs_path, "out": out,
                          "settings": ORIGINAL_UNOPTIMIZED.to_dict(), "providers": options.providers,
                          "threads": options.threads})
    with open(out) as f:
        annotations = Annotations.from_json(f.read())
    os.remove(out)
    graph = build_cost_graph(training, annotations.tensor_bytes, annotations.node_seconds,
                             tensor_shapes=annotations.tensor_shapes)
    return annotations, graph


def inlined_at_load(model: onnx.ModelProto, order: list[str]) -> list[str]:
    """Nodes of `model` that ONNX Runtime did not run as themselves: function ops it has no
    kernel for (HardSwish on the CPU provider, ...), inlined at load under new names."""
    ran = set(order)
    opset = opset_of(model)
    return [n.name for n in model.graph.node
            if n.name not in ran and n.op_type not in FOLDED_AT_LOAD_OPS and has_function(n, opset)]


def _type_protos(annotations: Annotations) -> dict[str, onnx.TypeProto]:
    types = {}
    for name, shape in annotations.tensor_shapes.items():
        dtype = annotations.tensor_dtypes.get(name)
        try:
            elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        except Exception:
            continue
        types[name] = onnx.helper.make_tensor_type_proto(elem, list(shape))
    return types


def _runtime_graph(training: TrainingGraph, inputs, options, workspace: Workspace | None = None):
    """Annotate `training`; where ONNX Runtime inlined function ops at load, write their
    bodies into the graph (`rewrite.expand_functions`) and annotate that instead, so the plan's
    order covers every node ORT runs (inlined at load, the body nodes would come after every
    node of the file in ORT's priority order). Returns (training, annotations, graph,
    {op_type: nodes expanded}, the annotations of the graph as it came). The graph as it came
    is saved in `workspace` as "original"."""
    if workspace is None:
        with Workspace(inputs) as temporary:
            return _runtime_graph(training, inputs, options, temporary)
    annotations, graph = _annotate(training, inputs, options, workspace, "original")
    first = annotations
    inlined = inlined_at_load(training.model, annotations.execution_order)
    if not inlined:
        return training, annotations, graph, {}, first
    model, expanded = expand_functions(training.model, inlined, _type_protos(annotations))
    if not expanded:
        return training, annotations, graph, {}, first
    op_types: dict[str, int] = {}
    expanded_names = set(expanded)
    for node in training.model.graph.node:
        if node.name in expanded_names:
            op_types[node.op_type] = op_types.get(node.op_type, 0) + 1
    training = analyze(model, options.loss)
    del model
    annotations, graph = _annotate(training, inputs, options, workspace, "expanded")
    return training, annotations, graph, op_types, first


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


def _original_path(original: onnx.ModelProto, workspace: Workspace) -> str:
    return workspace.path("original") or workspace.save(original, "original")


def _measure_all(original: onnx.ModelProto, rewritten: onnx.ModelProto, inputs, options,
                 workspace: Workspace | None = None) -> dict[str, Measurement]:
    """The original under both sessions and `rewritten` under its own, each in a fresh
    process, one after the other."""
    if workspace is None:
        with Workspace(inputs) as temporary:
            return _measure_all(original, rewritten, inputs, options, temporary)
    provider = options.providers[0] if options.providers else None
    original_path = _original_path(original, workspace)
    runs = {
        "original_default_session": (original_path, DEFAULT_SETTINGS),
        "original_optimizations_off": (original_path, ORIGINAL_UNOPTIMIZED),
        "optimized": (workspace.save(rewritten, "measured"), None),  # its own metadata settings
    }
    return {label: measure(path, workspace.inputs_path, settings, provider=provider, threads=options.threads)
            for label, (path, settings) in runs.items()}


def _measure_one(model: onnx.ModelProto, inputs, options, workspace: Workspace | None = None) -> Measurement:
    if workspace is None:
        with Workspace(inputs) as temporary:
            return _measure_one(model, inputs, options, temporary)
    provider = options.providers[0] if options.providers else None
    return measure(workspace.save(model, "measured"), workspace.inputs_path, None, provider=provider,
                   threads=options.threads)


def _reference_outputs(original: onnx.ModelProto, workspace: Workspace) -> str:
    """The original's outputs (optimizations off, one thread), computed once per workspace in
    a fresh process and kept on disk: their path."""
    if workspace.reference_path is None:
        out = os.path.join(workspace.folder, "reference.npz")
        run_task("reference", {"model": _original_path(original, workspace), "inputs": workspace.inputs_path,
                               "settings": ORIGINAL_UNOPTIMIZED.to_dict(), "threads": 1, "out": out})
        workspace.reference_path = out
    return workspace.reference_path


def _check_in_child(original: onnx.ModelProto, rewritten: onnx.ModelProto, options, workspace: Workspace,
                    order: bool) -> tuple[OutputComparison, list[str] | None]:
    """In a fresh process: `rewritten`'s outputs (its metadata session, one thread) against the
    original's, one array at a time; if they match and `order` is asked, the node order of
    one profiled run under PLANNED_SETTINGS (`verify.executed_order`)."""
    reference = _reference_outputs(original, workspace)
    settings = read_settings(rewritten) or DEFAULT_SETTINGS
    result = run_task("verify", {
        "model": workspace.save(rewritten, "candidate"), "inputs": workspace.inputs_path,
        "settings": settings.to_dict(), "threads": 1, "reference": reference, "tolerance": options.tolerance,
        "order": order, "order_settings": PLANNED_SETTINGS.to_dict(), "order_threads": options.threads,
        "providers": options.providers})
    return OutputComparison.from_dict(result["comparison"]), result["executed"]


def _planned_order(graph, plan: Plan) -> list[str]:
    return [op if copy == 0 else f"{op}__rc{copy}" for op, copy in priority_order(graph, plan.schedule)]


def _difference(comparison, options) -> str:
    return (f"output {comparison.worst_output()!r} differs from the original's (relative difference "
            f"{comparison.max_relative_difference:.3g} > {options.tolerance})")


def _record_comparison(comparison: OutputComparison, options, report: dict) -> bool:
    """Whether the rewritten model's outputs equal the original's (within the tolerance);
    records the comparison in `report` (and the difference under "outputs_differ")."""
    report["outputs_match"] = comparison.match
    report["max_relative_difference"] = comparison.max_relative_difference
    if not comparison.match:
        report["outputs_differ"] = {"output": comparison.worst_output(),
                                    "relative_difference": comparison.max_relative_difference,
                                    "reason": _difference(comparison, options)}
    return comparison.match


def _verify_plan(original, graph, plan: Plan, rewritten, inputs, options, report: dict,
                 workspace: Workspace | None = None) -> dict:
    """Outputs, then (if they match) the order of one rewritten plan: its `plans_tried` entry.
    A plan whose outputs differ is logged and rejected (its order is not checked). Both run in
    one fresh process (`_check_in_child`)."""
    if workspace is None:
        with Workspace(inputs) as temporary:
            return _verify_plan(original, graph, plan, rewritten, inputs, options, report, temporary)
    entry = _plan_summary(plan)
    record: dict = {}
    comparison, executed = _check_in_child(original, rewritten, options, workspace, order=True)
    if not _record_comparison(comparison, options, record):
        entry.update(outputs_match=False, outputs_differ=record["outputs_differ"],
                     order={"followed": False, "checked": False})
        log.warning("the %s plan was rejected: its %s", plan.strategy, record["outputs_differ"]["reason"])
        report.setdefault("rejected_for_outputs", []).append(dict(_plan_summary(plan), **record["outputs_differ"]))
        return entry
    report["outputs_match"] = True
    report["max_relative_difference"] = record["max_relative_difference"]
    entry["outputs_match"] = True
    entry["order"] = compare_order(_planned_order(graph, plan), executed).to_dict()
    return entry


def _accepted(entry: dict) -> bool:
    return entry.get("outputs_match", True) and entry["order"]["followed"]


def analyze_model(model: onnx.ModelProto, options: OptimizeOptions | None = None, plan: bool = False) -> dict:
    """Annotate `model` in ONNX Runtime and predict its peak; with `plan`, also run the search
    and predict the plan's peak. Rewrites nothing. Returns plain data (JSON-ready)."""
    options = options or OptimizeOptions()
    progress = options.progress or (lambda stage, fraction: None)
    progress("analyze", 0.0)
    training, inputs = _prepare(model, options)
    progress("annotate", 0.2)
    training, annotations, graph, expanded, _ = _runtime_graph(training, inputs, options)
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
        "functions_expanded": expanded,
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


# outcome of `optimize` (report["outcome"])
OUTCOME_OPTIMIZED = "optimized"     # the rewritten model: order followed, measured below the original
OUTCOME_ORIGINAL = "original"       # the original graph, with the session that measured lowest
OUTCOME_UNMEASURED = "unmeasured"   # the rewritten model, measurement off: not checked against the original


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _plan_summary(plan: Plan) -> dict:
    return {"strategy": plan.strategy, "checkpoints": len(plan.checkpoints),
            "recompute_nodes": plan.recompute_ops, "predicted_peak_bytes": plan.peak_bytes}


def _fallback_plans(graph, plan: Plan):
    """The plans tried after `plan`, best first: store-all (no recomputation; the order is
    still ours), unless `plan` already recomputes nothing."""
    if plan.recompute_ops:
        yield store_all(graph)


def _measurement_dict(m: Measurement) -> dict:
    return {"peak_bytes": m.peak_bytes, "step_seconds": m.step_seconds, "provider": m.provider,
            "method": m.method}


def _returned_original(original: onnx.ModelProto, settings: SessionSettings, annotations) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(original)
    write_settings(model, settings)
    if annotations is not None:
        write_annotations(model, annotations)
    return model


def first_in_order(original: onnx.ModelProto, training: TrainingGraph, graph, annotations, plans: list[Plan],
                   inputs, options: OptimizeOptions, report: dict, tried: list | None = None,
                   workspace: Workspace | None = None):
    """The first of `plans` whose rewritten model has outputs equal to `original`'s and that
    ONNX Runtime runs in the planned order (its profile checked): (plan, rewritten), or None.
    Each plan tried is appended to `tried` with whether its outputs matched and where its
    order deviated."""
    if workspace is None:
        with Workspace(inputs) as temporary:
            return first_in_order(original, training, graph, annotations, plans, inputs, options, report,
                                  tried, temporary)
    tried = [] if tried is None else tried
    for plan in plans:
        rewritten = rewrite(training, graph, plan, PLANNED_SETTINGS)
        write_annotations(rewritten, annotations)
        entry = _verify_plan(original, graph, plan, rewritten, inputs, options, report, workspace)
        tried.append(entry)
        if _accepted(entry):
            return plan, rewritten
    return None


def _not_delivered(report: dict) -> str:
    if report.get("rejected_for_outputs"):
        return ("no plan tried both computed the original's outputs and ran in the planned order in "
                "ONNX Runtime")
    return "ONNX Runtime did not run the planned order of any plan tried"


def _rejections(report: dict) -> str:
    """The plans rejected because their outputs differed, for `outcome_reason`."""
    return "".join(f"; the {r['strategy']} plan ({r['recompute_nodes']} recomputed nodes) was rejected: its "
                   f"{r['reason']}" for r in report.get("rejected_for_outputs", []))


def optimize(model: onnx.ModelProto, options: OptimizeOptions | None = None) -> OptimizeResult:
    """Annotate, plan, rewrite, verify and measure `model` (left untouched); deliver under the
    contracts of the module docstring."""
    options = options or OptimizeOptions()
    progress = options.progress or (lambda stage, fraction: None)
    started = time.perf_counter()

    progress("analyze", 0.0)
    training, inputs = _prepare(model, options)
    # every ONNX Runtime run in a fresh process, one at a time, models and outputs on disk
    with Workspace(inputs) as workspace:
        return _optimize(training, inputs, options, workspace, progress, started)


def _optimize(training: TrainingGraph, inputs, options: OptimizeOptions, workspace: Workspace,
              progress: Progress, started: float) -> OptimizeResult:
    original = training.model          # the user's graph (nodes named): reference and baseline
    progress("annotate", 0.1)
    training, annotations, graph, expanded, original_annotations = _runtime_graph(training, inputs, options,
                                                                                  workspace)
    predicted_original = simulate(graph, _profiled_schedule(graph, annotations.execution_order))

    progress("plan", 0.3)
    search_started = time.perf_counter()
    plan = plan_model(graph, options)
    search_seconds = time.perf_counter() - search_started

    def make(candidate: Plan) -> onnx.ModelProto:
        rewritten = rewrite(training, graph, candidate, PLANNED_SETTINGS)
        write_annotations(rewritten, annotations)
        return rewritten

    def describe(candidate: Plan, rewritten: onnx.ModelProto) -> None:
        report.update(strategy=candidate.strategy, checkpoints=sorted(candidate.checkpoints),
                      recompute_nodes=candidate.recompute_ops)
        report["nodes"]["optimized"] = len(rewritten.graph.node)
        report["predicted"]["optimized"] = {"peak_bytes": candidate.peak_bytes,
                                            "step_seconds": candidate.simulation.compute_seconds,
                                            "recompute_seconds": candidate.recompute_seconds}

    progress("rewrite", 0.5)
    rewritten = make(plan)
    report = {
        "loss": training.loss,
        "strategy": plan.strategy,
        "budget_bytes": options.budget_bytes,
        "nodes": {"original": len(original.graph.node), "optimized": len(rewritten.graph.node),
                  "forward": len(training.forward), "backward": len(training.backward)},
        "stashed_tensors": len(training.stashed),
        "checkpoints": sorted(plan.checkpoints),
        "recompute_nodes": plan.recompute_ops,
        "search_seconds": search_seconds,
        "functions_expanded": expanded,
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

    # ORDER: the first plan whose order ONNX Runtime follows
    deliverable = True
    if options.verify:
        progress("verify", 0.6)
        first = _verify_plan(original, graph, plan, rewritten, inputs, options, report, workspace)
        tried = [first]
        if not _accepted(first):
            why = ("its outputs differ from the original's" if not first["outputs_match"] else
                   f"ONNX Runtime left the planned order at step {first['order']['first_deviation']['position']}")
            progress(f"{why}: trying the next plan", 0.62)
            found = first_in_order(original, training, graph, annotations, list(_fallback_plans(graph, plan)),
                                   inputs, options, report, tried, workspace)
            if found is not None:
                plan, rewritten = found
                describe(plan, rewritten)
        if not any(entry["outputs_match"] for entry in tried):
            # even the plan without recomputation computes something else: the rewrite is broken
            raise VerificationError(
                f"the rewritten model's {tried[-1]['outputs_differ']['reason']} (plans tried: "
                f"{[entry['strategy'] for entry in tried]}); nothing was returned")
        deliverable = _accepted(tried[-1])
        report["order_followed"] = tried[-1]["order"]["followed"]
        report["order"] = {"followed": report["order_followed"], "plans_tried": tried}

    measured: dict[str, Measurement] = {}
    attempts = []
    if options.measure:
        progress("measure", 0.7)
        measured = _measure_all(original, rewritten, inputs, options, workspace)
        attempts = [{"planned_for_bytes": options.budget_bytes, "predicted_peak_bytes": plan.peak_bytes,
                     "measured_peak_bytes": measured["optimized"].peak_bytes}]
        while (deliverable and options.budget_bytes is not None
               and measured["optimized"].peak_bytes > options.budget_bytes and len(attempts) <= BUDGET_RETRIES):
            # the runtime held more than predicted: plan again for a budget lower by the overshoot
            overshoot = measured["optimized"].peak_bytes - plan.peak_bytes
            target = options.budget_bytes - max(overshoot, 0) - (len(attempts) - 1) * max(overshoot, 1 << 16)
            progress(f"budget missed by measurement ({measured['optimized'].peak_bytes} > "
                     f"{options.budget_bytes} bytes): planning for {target}", 0.75)
            retry = STRATEGIES[options.strategy](graph, budget_bytes=target)
            if retry.peak_bytes > target or retry.checkpoints == plan.checkpoints:
                break
            candidate = make(retry)
            if options.verify:
                entry = _verify_plan(original, graph, retry, candidate, inputs, options, report, workspace)
                report["order"]["plans_tried"].append(entry)
                if not _accepted(entry):
                    break
            plan, rewritten = retry, candidate
            measured["optimized"] = _measure_one(rewritten, inputs, options, workspace)
            attempts.append({"planned_for_bytes": target, "predicted_peak_bytes": plan.peak_bytes,
                             "measured_peak_bytes": measured["optimized"].peak_bytes})
        if options.budget_bytes is not None:
            report["budget_attempts"] = attempts
            describe(plan, rewritten)
            if deliverable and measured["optimized"].peak_bytes > options.budget_bytes:
                least = min(a["measured_peak_bytes"] for a in attempts)
                raise BudgetInfeasibleError(
                    f"budget of {options.budget_bytes} bytes is not met by measurement: the plans for it "
                    f"measured {[a['measured_peak_bytes'] for a in attempts]} bytes (predicted "
                    f"{[a['predicted_peak_bytes'] for a in attempts]}); the least measured was {least} bytes",
                    least_feasible_peak_bytes=least)

        # NEVER WORSE: the rewritten model only if it measured below the original in both sessions
        originals = {"original_default_session": DEFAULT_SETTINGS,
                     "original_optimizations_off": ORIGINAL_UNOPTIMIZED}
        best_original = min(originals, key=lambda k: measured[k].peak_bytes)
        bar = measured[best_original].peak_bytes
        if deliverable and measured["optimized"].peak_bytes >= bar and options.budget_bytes is None:
            # the next plan (less recomputation) may still beat the original
            report["plans_measured"] = [dict(_plan_summary(plan), measured_peak_bytes=measured["optimized"].peak_bytes)]
            for fallback in _fallback_plans(graph, plan):
                progress(f"the plan measured {measured['optimized'].peak_bytes} bytes, not below the "
                         f"original's {bar}: trying {fallback.strategy}", 0.85)
                candidate = make(fallback)
                if options.verify:
                    entry = _verify_plan(original, graph, fallback, candidate, inputs, options, report,
                                         workspace)
                    report["order"]["plans_tried"].append(entry)
                    if not _accepted(entry):
                        continue
                m = _measure_one(candidate, inputs, options, workspace)
                report["plans_measured"].append(dict(_plan_summary(fallback), measured_peak_bytes=m.peak_bytes))
                if m.peak_bytes < measured["optimized"].peak_bytes:
                    plan, rewritten, measured["optimized"] = fallback, candidate, m
                    describe(plan, rewritten)
                if m.peak_bytes < bar:
                    break
        report["prediction_error"] = {
            "optimized": plan.peak_bytes / max(1, measured["optimized"].peak_bytes) - 1,
            "original_optimizations_off":
                predicted_original.peak_bytes / max(1, measured["original_optimizations_off"].peak_bytes) - 1,
        }
        better = deliverable and measured["optimized"].peak_bytes < bar
        if better:
            outcome = OUTCOME_OPTIMIZED
            reason = (f"the optimized model measured {_mib(measured['optimized'].peak_bytes)}, below the "
                      f"original's {_mib(measured['original_default_session'].peak_bytes)} (default session) and "
                      f"{_mib(measured['original_optimizations_off'].peak_bytes)} (optimizations off)")
        else:
            outcome = OUTCOME_ORIGINAL
            session = best_original.replace("original_", "").replace("_", " ")
            why = (_not_delivered(report) if not deliverable else
                   f"the optimized model measured {_mib(measured['optimized'].peak_bytes)}, not below the "
                   f"original's {_mib(bar)} ({session})")
            reason = (f"{why}; the original model is returned with the session that measured lowest "
                      f"({session}: {_mib(bar)}), written in its metadata")
            report["rejected"] = dict(_plan_summary(plan), order_followed=deliverable,
                                      measured=_measurement_dict(measured["optimized"]))
            measured["optimized"] = measured[best_original]
            rewritten = _returned_original(original, originals[best_original], original_annotations)
            report.update(checkpoints=[], recompute_nodes=0, session=originals[best_original].to_dict())
            report["nodes"]["optimized"] = len(rewritten.graph.node)
            if options.budget_bytes is not None and bar > options.budget_bytes:
                raise BudgetInfeasibleError(
                    f"budget of {options.budget_bytes} bytes is not met: {why}, and the original "
                    f"measured {bar} bytes", least_feasible_peak_bytes=bar)
        report["outcome"] = outcome
        report["outcome_reason"] = reason + _rejections(report)
        report["measured"] = {k: _measurement_dict(m) for k, m in measured.items()}
        opt = measured["optimized"]
        report["ratios"] = {
            "peak_vs_default_session": opt.peak_bytes / max(1, measured["original_default_session"].peak_bytes),
            "peak_vs_optimizations_off": opt.peak_bytes / max(1, measured["original_optimizations_off"].peak_bytes),
            "step_time_vs_default_session": opt.step_seconds / measured["original_default_session"].step_seconds,
            "step_time_vs_optimizations_off": opt.step_seconds / measured["original_optimizations_off"].step_seconds,
        }
        if options.budget_bytes is not None:
            report["budget_met"] = opt.peak_bytes <= options.budget_bytes
    elif not deliverable:
        # no measurement to choose a session by: the original, as it came (its own settings)
        report["rejected"] = dict(_plan_summary(plan), order_followed=False)
        report["outcome"] = OUTCOME_ORIGINAL
        report["outcome_reason"] = (f"{_not_delivered(report)}; the original model is returned "
                                    f"unchanged{_rejections(report)}")
        rewritten = onnx.ModelProto()
        rewritten.CopyFrom(original)
        report.update(checkpoints=[], recompute_nodes=0)
        report["nodes"]["optimized"] = len(rewritten.graph.node)
        report.pop("session")
    else:
        report["outcome"] = OUTCOME_UNMEASURED
        report["outcome_reason"] = ("measurement was off: the optimized model is returned without checking "
                                    "that it needs less memory than the original" + _rejections(report))
    report["total_seconds"] = time.perf_counter() - started
    progress("done", 1.0)
    return OptimizeResult(rewritten, plan, report)
