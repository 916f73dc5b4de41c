"""Warm measuring processes (graphopt/runtime/warm.py): a child forked from the warm parent
measures what a fresh interpreter measures, reports how it ended, is killed on a timeout, and
a dead parent is replaced. Oracle: the same worker run in a fresh interpreter
(GRAPHOPT_WARM_PROCESSES=0)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import onnx
import pytest

from graphopt.examples import training_example
from graphopt.inputs import save_inputs
from graphopt.runtime import warm
from graphopt.runtime.measure import measure, time_steps
from graphopt.runtime.rss import tracking_children


@pytest.fixture(scope="module")
def resnet_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("warm")
    model, inputs = training_example("resnet")
    onnx.save(model, folder / "model.onnx")
    save_inputs(folder / "inputs.npz", inputs)
    return str(folder / "model.onnx"), str(folder / "inputs.npz")


def _peaks(files, monkeypatch, switch: str, runs: int = 2) -> list[int]:
    monkeypatch.setenv(warm.SWITCH_ENV, switch)
    return [measure(*files, timing=False).peak_bytes for _ in range(runs)]


def test_a_warm_child_measures_the_peak_a_fresh_interpreter_measures(resnet_files, monkeypatch):
    # the peak-measuring child asks glibc for mmap'd buffers (MALLOC_MMAP_THRESHOLD_=4096): read
    # at start by a fresh interpreter, applied with mallopt in a forked one. Without it the
    # forked child measured 83-88 MB against 35 (resnet example).
    cold = _peaks(resnet_files, monkeypatch, "0")
    hot = _peaks(resnet_files, monkeypatch, "1")
    assert warm.warm_parent() is not None
    spread = max(cold) / min(cold)   # a fresh interpreter against itself
    assert max(hot) / min(cold) <= max(1.02, spread) and min(hot) / max(cold) >= 1 / max(1.02, spread), (cold, hot)


def test_a_warm_timing_child_times_and_profiles_its_session(resnet_files, monkeypatch):
    monkeypatch.setenv(warm.SWITCH_ENV, "1")
    model = onnx.load(resnet_files[0], load_external_data=False)
    times = time_steps([(resnet_files[0], None), (resnet_files[0], None)], resnet_files[1], rounds=3, profile=(1,))
    assert len(times.runs[0]) == len(times.runs[1]) >= 3 and all(t > 0 for t in times.step_seconds)
    (nodes,) = times.node_seconds
    assert set(nodes) == {n.name for n in model.graph.node}   # every node profiled, from the forked child


def test_a_warm_child_holds_what_a_fresh_interpreter_holds(resnet_files, monkeypatch):
    # graphopt's own memory is stated from its children's reports: the RSS after the imports and
    # the growth over one session. Fork maps the parent's private memory but not its file pages
    # (the libraries' code): unmapped, they were faulted in during the session and counted as
    # its own (46.5 against 38.3 MiB on an MLP step).
    seen = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(warm.SWITCH_ENV, switch)
        with tracking_children() as peaks:
            time_steps([(resnet_files[0], None)], resnet_files[1], rounds=3)
        seen[switch] = (peaks.largest_session_bytes, peaks.baseline_bytes)
    (cold_session, cold_start), (hot_session, hot_start) = seen["0"], seen["1"]
    assert abs(hot_session / cold_session - 1) <= 0.05, seen
    assert abs(hot_start / cold_start - 1) <= 0.05, seen


def test_a_warm_child_reports_what_a_fresh_interpreter_reports(monkeypatch):
    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(warm.SWITCH_ENV, switch)
        failed = warm.run_module("graphopt.tasks", ["annotate"], input="not json")
        answered = warm.run_module("graphopt.tasks", ["no-such-task"], input="{}")
        results[switch] = (failed.returncode, failed.stderr.strip().splitlines()[-1], answered.returncode,
                           json.loads(answered.stdout.splitlines()[-1])["error"]["type"])
    assert results["0"] == results["1"], results
    assert results["1"][0] == 1 and "JSONDecodeError" in results["1"][1], results


def test_a_warm_child_over_its_time_is_killed(tmp_path, monkeypatch):
    monkeypatch.setenv(warm.SWITCH_ENV, "1")
    fifo = tmp_path / "spec"
    os.mkfifo(fifo)   # opening it blocks: the child never finishes
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run_module("graphopt.runtime._timing_worker", [str(fifo), "0"], timeout=1.0)
    child = warm.popen_module("graphopt.runtime._timing_worker", [str(fifo), "0"])
    assert child.poll() is None
    child.kill()
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert not os.path.exists(f"/proc/{child.pid}") or open(f"/proc/{child.pid}/stat").read().split()[2] == "Z"


def test_a_dead_warm_parent_is_replaced(monkeypatch):
    monkeypatch.setenv(warm.SWITCH_ENV, "1")
    first = warm.warm_parent()
    first.proc.kill()
    first.proc.wait()
    done = warm.run_module("graphopt.tasks", ["no-such-task"], input="{}")
    assert done.returncode == 0 and "error" in json.loads(done.stdout.splitlines()[-1])
    second = warm.warm_parent()
    assert second is not first and second.proc.pid != first.proc.pid and second.alive()


def test_a_caller_that_ends_leaves_no_warm_process_behind():
    script = ("from graphopt.runtime import warm\n"
              "assert warm.warm_parent() is not None\n"
              "print(warm.run_module('graphopt.tasks', ['x'], input='{}').returncode)\n")
    env = dict(os.environ, **{warm.SWITCH_ENV: "1"})
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    out, _ = caller.communicate(timeout=120)
    assert caller.returncode == 0 and out.strip() == "0"
    with pytest.raises(ProcessLookupError):   # the group: the caller, its warm parent, their children
        os.killpg(caller.pid, 0)


def test_a_warm_childs_cpu_is_counted(resnet_files, monkeypatch):
    # the report's stages count the CPU of the children that did ONNX Runtime's work; a warm
    # child is the warm parent's, so its CPU comes back with its exit status (wait4's rusage)
    monkeypatch.setenv(warm.SWITCH_ENV, "0")
    before = os.times()
    measure(*resnet_files, timing=False)
    after = os.times()
    cold = after.children_user + after.children_system - before.children_user - before.children_system
    monkeypatch.setenv(warm.SWITCH_ENV, "1")
    warm.warm_parent()
    before_warm = warm.children_cpu_seconds()
    measure(*resnet_files, timing=False)
    hot = warm.children_cpu_seconds() - before_warm
    assert 0.4 * cold <= hot <= 1.5 * cold, (cold, hot)
