"""The third stage, `deliver(prepared, plan, options) -> OptimizeResult` (graphopt/pipeline.py has
the first two, `prepare` and `plan`, and states the contracts delivery keeps: OUTPUTS, ORDER,
NEVER WORSE, BUDGET, MEMORY LIMIT).

Delivery is a loop over plans. The plan planned is rewritten and checked (outputs, then ONNX
Runtime's order; store-all next where it fails), then, with measurement on, measured: its peak in
a fresh process, its step timed in turn with the original's. Each plan measured is an `Attempt`,
kept in order in the `Delivery` state; a plan that is not returned says why
(`Attempt.rejected`, the report's `plans_measured[].rejected_because`). The next plan is chosen
from the cost graph for the reason the last one was rejected, by a search for a target of its
own (`pipeline.search_plan`: no call back into the `plan` stage, which reads its target from the
options):

    the last plan                              the next plan                         tried at most
    ONNX Runtime refused it under the memory   the leanest plan, then plans bisecting 1 + LIMIT_BISECTIONS
      limit                                      the step peak between the two
    measured over the budget                   one for the budget lowered by the      BUDGET_RETRIES
                                                 overshoot (`_budget_retry`)
    measured over the step-time limit          one for a predicted limit lowered by   TIME_RETRIES, then
                                                 the excess (`_time_retry`)             store-all
    measured not below the original's peak     store-all (nothing recomputed)         once

The loop ends when no rule gives a next plan (the plan is within what was asked, no retry is
left, the search finds the same plan, or the next plan fails its checks); the plan kept is
then returned, or the original is (NEVER WORSE; `_conclude`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import onnx

from .annotate import write_annotations
from .errors import BudgetInfeasibleError, MemoryLimitError, VerificationError
from .costmodel import priority_order
from .explain import explain_peak, explain_peaks, timeline
from .options import OptimizeOptions, Progress
from .pipeline import (ORIGINAL_SESSIONS, Checked, OptimizeResult, Prepared, _as_returned, _refusal, _summary,
                       check_plan, fallback_plans, first_in_order, limit_run, measure_plan,
                       optimizations_off_overhead, options_budget_bytes, rewrite_plan, search_plan, solver_exact,
                       start_original_peaks, start_peak)
from .report import (OUTCOME_OPTIMIZED, OUTCOME_ORIGINAL, OUTCOME_UNMEASURED, AnnotationSummary, BaseOrder,
                     BudgetAttempt, LimitAttempt, LimitRun, Measured, MeasuredRun, MemoryLimit, NodeCounts,
                     Objective, OrderReport, OverheadAttempt, PlanMeasured, Predicted, PredictedRun,
                     PredictionError, Ratios, ReducedSize, RejectedForOutputs, RejectedPlan, Report)
from .rewrite import PLANNED_SETTINGS
from .runtime.measure import Measurement
from .runtime.session import SessionSettings, write_settings
from .search import Plan, store_all
from .verify import OutputComparison

# With a budget, how many times a plan whose MEASURED peak is over the budget is planned
# again for a budget lowered by the overshoot (the runtime holds a little more than the
# cost model predicts: allocator rounding, small buffers).
BUDGET_RETRIES = 3
# With a step-time limit, how many times a plan whose MEASURED step time is over it is planned
# again for a predicted limit lowered by the excess, and by TIME_RETRY_MARGIN more: aimed at the
# limit itself, a retry lands on either side of it by the measurement's noise (the densenet
# example, limit 1.25x: measured 1.27x, then 1.25x over by a hair, then 1.20x; three timings)
TIME_RETRIES = 2
TIME_RETRY_MARGIN = 0.03
# With a memory limit, how many plans between the leanest (which runs under it) and one ONNX
# Runtime refused are tried, bisecting the predicted step peak they are planned for: each
# halves the range (a few MiB less can cost much more time: the fused-AdamW transformer
# example's plan for 79 MiB recomputes 1,746 nodes, its plan for 72 MiB 14,397).
LIMIT_BISECTIONS = 4
# The steps of the returned model timed under the limit when the original does not run there (the
# first is not: ONNX Runtime plans its memory pattern on it).
REDUCED_TIMED_STEPS = 5


def _no_progress(stage: str, fraction: float) -> None:
    pass


# -- the loop's state ------------------------------------------------------------------------------
@dataclass
class Candidate:
    """A plan chosen to try next, and what for."""
    plan: Plan
    why: str                                  # "planned", "memory limit", "budget retry", "time retry",
                                              # "store-all", "fallback store-all" (`PlanMeasured.why`)
    planned_for_bytes: int | None = None      # the budget it was searched for (a budget retry)
    planned_for_seconds: float | None = None  # the predicted step limit it was searched for (a time retry;
                                              # the first plan measured for the limit: its search's)


@dataclass
class Attempt:
    """A plan checked and measured: its peak in a fresh process, its step over the original's
    under the default session, timed in turn (`pipeline.measure_plan`)."""
    candidate: Candidate
    model: onnx.ModelProto                    # its rewritten model
    measurement: Measurement
    overhead: float                           # measured step / the original's (1.0: the same)
    entry: PlanMeasured                       # as the report states it (`Report.plans_measured`)

    @property
    def plan(self) -> Plan:
        return self.candidate.plan

    @property
    def peak_bytes(self) -> int:
        return self.measurement.peak_bytes

    @property
    def rejected(self) -> str | None:
        """Why it is not returned (None: it is, as things stand)."""
        return self.entry.rejected_because

    def reject(self, reason: str) -> None:
        self.entry.rejected_because = reason


@dataclass
class LimitTry:
    """A plan run under the memory limit (two steps, ONNX Runtime capped: `pipeline.limit_run`)."""
    plan: Plan
    model: onnx.ModelProto
    run: LimitRun


@dataclass
class Delivery:
    """The state of delivery: the plans checked (`tried`, with the report's order check), the
    plans measured (`attempts`, in order), the one that would be returned as things stand
    (`current`), and what they are measured against (`originals`)."""
    prepared: Prepared
    options: OptimizeOptions
    report: Report
    tried: list[Checked]                      # every plan checked, in order
    deliverable: bool                         # the last plan checked passed its checks
    progress: Progress = _no_progress
    originals: dict[str, Measurement] = field(default_factory=dict)   # ORIGINAL_SESSIONS' label -> peak
    attempts: list[Attempt] = field(default_factory=list)
    current: Attempt | None = None
    limit_report: MemoryLimit | None = None

    def check(self, candidate: Plan) -> Checked | None:
        """`candidate` rewritten and, when verifying, checked (None when it is not accepted); each
        check recorded in `tried` and the report."""
        if not self.options.verify:
            return Checked(candidate, rewrite_plan(self.prepared, candidate), OutputComparison(True, 0.0), None)
        checked = check_plan(self.prepared, candidate, self.options)
        self.tried.append(checked)
        if self.report.order is not None:
            self.report.order.plans_tried.append(checked.entry)
        if not checked.entry.outputs_match:
            _record_checks_rejection(self.report, checked)
        return checked if checked.accepted else None

    def measure(self, candidate: Candidate, model: onnx.ModelProto) -> Attempt:
        """`model` (of `candidate`) measured (`pipeline.measure_plan`), the prediction and the
        measurement recorded in the report."""
        m, ratio = measure_plan(self.prepared, model, self.options)
        return self.record(candidate, model, m, ratio)

    def record(self, candidate: Candidate, model: onnx.ModelProto, m: Measurement, ratio: float) -> Attempt:
        """`candidate`'s measurement `m` (its step `ratio` times the original's) recorded: an
        Attempt, in `attempts` and the report's `plans_measured` (the decisions read only these)."""
        chosen = candidate.plan
        entry = PlanMeasured(**_summary(chosen), measured_peak_bytes=m.peak_bytes, why=candidate.why,
                             predicted_step_seconds=chosen.simulation.compute_seconds,
                             measured_step_seconds=m.step_seconds)
        self.report.plans_measured.append(entry)
        attempt = Attempt(candidate, model, m, ratio, entry)
        self.attempts.append(attempt)
        return attempt

    def attempt(self, candidate: Candidate) -> Attempt | None:
        """`candidate` checked, then measured (None: it failed its checks)."""
        found = self.check(candidate.plan)
        return None if found is None else self.measure(candidate, found.model)

    def replace(self, attempt: Attempt, reason: str) -> None:
        """`attempt` is the plan to return now; the one before it is not, for `reason`."""
        self.current.reject(reason)
        self.current = attempt

    def original_overhead(self, label: str) -> float:
        """Each original session's step over the baseline (the one with optimizations off timed
        when first asked for: where the original may be returned)."""
        if label == "original_default_session":
            return 1.0
        overhead = optimizations_off_overhead(self.prepared, self.options)
        self.originals[label].step_seconds = self.prepared.timing.optimizations_off_seconds
        return overhead

    def best_original_label(self) -> str:
        """The original's session with the lowest measured peak among those within the step-time
        limit (the default session, the baseline, is always within it: where its peak is the
        lowest, no other session is timed)."""
        originals, allowed = self.originals, self.options.overhead_limit
        least = min(originals, key=lambda k: originals[k].peak_bytes)
        if originals[least].peak_bytes >= originals["original_default_session"].peak_bytes:
            return "original_default_session"
        eligible = {k: v for k, v in originals.items() if allowed is None or self.original_overhead(k) <= 1 + allowed}
        return min(eligible, key=lambda k: eligible[k].peak_bytes)


