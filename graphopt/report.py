"""What `optimize` returns about its work: one typed report, and the one human summary of it.

`Report` is a tree of dataclasses; `to_dict()` gives its JSON form (the names the READMEs,
benchmarks, the CLI's `--report` file, the worker protocol and the proto's `Report.json`
use) and `Report.from_dict()` reads it back. Every top-level field is in the JSON (null when
not known: measuring or verification was off, the solver does not say); a nested field that is
None is left out.

`summary_text(report)` is the human summary: the CLI prints it, the server logs it and sends
it in `Report.summary`, and the Node client prints that string.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field

from .runtime.session import SessionSettings

# report.outcome
OUTCOME_OPTIMIZED = "optimized"     # the rewritten model: order followed, measured below the original
OUTCOME_ORIGINAL = "original"       # the original graph, with the session that measured lowest
OUTCOME_UNMEASURED = "unmeasured"   # the rewritten model, measurement off: not checked against the original


# -- JSON form of a dataclass tree -------------------------------------------------------------
def _to_json(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, _Json) and hasattr(value, "to_dict"):
        return value.to_dict()          # a type with a JSON form of its own (SessionSettings)
    if dataclasses.is_dataclass(value):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)
                if getattr(value, f.name) is not None}
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    return value


def _from_json(kind, value):
    """`value` (JSON) as `kind` (a type hint of a report field)."""
    if value is None:
        return None
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        return _from_json(options[0], value) if len(options) == 1 else value
    if origin is list:
        (item,) = typing.get_args(kind)
        return [_from_json(item, v) for v in value]
    if origin is dict:
        _, item = typing.get_args(kind)
        return {k: _from_json(item, v) for k, v in value.items()}
    if dataclasses.is_dataclass(kind):
        return kind.from_dict(value)
    if kind is float and isinstance(value, int):
        return float(value)
    return value


class _Json:
    """to_dict / from_dict for the report's dataclasses (unknown keys are an error)."""

    def to_dict(self) -> dict:
        return _to_json(self)

    @classmethod
    def from_dict(cls, data: dict):
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        return cls(**{k: _from_json(hints[k], v) for k, v in data.items()})


# -- the tree ------------------------------------------------------------------------------------
@dataclass
class NodeCounts(_Json):
    original: int
    optimized: int
    forward: int
    backward: int


@dataclass
class PredictedRun(_Json):
    """The cost model's prediction of one training step."""
    peak_bytes: int
    step_seconds: float
    recompute_seconds: float | None = None   # the plan's only


@dataclass
class Predicted(_Json):
    original_optimizations_off: PredictedRun
    optimized: PredictedRun


@dataclass
class AnnotationSummary(_Json):
    provider: str
    tensors: int
    nodes_timed: int
    # where the nodes' seconds came from: "profile" (ONNX Runtime's profiler) or "replay" (each
    # distinct node run alone on the device: graphopt/runtime/replay.py); how many nodes kept the
    # profile's seconds all the same (they could not run alone)
    node_seconds_from: str = "profile"
    nodes_not_replayed: int = 0


@dataclass
class MeasuredRun(_Json):
    """One step measured in a fresh process."""
    peak_bytes: int
    step_seconds: float | None = None   # None: not timed (the original with optimizations off,
                                        # unless the answer depended on it)
    provider: str = ""
    method: str = ""


@dataclass
class Measured(_Json):
    original_default_session: MeasuredRun
    original_optimizations_off: MeasuredRun
    optimized: MeasuredRun              # what is returned (the original when it is)


@dataclass
class LiveTensor(_Json):
    """A buffer live at a peak."""
    name: str
    bytes: int
    kind: str                           # one of PEAK_KINDS
    producer: str                       # the node that wrote it
    module: str | None = None           # the module path the producer's name carries (None: none)


# What is alive at a peak, by kind: graph outputs waiting for the end of the step (gradients,
# updated state); forward tensors kept for the backward; recomputed tensors; the backward's own
# intermediates (a gradient's contributions waiting to be summed, ...); outputs nothing reads
# (ONNX Runtime never frees them); the running node's outputs and work buffer.
PEAK_KINDS = ("outputs", "activations", "recomputed", "backward", "unread", "running")


