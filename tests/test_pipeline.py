"""End to end on the six example training graphs: optimize, verify, measure in fresh
ONNX Runtime processes. Memory ratios are measured (not timed), so they are asserted here;
step-time ratios are printed by benchmarks/zoo_table.py."""
import statistics

import pytest

from graphopt.errors import BudgetInfeasibleError
from graphopt.examples import EXAMPLES, training_example
from graphopt.optimize import OptimizeOptions, optimize, summary_text
from graphopt.pipeline import measure_model, plan, prepare, rewrite_plan
from graphopt.search import chen_sqrt

_reports = {}


def report_for(name):
    if name not in _reports:
        model, inputs = training_example(name)
        _reports[name] = optimize(model, OptimizeOptions(inputs=inputs, objective="least-peak")).report
    return _reports[name]


@pytest.mark.parametrize("name", EXAMPLES)
def test_outputs_identical_and_order_followed(name):
    report = report_for(name)
    assert report.outputs_match
    assert report.max_relative_difference <= 1e-5
    assert report.order_followed, "ONNX Runtime did not execute the planned order"


@pytest.mark.parametrize("name", EXAMPLES)
def test_prediction_within_five_percent(name):
    error = report_for(name).prediction_error
    assert abs(error.optimized) <= 0.05, error
    assert abs(error.original_optimizations_off) <= 0.05, error


@pytest.mark.parametrize("name", EXAMPLES)
def test_measured_peak_saving(name):
    ratios = report_for(name).ratios
    # The built graphs are lean (tests/test_builder_vs_torch.py, benchmarks/builder_vs_eager.py):
    # measured with benchmarks/zoo_table.py, optimized / optimizations off ranged 0.21-0.79
    # (randwire highest: its random wiring leaves little to recompute), / default 0.18-0.58.
    assert ratios.peak_vs_default_session <= 0.65, ratios
    assert ratios.peak_vs_optimizations_off <= 0.85, ratios


def test_report_says_where_the_time_went():
    """Each stage's wall and CPU seconds: together the whole call; the plan stage holds the
    search; ONNX Runtime's work, done in children, is counted in CPU time."""
    report = report_for("mlp")
    stages = {s.stage: s for s in report.stages}
    assert {"annotate", "time", "plan", "verify", "measure"} <= set(stages), list(stages)
    wall = sum(s.wall_seconds for s in report.stages)
    assert 0.95 * report.total_seconds <= wall <= report.total_seconds
    assert stages["plan"].wall_seconds >= report.search_seconds
    # a measuring child works while this process waits: its CPU seconds are the stage's
    assert stages["measure"].cpu_seconds >= 0.3 * stages["measure"].wall_seconds, stages["measure"]
    assert "time" in summary_text(report).splitlines()[-2]


_chen = {}


def chen_peak_bytes(name):
    """Measured peak of Chen's sqrt(n) plan, rewritten and run like graphopt's own plan."""
    if name not in _chen:
        model, inputs = training_example(name)
        options = OptimizeOptions(inputs=inputs, verify=False)
        with prepare(model, options) as prepared:
            rewritten = rewrite_plan(prepared, chen_sqrt(prepared.graph))
            _chen[name] = measure_model(prepared, rewritten, options).peak_bytes
    return _chen[name]


@pytest.mark.parametrize("name", EXAMPLES)
def test_least_peak_never_above_chen(name):
    ours = report_for(name).measured.optimized.peak_bytes
    assert ours <= chen_peak_bytes(name), (ours, chen_peak_bytes(name))


def test_median_against_chen_and_default_session():
    vs_chen = [report_for(n).measured.optimized.peak_bytes / chen_peak_bytes(n) for n in EXAMPLES]
    vs_default = [report_for(n).ratios.peak_vs_default_session for n in EXAMPLES]
    assert statistics.median(vs_chen) <= 0.75, vs_chen
    assert statistics.median(vs_default) <= 0.40, vs_default


