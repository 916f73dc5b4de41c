"""End to end on the six example training graphs: optimize, verify, measure in fresh
ONNX Runtime processes. Memory ratios are measured (not timed), so they are asserted here;
step-time ratios are printed by benchmarks/zoo_table.py."""
import pytest

from graphopt.examples import EXAMPLES, training_example
from graphopt.optimize import OptimizeOptions, optimize

_reports = {}


def report_for(name):
    if name not in _reports:
        model, inputs = training_example(name)
        _reports[name] = optimize(model, OptimizeOptions(inputs=inputs)).report
    return _reports[name]


@pytest.mark.parametrize("name", EXAMPLES)
def test_outputs_identical_and_order_followed(name):
    report = report_for(name)
    assert report["outputs_match"]
    assert report["max_relative_difference"] <= 1e-5
    assert report["order_followed"], "ONNX Runtime did not execute the planned order"


@pytest.mark.parametrize("name", EXAMPLES)
def test_prediction_within_five_percent(name):
    error = report_for(name)["prediction_error"]
    assert abs(error["optimized"]) <= 0.05, error
    assert abs(error["original_optimizations_off"]) <= 0.05, error


@pytest.mark.parametrize("name", EXAMPLES)
def test_measured_peak_saving(name):
    ratios = report_for(name)["ratios"]
    assert ratios["peak_vs_default_session"] <= 0.6, ratios
    assert ratios["peak_vs_optimizations_off"] <= 0.75, ratios