@dataclass
class PeakExplained(_Json):
    """Where a schedule's predicted peak falls and what is alive there (graphopt/explain.py)."""
    peak_bytes: int
    step: int                           # its place in the schedule (0-based) ...
    steps: int                          # ... of this many
    node: str                           # the node running at the peak
    op_type: str
    bytes_by_kind: dict[str, int]       # PEAK_KINDS -> bytes; they add up to peak_bytes
    module: str | None = None           # the module path the node's name carries, e.g. layer1.0.conv2
    largest: list[LiveTensor] = field(default_factory=list)   # the largest buffers alive there


@dataclass
class PeakFloor(_Json):
    """The least peak the search can reach on this graph (`search.plan.peak_floor_bytes`) and what
    bounds it, in words a user can act on."""
    floor_bytes: int
    bound_by: str                       # the kind of most of the floor (PEAK_KINDS)
    bytes_by_kind: dict[str, int]
    advice: str


@dataclass
class PeaksExplained(_Json):
    """The peak of the original as ONNX Runtime runs it, of the returned model, and the floor."""
    original: PeakExplained
    returned: PeakExplained | None = None
    floor: PeakFloor | None = None


@dataclass
class Ratios(_Json):
    """Returned / original, measured."""
    peak_vs_default_session: float
    peak_vs_optimizations_off: float
    step_time_vs_default_session: float
    step_time_vs_optimizations_off: float | None = None   # None: that session was not timed


@dataclass
class PredictionError(_Json):
    """predicted / measured - 1 (peaks; `*_step_time`: step seconds, None when not timed)."""
    optimized: float
    original_optimizations_off: float
    optimized_step_time: float | None = None
    # the cost model on ORT's order of the original, optimizations off, against that session
    # measured; None where ORT's offline graph optimizations applied (the graph planned is not the
    # original, and is not timed in ORT's order: each plan's own error is in `plans_measured`)
    original_optimizations_off_step_time: float | None = None


@dataclass
class Objective(_Json):
    """What the plan was chosen for, and the chosen point."""
    name: str                           # "bounded-overhead", "least-peak" or "least-time-under-budget"
    max_overhead: float | None = None   # step time at most (1 + this) x the baseline
    baseline_step_seconds: float | None = None   # the original's, default session (measured)
    baseline: str = ""                  # what the baseline is
    step_seconds_limit: float | None = None      # (1 + max_overhead) x baseline
    predicted_step_seconds: float | None = None  # the returned plan's (cost model)
    measured_overhead: float | None = None       # the returned model's step time / baseline - 1
    met: bool | None = None             # measured_overhead <= max_overhead (None: no limit or not measured)
    # graphopt's graph, order and settings with nothing recomputed, over the faster of the
    # original's two sessions (measured in one process; None: not measured): what the session
    # settings a plan needs cost in time before any recomputation
    store_all_vs_faster_original: float | None = None


@dataclass
class OverheadAttempt(_Json):
    """A plan for a step-time limit, measured: planned again, tighter, when over the limit."""
    planned_for_seconds: float | None   # the predicted limit planned for (None: store-all, the last resort)
    predicted_step_seconds: float
    measured_overhead: float
    predicted_peak_bytes: int
    measured_peak_bytes: int


@dataclass
class OutputsDiffer(_Json):
    output: str
    relative_difference: float   # as in Report.max_relative_difference, above the tolerance
    reason: str


@dataclass
class Deviation(_Json):
    position: int | None
    planned: list[str] = field(default_factory=list)
    executed: list[str] = field(default_factory=list)


@dataclass
class OrderResult(_Json):
    """Whether ONNX Runtime's profile of a rewritten model showed the planned order."""
    followed: bool
    checked: bool | None = None          # False: not checked (its outputs differed)
    first_deviation: Deviation | None = None
    not_in_file: list[str] | None = None
    not_in_file_count: int | None = None
    # copies between host and device and precision casts ONNX Runtime inserted at load (not nodes of
    # the file: the order compared leaves them out, the measured peak counts them); the first few
    inserted_at_load: list[str] | None = None
    inserted_at_load_count: int | None = None


@dataclass
class PlanTried(_Json):
    """A plan, rewritten and checked (outputs, then order)."""
    strategy: str
    checkpoints: int
    recompute_nodes: int
    predicted_peak_bytes: int
    outputs_match: bool
    order: OrderResult
    outputs_differ: OutputsDiffer | None = None


@dataclass
class OrderReport(_Json):
    followed: bool
    plans_tried: list[PlanTried] = field(default_factory=list)


