"""The pipeline's stages, with typed results:

    prepare(model, options) -> Prepared      ingest, analyze, annotate (in a child), the cost
                                             graph, the original's predicted peak and its
                                             reference outputs (once, on disk)
    plan(prepared, options) -> Plan          the search (no ONNX Runtime run; `search_plan` for a
                                             target of the caller's)
    deliver(prepared, plan, options)         in graphopt/delivery.py: rewrite, verify (outputs and
        -> OptimizeResult                    order, one child per plan), measure, a loop of plans
                                             retried for the contracts below, never worse

This module holds the first two and the pieces delivery is made of (rewrite, check, measure,
run under a memory limit). `optimize`, `analyze_model` (graphopt/optimize.py), the sweep, the
batch and the service compose them. Every ONNX Runtime run happens in a fresh child process that holds one session
(step timing keeps a process per session alive and runs them in turn), on files of the
`Prepared`'s workspace (close it, or use it as a context manager); the weights stay in the
workspace's file, not in this process (`Workspace.copy_keeping_weights_on_disk`). Runs that
time nothing (peaks) may run in the background beside the caller's own runs, one at a time,
never beside a timing (`Prepared.overlap`).

Contracts at delivery (checked, never assumed):
- OUTPUTS: a plan whose rewritten model's outputs differ from the original's is rejected
  (a warning is logged and `report.rejected_for_outputs` and `outcome_reason` name the
  output and the difference); the next plan is tried as below. VerificationError only when
  even the plan without recomputation differs (the rewrite itself is broken).
- ORDER: a rewritten model is returned only if ONNX Runtime's profile shows it ran the planned
  order. Otherwise the next plan is tried (store-all: no recomputation, only the order is
  ours), then none: the original is returned.
- NEVER WORSE: with measurement on, a rewritten model is returned only if its measured peak
  is below the original's under both sessions (default session, optimizations off); otherwise
  the original graph is returned with the session settings that measured lowest (in its
  metadata, so `open_session` applies them). `report.outcome` says which, and why.
- BUDGET: met by measurement; a plan over it by measurement is planned again for a budget
  lowered by the overshoot (`delivery.BUDGET_RETRIES` times), else BudgetInfeasibleError.
- MEMORY LIMIT: what is returned ran under ONNX Runtime capped at the limit
  (`delivery._fit_memory_limit`), else MemoryLimitError; a rewritten model that runs under it is
  returned when the original does not, even if its measured peak is not below the original's.
  When the original runs under it in neither session, nothing runs it at full size: it is
  annotated at reduced batches of its twin (each run capped at the limit), plans are verified
  at the larger one against the original's twin, and the returned model is measured under the
  limit alone (`ReducedStep`, `delivery._reduced_delivery`).
"""
from __future__ import annotations

import logging
import os
import re
import time
import dataclasses
import functools
from dataclasses import dataclass, field

# analyze's graph library, imported with the planner (the measuring children never import it)
import networkx  # noqa: F401
import numpy as np
import onnx

from .analyze import TrainingGraph, analyze, fed_back_outputs
from .annotate import Annotations, write_annotations
from .costmodel import Simulation, priority_order, simulate
from .errors import BudgetInfeasibleError, GraphoptError, MemoryLimitError
from .ingest import follow_order, name_nodes
from .inputs import save_inputs, synthesize_inputs
from .op_rules import FOLDED_AT_LOAD_OPS, at_threads, build_cost_graph, opset_of, recompute_factor
from .options import OptimizeOptions
from .report import Deviation, GraphOptimizations, LimitRun, OrderResult, OutputsDiffer, PlanTried, Report
from .rewrite import PLANNED_SETTINGS, expand_functions, has_function, rewrite
from .runtime.isolated import Workspace
from .tasks import run_task
from .reduced import TwinError, batch_inputs, full_shapes, full_size_annotations, make_twin
from .runtime.limit import initializer_bytes, out_of_memory
from .runtime.measure import Measurement, measure, run_within_limit, time_steps
from .runtime.offline import without_transfers
from .runtime.overlap import Overlap
from .runtime.session import (DEFAULT_SETTINGS, UNOPTIMIZED_SETTINGS, SessionSettings, default_providers,
                              read_settings)
from .search import DEFAULT_STRATEGY, STRATEGIES, Plan, least_peak_within, store_all
from .search.auto import least_peak_local
from .search.plan import peak_floor_bytes
from .verify import OutputComparison, compare_order
from .runtime.weights import Weights

log = logging.getLogger(__name__)

# The original model as graphopt runs it: the strongest fair baseline, and the cost model's rules.
ORIGINAL_UNOPTIMIZED = UNOPTIMIZED_SETTINGS
# the two sessions the original is measured under (NEVER WORSE)
ORIGINAL_SESSIONS = {"original_default_session": DEFAULT_SETTINGS,
                     "original_optimizations_off": ORIGINAL_UNOPTIMIZED}

# The first plan is searched for this share of the step-time overhead allowed, by ONNX Runtime's
# threads (more than two: two's): the time model is fitted (op_rules.RECOMPUTE_FACTORS), so a plan
# predicted at the limit measures over it about half the time; the error grows with what is
# recomputed, and the step's own noise between two timings is larger at two threads than at one
# (`python benchmarks/time_model.py`, this 2-core machine: the plan without recomputation timed
# twice moved by -36% to +17% at two threads, -13% to +5% at one). At one thread 0.6 returned
# higher peaks than the factor 1.2 did before (the examples' median 0.37x against 0.31x, by
# `benchmarks/optimize_time.py --threads 1`), whose plans were within the limit on 5 of 6 first.
PLANNED_OVERHEAD_SHARES = {1: 0.85, 2: 0.6}


@dataclass
class StepTiming:
    """Step times measured against each other, step by step in turn (`runtime.measure.time_steps`),
    and what the cost model's seconds are scaled by. The baseline of `max_overhead` is
    `default_session_seconds`."""
    default_session_seconds: float       # the original under ONNX Runtime's default session
    # the original, graph optimizations off (ORT's order); None until the answer depends on it
    # (`optimizations_off_overhead`: where the original may be returned)
    optimizations_off_seconds: float | None
    store_all_seconds: float             # graphopt's order and settings, nothing recomputed
    planned_graph_off_seconds: float | None  # the graph planned in ORT's order, optimizations off:
                                         # what `predicted_original_seconds` predicts; known only
                                         # where it is the original (no offline graph optimizations)
                                         # and that was timed
    seconds_scale: float                 # store_all_seconds / the sum of its nodes' profiled seconds
    predicted_original_seconds: float    # the cost model on ORT's order of the original (optimizations off)
    provider: str


@dataclass
class OptimizeResult:
    """The returned model, its plan and report. Where the caller kept the weights on disk
    (`optimize(..., weights=...)`), `model` holds references to files of `weights.folder`, a
    folder of its own: write it with `graphopt.runtime.weights.save_model(model, path, weights)`, then
    `close` the result (or use it as a context manager) to remove that folder."""
    model: onnx.ModelProto
    plan: Plan
    report: Report
    weights: Weights | None = None
    # the predicted bytes alive over the original's schedule and the returned plan's (None: the
    # original is returned), by kind (`explain.Timeline`: what `plot.plot_timeline` draws)
    timelines: tuple | None = None

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()

    def __enter__(self) -> "OptimizeResult":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- prepare ---------------------------------------------------------------------------------------