# -- deliver ---------------------------------------------------------------------------------------
def deliver(prepared: Prepared, chosen: Plan, options: OptimizeOptions) -> OptimizeResult:
    """Rewrite `chosen`, verify and measure it; deliver under the contracts of graphopt/pipeline.py
    (what is returned may be another plan, or the original)."""
    progress = options.progress or _no_progress
    started = time.perf_counter()
    progress("rewrite", 0.5)
    rewritten = rewrite_plan(prepared, chosen)
    report = _new_report(prepared, chosen, rewritten, options)

    # OUTPUTS and ORDER: the first plan whose outputs match and whose order ORT follows
    tried: list[Checked] = []
    deliverable = True
    if options.verify:
        progress("verify", 0.6)
        if options.measure and prepared.reduced is None and prepared.overlap.enabled:
            start_peak(prepared, rewritten, options)   # (measured while it is verified)
        first = check_plan(prepared, chosen, options, rewritten)
        tried.append(first)
        if not first.accepted:
            why = ("its outputs differ from the original's" if not first.entry.outputs_match else
                   f"ONNX Runtime left the planned order at step {first.entry.order.first_deviation.position}")
            progress(f"{why}: trying the next plan", 0.62)
            found = first_in_order(prepared, fallback_plans(prepared, chosen), options, tried)
            if found is not None:
                chosen, rewritten = found.plan, found.model
        if not any(t.entry.outputs_match for t in tried):
            # even the plan without recomputation computes something else: the rewrite is broken
            raise VerificationError(
                f"the rewritten model's {tried[-1].entry.outputs_differ.reason} (plans tried: "
                f"{[t.plan.strategy for t in tried]}); nothing was returned")
        deliverable = tried[-1].accepted
        _record_checks(report, tried)

    if options.measure:
        state = Delivery(prepared, options, report, tried, deliverable, progress)
        if prepared.reduced is not None:
            chosen, rewritten = _reduced_delivery(state, chosen, rewritten)
        else:
            chosen, rewritten = _measured_delivery(state, chosen, rewritten)
    elif not deliverable:
        # no measurement to choose a session by: the original, as it came (its own settings)
        report.rejected = RejectedPlan(**_summary(chosen), order_followed=False)
        report.outcome = OUTCOME_ORIGINAL
        report.outcome_reason = (f"{_not_delivered(report)}; the original model is returned "
                                 f"unchanged{_rejections(report)}")
        rewritten = _returned_original(prepared, None, options)
        _describe(report, None, rewritten, prepared.graph)
        report.session = None
    else:
        _describe(report, chosen, rewritten, prepared.graph)
        report.outcome = OUTCOME_UNMEASURED
        report.outcome_reason = ("measurement was off: the optimized model is returned without checking "
                                 "that it needs less memory than the original" + _rejections(report))
    report.total_seconds += time.perf_counter() - started
    progress("done", 1.0)
    model, weights = prepared.leaving(rewritten)
    graph = prepared.graph
    timelines = (timeline(graph, [(n, 0) for n in prepared.annotations.execution_order if n in graph]),
                 None if report.peaks_explained.returned is None else
                 timeline(graph, priority_order(graph, chosen.schedule, distinct_steps=True)))
    return OptimizeResult(model, chosen, report, weights, timelines)


