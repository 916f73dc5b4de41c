"""runtime/profile's reading of ONNX Runtime's profiles, on profiles written here event by event
with figures chosen so that each rule of the docstrings gives its own answer: which events are
model runs and kernels, the line-by-line reading and its fallback to reading the file whole, the
last run's kernels (its span inclusive at both ends), each node's order and seconds (several
kernels of a node summed), and each node's median over the runs after the warm-up. Real ONNX
Runtime profiles are read in tests/test_runtime.py and tests/test_annotate.py (the selection of
tests/mutation.py runs those two as well); these take milliseconds."""
from __future__ import annotations

import json

import pytest

from graphopt.runtime.profile import (
    kernel_events,
    last_run_order_and_seconds,
    median_node_seconds,
    order_and_seconds,
    profile_events,
)


def run(ts: int, dur: int | None = None) -> dict:
    e = {"cat": "Session", "name": "model_run", "ts": ts, "pid": 1, "args": {}}
    if dur is not None:
        e["dur"] = dur
    return e


def kernel(name: str, ts: int, dur: int | None = None, **args) -> dict:
    e = {"cat": "Node", "name": name + "_kernel_time", "ts": ts, "pid": 1, "args": dict(args, op_name="Relu")}
    if dur is not None:
        e["dur"] = dur
    return e


# events of neither kind: the session's other events, a node's fences, a kernel event of
# another category, a model_run of another category, an event without category or name
NOISE = [{"cat": "Session", "name": "session_initialization", "ts": 0, "dur": 5},
         {"cat": "Node", "name": "a_fence_before", "ts": 11, "dur": 0},
         {"cat": "Session", "name": "a_kernel_time", "ts": 12, "dur": 3},
         {"cat": "Node", "name": "model_run", "ts": 13, "dur": 50},
         {"cat": "Node", "ts": 14, "dur": 1},
         {"name": "b_kernel_time", "ts": 15, "dur": 1}]


def write_as_ort(path, events: list[dict]) -> str:
    """ONNX Runtime's layout: "[", one event a line ending in ",", "]" (the last without ",")."""
    lines = ["["] + [json.dumps(e) + "," for e in events[:-1]] + [json.dumps(events[-1]), "]", ""]
    path.write_text("\n".join(lines))
    return str(path)


def test_profile_events_keeps_model_runs_and_kernels_in_the_files_order(tmp_path):
    events = [run(10, 100), kernel("a", 20, 7, shape=[1]), *NOISE, kernel("b", 15), run(200, 50)]
    path = write_as_ort(tmp_path / "p.json", events)
    runs, kernels = profile_events(path)
    assert runs == [events[0], events[-1]]
    assert kernels == [events[1], events[-2]]
    _, light = profile_events(path, keep_args=False)
    assert light == [{"name": "a_kernel_time", "ts": 20, "dur": 7}, {"name": "b_kernel_time", "ts": 15, "dur": 0}]


@pytest.mark.parametrize("layout", ["one_line", "indented", "two_events_a_line"])
def test_a_profile_laid_out_otherwise_is_read_whole(tmp_path, layout):
    """Not one event a line: the events read so far are dropped and the file read whole, the same
    events as from ONNX Runtime's layout (no event twice)."""
    events = [run(10, 100), kernel("a", 20, 7), *NOISE, kernel("b", 30, 2), run(200, 50), kernel("c", 210, 1)]
    if layout == "one_line":
        text = json.dumps(events)
    elif layout == "indented":
        text = json.dumps(events, indent=2)
    else:                                   # one event a line at first, then two on one line
        text = "[\n" + ",\n".join(json.dumps(e) for e in events[:3]) + ",\n" + \
               json.dumps(events[3]) + ", " + json.dumps(events[4]) + ",\n" + \
               ",\n".join(json.dumps(e) for e in events[5:]) + "\n]\n"
    path = tmp_path / "p.json"
    path.write_text(text)
    runs, kernels = profile_events(str(path))
    assert runs == [e for e in events if e.get("name") == "model_run" and e.get("cat") == "Session"]
    assert kernels == [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]


def test_kernel_events_are_the_last_runs_in_time_order_its_span_inclusive(tmp_path):
    events = [run(500, 100),                     # the last run, written first
              kernel("early", 499, 1),           # before its span
              kernel("late", 601, 1),            # after it
              kernel("end", 600, 3),             # at its end
              kernel("mid", 550, 2),
              kernel("start", 500, 4),           # at its start
              run(100, 300), kernel("old", 200, 9)]
    got = kernel_events(write_as_ort(tmp_path / "p.json", events))
    assert [e["name"] for e in got] == ["start_kernel_time", "mid_kernel_time", "end_kernel_time"]
    assert got[0] == events[5]                   # with its arguments