@dataclass
class Prepared:
    """A model ready to plan: the cost graph as ONNX Runtime runs it, and what delivery
    compares against. Holds a workspace on disk (inputs, models, the reference outputs)."""
    original: onnx.ModelProto            # the user's graph, nodes named: reference and baseline
    training: TrainingGraph              # as ORT runs it (function ops it inlines at load written out)
    annotations: Annotations             # of `training`
    original_annotations: Annotations | None   # of `original` (None: not yet, `original_annotations_for`)
    graph: object                        # the cost graph of `training`
    functions_expanded: dict[str, int]   # op type -> nodes written as their function body
    predicted_original: Simulation       # the cost model on ORT's own order of `training`
    inputs: dict[str, np.ndarray]
    workspace: Workspace
    timing: StepTiming | None = None     # None: measurement off (seconds as annotated)
    # ORT's graph optimizations applied offline before planning (`_apply_graph_optimizations`):
    # {"level", "nodes_before", "nodes_after", "op_types": {op type: count added (+) or removed (-)}},
    # or {} when none were applied (option "none", nothing changed, or outputs differed)
    graph_optimizations: GraphOptimizations = field(default_factory=GraphOptimizations)
    sums_chained: int = 0                # the backward's n-ary Sums written as Adds (`chain_gradient_sums`)
    plans: dict = field(default_factory=dict)   # (graph id, strategy) -> {budget: plan} (`plan`)
    # the cost graph in each order a plan can start from (BASE_ORDERS' labels: `base_graphs`),
    # the label of `graph` among them (the leanest with nothing recomputed) and each one's
    # predicted peak with nothing recomputed, in bytes
    base_graphs: dict = field(default_factory=dict)
    base_order: str = "file"
    base_order_peaks: dict = field(default_factory=dict)
    # with a memory limit: the original run under it in each of ORIGINAL_SESSIONS (`limit_run`)
    original_limit_runs: dict = field(default_factory=dict)
    # when the original runs under the limit in none of them: the step annotated and verified at
    # reduced batches (`ReducedStep`); None otherwise
    reduced: "ReducedStep | None" = None
    full_size_because: str | None = None   # why it is not, when the original does not run under the limit
    # child runs that time nothing, started in the background while planning and verifying go on
    # (`runtime.overlap`; at once where a memory limit is given: two processes at once might not fit)
    overlap: Overlap = field(default_factory=Overlap)
    # the caller keeps the weights on disk (`prepare(weights=...)`): the model delivered references
    # the workspace's weights, handed over to the result (`Workspace.hand_over`), not loaded back
    weights_on_disk: bool = False
    # the originals' peaks under ORIGINAL_SESSIONS (`start_original_peaks`): label -> Future[Measurement]
    original_peaks: dict = field(default_factory=dict)
    # peaks of rewritten models started before they were needed (`start_peak`): [(model, Future)]
    started_peaks: list = field(default_factory=list)

    def original_annotations_for(self, options: OptimizeOptions) -> Annotations:
        """The original's annotations, annotated now if they were not (the graph planned was ORT's
        optimized one)."""
        if self.original_annotations is None:
            self.overlap.quiet()   # (its node seconds are timed)
            self.original_annotations = _annotate_file(self.workspace.path("original"), self.workspace.inputs_path,
                                                       options, self.workspace, "original")
        return self.original_annotations

    def set_graphs(self, file_graph) -> None:
        """`file_graph` (the cost graph in the file's order) in every base order that can be
        had; `graph` the leanest of them with nothing recomputed (ties: the first)."""
        self.base_graphs = base_order_graphs(file_graph, self.annotations.execution_order)
        self.base_order_peaks = {label: store_all(g).peak_bytes for label, g in self.base_graphs.items()}
        self.base_order = min(self.base_order_peaks, key=lambda label: (self.base_order_peaks[label],
                                                                         BASE_ORDERS.index(label)))
        self.graph = self.base_graphs[self.base_order]

    @property
    def baseline_step_seconds(self) -> float:
        """What `max_overhead` is a fraction of: the original's measured step time under the
        default session, or (measurement off) its predicted time with optimizations off."""
        if self.timing is not None:
            return self.timing.default_session_seconds
        return self.predicted_original.compute_seconds

    def step_seconds_limit(self, options: OptimizeOptions) -> float | None:
        """The step seconds a plan may take under `options` (None: no limit)."""
        overhead = options.overhead_limit
        return None if overhead is None else (1.0 + overhead) * self.baseline_step_seconds

    def planned_seconds_limit(self, options: OptimizeOptions) -> float | None:
        """The predicted step seconds the first plan is searched for: a share of the overhead
        allowed (PLANNED_OVERHEAD_SHARES; None: no limit)."""
        overhead = options.overhead_limit
        if overhead is None:
            return None
        return (1.0 + at_threads(PLANNED_OVERHEAD_SHARES, options.threads) * overhead) * self.baseline_step_seconds

    @property
    def reference_path(self) -> str | None:
        """The original's outputs on disk (computed once), or None when not computed."""
        return self.workspace.reference_path

    def leaving(self, model: onnx.ModelProto) -> tuple[onnx.ModelProto, Weights | None]:
        """`model` as it leaves graphopt: its weights loaded back into it, or, where the caller
        keeps them on disk, handed over with it (`Workspace.hand_over`: the model and the
        `Weights` whose folder holds their data)."""
        if self.weights_on_disk:
            return model, self.workspace.hand_over(model)
        return self.workspace.with_weights(model), None

    def close(self) -> None:
        try:
            self.overlap.close()   # (its children read the workspace's files)
        finally:
            self.workspace.close()

    def __enter__(self) -> "Prepared":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prepare(model: onnx.ModelProto, options: OptimizeOptions, *, reference: bool | None = None,
            expand: bool = True, early_peaks: bool = False, weights: Weights | None = None) -> Prepared:
    """Check `options`; name, analyze and annotate `model` (left untouched) in a child; build
    the cost graph; the original's outputs once when `reference` (default: `options.verify`).
    `expand=False` keeps function ops ORT inlines at load as they are (the plan's order then
    cannot cover their bodies: for tests of the order check). `early_peaks`: the originals'
    peaks, which `deliver` compares against, measured from the start in the background (for a
    caller that delivers: `optimize`). `weights`: where the data of `model`'s stubs is
    (graphopt/weights.py: external data under `weights.folder`, tensors it holds); given, the
    weights are never loaded into this process, and the delivered model references them."""
    options.check()
    progress = options.progress or (lambda stage, fraction: None)
    progress("analyze", 0.0)
    workspace = Workspace()
    overlap = Overlap(enabled=options.memory_limit_bytes is None)
    try:
        # the weights stay in the workspace's file: this process holds the graph, the children
        # read the weights (`deliver` loads them back into the model it returns)
        working = workspace.copy_keeping_weights_on_disk(model, weights)
        name_nodes(working)
        training = analyze(working, options.loss)
        inputs = options.inputs if options.inputs is not None else synthesize_inputs(working, options.input_dims)
        workspace.save_inputs(inputs)
        original_runs: dict = {}
        reduced = None
        if options.memory_limit_bytes is not None:
            # the original under the limit first: where it runs in no session, nothing runs it at full
            # size (annotation and verification at reduced batches: ReducedStep)
            progress("memory limit: the original", 0.05)
            workspace.save(training.model, "original")
            path = _as_returned(workspace, training.model, "original-limited")
            original_runs = {label: _limit_run(workspace, path, options, settings)
                             for label, settings in ORIGINAL_SESSIONS.items()}
        full_size_because = None
        if original_runs and not any(run.fits for run in original_runs.values()):
            try:
                reduced = ReducedStep.start(training, inputs, workspace)
                progress("annotate at reduced batches", 0.1)
                annotations = first = _annotate(training, options, workspace, "original", reduced)
            except TwinError as exc:
                # on a host with room (the CPU provider) the step still runs at full size, outside the limit
                full_size_because = f"graphopt cannot annotate it at a reduced batch: {exc}"
                log.warning("the original does not run under the memory limit, and %s; it is annotated and "
                            "verified at full size, outside the limit", full_size_because)
                reduced = None
        if reduced is None:
            # the original is annotated only when it is the graph planned: where ORT's graph
            # optimizations apply, the optimized graph is annotated instead (and the original
            # only if it is returned with its annotations: `Prepared.original_annotations_for`)
            workspace.save(training.model, "original")
            annotations = first = None
        original_peaks = {}
        if early_peaks and options.measure and overlap.enabled and reduced is None:
            # what delivery compares any plan against, measured while graphopt goes on (nothing is
            # timed before the time stage, which waits for them: `Overlap.quiet`)
            original_peaks = _start_original_peaks(workspace, options, overlap)
        graph_optimized = GraphOptimizations()
        if options.graph_optimizations != "none":
            progress("graph optimizations", 0.12)
            training, annotations, graph_optimized = _apply_graph_optimizations(training, annotations, options,
                                                                                workspace, reduced)
        # the backward's n-ary Sums as Adds placed as each contribution arrives: on the graph planned
        # (after ORT's offline optimizations, which read the original's file); the original, saved
        # above, stays what is measured and verified against
        chained = chain_gradient_sums(training)
        sums_chained = 0
        if chained is not None:
            chained, sums_chained = chained
            name_nodes(chained)
            training = analyze(chained, options.loss)
            if annotations is not None:   # (annotated before: the graph optimized, or at reduced batches)
                annotations = _annotate(training, options, workspace, "sums-chained", reduced)
        del chained
        if annotations is None:
            progress("annotate", 0.14)
            annotations = first = _annotate(training, options, workspace, "original")
        expanded: dict[str, int] = {}
        if expand:
            try:
                training, annotations, expanded = _expand_inlined(training, annotations, options, workspace,
                                                                  reduced)
            except TwinError as exc:   # (only at reduced batches) the graph is planned as it is
                log.warning("function ops ONNX Runtime inlines at load are not written out: graphopt cannot "
                            "annotate the expanded graph at a reduced batch (%s)", exc)
        graph = build_cost_graph(training, annotations.tensor_bytes, annotations.node_seconds,
                                 tensor_shapes=annotations.tensor_shapes, provider=annotations.provider,
                                 recompute_factor=recompute_factor(options.threads))
        predicted = simulate(graph, [(name, 0) for name in annotations.execution_order if name in graph])
        prepared = Prepared(working, training, annotations, first, graph, expanded, predicted, inputs, workspace,
                            sums_chained=sums_chained,
                            graph_optimizations=graph_optimized, original_limit_runs=original_runs,
                            reduced=reduced, full_size_because=full_size_because,
                            overlap=overlap, original_peaks=original_peaks,
                            weights_on_disk=weights is not None)
        prepared.set_graphs(graph)
        if options.measure and reduced is None:
            progress("time", 0.2)
            _time_baseline(prepared, options)
        if options.verify if reference is None else reference:
            progress("reference outputs", 0.25)
            _reference_outputs(prepared)
        return prepared
    except BaseException:
        try:
            overlap.close()
        finally:
            workspace.close()
        raise