@dataclass
class RejectedForOutputs(_Json):
    strategy: str
    checkpoints: int
    recompute_nodes: int
    predicted_peak_bytes: int
    output: str
    relative_difference: float
    reason: str


@dataclass
class BudgetAttempt(_Json):
    planned_for_bytes: int | None
    predicted_peak_bytes: int
    measured_peak_bytes: int


@dataclass
class PlanMeasured(_Json):
    """A plan measured in ONNX Runtime: the cost model's prediction against the measurement.
    Step seconds are in the baseline's (the default session's, `Objective.baseline_step_seconds`):
    the measured ones are the plan's step over the original's timed in turn with it, times that."""
    strategy: str
    checkpoints: int
    recompute_nodes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    why: str = ""       # the first plan, a retry for the budget or the time limit, store-all, a fallback
    predicted_step_seconds: float | None = None
    measured_step_seconds: float | None = None
    # why it was not returned (graphopt/delivery.py: over the budget or the step-time limit, refused
    # under the memory limit, not below the original's peak); None: it is the plan returned
    rejected_because: str | None = None

    @property
    def step_time_error(self) -> float | None:
        """predicted / measured step seconds - 1 (None: not timed)."""
        if self.predicted_step_seconds is None or not self.measured_step_seconds:
            return None
        return self.predicted_step_seconds / self.measured_step_seconds - 1


@dataclass
class RejectedPlan(_Json):
    """The plan not returned (the original was): why, and what it measured."""
    strategy: str
    checkpoints: int
    recompute_nodes: int
    predicted_peak_bytes: int
    order_followed: bool
    measured: MeasuredRun | None = None


@dataclass
class BaseOrder(_Json):
    """The orders plans start from (pipeline.base_order_graphs): the one the plan came from,
    each order's predicted peak with nothing recomputed, and of the plan the search found from
    each (the returned plan was chosen among these)."""
    chosen: str
    store_all_peak_bytes: dict[str, int]
    plan_peak_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class LimitRun(_Json):
    """Training steps run under the memory limit (graphopt/runtime/limit.py): whether they fit."""
    fits: bool
    cap_bytes: int                      # ONNX Runtime's arena cap: the limit less what is held outside it
    outside_bytes: int                  # held outside the arena: weights, inputs, state buffers
    error: str | None = None            # ONNX Runtime's refusal
    shortfall_bytes: int | None = None  # how much more the refused allocation needed than was left
    rss_bytes: int | None = None        # CPU: the process's resident growth over the session and its steps
    step_seconds: float | None = None   # the median step after the first (None: did not fit)
    session_rss_bytes: int | None = None  # CPU: the growth once the session is open (weights, kernels)
    steps_rss_bytes: int | None = None    # CPU: what the steps added to the open session at their peak


@dataclass
class LimitAttempt(_Json):
    planned_for_bytes: int              # the predicted step peak the plan was searched for
    predicted_peak_bytes: int
    run: LimitRun


@dataclass
class MemoryLimit(_Json):
    """The memory limit (`memory_limit_bytes`), shown by runs under it: the original in each
    session it is measured in, the plans tried for it, and the returned model's run."""
    limit_bytes: int
    original: dict[str, LimitRun] = field(default_factory=dict)
    attempts: list[LimitAttempt] = field(default_factory=list)
    met: bool | None = None             # the returned model ran under it
    returned: LimitRun | None = None    # the returned model's run under it
    # the original does not run under it, yet graphopt annotated and verified it at full size
    # (outside the limit, on a host with room) because it could not at reduced batches: why
    full_size_because: str | None = None


@dataclass
class ReducedSize(_Json):
    """The step did not run under the memory limit at full size: graphopt annotated it at two
    smaller batches of its reduced twin and verified the rewrite's outputs at the larger one
    (graphopt/reduced.py); nothing ran the original at full size but the runs under the limit."""
    full_batch: int
    annotated_batches: list[int]
    verified_batch: int | None          # None: verification off
    rewritten_constants: int            # constants of the twin that hold the batch, rewritten


# graphopt's own memory: no process of a call may hold more than this many times the largest
# single session it ran, plus the baseline (issue 24; see GraphoptMemory)
OWN_MEMORY_FACTOR = 1.25