def _measured_delivery(state: Delivery, chosen: Plan, rewritten: onnx.ModelProto) -> tuple[Plan, onnx.ModelProto]:
    """Measure, meet the memory limit, the budget and the step-time limit by measurement, keep
    NEVER WORSE: the (plan, model) returned (the original's, with no plan, where it is)."""
    prepared, options, report = state.prepared, state.options, state.report
    state.progress("measure", 0.7)
    timing = prepared.timing
    start_original_peaks(prepared, options)
    state.originals = {label: future.result() for label, future in prepared.original_peaks.items()}
    state.originals["original_default_session"].step_seconds = timing.default_session_seconds
    # (None: not timed)
    state.originals["original_optimizations_off"].step_seconds = timing.optimizations_off_seconds
    report.plans_measured = []
    state.current = state.measure(Candidate(chosen, "planned"), rewritten)
    if options.memory_limit_bytes is not None:
        _meet_memory_limit(state)
    if options.budget_bytes is not None:
        _meet_budget(state)
    within_limit = True
    if options.overhead_limit is not None and state.deliverable:
        within_limit = _meet_step_time(state)
    return _conclude(state, within_limit)


# -- MEMORY LIMIT ----------------------------------------------------------------------------------
def _meet_memory_limit(state: Delivery) -> None:
    """The measured plan run under the memory limit; where ONNX Runtime refuses it, the plan that
    runs (`_fit_memory_limit`) is measured in its place."""
    prepared, options, report = state.prepared, state.options, state.report
    state.progress("memory limit", 0.72)
    limit_report = state.limit_report = report.memory_limit = MemoryLimit(options.memory_limit_bytes)
    limit_report.original = dict(prepared.original_limit_runs)
    limit_report.full_size_because = prepared.full_size_because
    if not state.deliverable:
        return
    current = state.current
    fitted, model = _fit_memory_limit(state, current.plan, current.model)
    if fitted is not current.plan:
        refused = limit_report.attempts[0].run
        state.replace(state.measure(Candidate(fitted, "memory limit"), model),
                      f"ONNX Runtime refused it under the memory limit of {_mib(limit_report.limit_bytes)} "
                      f"({_refusal(refused.error)})")