# The orders a plan can start from: the training graph's file order, and the order ONNX Runtime
# ran it in when it was annotated (its DEFAULT walk, optimizations off: the original's own
# session), where forward and backward ops may interleave (`CostGraph.in_order`); the plan's
# schedule sinks backward ops and inserts recomputation on top (search/plan.py).
BASE_ORDERS = ("file", "onnxruntime")


def chain_gradient_sums(training: TrainingGraph) -> tuple[onnx.ModelProto, int] | None:
    """The backward's n-ary Sums (a parameter's gradient contributions, one per use, held until
    one Sum adds them at the end) written as a chain of Adds placed as each contribution arrives
    (`builder.lean.sums_as_produced`, what graphopt's builder writes): in the file's order the
    chain holds one sum and the newest contribution where the Sum held them all. A new model and
    how many Sums were chained (None: none to chain; the weights stay stubs, not copied). Verified
    with the rest: the returned model's outputs against the original's."""
    from .builder.lean import sums_as_produced
    nodes = training.nodes
    if not any(nodes[name].op_type == "Sum" and len([i for i in nodes[name].input if i]) > 2
               for name in training.backward):
        return None
    model = onnx.ModelProto()
    model.CopyFrom(training.model)
    forward = {o for name in training.forward for o in nodes[name].output if o}
    chained = sums_as_produced(model, forward)
    return (model, chained) if chained else None


def base_order_graphs(graph, execution_order: list[str]) -> dict:
    """`graph` (in the file's order) in each of BASE_ORDERS that can be had: ONNX Runtime's when
    every op it ran is in a topological order of the graph. The order ONNX Runtime runs the
    original in can be far leaner than the file's: measured on BERT-base's training graph (4 x
    128 tokens, legacy exporter) 418.9 MiB against 508.7 with nothing recomputed (its tied
    embedding's gradient is made at the start of the backward pass in the file and held to its
    end); a plan from the worse order cannot reach the original's peak however much it
    recomputes. The file's can be the leaner one too (the tanh MLP example: 54.1 MiB against
    102.2), and which gives the best plan after recomputation differs by model, so plans are
    searched from each (`plan`)."""
    graphs = {"file": graph}
    try:
        graphs["onnxruntime"] = graph.in_order(execution_order)
    except ValueError as exc:
        log.warning("plans cannot start from ONNX Runtime's order (%s): they start from the file's", exc)
    return graphs


# The timing of sessions against each other: rounds of one step per session in turn (fewer,
# at least 3, once they took the seconds given).
TIMING_ROUNDS = 5
TIMING_MAX_SECONDS = 40.0
# ... and fewer (at least 3) once the rounds left could not move the median of any session's
# step over the default session's by more than 2%, whatever they gave (`runtime.measure.settled`:
# after 4 rounds of 5, where the middle two lie within 2%)
TIMING_SETTLE = 0.02


def _time_baseline(prepared: Prepared, options: OptimizeOptions) -> None:
    """Measure the step times `StepTiming` holds, in turn (see `runtime._timing_worker`),
    and give the cost graph the seconds ONNX Runtime spends on each node in graphopt's order and
    settings (store-all's profiled nodes, scaled to its measured step time): the annotation's
    come from ORT's own order in a process whose every buffer is a fresh mmap, which measured
    1.2-1.5x the step time on the examples."""
    workspace = prepared.workspace
    no_recompute = rewrite_plan(prepared, store_all(prepared.graph))
    original = workspace.path("original")
    # store-all profiled for its nodes' seconds first, then timed with the profiler off (its step
    # timed with the profiler on, every example's plan was predicted 13-18% slow, against -7% to
    # +11% from an unprofiled twin: `benchmarks/optimize_time.py`; that twin, a third session
    # timed every round, is no longer needed). The original with optimizations off is timed only
    # where the answer depends on it (`optimizations_off_overhead`).
    store_all_path = workspace.save(no_recompute, "store-all")
    sessions = [(original, DEFAULT_SETTINGS), (store_all_path, None)]
    prepared.overlap.quiet()
    # where the nodes' seconds were replayed (a provider whose profile times launches), store-all is
    # not profiled: its profile would be launches too; the replayed seconds are scaled to its step
    replayed = prepared.annotations.node_seconds_from == "replay"
    times = time_steps(sessions, workspace.inputs_path, provider=options.provider, threads=options.threads,
                       rounds=TIMING_ROUNDS, max_seconds=TIMING_MAX_SECONDS, profile=() if replayed else (1,),
                       settle=TIMING_SETTLE)
    ours = {} if replayed else times.node_seconds[0]
    default_seconds = times.step_seconds[0]
    # each session against the default one by the median of the rounds' ratios (the runs of one
    # round are next to each other in time: a load that comes and goes moves both)
    store_all_seconds = default_seconds * times.ratio(1, 0)
    annotated = prepared.annotations.node_seconds
    common = [n for n in ours if n in annotated]
    annotated_scale = (sum(ours[n] for n in common) / sum(annotated[n] for n in common)
                       if common and sum(annotated[n] for n in common) > 0 else 1.0)
    node_seconds = {n: ours.get(n, annotated_scale * annotated.get(n, 0.0)) for n in prepared.graph.ops}
    profiled = sum(node_seconds.values())
    scale = store_all_seconds / profiled if profiled > 0 else 1.0
    node_seconds = {n: v * scale for n, v in node_seconds.items()}
    annotations = prepared.annotations
    prepared.set_graphs(build_cost_graph(prepared.training, annotations.tensor_bytes, node_seconds,
                                         tensor_shapes=annotations.tensor_shapes, provider=annotations.provider,
                                         recompute_factor=recompute_factor(options.threads)))
    prepared.predicted_original = simulate(
        prepared.graph, [(name, 0) for name in annotations.execution_order if name in prepared.graph])
    prepared.timing = StepTiming(
        default_session_seconds=default_seconds, optimizations_off_seconds=None,
        store_all_seconds=store_all_seconds, planned_graph_off_seconds=None, seconds_scale=scale,
        predicted_original_seconds=prepared.predicted_original.compute_seconds, provider=times.provider)