@dataclass
class GraphoptMemory(_Json):
    """graphopt's own memory in this call: the peak resident memory of its own process and of
    the largest of the child processes it ran (each reports its own peak), by kind (annotate,
    reference, verify, measure, timing, limit, graph-optimize), beside the largest training step
    it measured (the original's and the returned model's peaks).

    The bound: no process holds more than OWN_MEMORY_FACTOR x ``largest_session_bytes`` +
    ``baseline_bytes``. ``largest_session_bytes``: the largest footprint of one session that a
    child holding only that session reported (weights as ONNX Runtime holds them, its
    structures, inputs and steps; the timing children run the session as users have it, arena
    on). ``baseline_bytes``: the largest RSS of a child after its imports, before it loaded
    anything. A child counts with its peak; the calling process with what it grew by during the
    call (its peak during the call - ``main_process_start_bytes``) plus the baseline, since what it
    held before the call (the caller's model, the interpreter) is not the call's.
    ``main_process_bytes`` is that process's peak over its life (the CLI's: reading the model too)."""
    main_process_bytes: int | None
    largest_child_bytes: int | None
    largest_child: str | None
    children_bytes: dict[str, int] = field(default_factory=dict)
    largest_step_bytes: int | None = None
    main_process_start_bytes: int | None = None
    largest_session_bytes: int | None = None
    largest_session: str | None = None  # the kind of child that ran it
    baseline_bytes: int | None = None
    bound_bytes: int | None = None
    within_bound: bool | None = None    # None: no child reported a session to bound by


@dataclass
class StageSeconds(_Json):
    """One stage of `optimize`, from its progress message to the next: wall seconds, and CPU
    seconds of this process and of the children it waited for (ONNX Runtime runs in children)."""
    stage: str
    wall_seconds: float
    cpu_seconds: float


@dataclass
class GraphOptimizations(_Json):
    """ONNX Runtime's graph optimizations applied offline before planning (see
    graphopt/runtime/offline.py); every field None (JSON {}) when none were."""
    level: str | None = None
    nodes_before: int | None = None
    nodes_after: int | None = None
    op_types: dict[str, int] | None = None   # op type -> how many were added (+) or removed (-)

    @property
    def applied(self) -> bool:
        return self.level is not None


@dataclass
class Report(_Json):
    """Everything `optimize` says about its work (see the module docstring)."""
    loss: str
    strategy: str                       # of the returned plan
    nodes: NodeCounts
    stashed_tensors: int
    checkpoints: list[str]
    recompute_nodes: int
    search_seconds: float               # wall seconds of the search (see search_cpu_seconds)
    predicted: Predicted
    annotations: AnnotationSummary
    provider: str = ""                  # where ONNX Runtime ran (annotation and measurement)
    threads: int = 1                    # its intra-op threads there (outputs verified at one)
    # CPU seconds of the search's own thread (peaks are measured in the background meanwhile)
    search_cpu_seconds: float | None = None
    outcome: str = ""                   # OUTCOME_*
    outcome_reason: str = ""
    budget_bytes: int | None = None
    solver_exact: bool | None = None    # the plan is optimal under its solver's model (None: not known)
    base_order: BaseOrder | None = None  # the order the plan started from
    functions_expanded: dict[str, int] = field(default_factory=dict)
    # n-ary Sums of gradient contributions written as a chain of Adds, each placed as its
    # contribution arrives (pipeline.chain_gradient_sums)
    sums_chained: int = 0
    graph_optimizations: GraphOptimizations = field(default_factory=GraphOptimizations)
    session: SessionSettings | None = None   # the session settings written in the returned model
    outputs_match: bool | None = None   # None: not verified
    # the worst output's difference as verify.compare_outputs measures it: max |a - b| over the output's
    # largest value, or over a hundredth of the largest value of its kind where that is larger
    max_relative_difference: float | None = None
    outputs_differ: OutputsDiffer | None = None
    rejected_for_outputs: list[RejectedForOutputs] = field(default_factory=list)
    order_followed: bool | None = None  # None: not verified
    order: OrderReport | None = None
    budget_attempts: list[BudgetAttempt] | None = None
    objective: Objective | None = None
    overhead_attempts: list[OverheadAttempt] | None = None
    plans_measured: list[PlanMeasured] | None = None   # every plan measured, in order
    rejected: RejectedPlan | None = None
    measured: Measured | None = None    # None: measurement off
    measurement_method: str | None = None   # how the peaks were taken (VmHWM, nvml, ...)
    ratios: Ratios | None = None
    prediction_error: PredictionError | None = None
    peaks_explained: PeaksExplained | None = None   # where each predicted peak falls, and the floor
    budget_met: bool | None = None
    memory_limit: MemoryLimit | None = None
    reduced: ReducedSize | None = None  # the step annotated and verified at reduced batches
    graphopt_memory: GraphoptMemory | None = None
    total_seconds: float = 0.0
    stages: list[StageSeconds] = field(default_factory=list)   # where total_seconds went, in order

    def to_dict(self) -> dict:
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}


