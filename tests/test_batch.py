"""`graphopt batch`: a zoo of real models, in worker processes, on three real servers (one
killed mid-batch) and on a two-node Ray cluster (one node killed mid-model), resumable, with
its summary files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from graphopt.examples import training_example
from graphopt.optimize import save_model
from graphopt_zoo.batch_zoo import forward_classifier, write_batch_zoo
from batch_checks import batch_models, check_batch_outputs, unmeasured_summary
from service_process import ServerProcess


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    """Ten models: the six example training graphs and four forward classifiers."""
    return write_batch_zoo(tmp_path_factory.mktemp("zoo"))


def _batch(*args, check=True, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "graphopt.cli", "batch", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_batch_in_worker_processes_is_resumable_and_survives_a_bad_model(zoo, tmp_path):
    zoo_with_bad = tmp_path / "zoo"
    subprocess.run(["cp", "-r", str(zoo), str(zoo_with_bad)], check=True)
    (zoo_with_bad / "broken.onnx").write_bytes(b"not a model at all")
    out = tmp_path / "out"
    proc = _batch(zoo_with_bad, "-o", out, "--jobs", "2", check=False)
    assert proc.returncode == 1 and "broken.onnx" in proc.stderr, proc.stderr
    assert "10 optimized, 0 done before, 1 failed" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == ["broken.onnx"] and summary["ok"] == 10
    (zoo_with_bad / "broken.onnx").unlink()
    stamps = {name: (out / name[:-5] / "report.json").stat().st_mtime_ns for name in batch_models(zoo_with_bad)}
    again = _batch(zoo_with_bad, "-o", out, "--jobs", "2")
    assert "0 optimized, 10 done before, 0 failed" in again.stdout
    assert {name: (out / name[:-5] / "report.json").stat().st_mtime_ns for name in stamps} == stamps
    check_batch_outputs(zoo_with_bad, out)


def test_batch_on_three_servers_survives_one_dying(zoo, tmp_path):
    servers = [ServerProcess(tmp_path / f"server{k}", "--workers", "1") for k in range(3)]
    out = tmp_path / "out"
    try:
        targets = ",".join(s.target for s in servers)
        batch = subprocess.Popen([sys.executable, "-m", "graphopt.cli", "batch", str(zoo), "-o", str(out),
                                  "--jobs", "3", "--server", targets],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        victim = servers[1]
        victim.wait_for_log("call started", timeout_seconds=120)
        os.killpg(victim.proc.pid, signal.SIGKILL)        # the server and its worker, mid-call
        victim.proc.wait()
        stdout, stderr = batch.communicate(timeout=600)
        assert batch.returncode == 0, stderr
        assert "10 optimized" in stdout
        reports = check_batch_outputs(zoo, out)
        assert len(reports) == 10
        # every model optimized exactly once: one successful Optimize call per model, in all logs
        # (each server logs a call's end on the call's thread: waited for, not read at once)
        deadline = time.monotonic() + 30
        while sum(len(s.entries("call finished", method="Optimize", status="OK")) for s in servers) < 10:
            assert time.monotonic() < deadline, "fewer than 10 successful Optimize calls in the logs"
            time.sleep(0.1)
        finished = [e for s in servers for e in s.entries("call finished", method="Optimize")]
        assert sum(e["status"] == "OK" for e in finished) == 10, finished
        victim_started = [e for e in victim.logs() if e.get("message") == "call started"]
        victim_finished = [e for e in victim.logs() if e.get("message") == "call finished"]
        assert len(victim_started) > len(victim_finished)     # it died with a call in flight
        assert "sending the call again" in stderr            # ... which went to another server
        # a rerun against the two left does no work
        calls_before = sum(len([e for e in s.logs() if e.get("message") == "call started"]) for s in servers)
        rest = ",".join(s.target for s in (servers[0], servers[2]))
        again = _batch(zoo, "-o", out, "--server", rest)
        assert "0 optimized, 10 done before, 0 failed" in again.stdout
        time.sleep(0.5)
        assert sum(len([e for e in s.logs() if e.get("message") == "call started"]) for s in servers) == calls_before
    finally:
        for server in servers:
            server.kill()


def test_batch_with_sweep_plots_each_front(tmp_path):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    model, _ = training_example("resnet", small=True)
    save_model(model, zoo / "resnet.onnx")
    out = tmp_path / "out"
    _batch(zoo, "-o", out, "--sweep", "2")
    report = json.loads((out / "resnet" / "report.json").read_text())
    least = next(r for r in report["rows"] if r["label"] == "least-peak")
    row = json.loads((out / "summary.json").read_text())["models"][0]
    assert row["peak_after_bytes"] == least["measured_peak_bytes"] and row["nodes"] == len(model.graph.node)
    assert (out / "resnet" / "optimized.sweep.csv").is_file()
    assert (out / "fronts.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _batch(zoo, "-o", out, "--sweep", "2", "--server", "127.0.0.1:1", check=False).returncode == 2


def test_batch_passes_objective_and_max_overhead_to_each_model(tmp_path):
    """In worker processes and on a server: each model's report has the objective asked for, the
    summary shows it beside the step time ratio; a bad combination stops the batch before any model."""
    from graphopt.batch import BatchOptions, content_key
    from graphopt.options import OptimizeOptions
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    model, _ = training_example("mlp", small=True)
    save_model(model, zoo / "mlp.onnx")
    onnx.save(forward_classifier(0), zoo / "classifier.onnx")

    out = tmp_path / "local"
    _batch(zoo, "-o", out, "--no-measure", "--max-overhead", "0.3")
    summary = {row["model"]: row for row in json.loads((out / "summary.json").read_text())["models"]}
    markdown = (out / "summary.md").read_text()
    for name in ("mlp.onnx", "classifier.onnx"):
        objective = json.loads((out / name[:-5] / "report.json").read_text())["objective"]
        assert objective["name"] == "bounded-overhead" and objective["max_overhead"] == 0.3
        assert summary[name]["objective"] == "bounded-overhead" and summary[name]["max_overhead"] == 0.3
    assert markdown.count("(limit 1.30x) | bounded-overhead |") == 2, markdown
    # each model's timeline beside its report, its peak's kind in one word, linked from the summary
    from graphopt.batch_summary import PEAK_WORDS
    for name in ("mlp", "classifier"):
        assert (out / name / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        kind = summary[f"{name}.onnx"]["peak_kind"]
        assert kind in PEAK_WORDS.values()
        assert f"[{kind}]({name}/timeline.png)" in markdown

    server = ServerProcess(tmp_path / "server", "--workers", "1")
    try:
        remote = tmp_path / "remote"
        _batch(zoo, "-o", remote, "--no-measure", "--objective", "least-peak", "--server", server.target)
        for name in ("mlp", "classifier"):
            objective = json.loads((remote / name / "report.json").read_text())["objective"]
            assert objective["name"] == "least-peak" and objective.get("max_overhead") is None
    finally:
        server.kill()

    refused = _batch(zoo, "-o", tmp_path / "refused", "--objective", "least-peak", "--max-overhead", "0.3",
                     check=False)
    assert refused.returncode == 2 and "least-peak takes no max overhead" in refused.stderr, refused.stderr
    assert not (tmp_path / "refused").exists()
    # the options are part of each job's key: another objective is another job, not "done before"
    keys = {content_key(zoo / "mlp.onnx", BatchOptions(optimize=OptimizeOptions(**options)))
            for options in ({}, {"objective": "least-peak"}, {"max_overhead": 0.3}, {"max_overhead": 0.5})}
    assert len(keys) == 4


def _ray_optimize_processes(root_pid: int) -> list[tuple[int, str]]:
    """(pid, model path) of each `graphopt optimize` run below `root_pid` (a Ray node's raylet)."""
    found, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
        if b"graphopt.cli" in argv and b"optimize" in argv:
            found.append((pid, argv[argv.index(b"optimize") + 1].decode()))
    return found


def test_batch_on_a_two_node_ray_cluster_survives_losing_a_node(zoo, tmp_path):
    """The zoo on a local Ray cluster on this machine (a head and a second node, one CPU each), the
    second node killed while it runs a model: every model optimized once, the lost one again
    on the head; the summary as the local batch's; a rerun does nothing."""
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    out = tmp_path / "out"
    batch = None
    try:
        second = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        head_id, second_id = cluster.head_node.node_id, second.node_id
        raylet = second.all_processes["raylet"][0].process.pid
        batch = subprocess.Popen([sys.executable, "-m", "graphopt.cli", "batch", str(zoo), "-o", str(out),
                                  "--jobs", "2", "--ray", cluster.address],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not (running := _ray_optimize_processes(raylet)):
            assert batch.poll() is None and time.monotonic() < deadline, "no model ever ran on the second node"
            time.sleep(0.05)
        lost = running[0][1]
        cluster.remove_node(second, allow_graceful=False)      # its raylet and workers, mid-model
        stdout, stderr = batch.communicate(timeout=900)
        assert batch.returncode == 0, stderr
        assert "10 optimized, 0 done before, 0 failed" in stdout
        reports = check_batch_outputs(zoo, out)
        nodes = {name: r["graphopt_batch"]["ray_node_id"] for name, r in reports.items()}
        assert set(nodes.values()) <= {head_id, second_id}
        from graphopt.batch_ray import TASK_FOLDER_PREFIX, task_folder_name
        lost_name = next(name for name in reports
                         if f"/{TASK_FOLDER_PREFIX}{task_folder_name(name)}-" in lost)
        assert nodes[lost_name] == head_id, (lost_name, nodes)        # run again, on the node left
        assert len({r["graphopt_batch"]["ray_task_id"] for r in reports.values()}) == 10
        # each model's timeline beside its report, drawn on the node that ran it
        for name in reports:
            assert (out / name[:-5] / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        # the same summary as the local batch's on the same zoo
        local = tmp_path / "local"
        _batch(zoo, "-o", local, "--jobs", "2")
        ours, theirs = unmeasured_summary(out), unmeasured_summary(local)
        assert sorted(ours) == batch_models(zoo) and ours == theirs
        # resumable: a rerun on the cluster finds every model done
        stamps = {n: (out / n[:-5] / "report.json").stat().st_mtime_ns for n in batch_models(zoo)}
        again = _batch(zoo, "-o", out, "--ray", cluster.address)
        assert "0 optimized, 10 done before, 0 failed" in again.stdout
        assert {n: (out / n[:-5] / "report.json").stat().st_mtime_ns for n in stamps} == stamps
    finally:
        if batch is not None and batch.poll() is None:
            batch.kill()
        cluster.shutdown()