def _annotate(training: TrainingGraph, options: OptimizeOptions, workspace: Workspace, label: str,
              reduced: "ReducedStep | None" = None) -> Annotations:
    """`annotate` `training.model` (saved in `workspace` as `label`) in a fresh process; when
    `reduced`, its twins at two smaller batches instead (`ReducedStep.annotate`)."""
    path = workspace.save(training.model, label)
    if reduced is not None:
        return reduced.annotate(training, options, workspace, label)
    return _annotate_file(path, workspace.inputs_path, options, workspace, label)


def _annotate_file(path: str, inputs_path: str, options: OptimizeOptions, workspace: Workspace, label: str,
                   cap_bytes: int | None = None) -> Annotations:
    return _annotate_file_checked(path, inputs_path, options, workspace, label, cap_bytes)[0]


def _annotate_file_checked(path: str, inputs_path: str, options: OptimizeOptions, workspace: Workspace,
                           label: str, cap_bytes: int | None = None, reference: str | None = None
                           ) -> tuple[Annotations, OutputComparison | None]:
    """`_annotate_file`, and with a `reference`, the annotated run's outputs compared with it
    within `options.tolerance` in the same child (a run fewer than verifying apart)."""
    out = os.path.join(workspace.folder, label + ".annotations.json")
    result = run_task("annotate", {"model": path, "inputs": inputs_path, "out": out,
                                   "settings": ORIGINAL_UNOPTIMIZED.to_dict(), "providers": options.providers,
                                   "threads": options.threads, "cap_bytes": cap_bytes, "reference": reference,
                                   "tolerance": options.tolerance,
                                   "node_times": "replay" if options.replays_node_times else "profile"})
    with open(out) as f:
        annotations = Annotations.from_json(f.read())
    os.remove(out)
    comparison = None if reference is None else OutputComparison.from_dict(result["comparison"])
    return annotations, comparison


_RECOMPUTED = re.compile(r"__rc\d+_*$")   # rewrite.version_name's suffix


