"""Memory and time of graphopt.annotate and of the whole graphopt.optimize on large training
graphs, next to the model's own one-step peak and to the old way of measuring sizes (every
intermediate exposed as a graph output in one run).

    python benchmarks/annotate_memory.py [--models bert:large,gpt2:large]
        [--modes step,annotate,optimize,all-outputs] [--limit-gib 8] [--cache DIR]

Per model, the training graph is built once in a subprocess (``real_zoo.CORPUS[name](size)``,
legacy export, ``build_training_graph(..., loss="cross_entropy")``, nodes named as optimize
names them) and cached in ``--cache`` with its inputs and labels. Then each mode runs in a
fresh subprocess, which loads the graph and inputs, notes its RSS ("before") and runs:

* ``step``: a session opened as optimize opens it (UNOPTIMIZED_SETTINGS, CPU arena off) and one
  ``session.run``: the model's own one-step peak (session and weights included, as in the others);
* ``annotate``: ``annotate(graph, inputs, UNOPTIMIZED_SETTINGS)`` as optimize calls it;
* ``all-outputs``: what annotate did before (every node output exposed in one run, then the
  two profiled runs), via ``measure_exposed(..., chunk=0)``;
* ``optimize``: ``optimize(graph, OptimizeOptions(inputs=..., threads=1))`` as the CLI runs it
  (annotate, plan, rewrite, verify, measure); it runs ONNX Runtime in children of its own
  (``graphopt.runtime.isolated``, the measuring workers), one at a time.

Peak RSS is the child's own peak (``VmHWM``, else ``ru_maxrss`` from ``wait4``), with
``MALLOC_MMAP_THRESHOLD_=65536`` so freed buffers go back to the OS; "with children" is the
largest sum of the RSS of the child and its descendants, sampled every 0.1 s (what the machine
must have free). A child whose RSS with its descendants passes ``--limit-gib`` is killed and
reported as over the limit (the old way on BERT-base 8x256 passed 12 GB). Prints a markdown
table: peak RSS, peak above "before", that over the step's, with children, and wall seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT,):
    if _path not in sys.path:
        sys.path.insert(0, _path)

MiB = 2 ** 20
MODES = ("step", "annotate", "optimize", "all-outputs")
DEFAULT_MODES = ("step", "annotate", "optimize")


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (from /proc/*/stat)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def _child(args: list[str], limit_bytes: int) -> dict:
    """Run this script with ``args`` in a child; its JSON line, peak RSS (its own, and with its
    descendants, sampled) and wall seconds."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    t0 = time.perf_counter()
    # stderr to a file: a chatty child must not block on a full pipe while we only poll it
    errors = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], env=env,
                            stdout=subprocess.PIPE, stderr=errors, text=True)
    killed = False
    tree_peak = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        tree = _rss_bytes(proc.pid) + sum(_rss_bytes(p) for p in _descendants(proc.pid))
        tree_peak = max(tree_peak, tree)
        if tree > limit_bytes:
            proc.kill()
            killed = True
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    out = proc.stdout.read()
    errors.seek(0)
    err = errors.read()
    errors.close()
    row = {"peak_rss_bytes": usage.ru_maxrss * 1024, "wall_seconds": wall, "killed_over_limit": killed}
    lines = [l for l in out.splitlines() if l.startswith("{")]
    if lines:
        row.update(json.loads(lines[-1]))
    elif not killed:
        row["error"] = err.strip().splitlines()[-3:] if err.strip() else f"exit status {status}"
    row["peak_rss_bytes"] = row.pop("own_peak_rss_bytes", None) or row["peak_rss_bytes"]
    row["tree_peak_rss_bytes"] = max(tree_peak, row["peak_rss_bytes"])
    return row


def _paths(cache: str, spec: str) -> tuple[str, str]:
    name, size = spec.split(":")
    return os.path.join(cache, f"{name}.{size}.train.onnx"), os.path.join(cache, f"{name}.{size}.npz")


def build(spec: str, cache: str) -> None:
    import numpy as np
    import onnx
    from graphopt_zoo import real_zoo
    from graphopt.builder.train_graph import build_training_graph
    from graphopt.ingest import name_nodes
    from graphopt.inputs import save_inputs
    name, size = spec.split(":")
    model_path, inputs_path = _paths(cache, spec)
    m = real_zoo.CORPUS[name](size)
    train = build_training_graph(real_zoo.export(m, "legacy"), loss="cross_entropy", class_axis=m.class_axis)
    name_nodes(train)
    onnx.save(train, model_path)
    feeds = {k: v.numpy() for k, v in m.inputs.items()}
    feeds["labels"] = m.labels.numpy().astype(np.int64)
    save_inputs(inputs_path, feeds)