# -- what analyze_model returns ----------------------------------------------------------------
@dataclass
class AnalysisNodes(_Json):
    total: int
    forward: int
    backward: int


@dataclass
class AnalysisPeaks(_Json):
    """Predicted step peaks (the cost model), in bytes."""
    original_optimizations_off: int     # the original in ONNX Runtime's order, optimizations off
    planned: int | None = None          # the plan's (None: no plan was asked for)


@dataclass
class AnalysisBaseOrder(_Json):
    """The orders plans start from (as `BaseOrder`); `plan_peak_bytes` only with a plan."""
    chosen: str
    store_all_peak_bytes: dict[str, int]
    plan_peak_bytes: dict[str, int] | None = None


@dataclass
class AnalysisPlan(_Json):
    """The plan `analyze_model(plan=True)` searched (nothing rewritten, nothing measured)."""
    strategy: str
    checkpoints: list[str]
    recompute_nodes: int
    recompute_seconds: float
    predicted_step_seconds: float
    objective: str
    max_overhead: float | None          # None: no step-time limit (written as null)
    baseline_step_seconds: float
    solver_exact: bool | None           # (written as null when not known)

    def to_dict(self) -> dict:   # every field, null ones too (the JSON analyze_model has always written)
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass
class Analysis(_Json):
    """What `analyze_model` returns: the training graph annotated in ONNX Runtime and its peak
    predicted, with a plan when asked for. `to_dict()` is its JSON (the CLI's `analyze`, the
    worker's answer, the service's `AnalyzeResponse.json`); `Analysis.from_dict` reads it back."""
    loss: str
    nodes: AnalysisNodes
    stashed_tensors: list[str]
    provider: str
    predicted_peak_bytes: AnalysisPeaks
    tensor_bytes: dict[str, int]
    node_seconds: dict[str, float]
    execution_order: list[str]
    functions_expanded: dict[str, int]
    graph_optimizations: GraphOptimizations   # as `Report.graph_optimizations`
    base_order: AnalysisBaseOrder
    plan: AnalysisPlan | None = None    # None: no plan was asked for (the key is left out)
    # where the original's predicted peak falls (and the plan's, when asked for), and the floor
    peaks_explained: PeaksExplained | None = None

    def to_dict(self) -> dict:
        data = _to_json(self)
        if self.plan is not None:
            data["plan"] = self.plan.to_dict()
        return data