@pytest.mark.parametrize("fraction", [0.25, 0.6])
def test_budget_met_by_measurement(fraction):
    """A budget between the least peak and store-all is met by the measured peak."""
    least = report_for("resnet")
    low = least.measured.optimized.peak_bytes
    high = least.measured.original_optimizations_off.peak_bytes
    budget = int(low + fraction * (high - low))
    model, inputs = training_example("resnet")
    report = optimize(model, OptimizeOptions(inputs=inputs, budget_bytes=budget)).report
    assert report.outputs_match and report.order_followed
    assert report.measured.optimized.peak_bytes <= budget, report.budget_attempts
    assert report.budget_met
    # least time under the budget: no more recomputation than the least-peak plan (which fits any
    # budget above its peak). The two runs annotate and time separately, and each node's measured
    # time moves between them, not only the machine's speed: taken over each run's own original
    # step, the shares still differed by 1.18x in one CI run (2.04 against 1.74). So 1.5x is
    # allowed; a budget search that ends on a plan recomputing several times more (6.3x the step
    # against 1.7x before the least-peak plan was a candidate, 3.7x the share) fails.
    def recompute_share(r):
        return r.predicted.optimized.recompute_seconds / r.predicted.original_optimizations_off.step_seconds
    assert recompute_share(report) <= 1.5 * recompute_share(least), (recompute_share(report), recompute_share(least))


def test_impossible_budget_names_the_least_peak():
    model, inputs = training_example("mlp", small=True)
    with pytest.raises(BudgetInfeasibleError, match="least peak"):
        optimize(model, OptimizeOptions(inputs=inputs, budget_bytes=1, measure=False, verify=False))


def test_budget_just_above_a_prediction_is_met_by_measurement():
    """A budget 8 KiB above a plan's predicted peak. The measured peak of that plan lands
    within about +-70 KiB of the prediction (page rounding, allocator overhead): when it is
    over, optimize plans again for the budget lowered by the overshoot (measured once:
    40,050,688 > 39,990,828 bytes, then 39,587,840). Either way the result must fit."""
    model, inputs = training_example("resnet")
    planned = optimize(model, OptimizeOptions(inputs=inputs, budget_bytes=40_000_000, verify=False, measure=False))
    budget = planned.plan.peak_bytes + 8192
    report = optimize(model, OptimizeOptions(inputs=inputs, budget_bytes=budget)).report
    attempts = report.budget_attempts
    assert report.measured.optimized.peak_bytes <= budget and report.budget_met, attempts
    assert all(a.measured_peak_bytes > budget for a in attempts[:-1]), attempts
    assert report.outputs_match and report.order_followed


# -- memory at a chosen time cost -------------------------------------------------------------
def test_default_objective_states_its_point_and_never_returns_over_the_limit():
    """The default objective bounds the step time: the report names it, its baseline (the
    original under the default session, measured), and whether the returned model measured
    within it; a rewritten model is returned only when it did."""
    from graphopt.options import DEFAULT_MAX_OVERHEAD
    model, inputs = training_example("resnet")
    report = optimize(model, OptimizeOptions(inputs=inputs)).report
    objective = report.objective
    assert objective.name == "bounded-overhead" and objective.max_overhead == DEFAULT_MAX_OVERHEAD
    assert objective.baseline_step_seconds == report.measured.original_default_session.step_seconds
    assert objective.step_seconds_limit == pytest.approx((1 + DEFAULT_MAX_OVERHEAD) * objective.baseline_step_seconds)
    assert objective.met == (report.ratios.step_time_vs_default_session <= 1 + DEFAULT_MAX_OVERHEAD)
    assert objective.measured_overhead == pytest.approx(report.ratios.step_time_vs_default_session - 1)
    if report.outcome == "optimized":
        assert objective.met, report.overhead_attempts
        assert report.outputs_match and report.order_followed
    attempts = report.overhead_attempts
    assert attempts, report
    # a plan is measured again (a retry, store-all) only after the one before measured over the limit
    assert all(a.measured_overhead > DEFAULT_MAX_OVERHEAD for a in attempts[:-1]), attempts
    assert report.prediction_error.optimized_step_time is not None
    # every plan measured is stated, predicted against measured, peak and step: those for the limit
    # are its attempts, one for one (the attempts' overheads are over the baseline, timed in turn)
    measured = report.plans_measured
    assert measured and measured[0].why == "planned"
    assert all(p.predicted_step_seconds > 0 and p.measured_step_seconds > 0 for p in measured), measured
    for_limit = [p for p in measured if p.why in ("planned", "time retry", "store-all")]
    assert [(p.predicted_peak_bytes, p.measured_peak_bytes) for p in for_limit] == \
        [(a.predicted_peak_bytes, a.measured_peak_bytes) for a in report.overhead_attempts]
    for p, a in zip(for_limit, report.overhead_attempts):
        assert p.predicted_step_seconds == pytest.approx(a.predicted_step_seconds)
        assert p.measured_step_seconds == pytest.approx((1 + a.measured_overhead) * objective.baseline_step_seconds)
    if report.outcome == "optimized":
        returned = report.measured.optimized
        assert (returned.peak_bytes, returned.step_seconds) in [(p.measured_peak_bytes, p.measured_step_seconds)
                                                                for p in measured]
    assert "predicted against measured" in summary_text(report)
    assert_each_plan_not_returned_says_why(report)


