"""ONNX Runtime's profile files read: which nodes ran, in what order, for how long.

A profile holds every node's arguments for every run; it is read one event at a time (see
`profile_events`)."""
from __future__ import annotations

import json

import numpy as np

KERNEL_SUFFIX = "_kernel_time"      # a node's kernel event is named NODE + this


def profile_events(path: str, *, keep_args: bool = True) -> tuple[list[dict], list[dict]]:
    """(model_run events, kernel events) of the ONNX Runtime profile at ``path``, read one event
    at a time: a profile holds every node's arguments for every run (shapes, thread statistics),
    tens of MiB on a graph of thousands of nodes, and read whole it made the process that read it
    larger than the session it profiled. ``keep_args=False`` drops the kernels' arguments."""
    runs: list[dict] = []
    kernels: list[dict] = []

    def take(e: dict) -> None:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            runs.append(e)
        elif e.get("cat") == "Node" and str(e.get("name", "")).endswith(KERNEL_SUFFIX):
            kernels.append(e if keep_args else {"name": e["name"], "ts": e["ts"], "dur": e.get("dur", 0)})
    with open(path) as f:
        for line in f:   # ONNX Runtime writes "[", then one event per line ending in ",", then "]"
            line = line.strip().rstrip(",")
            if line in ("", "[", "]"):
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = None
            if not isinstance(event, dict):   # laid out otherwise: read whole
                runs.clear()
                kernels.clear()
                f.seek(0)
                for e in json.load(f):
                    take(e)
                break
            take(event)
    return runs, kernels


def kernel_events(path: str) -> list[dict]:
    """The kernel events of the last ``model_run`` in the profile at ``path``, in time order."""
    runs, kernels = profile_events(path)
    if runs:
        last = max(runs, key=lambda e: e["ts"])
        lo, hi = last["ts"], last["ts"] + last.get("dur", 0)
        kernels = [e for e in kernels if lo <= e["ts"] <= hi]
    kernels.sort(key=lambda e: e["ts"])
    return kernels


def order_and_seconds(kernels: list[dict]) -> tuple[list[str], dict[str, float]]:
    order: list[str] = []
    seconds: dict[str, float] = {}
    for e in kernels:
        name = e["name"][: -len(KERNEL_SUFFIX)]
        if name not in seconds:
            order.append(name)
            seconds[name] = 0.0
        seconds[name] += float(e.get("dur", 0)) * 1e-6
    return order, seconds


def median_node_seconds(path: str, skip_runs: int = 1) -> tuple[dict[str, float], int]:
    """Each node's median seconds over the ``model_run``s in the profile at ``path`` after the
    first ``skip_runs`` (warm-up), and how many runs that was; a node that runs several kernels
    sums them per run. One profiled run's kernel times vary by 10-40% on a shared machine; the
    median of several does not."""
    runs, kernels = profile_events(path, keep_args=False)
    runs = sorted(runs, key=lambda e: e["ts"])[skip_runs:]
    kernels.sort(key=lambda e: e["ts"])
    per_node: dict[str, list[float]] = {}
    for run in runs:
        lo, hi = run["ts"], run["ts"] + run.get("dur", 0)
        seconds: dict[str, float] = {}
        for e in kernels:
            if lo <= e["ts"] <= hi:
                name = e["name"][: -len(KERNEL_SUFFIX)]
                seconds[name] = seconds.get(name, 0.0) + float(e.get("dur", 0)) * 1e-6
        for name, value in seconds.items():
            per_node.setdefault(name, []).append(value)
    return {name: float(np.median(values)) for name, values in per_node.items()}, len(runs)


def last_run_order_and_seconds(path: str) -> tuple[list[str], dict[str, float]]:
    """Execution order and seconds per node of the last run in the profile at ``path``."""
    return order_and_seconds(kernel_events(path))