def _fit_memory_limit(state: Delivery, chosen: Plan, rewritten: onnx.ModelProto) -> tuple[Plan, onnx.ModelProto]:
    """The plan run under the memory limit, ONNX Runtime the judge. When it refuses the plan,
    the leanest plan there is (the least predicted peak) is run under it: refused too, nothing
    fits (MemoryLimitError); else the least step time that runs is searched between the two by
    bisection on the predicted step peak planned for (LIMIT_BISECTIONS runs at most). ONNX
    Runtime's arena holds more than the step's pages the cost model predicts (the resnet
    example's leanest plan: 16.2 MiB measured, 15.7 predicted, refused under a 20 MiB cap, ran
    under 24), so a step lower by the shortfall it names was not enough there.
    Returns the (plan, model) that runs, or raises MemoryLimitError."""
    prepared, options, limit_report = state.prepared, state.options, state.limit_report
    limit = options.memory_limit_bytes
    planned_for = options_budget_bytes(prepared, options) if options.plans_for_limit else chosen.peak_bytes
    best = _run_under_limit(state, chosen, planned_for, rewritten)
    limit_report.returned = best.run
    if best.run.fits:
        limit_report.met = True
        return chosen, rewritten
    state.progress("ONNX Runtime refused the plan under the memory limit: trying the leanest plan", 0.73)
    leanest = search_plan(prepared, options, options.strategy, None, None)
    tried = None if _same_recomputation(leanest, chosen) else _run_under_limit(state, leanest, leanest.peak_bytes)
    if tried is None or not tried.run.fits:
        limit_report.met = False
        original = ", ".join(f"{label}: {'runs' if r.fits else 'does not run'}"
                             for label, r in limit_report.original.items())
        last = limit_report.attempts[-1]
        raise MemoryLimitError(
            f"memory limit of {limit} bytes is not met: ONNX Runtime refused the plan for it and the leanest "
            f"plan there is (predicted step peak {leanest.peak_bytes} bytes, the weights, inputs and state "
            f"{prepared.graph.outside_peak_bytes} bytes; ONNX Runtime: {last.run.error}); the original under "
            f"it: {original}")
    best = tried
    limit_report.returned = best.run
    # the least step time that runs: bisection between the leanest (runs) and the refused
    low, high = leanest.peak_bytes, min(planned_for, limit_report.attempts[0].predicted_peak_bytes)
    for _ in range(LIMIT_BISECTIONS):
        if high - low < max(limit // 100, 1):
            break
        middle = (low + high) // 2
        state.progress(f"the leanest plan runs under the memory limit: trying a step peak of {middle} bytes", 0.74)
        try:
            candidate = search_plan(prepared, options, options.strategy, middle, prepared.step_seconds_limit(options))
        except BudgetInfeasibleError:
            low = middle
            continue
        if _same_recomputation(candidate, best.plan):
            low = middle
            continue
        tried = _run_under_limit(state, candidate, middle)
        if tried is None or not tried.run.fits:
            high = middle
            continue
        low = middle
        if candidate.simulation.compute_seconds < best.plan.simulation.compute_seconds:
            best = tried
            limit_report.returned = best.run
    limit_report.met = True
    return best.plan, best.model


def _same_recomputation(a: Plan, b: Plan) -> bool:
    return a.checkpoints == b.checkpoints and a.recompute_ops == b.recompute_ops


def _run_under_limit(state: Delivery, candidate: Plan, planned_for: int,
                     model: onnx.ModelProto | None = None) -> LimitTry | None:
    """`candidate` (checked first unless its `model` is given) run under the limit, the run
    recorded in the report; None when it fails its checks."""
    if model is None:
        found = state.check(candidate)
        if found is None:
            return None
        model = found.model
    run = limit_run(state.prepared, _as_returned(state.prepared.workspace, model, "limited"), state.options)
    state.limit_report.attempts.append(LimitAttempt(planned_for, candidate.peak_bytes, run))
    return LimitTry(candidate, model, run)


# -- BUDGET ----------------------------------------------------------------------------------------
def _meet_budget(state: Delivery) -> None:
    """The budget met by measurement: a plan measured over it is replaced by a retry
    (`_budget_retry`) until one is within it or none is left; else BudgetInfeasibleError."""
    budget = state.options.budget_bytes
    first = state.current
    attempts = [BudgetAttempt(budget, first.plan.peak_bytes, first.peak_bytes)]
    while (candidate := _budget_retry(state, len(attempts))) is not None:
        attempt = state.attempt(candidate)
        if attempt is None:
            break
        state.replace(attempt, f"it measured {state.current.peak_bytes} bytes, over the budget of {budget} bytes")
        attempts.append(BudgetAttempt(candidate.planned_for_bytes, attempt.plan.peak_bytes, attempt.peak_bytes))
    state.report.budget_attempts = attempts
    if state.deliverable and state.current.peak_bytes > budget:
        least = min(a.measured_peak_bytes for a in attempts)
        raise BudgetInfeasibleError(
            f"budget of {budget} bytes is not met by measurement: the plans for it measured "
            f"{[a.measured_peak_bytes for a in attempts]} bytes (predicted "
            f"{[a.predicted_peak_bytes for a in attempts]}); the least measured was {least} bytes",
            least_feasible_peak_bytes=least)


def _budget_retry(state: Delivery, measured_for_budget: int) -> Candidate | None:
    """The next plan for the budget after `measured_for_budget` plans were measured for it: where
    the last measured over it, the plan for a budget lower by the overshoot (the runtime held
    more than predicted); None where it did not, no retry is left, or the search has no other plan."""
    budget, current = state.options.budget_bytes, state.current
    if not (state.deliverable and current.peak_bytes > budget and measured_for_budget <= BUDGET_RETRIES):
        return None
    overshoot = current.peak_bytes - current.plan.peak_bytes
    target = budget - max(overshoot, 0) - (measured_for_budget - 1) * max(overshoot, 1 << 16)
    state.progress(f"budget missed by measurement ({current.peak_bytes} > {budget} bytes): "
                   f"planning for {target}", 0.75)
    try:
        retry = search_plan(state.prepared, state.options, state.options.strategy, target,
                            state.prepared.step_seconds_limit(state.options))
    except BudgetInfeasibleError:
        return None
    if retry.checkpoints == current.plan.checkpoints:
        return None
    return Candidate(retry, "budget retry", planned_for_bytes=target)


# -- TIME LIMIT ------------------------------------------------------------------------------------
def _meet_step_time(state: Delivery) -> bool:
    """The step-time limit met by measurement: a plan measured over it is replaced by a retry
    (`_time_retry`), then by store-all where every plan measured was over (`_store_all_after`);
    the plan kept is the least measured peak among those within it (`_keep_within`). Whether one
    was (with a budget too, none is a BudgetInfeasibleError)."""
    options, current = state.options, state.current
    planned_for = float(current.plan.notes.get("seconds_limit", state.prepared.step_seconds_limit(options)))
    current.candidate.planned_for_seconds = planned_for
    measured = [current]
    while (candidate := _time_retry(state, len(measured))) is not None:
        if not _measure_for_time(state, candidate, measured):
            break
    if (candidate := _store_all_after(state, measured)) is not None:
        _measure_for_time(state, candidate, measured)
    state.report.overhead_attempts = [
        OverheadAttempt(a.candidate.planned_for_seconds, a.plan.simulation.compute_seconds, a.overhead - 1,
                        a.plan.peak_bytes, a.peak_bytes) for a in measured]
    return _keep_within(state, measured)


def _measure_for_time(state: Delivery, candidate: Candidate, measured: list[Attempt]) -> bool:
    """`candidate` checked and measured for the step-time limit, in `measured` and kept in place of
    the plan before it (over the limit); False where it failed its checks."""
    attempt = state.attempt(candidate)
    if attempt is None:
        return False
    measured.append(attempt)
    state.replace(attempt, _over_time(state.current, state.options.overhead_limit))
    return True


def _store_all_after(state: Delivery, measured: list[Attempt]) -> Candidate | None:
    """Store-all, where every plan `measured` for the step-time limit was over it and the last
    recomputes (nothing recomputed costs least time, and often still less memory than the
    original); None with a budget or a memory limit (another plan is not known to meet them)."""
    options, allowed = state.options, state.options.overhead_limit
    if (all(a.overhead > 1 + allowed for a in measured) and options.budget_bytes is None
            and state.limit_report is None and state.current.plan.recompute_ops):
        state.progress(f"no plan measured within {1 + allowed:.2f}x: trying store-all", 0.8)
        return Candidate(store_all(state.prepared.graph), "store-all")
    return None


def _keep_within(state: Delivery, measured: list[Attempt]) -> bool:
    """The least measured peak among the plans `measured` within the step-time limit kept (the
    others rejected); whether there was one. None within it with a budget: BudgetInfeasibleError."""
    options, allowed = state.options, state.options.overhead_limit
    fits = [a for a in measured if a.overhead <= 1 + allowed]
    if fits:
        best = min(fits, key=lambda a: a.peak_bytes)
        if best is not state.current:
            state.replace(best, f"{best.candidate.why} measured a lower peak within the step-time limit")
        return True
    if options.budget_bytes is not None:
        current = state.current
        raise BudgetInfeasibleError(
            f"budget of {options.budget_bytes} bytes is met, but the step time measured {current.overhead:.2f}x the "
            f"original's (default session), over the {1 + allowed:.2f}x allowed",
            least_feasible_peak_bytes=current.peak_bytes)
    return False


def _time_retry(state: Delivery, measured_for_limit: int) -> Candidate | None:
    """The next plan for the step-time limit after `measured_for_limit` plans were measured for
    it: where the last measured over it, the plan for a predicted limit lower by the excess and
    TIME_RETRY_MARGIN; None where it did not, no retry is left, the search finds the same plan, or
    a budget or a memory limit holds the plan (another is not known to meet them)."""
    options, current = state.options, state.current
    allowed = options.overhead_limit
    if not (current.overhead > 1 + allowed and options.budget_bytes is None and state.limit_report is None
            and measured_for_limit <= TIME_RETRIES):
        return None
    # the runtime took longer than predicted: plan again for a limit lower by the excess
    planned_for = (current.plan.simulation.compute_seconds * (1 + allowed) / current.overhead
                   * (1 - TIME_RETRY_MARGIN))
    state.progress(f"step time {current.overhead:.2f}x the original's by measurement, over {1 + allowed:.2f}x: "
                   f"planning for {planned_for:.4g} s", 0.78)
    retry = search_plan(state.prepared, options, options.strategy, None, planned_for)
    if retry.checkpoints == current.plan.checkpoints and retry.refresh_gap == current.plan.refresh_gap:
        return None
    return Candidate(retry, "time retry", planned_for_seconds=planned_for)


def _over_time(attempt: Attempt, allowed: float) -> str:
    return f"its step measured {attempt.overhead:.3f}x the original's, over the {1 + allowed:.3f}x allowed"


# -- NEVER WORSE -----------------------------------------------------------------------------------
def _conclude(state: Delivery, within_limit: bool) -> tuple[Plan, onnx.ModelProto]:
    """NEVER WORSE: the plan kept, only if it measured below the original in both sessions (and
    within the step-time limit), after store-all is tried where it did not; else the original,
    under its session that measured the lower peak among those within the limit. The outcome,
    the measured figures and the ratios in the report; the (plan, model) returned."""
    prepared, options, report, originals = state.prepared, state.options, state.report, state.originals
    timing, deliverable, limit_report = prepared.timing, state.deliverable, state.limit_report
    budget, allowed = options.budget_bytes, options.overhead_limit
    bar = min(m.peak_bytes for m in originals.values())
    # under a memory limit: an original that does not run under it is no alternative
    original_fits = limit_report is None or limit_report.original[state.best_original_label()].fits
    if (deliverable and within_limit and state.current.peak_bytes >= bar and budget is None
            and limit_report is None):
        _try_fallbacks(state, bar)
    current = state.current
    chosen, rewritten, optimized, overhead = current.plan, current.model, current.measurement, current.overhead
    _describe(report, chosen, rewritten, prepared.graph)
    report.prediction_error = PredictionError(
        optimized=chosen.peak_bytes / max(1, optimized.peak_bytes) - 1,
        original_optimizations_off=prepared.predicted_original.peak_bytes
        / max(1, originals["original_optimizations_off"].peak_bytes) - 1,
        # step times as overheads over the default session timed in the same process (the
        # machine's speed moves between processes; the ratio does not)
        optimized_step_time=(chosen.simulation.compute_seconds / timing.default_session_seconds) / overhead - 1,
        original_optimizations_off_step_time=None)
    returned, returned_overhead = optimized, overhead
    if deliverable and within_limit and (optimized.peak_bytes < bar or not original_fits):
        report.outcome = OUTCOME_OPTIMIZED
        if optimized.peak_bytes < bar:
            reason = (f"the optimized model measured {_mib(optimized.peak_bytes)}, below the original's "
                      f"{_mib(originals['original_default_session'].peak_bytes)} (default session) and "
                      f"{_mib(originals['original_optimizations_off'].peak_bytes)} (optimizations off)")
        else:
            reason = (f"the optimized model runs within the memory limit of {_mib(limit_report.limit_bytes)} and the "
                      f"original does not (it measured {_mib(optimized.peak_bytes)}, the original "
                      f"{_mib(bar)} at least)")
        if limit_report is not None:
            reason += f", and runs within the memory limit of {_mib(limit_report.limit_bytes)}"
        if allowed is not None:
            reason += f", at {overhead:.2f}x the original's step time (at most {1 + allowed:.2f}x allowed)"
    else:
        report.outcome = OUTCOME_ORIGINAL
        best_original = state.best_original_label()
        session = best_original.replace("original_", "").replace("_", " ")
        why = (_not_delivered(report) if not deliverable else
               f"no plan measured within {1 + allowed:.2f}x the original's step time (the last: "
               f"{overhead:.2f}x)" if not within_limit else
               f"the optimized model measured {_mib(optimized.peak_bytes)}, not below the original's "
               f"{_mib(bar)}")
        current.reject(why)
        reason = (f"{why}; the original model is returned with the session that measured lowest"
                  + ("" if allowed is None else " within the step-time limit")
                  + f" ({session}: {_mib(originals[best_original].peak_bytes)}), written in its metadata")
        report.rejected = RejectedPlan(**_summary(chosen), order_followed=deliverable, measured=_run(optimized))
        returned, returned_overhead = originals[best_original], state.original_overhead(best_original)
        rewritten = _returned_original(prepared, ORIGINAL_SESSIONS[best_original], options)
        _describe(report, None, rewritten, prepared.graph)
        report.session = ORIGINAL_SESSIONS[best_original]
        if limit_report is not None:
            limit_report.met = original_fits
            limit_report.returned = limit_report.original[best_original]
            if not original_fits:
                raise MemoryLimitError(
                    f"memory limit of {limit_report.limit_bytes} bytes is not met: {why}, and the original does "
                    f"not run under it ({limit_report.original[best_original].error})")
        if budget is not None and originals[best_original].peak_bytes > budget:
            raise BudgetInfeasibleError(
                f"budget of {budget} bytes is not met: {why}, and the original measured "
                f"{originals[best_original].peak_bytes} bytes", least_feasible_peak_bytes=bar)
    report.outcome_reason = reason + _rejections(report)
    report.measured = Measured(_run(originals["original_default_session"]),
                               _run(originals["original_optimizations_off"]), _run(returned))
    report.measurement_method = returned.method
    report.provider = returned.provider or report.provider
    default, off = originals["original_default_session"], originals["original_optimizations_off"]
    report.ratios = Ratios(
        peak_vs_default_session=returned.peak_bytes / max(1, default.peak_bytes),
        peak_vs_optimizations_off=returned.peak_bytes / max(1, off.peak_bytes),
        step_time_vs_default_session=returned_overhead,
        step_time_vs_optimizations_off=(None if timing.optimizations_off_seconds is None else
                                        returned_overhead / state.original_overhead("original_optimizations_off")))
    if timing.planned_graph_off_seconds is not None:
        report.prediction_error.original_optimizations_off_step_time = (
            timing.predicted_original_seconds / timing.planned_graph_off_seconds - 1)
    report.objective.measured_overhead = returned_overhead - 1
    if allowed is not None:
        report.objective.met = returned_overhead <= 1 + allowed
    if budget is not None:
        report.budget_met = returned.peak_bytes <= budget
    return chosen, rewritten


def _try_fallbacks(state: Delivery, bar: int) -> None:
    """The plan kept measured not below the original's peak: the next plans with less
    recomputation (`pipeline.fallback_plans`: store-all) may still beat it, each kept where it
    measures lower, until one is below the original."""
    for fallback in fallback_plans(state.prepared, state.current.plan):
        state.progress(f"the plan measured {state.current.peak_bytes} bytes, not below the original's {bar}: "
                       f"trying {fallback.strategy}", 0.85)
        attempt = state.attempt(Candidate(fallback, f"fallback {fallback.strategy}"))
        if attempt is not None and _keep_fallback(state, attempt, bar):
            break


def _keep_fallback(state: Delivery, attempt: Attempt, bar: int) -> bool:
    """A fallback measured: kept in place of the plan before it where it measured less (and,
    with a step-time limit, within it: the plan before it was), else rejected; whether it was kept
    below the original's peak `bar` (no other is tried then)."""
    allowed = state.options.overhead_limit
    if allowed is not None and attempt.overhead > 1 + allowed:
        attempt.reject(_over_time(attempt, allowed))
        return False
    if attempt.peak_bytes < state.current.peak_bytes:
        state.replace(attempt, f"it measured {_mib(state.current.peak_bytes)}, not below the original's "
                               f"{_mib(bar)}, and {attempt.plan.strategy} measured less")
    else:
        attempt.reject(f"it measured {_mib(attempt.peak_bytes)}, not below the plan before it")
    return attempt.peak_bytes < bar


# -- MEMORY LIMIT, the original running under it in no session -------------------------------------
def _reduced_delivery(state: Delivery, chosen: Plan, rewritten: onnx.ModelProto) -> tuple[Plan, onnx.ModelProto]:
    """The original runs under the memory limit in no session (`ReducedStep`): the rewrite is
    what runs under it (`_fit_memory_limit`), or nothing does (MemoryLimitError). What is measured
    is the returned model's run under the limit, at full size: ONNX Runtime's cap holds, the
    process's resident growth, the step time; nothing runs the original at full size."""
    prepared, options, report = state.prepared, state.options, state.report
    reduced = prepared.reduced
    limit_report = state.limit_report = report.memory_limit = MemoryLimit(options.memory_limit_bytes)
    limit_report.original = dict(prepared.original_limit_runs)
    batches = [b for b in reduced.batches if b]
    report.reduced = ReducedSize(full_batch=reduced.full_batch, annotated_batches=batches,
                                 verified_batch=reduced.batches[1] if options.verify else None,
                                 rewritten_constants=reduced.rewritten_constants)
    errors = "; ".join(f"{label.replace('original_', '').replace('_', ' ')}: {_refusal(run.error)}"
                       for label, run in limit_report.original.items())
    if not state.deliverable:
        limit_report.met = False
        raise MemoryLimitError(
            f"memory limit of {limit_report.limit_bytes} bytes is not met: {_not_delivered(report)}, and the original "
            f"does not run under it ({errors})")
    state.progress("memory limit", 0.72)
    chosen, rewritten = _fit_memory_limit(state, chosen, rewritten)
    run = limit_run(prepared, _as_returned(prepared.workspace, rewritten, "limited"), options,
                    steps=REDUCED_TIMED_STEPS)
    if not run.fits:   # it ran under the cap a moment ago: say so rather than return it
        limit_report.met = False
        raise MemoryLimitError(f"memory limit of {limit_report.limit_bytes} bytes: the plan that ran under it "
                               f"did not in a second run ({run.error})")
    limit_report.returned = run
    _describe(report, chosen, rewritten, prepared.graph)
    report.outcome = OUTCOME_OPTIMIZED
    report.outcome_reason = (
        f"the original does not run under the memory limit of {_mib(limit_report.limit_bytes)} in any session "
        f"({errors}); the optimized model runs under it ({REDUCED_TIMED_STEPS} steps at full size, the step "
        f"{run.step_seconds:.3f} s), annotated at batches "
        f"{' and '.join(map(str, batches))} of {reduced.full_batch}"
        + (f", its outputs identical to the original's at batch {reduced.batches[1]}" if options.verify else "")
        # a budget is met by the step's peak measured in a fresh process without a cap, which is not run here
        + ("" if options.budget_bytes is None else
           f"; it was planned for the budget of {options.budget_bytes} bytes, which was not checked by measurement "
           "(only runs under the limit are made)")
        + _rejections(report))
    return chosen, rewritten


# -- the report ------------------------------------------------------------------------------------
def _new_report(prepared: Prepared, chosen: Plan, rewritten: onnx.ModelProto, options: OptimizeOptions) -> Report:
    training, annotations, predicted = prepared.training, prepared.annotations, prepared.predicted_original
    report = Report(
        loss=training.loss, strategy=chosen.strategy, budget_bytes=options.budget_bytes,
        nodes=NodeCounts(original=len(prepared.original.graph.node), optimized=len(rewritten.graph.node),
                         forward=len(training.forward), backward=len(training.backward)),
        stashed_tensors=len(training.stashed), checkpoints=[], recompute_nodes=0,
        search_seconds=float(chosen.notes.get("search_seconds", 0.0)),
        search_cpu_seconds=chosen.notes.get("search_cpu_seconds"),
        functions_expanded=dict(prepared.functions_expanded), sums_chained=prepared.sums_chained,
        graph_optimizations=prepared.graph_optimizations,
        predicted=Predicted(PredictedRun(predicted.peak_bytes, prepared.timing.predicted_original_seconds
                                         if prepared.timing is not None else predicted.compute_seconds),
                            PredictedRun(0, 0.0)),
        objective=_objective(prepared, chosen, options),
        annotations=AnnotationSummary(annotations.provider, len(annotations.tensor_bytes),
                                      len(annotations.node_seconds), annotations.node_seconds_from,
                                      annotations.nodes_not_replayed),
        provider=annotations.provider, threads=options.threads, session=PLANNED_SETTINGS,
        base_order=BaseOrder(chosen.notes.get("base_order", prepared.base_order), dict(prepared.base_order_peaks),
                             dict(chosen.notes.get("base_order_peak_bytes", {}))),
        peaks_explained=explain_peaks(prepared.graph, prepared.annotations.execution_order,
                                      prepared.base_graphs.values()))
    _describe(report, chosen, rewritten, prepared.graph)
    return report


def _objective(prepared: Prepared, chosen: Plan, options: OptimizeOptions) -> Objective:
    limit = prepared.step_seconds_limit(options)
    return Objective(
        name=options.effective_objective, max_overhead=options.overhead_limit,
        baseline_step_seconds=prepared.baseline_step_seconds,
        baseline=("the original, ONNX Runtime's default session, measured" if prepared.timing is not None else
                  "the original, optimizations off, predicted (measurement off)"),
        step_seconds_limit=limit, predicted_step_seconds=chosen.simulation.compute_seconds,
        store_all_vs_faster_original=(None if prepared.timing is None else prepared.timing.store_all_seconds / min(
            prepared.timing.default_session_seconds,
            prepared.timing.optimizations_off_seconds or prepared.timing.default_session_seconds)))


def _describe(report: Report, chosen: Plan | None, model: onnx.ModelProto, graph=None) -> None:
    """The returned plan in `report` (None: the original is returned); `graph`: the cost graph it
    was planned on."""
    report.nodes.optimized = len(model.graph.node)
    if report.peaks_explained is not None and graph is not None:
        report.peaks_explained.returned = (
            None if chosen is None else explain_peak(graph, priority_order(graph, chosen.schedule, distinct_steps=True)))
    if chosen is None:   # nothing of a plan measured and rejected stays: the original has no solver
        report.checkpoints, report.recompute_nodes, report.solver_exact = [], 0, None
        return
    report.strategy = chosen.strategy
    report.checkpoints = sorted(chosen.checkpoints)
    report.recompute_nodes = chosen.recompute_ops
    report.solver_exact = solver_exact(chosen)
    report.predicted.optimized = PredictedRun(chosen.peak_bytes, chosen.simulation.compute_seconds,
                                              chosen.recompute_seconds)
    if report.objective is not None:
        report.objective.predicted_step_seconds = chosen.simulation.compute_seconds


def _record_checks(report: Report, tried: list[Checked]) -> None:
    last = tried[-1]
    matched = [t for t in tried if t.entry.outputs_match]
    report.outputs_match = last.entry.outputs_match
    report.max_relative_difference = (matched[-1] if matched else last).comparison.max_relative_difference
    report.rejected_for_outputs = [
        RejectedForOutputs(**_summary(t.plan), output=t.entry.outputs_differ.output,
                           relative_difference=t.entry.outputs_differ.relative_difference,
                           reason=t.entry.outputs_differ.reason)
        for t in tried if not t.entry.outputs_match]
    report.order_followed = last.entry.order.followed
    report.order = OrderReport(followed=report.order_followed, plans_tried=[t.entry for t in tried])


def _record_checks_rejection(report: Report, checked: Checked) -> None:
    differ = checked.entry.outputs_differ
    report.rejected_for_outputs.append(RejectedForOutputs(
        **_summary(checked.plan), output=differ.output, relative_difference=differ.relative_difference,
        reason=differ.reason))


def _not_delivered(report: Report) -> str:
    if report.rejected_for_outputs:
        return ("no plan tried both computed the original's outputs and ran in the planned order in "
                "ONNX Runtime")
    return "ONNX Runtime did not run the planned order of any plan tried"


def _rejections(report: Report) -> str:
    """The plans rejected because their outputs differed, for `outcome_reason`."""
    return "".join(f"; the {r.strategy} plan ({r.recompute_nodes} recomputed nodes) was rejected: its "
                   f"{r.reason}" for r in report.rejected_for_outputs)


def _run(m: Measurement) -> MeasuredRun:
    return MeasuredRun(peak_bytes=m.peak_bytes, step_seconds=m.step_seconds, provider=m.provider, method=m.method)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _returned_original(prepared: Prepared, settings: SessionSettings | None, options: OptimizeOptions
                       ) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(prepared.original)
    if settings is not None:
        write_settings(model, settings)
        write_annotations(model, prepared.original_annotations_for(options))
    return model


__all__ = ["deliver", "Delivery", "Attempt", "Candidate", "LimitTry", "BUDGET_RETRIES", "TIME_RETRIES",
           "TIME_RETRY_MARGIN", "LIMIT_BISECTIONS", "REDUCED_TIMED_STEPS"]