def assert_each_plan_not_returned_says_why(report):
    """Every plan measured but the returned one names why it was not returned (`rejected_because`,
    graphopt/delivery.py), and a plan followed by a retry for the step-time limit measured over the
    limit (the measurement is the oracle, not the reason's text)."""
    measured = report.plans_measured
    kept = [p for p in measured if p.rejected_because is None]
    if report.outcome == "optimized":
        returned = report.measured.optimized
        assert [(p.measured_peak_bytes, p.measured_step_seconds) for p in kept] == \
            [(returned.peak_bytes, returned.step_seconds)], measured
    else:
        assert not kept, measured
    limit = report.objective.step_seconds_limit
    for p, after in zip(measured, measured[1:]):
        if after.why in ("time retry", "store-all"):
            assert "over the" in p.rejected_because and p.measured_step_seconds > limit, (p, limit)


def test_a_limit_that_binds_is_honoured_by_measurement():
    """At a step-time limit of the original's own step (max overhead 0) on the unet example, where
    every plan measured over it (by hand, with the limit check broken: three plans at 1.09-1.12x,
    each at half the original's peak, and the last returned): whatever optimize returns measured
    within the limit against the original timed in turn with it, and a plan is tried again only
    after the one before measured over."""
    model, inputs = training_example("unet")
    report = optimize(model, OptimizeOptions(inputs=inputs, max_overhead=0.0)).report
    attempts = report.overhead_attempts
    assert attempts and all(a.measured_overhead > 0.0 for a in attempts[:-1]), attempts
    assert_each_plan_not_returned_says_why(report)
    if report.outcome == "optimized":
        assert report.ratios.step_time_vs_default_session <= 1.0, (report.ratios, attempts)
        assert attempts[-1].measured_overhead <= 0.0, attempts
    else:   # (over the limit, or not below the original's peak) nothing of the plans it rejected
        # is said of the original it returns
        assert report.solver_exact is None and report.checkpoints == [] and report.recompute_nodes == 0, report


def test_max_overhead_bounds_the_predicted_step_time():
    """With measurement off the baseline is the original's predicted step time (optimizations
    off): the plan's predicted step time stays within (1 + F) of it, and a tighter F never gives
    a lower predicted peak than a looser one."""
    model, inputs = training_example("mlp", small=True)
    peaks = []
    for overhead in (0.0, 0.1, 0.5):
        report = optimize(model, OptimizeOptions(inputs=inputs, max_overhead=overhead, measure=False,
                                                 verify=False)).report
        objective = report.objective
        assert objective.name == "bounded-overhead" and objective.max_overhead == overhead
        assert "predicted" in objective.baseline
        assert objective.predicted_step_seconds <= objective.step_seconds_limit * (1 + 1e-9), objective
        peaks.append(report.predicted.optimized.peak_bytes)
    assert peaks[0] >= peaks[1] >= peaks[2], peaks
    least = optimize(model, OptimizeOptions(inputs=inputs, objective="least-peak", measure=False,
                                            verify=False)).report
    assert least.objective.name == "least-peak" and least.predicted.optimized.peak_bytes <= peaks[-1]


