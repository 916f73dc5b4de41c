"""Child runs that time nothing run in the background while optimize goes on (runtime/overlap.py),
and never beside a run that times a step."""
from __future__ import annotations

import threading
import time

import pytest

import graphopt.pipeline as pipeline
from graphopt.examples import training_example
from graphopt.optimize import OptimizeOptions, optimize
from graphopt.runtime.overlap import Overlap
from graphopt.runtime.rss import record_child, tracking_children


def test_overlap_runs_in_the_background_keeps_errors_and_the_callers_context():
    overlap = Overlap()
    started = threading.Event()
    release = threading.Event()

    def slow():
        started.set()
        release.wait(10)
        return threading.current_thread().name

    with tracking_children() as children:
        future = overlap.start(slow)
        assert started.wait(10) and not future.done()        # the caller went on meanwhile
        failing = overlap.start(lambda: 1 / 0)
        recorded = overlap.start(record_child, "measure", {"process_peak_bytes": 123 << 20})
        release.set()
        overlap.quiet()
        assert future.done() and failing.done() and recorded.done()
        assert future.result() != threading.current_thread().name
        with pytest.raises(ZeroDivisionError):
            failing.result()
    # what a background run reported of its child is the caller's (its context was copied)
    assert children.by_kind == {"measure": 123 << 20}
    overlap.close()


def test_a_disabled_overlap_runs_each_at_once_in_the_callers_thread():
    overlap = Overlap(enabled=False)
    future = overlap.start(lambda: threading.current_thread().name)
    assert future.done() and future.result() == threading.current_thread().name
    with pytest.raises(ValueError):
        overlap.start(int, "not a number").result()


def test_close_drops_what_has_not_begun_and_waits_for_what_runs():
    overlap = Overlap()
    ran = []
    first = overlap.start(lambda: (time.sleep(0.3), ran.append(1)))
    second = overlap.start(ran.append, 2)
    time.sleep(0.05)
    overlap.close()
    assert first.done() and ran[:1] == [1]
    assert second.cancelled() or ran == [1, 2]


def test_optimize_measures_peaks_in_the_background_and_never_beside_a_timing(monkeypatch):
    """A real optimize of the MLP example with its child runs logged: the originals' and the
    plan's peaks run while the pipeline goes on (graph optimizations and annotation; the plan's
    verification), no timing of steps (`time_steps`) begins before they are done, and the
    report's peaks are those runs' peaks."""
    log: list[tuple[str, float, float, str]] = []
    lock = threading.Lock()

    def logged(name, fn):
        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    log.append((name, begin, time.perf_counter(), threading.current_thread().name))
        return wrapper
    peaks = []

    def measure(*args, **kwargs):
        m = real_measure(*args, **kwargs)
        peaks.append(m.peak_bytes)
        return m
    real_measure = pipeline.measure
    monkeypatch.setattr(pipeline, "measure", logged("peak", measure))
    monkeypatch.setattr(pipeline, "time_steps", logged("timing", pipeline.time_steps))
    monkeypatch.setattr(pipeline, "run_task", logged("task", pipeline.run_task))
    model, inputs = training_example("mlp")
    report = optimize(model, OptimizeOptions(inputs=inputs)).report
    background = [e for e in log if e[3].startswith("graphopt-overlap")]
    timings = [e for e in log if e[0] == "timing"]
    assert len(background) == 3 and all(e[0] == "peak" for e in background), log
    # the baseline and the returned plan at least (a loaded machine can time a retry, or the
    # original with optimizations off, too): none of them beside a background peak
    assert len(timings) >= 2, log
    for _, begin, end, _ in background:
        assert all(end <= t_begin or t_end <= begin for _, t_begin, t_end, _ in timings), log
    # the first original's peak and the plan's overlapped work of the caller's thread (a task:
    # graph optimizations, annotation; the plan's verification)
    tasks = [e for e in log if e[0] == "task" and not e[3].startswith("graphopt-overlap")]
    background.sort(key=lambda e: e[1])
    for _, b, e, _ in (background[0], background[-1]):
        assert any(b < t_end and t_begin < e for _, t_begin, t_end, _ in tasks), log
    # the peaks measured are the originals' two and each plan's (a loaded machine can retry a
    # plan over the time limit: one more), and the report's are those
    measured = report.measured
    assert sorted(peaks) == sorted([measured.original_default_session.peak_bytes,
                                    measured.original_optimizations_off.peak_bytes]
                                   + [p.measured_peak_bytes for p in report.plans_measured])
    assert measured.optimized.peak_bytes in peaks