def worker(mode: str, model_path: str, inputs_path: str) -> dict:
    import onnx
    from graphopt.annotate import _profile, annotate, measure_exposed
    from graphopt.inputs import load_inputs
    from graphopt.runtime.session import UNOPTIMIZED_SETTINGS, open_session
    model = onnx.load(model_path)
    inputs = load_inputs(inputs_path)
    known = {i.name for i in model.graph.input}
    inputs = {k: v for k, v in inputs.items() if k in known}
    before = _rss_bytes(os.getpid())
    t0 = time.perf_counter()
    row: dict = {"nodes": len(model.graph.node)}
    if mode == "step":
        sess = open_session(model, UNOPTIMIZED_SETTINGS, threads=1)
        sess.run(None, inputs)
    elif mode == "annotate":
        ann = annotate(model, inputs, UNOPTIMIZED_SETTINGS, threads=1)
        row["tensors"] = len(ann.tensor_bytes)
        row["order"] = len(ann.execution_order)
    elif mode == "optimize":
        from graphopt.optimize import OptimizeOptions, optimize
        report = optimize(model, OptimizeOptions(inputs=inputs, threads=1)).report.to_dict()
        row.update(outcome=report["outcome"], recompute_nodes=report["recompute_nodes"],
                   measured_peak_bytes={k: v["peak_bytes"] for k, v in report["measured"].items()})
    elif mode == "all-outputs":
        names = [o for n in model.graph.node for o in n.output if o]
        arrays = measure_exposed(model, inputs, names, threads=1, chunk=0)
        row["tensors"] = len(arrays)
        del arrays
        _profile(model, inputs, UNOPTIMIZED_SETTINGS, 2, ["CPUExecutionProvider"], 1)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    row["seconds"] = time.perf_counter() - t0
    row["before_rss_bytes"] = before
    from graphopt.runtime.rss import peak_rss_bytes
    hwm = peak_rss_bytes()
    if hwm:
        row["own_peak_rss_bytes"] = hwm
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bert:large,gpt2:large")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--limit-gib", type=float, default=8.0)
    p.add_argument("--cache", default="/tmp/graphopt-annotate-memory")
    p.add_argument("--json")
    p.add_argument("--worker", nargs=3, metavar=("MODE", "MODEL", "INPUTS"))
    p.add_argument("--build", metavar="NAME:SIZE")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)), flush=True)
        return 0
    if args.build:
        build(args.build, args.cache)
        print("{}")
        return 0
    os.makedirs(args.cache, exist_ok=True)
    limit = int(args.limit_gib * 2 ** 30)
    rows = []
    print("| model | mode | peak RSS MiB | above before MiB | / step's | with children MiB | seconds | note |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.models.split(","):
        model_path, inputs_path = _paths(args.cache, spec)
        if not (os.path.exists(model_path) and os.path.exists(inputs_path)):
            built = _child(["--build", spec, "--cache", args.cache], limit)
            if "error" in built:
                print(f"| {spec} | build | | | | | {built['error']} |", flush=True)
                continue
        step_above = None
        for mode in args.modes.split(","):
            r = _child(["--worker", mode, model_path, inputs_path], limit)
            r.update(model=spec, mode=mode)
            rows.append(r)
            above = r["peak_rss_bytes"] - r.get("before_rss_bytes", 0)
            if mode == "step" and not r["killed_over_limit"] and "error" not in r:
                step_above = above
            if r["killed_over_limit"]:
                note = f"killed: RSS passed {args.limit_gib:g} GiB"
            elif "outcome" in r:
                note = (f"outcome {r['outcome']}, {r['recompute_nodes']} recompute nodes; measured step peaks MiB: "
                        + ", ".join(f"{k} {v / MiB:.0f}" for k, v in r["measured_peak_bytes"].items()))
            else:
                note = r.get("error", f"{r.get('tensors', '')} tensors" if "tensors" in r else "")
            ratio = f"{above / step_above:.2f}" if step_above and mode != "step" and not r["killed_over_limit"] else ""
            secs = f"{r['seconds']:.1f}" if "seconds" in r else f">{r['wall_seconds']:.0f}"
            above_text = f"{above / MiB:.0f}" if "before_rss_bytes" in r else ""
            print(f"| {spec} | {mode} | {r['peak_rss_bytes'] / MiB:.0f} | "
                  f"{above_text} | {ratio} | {r['tree_peak_rss_bytes'] / MiB:.0f} | {secs} | {note} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