@pytest.mark.parametrize("threads", [1, 2])
def test_the_plan_is_searched_for_a_share_of_the_overhead_at_the_threads_given(threads):
    """The thread count reaches the time model (a recomputed copy's factor,
    `op_rules.RECOMPUTE_FACTORS`) and the limit the first plan is searched for (a share of the
    overhead allowed, `pipeline.PLANNED_OVERHEAD_SHARES`), on the resnet example, at the
    overhead its least-peak plan takes: searched for the whole overhead, that plan is found
    (over the share); searched for the share, a plan within it."""
    import dataclasses

    from graphopt.op_rules import RECOMPUTE_FACTORS, at_threads
    from graphopt.options import LEAST_PEAK
    from graphopt.pipeline import PLANNED_OVERHEAD_SHARES
    model, inputs = training_example("resnet")
    options = OptimizeOptions(inputs=inputs, measure=False, verify=False, threads=threads)
    with prepare(model, options) as prepared:
        assert all(g.recompute_factor == RECOMPUTE_FACTORS[threads] for g in prepared.base_graphs.values())
        baseline = prepared.baseline_step_seconds
        least = plan(prepared, dataclasses.replace(options, objective=LEAST_PEAK, max_overhead=None))
        overhead = least.simulation.compute_seconds / baseline - 1 + 1e-9
        assert overhead > 0, "the least-peak plan recomputes"
        bounded = dataclasses.replace(options, max_overhead=overhead)
        shared = (1 + at_threads(PLANNED_OVERHEAD_SHARES, threads) * overhead) * baseline
        whole = plan(prepared, bounded, seconds_limit=prepared.step_seconds_limit(bounded))
        chosen = plan(prepared, bounded)
    assert whole.peak_bytes == least.peak_bytes and whole.simulation.compute_seconds > shared
    assert chosen.simulation.compute_seconds <= shared and chosen.notes["seconds_limit"] == pytest.approx(shared)
    assert chosen.peak_bytes >= whole.peak_bytes


def test_the_limit_searched_from_the_leaner_order_loses_nothing():
    """Under a step-time limit the bisection runs only from base orders whose least peak is near
    the leanest's: on the resnet example (ONNX Runtime's order 9% leaner than the file's, and
    its least-peak plan over the limit) the plan is the one bisecting from every order finds
    (least_peak_within on each, independently)."""
    from graphopt.search import STRATEGIES, least_peak_within
    model, inputs = training_example("resnet")
    options = OptimizeOptions(inputs=inputs, measure=False, verify=False)
    with prepare(model, options) as prepared:
        limit = prepared.planned_seconds_limit(options)
        chosen = plan(prepared, options)
        everywhere = [least_peak_within(graph, STRATEGIES["auto"], limit) for graph in prepared.base_graphs.values()]
    within = [p for p in everywhere if p.simulation.compute_seconds <= limit]
    assert within and chosen.simulation.compute_seconds <= limit
    assert chosen.peak_bytes <= min(p.peak_bytes for p in within), (chosen.peak_bytes, [p.peak_bytes for p in within])


def test_budget_and_max_overhead_that_cannot_both_hold_name_both():
    # an example whose least peak needs recomputation (the small mlp's needs only a reorder,
    # so there both can hold and the outcome is a rounding of two equal times)
    model, inputs = training_example("resnet", small=True)
    least = optimize(model, OptimizeOptions(inputs=inputs, objective="least-peak", measure=False,
                                            verify=False)).report
    assert least.recompute_nodes > 0 and least.predicted.optimized.recompute_seconds > 0
    with pytest.raises(BudgetInfeasibleError, match="cannot both hold") as caught:
        optimize(model, OptimizeOptions(inputs=inputs, budget_bytes=least.predicted.optimized.peak_bytes,
                                        max_overhead=0.0, measure=False, verify=False))
    assert "least step time" in str(caught.value) and "least peak" in str(caught.value)


@pytest.mark.parametrize("options, message", [
    ({"objective": "fastest"}, "unknown objective"),
    ({"objective": "least-peak", "max_overhead": 0.1}, "least-peak takes no max overhead"),
    ({"max_overhead": -0.1}, "max overhead must be"),
    ({"max_overhead": 0.1, "strategy": "feng-huang"}, "cannot bound the step time"),
])
def test_bad_objective_options_are_refused_before_any_work(options, message):
    from graphopt.errors import InvalidOptionError
    model, inputs = training_example("mlp", small=True)
    with pytest.raises(InvalidOptionError, match=message):
        optimize(model, OptimizeOptions(inputs=inputs, **options))