@dataclass
class ReducedStep:
    """A step that does not run under the memory limit at full size in any session: annotated at
    two smaller batches of its reduced twin (graphopt/reduced.py), each run capped at the limit,
    and extended to the full batch; its rewrites verified at the larger of them against the
    original's twin there. The first batch tried is half the full one, halved again while ONNX
    Runtime refuses the twin under the limit."""
    full_batch: int
    state: frozenset
    parameters: frozenset
    inputs: dict
    base_dir: str                            # the workspace's folder (the weights file)
    batches: tuple[int | None, int] | None = None   # (low, high): annotated at both (low None: at high
                                                    # alone), verified at high
    inputs_path: str | None = None           # the inputs at `batches[1]` (the first samples)
    reference_path: str | None = None        # the original twin's outputs at `batches[1]`
    rewritten_constants: int = 0
    # every tensor's full-size shape as annotated (extrapolated): what shape inference cannot
    # give (outputs of operators it has no schema for, such as ORT's fused ones) of a rewrite
    known_shapes: dict = field(default_factory=dict)

    @classmethod
    def start(cls, training: TrainingGraph, inputs: dict, workspace: Workspace) -> "ReducedStep":
        state = frozenset(fed_back_outputs(training.model).values())
        full, _ = batch_inputs(training.model, inputs, state)
        if full < 2:
            raise TwinError(f"its batch ({full}) is too small to reduce (graphopt reduces the batch; a reduced "
                            "sequence is not done yet)")
        return cls(full, state, frozenset(training.parameters) | state, inputs, workspace.folder)

    def twin(self, model: onnx.ModelProto, batch: int, shapes=None):
        """`model` (the original, a plan's rewrite) at `batch` (graphopt/reduced.py). A recomputed
        value (`x__rc1`) has its original's annotated shape where inference has none."""
        if shapes is None and self.known_shapes:
            shapes = full_shapes(model)
            for node in model.graph.node:
                for out in node.output:
                    base = _RECOMPUTED.sub("", out)
                    if out and out not in shapes and base in self.known_shapes:
                        shapes[out] = list(self.known_shapes[base])
        return make_twin(model, self.inputs, batch, state=self.state, keep=self.parameters, shapes=shapes,
                         base_dir=self.base_dir)

    def annotate(self, training: TrainingGraph, options: OptimizeOptions, workspace: Workspace,
                 label: str) -> Annotations:
        """The annotations of `training` at its full batch from its twins' (module docstring)."""
        model = training.model
        inferred = full_shapes(model)
        high = self.batches[1] if self.batches else self.full_batch // 2
        refused = None
        while True:
            low = high // 2 or None   # batch 1 alone: its shapes scaled on the tracked batch axis
            if high < 1:
                outside = initializer_bytes(model) + sum(int(np.asarray(v).nbytes) for v in self.inputs.values())
                # what every step writes whatever its batch: the gradients, the updated state
                outputs = sum(int(np.prod(inferred[o.name], dtype=np.int64)) * np.dtype(
                    onnx.helper.tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type)).itemsize
                    for o in model.graph.output if o.name in inferred and o.type.tensor_type.elem_type)
                raise MemoryLimitError(
                    f"memory limit of {options.memory_limit_bytes} bytes is not met: the original does not run under "
                    f"it, nor does its twin at batch 1 (of {self.full_batch}), beside the weights and inputs "
                    f"of {outside} bytes at most (ONNX Runtime: {_refusal(str(refused))}); the step's outputs (the "
                    f"gradients, any updated state) alone take {outputs} bytes at every batch")
            twins = {b: self.twin(model, b, inferred) for b in (low, high) if b}
            try:
                measured = {high: self._annotate_twin(twins[high], options, workspace, label)}
                break
            except GraphoptError as exc:
                if not out_of_memory(str(exc)) or self.batches:
                    raise
                refused = exc
                log.info("the twin at batch %d does not run under the memory limit: trying %d", high, high // 2)
                high //= 2
        if low:
            measured[low] = self._annotate_twin(twins[low], options, workspace, label)
        annotations = full_size_annotations(model, measured.get(low), measured[high], low, high, self.full_batch,
                                            inferred, twins[high].positions)
        self.batches = (low, high)
        self.rewritten_constants = twins[high].rewritten_constants
        self.known_shapes = dict(annotations.tensor_shapes)
        if self.inputs_path is None:
            self.inputs_path = os.path.join(workspace.folder, f"inputs-b{high}.npz")
            save_inputs(self.inputs_path, twins[high].inputs)
        return annotations

    def reference(self, workspace: Workspace, original: onnx.ModelProto) -> str:
        """The original's twin's outputs at the batch rewrites are verified at (computed once)."""
        if self.reference_path is None:
            twin = self.twin(original, self.batches[1])
            out = os.path.join(workspace.folder, f"reference-b{twin.batch}.npz")
            run_task("reference", {"model": workspace.save(twin.model, "original-twin"), "inputs": self.inputs_path,
                                   "settings": ORIGINAL_UNOPTIMIZED.to_dict(), "threads": 1, "out": out})
            self.reference_path = out
        return self.reference_path

    def _annotate_twin(self, twin, options: OptimizeOptions, workspace: Workspace, label: str) -> Annotations:
        name = f"{label}-b{twin.batch}"
        path = workspace.save(twin.model, name)
        inputs_path = os.path.join(workspace.folder, name + ".npz")
        save_inputs(inputs_path, twin.inputs)
        cap = options.memory_limit_bytes - initializer_bytes(twin.model) - sum(
            int(np.asarray(v).nbytes) for v in twin.inputs.values())
        try:
            return _annotate_file(path, inputs_path, options, workspace, name, cap_bytes=max(cap, 1))
        finally:
            os.remove(inputs_path)


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


def _expand_inlined(training: TrainingGraph, annotations: Annotations, options: OptimizeOptions,
                    workspace: Workspace, reduced: ReducedStep | None = None
                    ) -> tuple[TrainingGraph, Annotations, dict[str, int]]:
    """Where ONNX Runtime inlined function ops at load, write their bodies into the graph
    (`rewrite.expand_functions`) and annotate that instead, so the plan's order covers every
    node ORT runs (inlined at load, the body nodes would come after every node of the file
    in ORT's priority order)."""
    inlined = inlined_at_load(training.model, annotations.execution_order)
    if not inlined:
        return training, annotations, {}
    model, expanded = expand_functions(training.model, inlined, _type_protos(annotations))
    if not expanded:
        return training, annotations, {}
    op_types: dict[str, int] = {}
    expanded_names = set(expanded)
    for node in training.model.graph.node:
        if node.name in expanded_names:
            op_types[node.op_type] = op_types.get(node.op_type, 0) + 1
    training = analyze(model, options.loss)
    del model
    return training, _annotate(training, options, workspace, "expanded", reduced), op_types


def _op_type_changes(before: onnx.ModelProto, after: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in before.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) - 1
    for node in after.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return {op: n for op, n in sorted(counts.items()) if n}


def _apply_graph_optimizations(training: TrainingGraph, annotations: Annotations | None, options: OptimizeOptions,
                               workspace: Workspace, reduced: "ReducedStep | None" = None
                               ) -> tuple[TrainingGraph, Annotations | None, GraphOptimizations]:
    """Plan the graph ONNX Runtime would run: its graph optimizations at
    `options.graph_optimizations` applied offline (`runtime.offline`), in a child, to the original
    saved in `workspace`. The result replaces `training` only if it is still the same training
    graph (same outputs, analyzable) and, when verifying, computes the original's outputs within
    the tolerance (for a ReducedStep: their twins at its batch); otherwise a warning says why and
    the original is planned as given, with `annotations` (None: the caller annotates it)."""
    original = workspace.path("original")
    # (not a label of `workspace.save`, which would remove its weights file)
    out = os.path.join(workspace.folder, "ort-optimized.onnx")
    level = options.graph_optimizations
    if level == "extended" and (options.providers or default_providers())[0] != "CPUExecutionProvider":
        # EXTENDED's fused operators are assigned to the provider they were made for, and graphopt
        # checks outputs on the CPU provider: elsewhere only BASIC's, which are standard operators
        level = "basic"
    try:
        # its weights in `out`.data beside the workspace's, and left there (`copy_keeping_weights_on_disk`)
        run_task("graph-optimize", {"model": original, "out": out, "level": level, "providers": options.providers,
                                    "external_data": True})
        model = onnx.load(out, load_external_data=False)
        transfers = without_transfers(model)
        if transfers:
            log.info("ONNX Runtime's saved graph carried %d copies between host and device; they are left to "
                     "ONNX Runtime to insert at load", transfers)
    except Exception as exc:  # noqa: BLE001 - the plan can go on without ORT's fusions
        log.warning("ONNX Runtime's %s graph optimizations could not be applied offline (%s): the graph is "
                    "planned as given", level, exc)
        return training, annotations, GraphOptimizations()
    changes = _op_type_changes(training.model, model)
    if not changes:
        return training, annotations, GraphOptimizations()
    follow_order(model, training.model)   # ORT saves its own topological order; keep the file's
    name_nodes(model)
    outputs = [o.name for o in training.model.graph.output]
    why = None
    if [o.name for o in model.graph.output] != outputs:
        why = "its outputs are not the original's"
    else:
        try:
            optimized = analyze(model, training.loss)
        except GraphoptError as exc:
            why = f"it is not a training graph graphopt can plan ({exc})"
    checked, inputs_path, reference = out, workspace.inputs_path, None
    # on the CPU provider, the outputs of the optimized graph's annotation run are checked (a run
    # fewer); elsewhere (and for a ReducedStep's twin) a verification on the CPU provider, one thread
    check_in_annotation = (why is None and options.verify and reduced is None
                           and (options.providers or default_providers())[0] == "CPUExecutionProvider")
    if why is None and options.verify and reduced is not None:
        try:
            checked = workspace.save(reduced.twin(model, reduced.batches[1]).model, "graph-optimized-twin")
            inputs_path, reference = reduced.inputs_path, reduced.reference(workspace, training.model)
        except TwinError as exc:
            why = f"graphopt cannot check it at a reduced batch ({exc})"
    if why is None and options.verify and not check_in_annotation:
        result = run_task("verify", {"model": checked, "inputs": inputs_path,
                                     "settings": ORIGINAL_UNOPTIMIZED.to_dict(), "threads": 1,
                                     "reference": reference or _reference_path(workspace),
                                     "tolerance": options.tolerance})
        why = _differs(OutputComparison.from_dict(result["comparison"]), options)
    def not_used(why: str):
        log.warning("ONNX Runtime's %s graph optimizations are not used: %s; the graph is planned as given",
                    level, why)
        return training, annotations, GraphOptimizations()
    if why is not None:
        return not_used(why)
    del model
    summary = GraphOptimizations(level=level, nodes_before=len(training.model.graph.node),
                                 nodes_after=len(optimized.model.graph.node), op_types=changes)
    if options.progress is not None:
        options.progress("annotate", 0.14)
    try:
        if check_in_annotation:
            optimized_annotations, comparison = _annotate_file_checked(
                workspace.save(optimized.model, "graph-optimized"), workspace.inputs_path, options, workspace,
                "graph-optimized", reference=_reference_path(workspace))
            why = _differs(comparison, options)
            if why is not None:
                return not_used(why)
        else:
            optimized_annotations = _annotate(optimized, options, workspace, "graph-optimized", reduced)
    except GraphoptError as exc:
        if reduced is None or not (isinstance(exc, TwinError) or out_of_memory(str(exc))):
            raise
        log.warning("ONNX Runtime's %s graph optimizations are not used: graphopt cannot annotate the optimized "
                    "graph at a reduced batch (%s); the graph is planned as given", level, exc)
        return training, annotations, GraphOptimizations()
    return optimized, optimized_annotations, summary


def _differs(comparison: OutputComparison, options: OptimizeOptions) -> str | None:
    """Why a graph ONNX Runtime optimized is not used (None: its outputs match the original's)."""
    if comparison.match:
        return None
    return (f"its output {comparison.worst_output()!r} differs from the original's (relative difference "
            f"{comparison.max_relative_difference:.3g} > {options.tolerance})")


def _reference_outputs(prepared: Prepared) -> str:
    """The original's outputs (optimizations off, one thread), computed once per workspace in
    a fresh process and kept on disk: their path. For a ReducedStep, its twin's at the batch
    rewrites are verified at."""
    if prepared.reduced is None:
        return _reference_path(prepared.workspace)
    return prepared.reduced.reference(prepared.workspace, prepared.original)


def _reference_path(workspace: Workspace) -> str:
    if workspace.reference_path is None:
        out = os.path.join(workspace.folder, "reference.npz")
        run_task("reference", {"model": workspace.path("original"), "inputs": workspace.inputs_path,
                               "settings": ORIGINAL_UNOPTIMIZED.to_dict(), "threads": 1, "out": out})
        workspace.reference_path = out
    return workspace.reference_path


# -- plan ------------------------------------------------------------------------------------------
# Under a step-time limit, the least peak within it is searched by bisection on the budget (14
# searches from the two base orders on the resnet example) only from the base orders whose least
# peak is within this fraction of the leanest order's. On the six examples the order with the
# lower least peak also had the lower peak within the limit where the limit bound, by 3-175%
# where their least peaks differed by more than 1% (by hand, on the examples' cost graphs at one
# thread; unet's orders, 0.8% apart, are both searched). Another order's plan is then its
# least-peak plan, over the limit.
BISECTED_ORDERS_MARGIN = 0.05
# ... and for `auto`, the bisection's plans are the starts of a local search for the least peak
# within the limit (`auto.least_peak_local`), kept where it is lower: on the six examples at four
# limits each, 0.974x the bisection's predicted peak on average, 0.82x at best (lower at 11 of
# the 24), for 6% more search CPU (`python benchmarks/limit_search.py`)
LIMIT_SEARCH_REFINE = True
_OPTIONS_BUDGET = object()


_OPTIONS_LIMIT = object()


def plan(prepared: Prepared, options: OptimizeOptions, budget_bytes=_OPTIONS_BUDGET, *,
         strategy: str | None = None, seconds_limit=_OPTIONS_LIMIT) -> Plan:
    """The plan of `strategy` (default: `options.strategy`) for `options`' objective, timed in
    `plan.notes["search_seconds"]`; no ONNX Runtime run. The strategy plans from every base
    order (`Prepared.base_graphs`: the file's, ONNX Runtime's) and the best plan for the
    objective is kept (`plan.notes["base_order"]` names its order).

    - a budget (`budget_bytes`, default `options.budget_bytes`): the least predicted step time
      whose predicted peak fits; a budget the strategy cannot fit is a BudgetInfeasibleError
      naming the least peak it found. With a step-time limit too, a plan over the limit is a
      BudgetInfeasibleError naming both reachable pairs (the budget's least time, the limit's
      least peak).
    - else a step-time limit (`seconds_limit`, default `prepared.planned_seconds_limit(options)`, a
      share of the overhead allowed: PLANNED_OVERHEAD_SHARES):
      the least peak whose predicted step time fits (`search.least_peak_within`).
    - else the least peak.

    What is searched for is read from `options` here; `search_plan` searches (delivery's retries
    call it with targets of their own)."""
    budget = options_budget_bytes(prepared, options) if budget_bytes is _OPTIONS_BUDGET else budget_bytes
    # with a budget too, the limit is a check on the plan (the user's); alone, what is searched for
    if seconds_limit is not _OPTIONS_LIMIT:
        limit = seconds_limit
    elif budget is not None:
        limit = prepared.step_seconds_limit(options)
    else:
        limit = prepared.planned_seconds_limit(options)
    return search_plan(prepared, options, strategy or options.strategy, budget, limit)


def search_plan(prepared: Prepared, options: OptimizeOptions, strategy: str, budget_bytes: int | None,
                seconds_limit: float | None) -> Plan:
    """The plan of `strategy` for a predicted peak of at most `budget_bytes` and a predicted step
    of at most `seconds_limit` seconds (None: none), as `plan` describes: with a budget, the
    least step time under it (the limit a check: BudgetInfeasibleError where both cannot hold);
    with a limit alone, the least peak within it; else the least peak. `options` names the
    budget in errors (a memory limit's, `OptimizeOptions.plans_for_limit`)."""
    budget, limit = budget_bytes, seconds_limit
    started, started_cpu = time.perf_counter(), time.thread_time()
    if budget is None and limit is not None and STRATEGIES[strategy].takes_budget:
        chosen = _best_over_orders(prepared, strategy, functools.partial(_within_limit, prepared, strategy, limit),
                                   None, limit)
    else:
        chosen = _best_over_orders(prepared, strategy, functools.partial(_within_budget, strategy, budget),
                                   budget, None)
    chosen.notes["search_seconds"] = time.perf_counter() - started
    chosen.notes["search_cpu_seconds"] = time.thread_time() - started_cpu
    if budget is not None and chosen.peak_bytes > budget:
        hint = "" if strategy == DEFAULT_STRATEGY else f" by {strategy} ({DEFAULT_STRATEGY} may find less)"
        if options.plans_for_limit:
            outside = prepared.graph.outside_peak_bytes
            raise MemoryLimitError(
                f"memory limit of {options.memory_limit_bytes} bytes cannot be met: the weights, inputs and "
                f"state take {outside} bytes, and the least step peak found{hint} is {chosen.peak_bytes} bytes "
                f"(predicted; the plan was searched for {budget}): a limit of {chosen.peak_bytes + outside} bytes "
                f"or more may be met")
        raise BudgetInfeasibleError(
            f"budget of {budget} bytes cannot be met: the least peak found{hint} is {chosen.peak_bytes} bytes",
            least_feasible_peak_bytes=chosen.peak_bytes)
    if budget is not None and limit is not None and chosen.simulation.compute_seconds > limit:
        within = _best_over_orders(prepared, strategy, functools.partial(_within_limit, prepared, strategy, limit),
                                   None, limit)
        baseline = prepared.baseline_step_seconds
        raise BudgetInfeasibleError(
            f"budget of {budget} bytes and step time at most {limit:.4g} s ({limit / baseline:.2f}x the "
            f"original's {baseline:.4g} s) cannot both hold (predicted): under the budget the least step "
            f"time is {chosen.simulation.compute_seconds:.4g} s "
            f"({chosen.simulation.compute_seconds / baseline:.2f}x, peak {chosen.peak_bytes} bytes); "
            f"within the step time the least peak is {within.peak_bytes} bytes "
            f"({within.simulation.compute_seconds / baseline:.2f}x)",
            least_feasible_peak_bytes=within.peak_bytes)
    return chosen


def _within_limit(prepared: Prepared, strategy: str, limit: float, graph, solve) -> Plan:
    """The least peak from `graph` whose predicted step is within `limit` (`search.least_peak_within`),
    or its least-peak plan where another base order is far leaner (BISECTED_ORDERS_MARGIN)."""
    low = solve(graph)
    # the leanest base order's least peak (each order's least-peak plan is remembered: `_remembered`)
    least_bytes = min(_remembered(prepared, strategy, g)(g).peak_bytes for g in prepared.base_graphs.values())
    if low.simulation.compute_seconds > limit and low.peak_bytes > (1 + BISECTED_ORDERS_MARGIN) * least_bytes:
        # an order far leaner than this one: its least peak within the limit is searched only there
        return low
    refine = least_peak_local if strategy == DEFAULT_STRATEGY and LIMIT_SEARCH_REFINE else None
    return least_peak_within(graph, solve, limit, least_peak=low, refine=refine)


def _within_budget(strategy: str, budget: int | None, graph, solve) -> Plan:
    """The least step time from `graph` under `budget` (None: the least peak)."""
    found = solve(graph, budget_bytes=budget)
    if budget is None or not STRATEGIES[strategy].takes_budget:
        return found
    # the least-peak plan is a plan under the budget too when it fits it: a search for the
    # least time under a budget can end on a plan that recomputes more (the resnet example
    # built with per-tap weight gradients: 3.39 s of recomputation under a budget its
    # least-peak plan met with 0.79 s)
    least = solve(graph)
    if least.peak_bytes > budget or (found.peak_bytes <= budget
                                     and least.recompute_seconds >= found.recompute_seconds):
        return found
    least.notes["exact"] = False   # least peak was its objective, not least time under the budget
    return least


def options_budget_bytes(prepared: Prepared, options: OptimizeOptions) -> int | None:
    """The predicted step peak a plan is searched for: the budget; or, planning for the memory
    limit (`OptimizeOptions.plans_for_limit`), the limit less what the predicted peak leaves out
    (`CostGraph.outside_peak_bytes`: weights, inputs, state), which runs under the cap then
    correct (`delivery._fit_memory_limit`); else None."""
    if options.budget_bytes is not None or not options.plans_for_limit:
        return options.budget_bytes
    outside = prepared.graph.outside_peak_bytes
    if options.memory_limit_bytes <= outside:
        raise MemoryLimitError(f"memory limit of {options.memory_limit_bytes} bytes cannot be met: the weights, "
                               f"inputs and state alone take {outside} bytes")
    return options.memory_limit_bytes - outside


def _best_over_orders(prepared: Prepared, strategy: str, search, budget: int | None,
                      limit: float | None) -> Plan:
    """`search(graph, solve)` from every base order, the best plan for the objective: with a
    budget, the least recompute time that fits (else the least peak); with a step-time limit,
    the least peak within it (else the least time); else the least peak, then the least
    recompute time. Ties: the first order (BASE_ORDERS). `notes["exact"]` stays only where no
    other order's peak floor is lower (the floor bounds the plans of its own order)."""
    plans = []
    for label, graph in prepared.base_graphs.items():
        found = search(graph, _remembered(prepared, strategy, graph))
        found.notes["base_order"] = label
        plans.append(found)
    if budget is not None:
        def key(p):
            return (max(0, p.peak_bytes - budget), p.recompute_seconds, p.peak_bytes)
    elif limit is not None:
        def key(p):
            over = p.simulation.compute_seconds > limit
            return (over, p.simulation.compute_seconds if over else 0.0, p.peak_bytes, p.simulation.compute_seconds)
    else:
        def key(p):
            return (p.peak_bytes, p.recompute_seconds)
    chosen = min(plans, key=key)
    if chosen.notes.get("exact") and len(plans) > 1 and strategy == DEFAULT_STRATEGY:
        chosen.notes["exact"] = chosen.peak_bytes <= min(peak_floor_bytes(g) for g in prepared.base_graphs.values())
    chosen.notes["base_order_peak_bytes"] = {p.notes["base_order"]: p.peak_bytes for p in plans}
    return chosen


def _remembered(prepared: Prepared, strategy: str, graph):
    """`strategy`'s solve, remembering its plan per budget for `graph` (one of `prepared`'s): a
    plan for a step-time limit is searched again (tighter) when it measures over the limit, and
    the bisection revisits the least-peak plan and its first budgets."""
    memo = prepared.plans.setdefault((id(graph), strategy), {})
    solver = STRATEGIES[strategy]

    def solve(graph, budget_bytes=None):
        if budget_bytes not in memo:
            memo[budget_bytes] = solver(graph, budget_bytes=budget_bytes)
        remembered = memo[budget_bytes]
        return dataclasses.replace(remembered, notes=dict(remembered.notes))
    return solve


def solver_exact(chosen: Plan) -> bool:
    """Whether `chosen` is optimal under its solver's model (`Plan.exact`)."""
    return chosen.exact


# -- deliver: the pieces ---------------------------------------------------------------------------
def rewrite_plan(prepared: Prepared, chosen: Plan) -> onnx.ModelProto:
    """`prepared`'s graph rewritten for `chosen` (recompute nodes, the planned order and
    session settings, the annotations in its metadata)."""
    rewritten = rewrite(prepared.training, prepared.graph, chosen, PLANNED_SETTINGS)
    write_annotations(rewritten, prepared.annotations)
    return rewritten


def planned_order(prepared: Prepared, chosen: Plan) -> list[str]:
    """The node order ONNX Runtime should run the rewritten model in."""
    return [op if copy == 0 else f"{op}__rc{copy}" for op, copy in priority_order(prepared.graph, chosen.schedule)]


def compare_in_child(prepared: Prepared, rewritten: onnx.ModelProto, options: OptimizeOptions,
                     order: bool) -> tuple[OutputComparison, list[str] | None, list[str] | None]:
    """In a fresh process: `rewritten`'s outputs (its metadata session, one thread) against the
    original's, one array at a time; if they match and `order` is asked, the node order of one
    profiled run under PLANNED_SETTINGS (`verify.executed_order`: a profile, no annotate), and the
    copies and casts ONNX Runtime inserted at load, which that order leaves out."""
    reference = _reference_outputs(prepared)
    workspace = prepared.workspace
    settings = read_settings(rewritten) or DEFAULT_SETTINGS
    inputs_path = workspace.inputs_path
    if prepared.reduced is not None:
        # at the reduced batch: the rewrite's twin against the original's
        rewritten = prepared.reduced.twin(rewritten, prepared.reduced.batches[1]).model
        inputs_path = prepared.reduced.inputs_path
    result = run_task("verify", {
        "model": workspace.save(rewritten, "candidate"), "inputs": inputs_path,
        "settings": settings.to_dict(), "threads": 1, "reference": reference, "tolerance": options.tolerance,
        "order": order, "order_settings": PLANNED_SETTINGS.to_dict(), "order_threads": options.threads,
        "providers": options.providers})
    return OutputComparison.from_dict(result["comparison"]), result["executed"], result.get("inserted")


def _difference(comparison: OutputComparison, options: OptimizeOptions) -> OutputsDiffer:
    return OutputsDiffer(
        output=comparison.worst_output(), relative_difference=comparison.max_relative_difference,
        reason=(f"output {comparison.worst_output()!r} differs from the original's (relative difference "
                f"{comparison.max_relative_difference:.3g} > {options.tolerance})"))


def _summary(chosen: Plan) -> dict:
    return {"strategy": chosen.strategy, "checkpoints": len(chosen.checkpoints),
            "recompute_nodes": chosen.recompute_ops, "predicted_peak_bytes": chosen.peak_bytes}


@dataclass
class Checked:
    """A plan rewritten and checked: the rewritten model, its outputs' comparison and entry."""
    plan: Plan
    model: onnx.ModelProto
    comparison: OutputComparison
    entry: PlanTried

    @property
    def accepted(self) -> bool:
        return self.entry.outputs_match and self.entry.order.followed


def check_plan(prepared: Prepared, chosen: Plan, options: OptimizeOptions,
               rewritten: onnx.ModelProto | None = None) -> Checked:
    """Rewrite `chosen` (unless given) and check it in one child: outputs, then (if they match)
    the order from one profiled run. A plan whose outputs differ is logged as rejected."""
    rewritten = rewrite_plan(prepared, chosen) if rewritten is None else rewritten
    comparison, executed, inserted = compare_in_child(prepared, rewritten, options, order=True)
    if not comparison.match:
        differ = _difference(comparison, options)
        log.warning("the %s plan was rejected: its %s", chosen.strategy, differ.reason)
        entry = PlanTried(**_summary(chosen), outputs_match=False, outputs_differ=differ,
                          order=OrderResult(followed=False, checked=False))
    else:
        check = compare_order(planned_order(prepared, chosen), executed)
        entry = PlanTried(**_summary(chosen), outputs_match=True, order=OrderResult(
            followed=check.followed,
            first_deviation=None if check.followed else Deviation(check.position, check.planned, check.executed),
            not_in_file=None if check.followed else check.not_in_file[:10],
            not_in_file_count=None if check.followed else len(check.not_in_file),
            inserted_at_load=inserted[:10] if inserted else None,
            inserted_at_load_count=len(inserted) if inserted else None))
    return Checked(chosen, rewritten, comparison, entry)


def first_in_order(prepared: Prepared, plans, options: OptimizeOptions,
                   tried: list[Checked] | None = None) -> Checked | None:
    """The first of `plans` whose rewritten model has the original's outputs and that ONNX
    Runtime runs in the planned order, or None; each plan checked is appended to `tried`."""
    tried = [] if tried is None else tried
    for candidate in plans:
        checked = check_plan(prepared, candidate, options)
        tried.append(checked)
        if checked.accepted:
            return checked
    return None


def fallback_plans(prepared: Prepared, chosen: Plan):
    """The plans tried after `chosen`, best first: store-all (no recomputation; the order is
    still ours), unless `chosen` already recomputes nothing."""
    if chosen.recompute_ops:
        yield store_all(prepared.graph)


def measure_model(prepared: Prepared, model: onnx.ModelProto, options: OptimizeOptions,
                  settings: SessionSettings | None = None, repeats: int = 7, timing: bool = True,
                  label: str = "measured") -> Measurement:
    """One training step of `model` (under `settings`; None: its metadata) in a fresh process
    (saved in the workspace as `label`)."""
    if timing:
        prepared.overlap.quiet()
    return measure(prepared.workspace.save(model, label), prepared.workspace.inputs_path, settings,
                   provider=options.provider, threads=options.threads, repeats=repeats, timing=timing)


def measure_original(prepared: Prepared, options: OptimizeOptions, settings: SessionSettings,
                     repeats: int = 7, timing: bool = True) -> Measurement:
    """One training step of the original under `settings` in a fresh process."""
    if timing:
        prepared.overlap.quiet()
    return _measure_original(prepared.workspace, options, settings, repeats, timing)


def _measure_original(workspace: Workspace, options: OptimizeOptions, settings: SessionSettings,
                      repeats: int = 7, timing: bool = True) -> Measurement:
    return measure(workspace.path("original"), workspace.inputs_path, settings,
                   provider=options.provider, threads=options.threads, repeats=repeats, timing=timing)


def _start_original_peaks(workspace: Workspace, options: OptimizeOptions, overlap: Overlap) -> dict:
    """The original's peak under each of ORIGINAL_SESSIONS, measured on `overlap` from now on:
    label -> Future[Measurement]."""
    return {label: overlap.start(_measure_original, workspace, options, settings, timing=False)
            for label, settings in ORIGINAL_SESSIONS.items()}


def start_original_peaks(prepared: Prepared, options: OptimizeOptions) -> None:
    """The originals' peaks (what delivery compares a plan against, whatever the plan) measured
    from now on, unless they were (`prepare` starts them where `Prepared.overlap` runs in the
    background)."""
    if not prepared.original_peaks:
        prepared.original_peaks = _start_original_peaks(prepared.workspace, options, prepared.overlap)


def start_peak(prepared: Prepared, model: onnx.ModelProto, options: OptimizeOptions) -> None:
    """Measure `model`'s peak in the background from now on (while it is verified): `measure_plan`
    takes it from there when it measures this same model."""
    label = f"measured-early{len(prepared.started_peaks)}"
    prepared.started_peaks.append((model, prepared.overlap.start(measure_model, prepared, model, options,
                                                                 timing=False, label=label)))


def optimizations_off_overhead(prepared: Prepared, options: OptimizeOptions) -> float:
    """The original's step with optimizations off over its default session's, timed against
    each other the first time it is asked for (`StepTiming.optimizations_off_seconds`): only
    where the answer depends on it (the original may be returned, and under which session)."""
    timing = prepared.timing
    if timing.optimizations_off_seconds is None:
        original = prepared.workspace.path("original")
        prepared.overlap.quiet()
        times = time_steps([(original, DEFAULT_SETTINGS), (original, ORIGINAL_UNOPTIMIZED)],
                           prepared.workspace.inputs_path, provider=options.provider, threads=options.threads,
                           rounds=TIMING_ROUNDS, max_seconds=TIMING_MAX_SECONDS, settle=TIMING_SETTLE)
        timing.optimizations_off_seconds = timing.default_session_seconds * times.ratio(1, 0)
        if not prepared.graph_optimizations.applied:   # the graph planned is that original
            timing.planned_graph_off_seconds = timing.optimizations_off_seconds
    return timing.optimizations_off_seconds / timing.default_session_seconds


def measure_plan(prepared: Prepared, model: onnx.ModelProto, options: OptimizeOptions) -> tuple[Measurement, float]:
    """`model`'s peak (a fresh process; started early by `start_peak`, or now), and its step time
    timed against the original's under the default session in one process: (the measurement,
    step time / the original's, the median of the rounds' ratios). The measurement's step seconds
    are that ratio times the baseline's seconds (`StepTiming.default_session_seconds`)."""
    early = [future for started, future in prepared.started_peaks if started is model]
    m = early[0].result() if early else measure_model(prepared, model, options, timing=False)
    path = prepared.workspace.save(model, "measured")
    prepared.overlap.quiet()
    times = time_steps([(prepared.workspace.path("original"), DEFAULT_SETTINGS), (path, None)],
                       prepared.workspace.inputs_path,
                       provider=options.provider, threads=options.threads, rounds=TIMING_ROUNDS,
                       max_seconds=TIMING_MAX_SECONDS, settle=TIMING_SETTLE)
    ratio = times.ratio(1, 0)
    # in the baseline's seconds (the machine's speed moves between processes; the ratio is what
    # was measured against the baseline), so that the report's step times divide as its ratios
    baseline = prepared.timing.default_session_seconds if prepared.timing is not None else times.step_seconds[0]
    m.step_seconds = ratio * baseline
    return m, ratio


def _refusal(error: str | None) -> str:
    """ONNX Runtime's refusal without its source location."""
    return (error or "").split("Status Message: ")[-1].split("bfc_arena.cc")[-1].split(") ")[-1].strip()


def _as_returned(workspace: Workspace, model: onnx.ModelProto, label: str) -> str:
    """`model` saved as it leaves graphopt, its weights in the file, for a run under the limit:
    ONNX Runtime's verdict under the cap differs with the weights as external data (the fused-
    AdamW U-Net example's plan for 0.5x its need ran with them in the workspace's weights file,
    and failed, three runs of three, from the file `optimize -o` writes)."""
    return workspace.save_with_weights(model, label)


def limit_run(prepared: Prepared, model_path: str, options: OptimizeOptions,
              settings: SessionSettings | None = None, steps: int = 2) -> LimitRun:
    """Two training steps of the saved model under `options.memory_limit_bytes`, in a fresh
    process (`runtime.measure.run_within_limit`)."""
    return _limit_run(prepared.workspace, model_path, options, settings, steps)


def _limit_run(workspace: Workspace, model_path: str, options: OptimizeOptions,
               settings: SessionSettings | None = None, steps: int = 2) -> LimitRun:
    run = run_within_limit(model_path, workspace.inputs_path, options.memory_limit_bytes, settings,
                           provider=options.provider, threads=options.threads, steps=steps)
    return LimitRun(fits=run.fits, cap_bytes=run.cap_bytes, outside_bytes=run.outside_bytes, error=run.error,
                    shortfall_bytes=run.shortfall_bytes, rss_bytes=run.rss_bytes, step_seconds=run.step_seconds,
                    session_rss_bytes=run.session_rss_bytes, steps_rss_bytes=run.steps_rss_bytes)


__all__ = ["Prepared", "prepare", "plan", "search_plan", "OptimizeResult", "Checked", "check_plan",
           "first_in_order", "fallback_plans", "rewrite_plan", "planned_order", "measure_model",
           "measure_original", "start_original_peaks", "start_peak", "solver_exact", "inlined_at_load",
           "ORIGINAL_UNOPTIMIZED", "limit_run", "options_budget_bytes"]