def test_kernel_events_of_a_run_without_duration_and_of_no_run(tmp_path):
    # a model_run without "dur": its span is its start alone
    events = [run(100), kernel("a", 100, 1), kernel("b", 101, 1), kernel("c", 99, 1)]
    assert [e["name"] for e in kernel_events(write_as_ort(tmp_path / "p.json", events))] == ["a_kernel_time"]
    # no model_run: every kernel, in time order
    events = [kernel("b", 30, 1), kernel("a", 10, 1), kernel("c", 20, 1)]
    got = kernel_events(write_as_ort(tmp_path / "q.json", events))
    assert [e["name"] for e in got] == ["a_kernel_time", "c_kernel_time", "b_kernel_time"]


def test_order_and_seconds_sum_a_nodes_kernels_in_order_of_first_run():
    kernels = [kernel("b", 1, 30), kernel("a", 2, 5), kernel("b", 3, 12), kernel("c", 4), kernel("a_kernel_time", 5, 1)]
    order, seconds = order_and_seconds(kernels)
    assert order == ["b", "a", "c", "a_kernel_time"]
    assert seconds == {"b": pytest.approx(42e-6, rel=1e-12), "a": pytest.approx(5e-6, rel=1e-12), "c": 0.0,
                       "a_kernel_time": pytest.approx(1e-6, rel=1e-12)}
    assert order_and_seconds([]) == ([], {})


def test_last_run_order_and_seconds(tmp_path):
    events = [run(0, 50), kernel("x", 10, 1000), run(100, 50), kernel("y", 120, 7), kernel("x", 110, 3),
              kernel("y", 130, 4)]
    order, seconds = last_run_order_and_seconds(write_as_ort(tmp_path / "p.json", events))
    assert order == ["x", "y"]
    assert seconds == {"x": pytest.approx(3e-6, rel=1e-12), "y": pytest.approx(11e-6, rel=1e-12)}


def test_median_node_seconds_over_the_runs_after_the_warm_up(tmp_path):
    """Four runs written out of time order; the first in time (the warm-up, x at 1000 us) is
    skipped. Per run: x 10, 40 (two kernels of 15 and 25), 30 -> median 30 us; y in two runs
    only, 8 and 2 -> 5 us (the mean of the two middle values); z only in the warm-up: absent."""
    events = [run(300, 50), kernel("x", 310, 30),
              run(0, 50), kernel("x", 10, 1000), kernel("z", 20, 9),
              run(100, 50), kernel("x", 110, 10), kernel("y", 120, 8),
              run(200, 50), kernel("x", 210, 15), kernel("y", 220, 2), kernel("x", 250, 25),
              kernel("x", 251, 500)]             # just after the third run: in none
    path = write_as_ort(tmp_path / "p.json", events)
    seconds, runs = median_node_seconds(path)
    assert runs == 3
    assert seconds == {"x": pytest.approx(30e-6, rel=1e-12), "y": pytest.approx(5e-6, rel=1e-12)}
    seconds, runs = median_node_seconds(path, skip_runs=0)
    assert runs == 4
    # x: 1000, 10, 40, 30 -> 35; y: 8, 2 -> 5; z: 9
    assert seconds == {"x": pytest.approx(35e-6, rel=1e-12), "y": pytest.approx(5e-6, rel=1e-12),
                       "z": pytest.approx(9e-6, rel=1e-12)}
    seconds, runs = median_node_seconds(path, skip_runs=3)
    assert (seconds, runs) == ({"x": pytest.approx(30e-6, rel=1e-12)}, 1)


def test_median_node_seconds_of_runs_and_kernels_without_duration(tmp_path):
    events = [run(0, 10), kernel("x", 5, 4), run(100), kernel("x", 100), kernel("y", 100, 6), kernel("y", 101, 6)]
    seconds, runs = median_node_seconds(write_as_ort(tmp_path / "p.json", events), skip_runs=0)
    # the second run's span is its start alone: x (no duration: 0) and the first y are in it
    assert runs == 2
    assert seconds == {"x": pytest.approx(2e-6, rel=1e-12), "y": pytest.approx(6e-6, rel=1e-12)}


def test_a_profile_is_read_one_event_at_a_time(tmp_path):
    """The docstrings' reason for reading line by line: a profile of large arguments (here 4,000
    kernel events of 2 KB each, in ONNX Runtime's layout, and a blank line at its end) read with
    `keep_args=False`, and by `median_node_seconds`, allocates far less than the file (measured
    with tracemalloc: under a quarter of it); read whole it allocates more than the file."""
    import tracemalloc
    events = [run(0, 10 ** 9)] + [kernel(f"n{i}", 1 + i, 3, note="x" * 2000) for i in range(4000)]
    path = write_as_ort(tmp_path / "p.json", events)
    with open(path, "a") as f:
        f.write("\n")
    size = (tmp_path / "p.json").stat().st_size

    def peak(read) -> int:
        tracemalloc.start()
        try:
            read()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def whole():
        with open(path) as f:
            json.load(f)
    assert peak(whole) > size
    assert peak(lambda: profile_events(path, keep_args=False)) < size / 4
    assert peak(lambda: median_node_seconds(path)) < size / 4
    _, kernels = profile_events(path, keep_args=False)
    assert len(kernels) == 4000 and kernels[-1] == {"name": "n3999_kernel_time", "ts": 4000, "dur": 3}