# -- the human summary ---------------------------------------------------------------------------
def _mib(n: int | float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _peak_line(label: str, peak: PeakExplained) -> str:
    where = peak.node + (f" ({peak.op_type}, {peak.module})" if peak.module else f" ({peak.op_type})")
    kinds = ", ".join(f"{kind} {_mib(n)}" for kind, n in peak.bytes_by_kind.items() if n)
    largest = peak.largest[0] if peak.largest else None
    return (f"{label} predicted peak {_mib(peak.peak_bytes)} at step {peak.step + 1} of {peak.steps}, {where}: "
            f"{kinds}" + (f"; largest {largest.name} {_mib(largest.bytes)} ({largest.kind}, from {largest.producer})"
                          if largest else ""))


def peak_lines(peaks: PeaksExplained) -> list[str]:
    """Where the predicted peaks fall and what bounds the least one (the summary's lines)."""
    lines = [_peak_line("original:", peaks.original)]
    if peaks.returned is not None:
        lines.append(_peak_line("returned:", peaks.returned))
    if peaks.floor is not None:
        lines.append(f"least peak the search can reach: {_mib(peaks.floor.floor_bytes)}, bound by "
                     f"{peaks.floor.advice}")
    return lines


def summary_text(report: Report) -> str:
    """The human summary of one `optimize` (the CLI, the server's log, the Node client)."""
    lines = [f"strategy {report.strategy}: {len(report.checkpoints)} checkpoints, "
             f"{report.recompute_nodes} recompute nodes, search {report.search_seconds:.2f} s"
             + ("" if report.search_cpu_seconds is None else f" ({report.search_cpu_seconds:.2f} s CPU)")
             + ("" if report.solver_exact is None else
                f" ({'exact' if report.solver_exact else 'not proven optimal'} under its solver's model)")]
    if report.base_order is not None and len(report.base_order.store_all_peak_bytes) > 1:
        base = report.base_order
        lines.append(f"planned from the {base.chosen} order; predicted peaks by order, nothing recomputed / "
                     "planned: " + ", ".join(f"{label} {_mib(b)} / {_mib(base.plan_peak_bytes.get(label, 0))}"
                                           for label, b in base.store_all_peak_bytes.items()))
    if report.sums_chained:
        lines.append(f"{report.sums_chained} n-ary Sum(s) of gradient contributions written as Adds, each "
                     "placed as its contribution arrives")
    applied = report.graph_optimizations
    if applied.applied:
        ops = ", ".join(f"{op} {n:+d}" for op, n in (applied.op_types or {}).items())
        lines.append(f"planned on ONNX Runtime's {applied.level} graph optimizations: "
                     f"{applied.nodes_before} -> {applied.nodes_after} nodes ({ops})")
    predicted = report.predicted
    lines.append(f"predicted peak: original (optimizations off) "
                 f"{_mib(predicted.original_optimizations_off.peak_bytes)}, "
                 f"optimized {_mib(predicted.optimized.peak_bytes)}; predicted step "
                 f"{predicted.original_optimizations_off.step_seconds:.3f} s / {predicted.optimized.step_seconds:.3f} s")
    if report.peaks_explained is not None:
        lines.extend(peak_lines(report.peaks_explained))
    objective = report.objective
    if objective is not None:
        line = f"objective {objective.name}"
        if objective.max_overhead is not None:
            line += (f": step time at most {1 + objective.max_overhead:.2f}x the original's "
                     f"({objective.baseline}: {objective.baseline_step_seconds:.3f} s)")
        if objective.measured_overhead is not None:
            line += (f"; returned: {1 + objective.measured_overhead:.2f}x measured"
                     + ("" if objective.met is None else (" (within)" if objective.met else " (NOT within)")))
        lines.append(line)
    rejected = report.rejected
    if report.measured is not None:
        m = report.measured
        lines.append(f"measured peak of one training step in ONNX Runtime ({report.provider}, "
                     f"{report.threads} thread{'s' if report.threads != 1 else ''}"
                     + (f", {report.measurement_method}" if report.measurement_method else "") + "):")
        rows = [("original_default_session", m.original_default_session),
                ("original_optimizations_off", m.original_optimizations_off)]
        if rejected is not None and rejected.measured is not None:
            rows.append(("optimized (not returned)", rejected.measured))
            rows.append(("returned (the original)", m.optimized))
        else:
            rows.append(("optimized", m.optimized))
        for label, row in rows:
            step = "not timed" if row.step_seconds is None else f"{row.step_seconds:.3f} s"
            lines.append(f"  {label:28s} {_mib(row.peak_bytes):>12s}   step {step}")
        r = report.ratios
        off = ("" if r.step_time_vs_optimizations_off is None else
               f" / {r.step_time_vs_optimizations_off:.2f}x")
        lines.append(f"returned / original: peak {r.peak_vs_default_session:.2f}x (default session), "
                     f"{r.peak_vs_optimizations_off:.2f}x (optimizations off); step time "
                     f"{r.step_time_vs_default_session:.2f}x{off}")
    if report.plans_measured:
        lines.append("plans measured, predicted against measured: " + "; ".join(
            f"{p.why or p.strategy} peak {_mib(p.predicted_peak_bytes)} / {_mib(p.measured_peak_bytes)}"
            + ("" if p.step_time_error is None else
               f", step {p.predicted_step_seconds:.3f} / {p.measured_step_seconds:.3f} s ({p.step_time_error:+.0%})")
            for p in report.plans_measured))
    limit = report.memory_limit
    if limit is not None:
        originals = ", ".join(f"{label.replace('original_', '').replace('_', ' ')} "
                              f"{'runs' if run.fits else 'FAILS'}" for label, run in limit.original.items())
        returned = limit.returned
        lines.append(f"memory limit {_mib(limit.limit_bytes)} (ONNX Runtime capped at it, two steps): original: "
                     f"{originals or 'not run'}; returned: "
                     + ("not run" if returned is None else "runs" if returned.fits else "FAILS")
                     + (f" ({len(limit.attempts)} plans tried)" if len(limit.attempts) > 1 else ""))
        if limit.full_size_because:
            lines.append(f"annotated and verified at full size, outside the limit: {limit.full_size_because}")
    reduced = report.reduced
    if reduced is not None:
        returned = limit.returned if limit is not None else None
        lines.append(f"the original does not run under the limit: annotated at batches "
                     f"{' and '.join(map(str, reduced.annotated_batches))} of {reduced.full_batch}"
                     + ("" if reduced.verified_batch is None else
                        f", outputs verified at batch {reduced.verified_batch}")
                     + ("" if returned is None or returned.step_seconds is None else
                        f"; returned model under the limit at full size: step {returned.step_seconds:.3f} s"
                        + ("" if returned.steps_rss_bytes is None else
                           f", its steps {_mib(returned.steps_rss_bytes)} resident beyond the open session's "
                           f"{_mib(returned.session_rss_bytes or 0)}")))
    if report.outputs_match is not None:
        lines.append(f"outputs identical: {report.outputs_match} "
                     f"(max relative difference {report.max_relative_difference:.2e})")
    if report.order_followed is not None:
        tried = report.order.plans_tried if report.order is not None else []
        inserted = tried[-1].order.inserted_at_load_count if tried else None
        lines.append(f"planned order followed by ONNX Runtime: {report.order_followed}"
                     + (f" ({len(tried)} plans tried)" if len(tried) > 1 else "")
                     + (f"; {inserted} copies or casts ONNX Runtime inserted at load ran besides" if inserted else ""))
    own = report.graphopt_memory
    if own is not None and own.largest_child_bytes is not None:
        line = (f"graphopt's own memory: largest process {_mib(own.largest_child_bytes)} ({own.largest_child}), "
                f"its own {_mib(own.main_process_bytes or 0)}")
        if own.largest_step_bytes:
            line += f"; the largest step it measured {_mib(own.largest_step_bytes)}"
        if own.within_bound is not None:
            line += (f"; bound {OWN_MEMORY_FACTOR}x its largest session {_mib(own.largest_session_bytes or 0)} "
                     f"({own.largest_session}) + "
                     f"{_mib(own.baseline_bytes or 0)} baseline = {_mib(own.bound_bytes or 0)}: "
                     + ("within" if own.within_bound else "EXCEEDED"))
        lines.append(line)
    if report.stages:
        lines.append(stages_line(report.stages, report.total_seconds))
    if report.outcome == OUTCOME_ORIGINAL:
        lines.append("OUTCOME: NOT IMPROVED, the original model is returned: " + report.outcome_reason)
    elif report.outcome == OUTCOME_UNMEASURED:
        lines.append("OUTCOME: not measured: " + report.outcome_reason)
    elif report.outcome:
        lines.append("outcome: optimized: " + report.outcome_reason)
    return "\n".join(lines)


def stages_line(stages: list[StageSeconds], total_seconds: float) -> str:
    """One line of where `optimize`'s time went: each stage's wall seconds (its label up to a
    colon; repeated labels summed, in the order first seen) and the CPU seconds of all of them."""
    wall: dict[str, float] = {}
    for s in stages:
        label = s.stage.split(":")[0]
        wall[label] = wall.get(label, 0.0) + s.wall_seconds
    cpu = sum(s.cpu_seconds for s in stages)
    return (f"time {total_seconds:.1f} s ({cpu:.1f} s CPU): "
            + ", ".join(f"{label} {seconds:.1f} s" for label, seconds in wall.items()))


__all__ = ["Report", "summary_text", "stages_line", "StageSeconds", "OUTCOME_OPTIMIZED", "OUTCOME_ORIGINAL", "OUTCOME_UNMEASURED",
           "NodeCounts", "Predicted", "PredictedRun", "AnnotationSummary", "Measured", "MeasuredRun", "Ratios",
           "PredictionError", "OutputsDiffer", "Deviation", "OrderResult", "PlanTried", "OrderReport",
           "RejectedForOutputs", "BudgetAttempt", "PlanMeasured", "RejectedPlan", "Objective", "OverheadAttempt",
           "BaseOrder", "LimitRun", "LimitAttempt", "MemoryLimit", "ReducedSize", "GraphoptMemory",
           "LiveTensor", "PEAK_KINDS", "PeakExplained", "PeakFloor", "PeaksExplained"]
