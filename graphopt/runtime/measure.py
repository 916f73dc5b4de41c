"""Measure the peak memory and time of one training step in a fresh process (forked from the
warm parent of :mod:`graphopt.runtime.warm`, else a fresh interpreter).

See :mod:`graphopt.runtime._measure_worker` for exactly how the numbers are taken.
On CPU the resolution is the page (and what the allocator already holds): a graph
whose live set is a few KiB can measure 0. Measured on onnxruntime 1.32: a chain
keeping six 16 MiB outputs alive measured 96.02 MiB (expected 96) every time; a 50-170 MiB
MLP training step repeated within 0.1%.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field

from graphopt.errors import GraphoptError
from graphopt.runtime.rss import record_child
from graphopt.runtime.session import SessionSettings, default_providers
from graphopt.runtime.warm import WarmProcess, popen_module, run_module


class MeasurementError(GraphoptError):
    """The measuring subprocess failed or timed out (the message carries its stderr tail)."""


@dataclass
class Measurement:
    peak_bytes: int  # peak memory growth during one session.run (one training step)
    step_seconds: float  # median of `repeats` runs
    provider: str
    settings: SessionSettings
    method: str = ""  # how the peak was taken: "VmHWM", "ru_maxrss", "arena log", "nvml (...)"
    nvml_peak_bytes: int | None = None  # CUDA: the device's used memory before and after the step, by NVML


# Allocations of at least this many bytes come from mmap and go back to the OS when freed, so
# RSS follows what the runtime holds at page granularity. With 65536 (the threshold in
# shared/docs/ort-facts.md) the 4-64 KiB buffers (small weights' gradients, per-channel
# statistics) share glibc's heap, whose top cannot shrink past a live chunk: measured on the
# randwire example's plan (predicted 28.34 MiB), 30.23 MiB with 65536 and 28.39 MiB with 4096.
# That extra is heap fragmentation of glibc, not memory the runtime holds.
MMAP_THRESHOLD_BYTES = 4096
TRIM_THRESHOLD_BYTES = 131072


def malloc_env() -> dict[str, str]:
    """The allocator settings of a peak-measuring process (used for torch comparisons too)."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
            "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES)}


def _worker_env(plain_allocator: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        env.pop(key, None)
    if plain_allocator:
        return env
    # buffers come from mmap and go back to the OS when freed, so RSS follows what ORT
    # really holds; the low trim threshold returns freed heap top as well
    env.update(malloc_env())
    return env


def _run_worker(module: str, argv: list[str], env: dict[str, str], model_path, timeout_seconds: float,
                kind: str) -> dict:
    try:
        proc = run_module(module, argv, env=env, timeout=timeout_seconds)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise MeasurementError(
            f"measurement of {os.fspath(model_path)} timed out after {timeout_seconds} s; stderr tail:\n{tail[-3000:]}"
        ) from None
    if proc.returncode != 0:
        raise MeasurementError(
            f"measurement of {os.fspath(model_path)} failed (exit {proc.returncode}); stderr tail:\n"
            f"{proc.stderr[-3000:]}"
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    try:
        d = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise MeasurementError(
            f"measurement worker printed no result; stdout tail:\n{proc.stdout[-2000:]}\n"
            f"stderr tail:\n{proc.stderr[-2000:]}"
        ) from None
    record_child(kind, d)
    return d


def measure(
    model_path: str | os.PathLike,
    inputs_path: str | os.PathLike,
    settings: SessionSettings | None = None,
    *,
    provider: str | None = None,
    threads: int = 1,
    repeats: int = 7,
    timeout_seconds: float = 600,
    timing: bool = True,
) -> Measurement:
    """Peak memory growth and median step time of ``session.run`` on the saved model and
    inputs (:func:`graphopt.runtime.arrays.save_arrays`), in a fresh subprocess.

    ``settings=None`` uses the model's metadata, else the defaults. ``provider=None``
    picks CUDA when available, else CPU. ``timing=False``: the peak only (step_seconds NaN;
    `time_steps` times sessions against each other).
    """
    worker = "graphopt.runtime._measure_worker"
    cmd = [os.fspath(model_path), os.fspath(inputs_path), "--threads", str(int(threads))]
    if settings is not None:
        cmd += ["--settings", settings.to_json()]
    if provider is not None:
        cmd += ["--provider", provider]
    # Peak: in a process whose large buffers go back to the OS, so RSS follows what ORT holds.
    peak = _run_worker(worker, cmd + ["--repeats", "1"], _worker_env(), model_path, timeout_seconds, "measure")
    # Step time: in a process with the allocator as users have it (returning every buffer to
    # the OS makes each step pay page faults, which is not what a training loop sees) and ONNX
    # Runtime's CPU arena on, as a plain session has it (with it off, glibc keeps the heap of each
    # step's freed buffers: the transformer example's plan grew its process by 52 MiB over 6
    # steps with the arena, by up to 259 MiB without; by hand).
    if not timing:
        d = dict(peak, step_seconds=float("nan"))
    else:
        timed = _run_worker(worker, cmd + ["--repeats", str(int(repeats)), "--arena"], _worker_env(plain_allocator=True),
                            model_path, timeout_seconds, "measure")
        d = dict(peak, step_seconds=timed["step_seconds"])
    return Measurement(
        peak_bytes=int(d["peak_bytes"]),
        step_seconds=float(d["step_seconds"]),
        provider=str(d["provider"]),
        settings=SessionSettings.from_dict(d["settings"]),
        method=str(d.get("method", "")),
        nvml_peak_bytes=d.get("nvml_peak_bytes"),
    )


@dataclass
class StepTimes:
    """Step seconds of several sessions timed against each other, step by step in turn."""
    step_seconds: list[float]             # median per session, in the order given
    runs: list[list[float]]               # every timed run per session
    provider: str
    node_seconds: list[dict[str, float]]  # per profiled session: its median seconds per node
    profiled_runs: list[int] = field(default_factory=list)   # per profiled session: the runs those
                                                              # medians are over

    def ratio(self, i: int, j: int) -> float:
        """Session i's step time over session j's: the median of the rounds' ratios."""
        return float(statistics.median(a / b for a, b in zip(self.runs[i], self.runs[j])))


# the least rounds of `time_steps`, however long they take
MIN_ROUNDS = 3


def median_bounds(values: list[float], more: int) -> tuple[float, float] | None:
    """Where the median of `values` and `more` values not yet known can lie, whatever they are:
    (lowest, highest); None where it is unbounded (too few values)."""
    ordered = sorted(values)
    n = len(ordered) + more
    low_index, high_index = (n - 1) // 2 - more, n // 2
    if low_index < 0 or high_index >= len(ordered):
        return None
    return ordered[low_index], ordered[high_index]


def settled(runs: list[list[float]], band: float | None, rounds: int) -> bool:
    """Whether the rounds so far already give the answer: for every session's step over the
    first's, round by round (one session: its steps), the median over `rounds` rounds lies
    within ``band`` of the median so far, whatever the rounds left give (`median_bounds`: after
    3 of 5 rounds, all three within the band; after 4, the middle two). ``band=None``: never."""
    if band is None or not runs or not runs[0]:
        return False
    if len(runs) == 1:
        series = [runs[0]]
    else:
        series = [[a / b for a, b in zip(runs[k], runs[0])] for k in range(1, len(runs))]
    for values in series:
        middle = statistics.median(values)
        bounds = median_bounds(values, max(0, rounds - len(values)))
        if middle <= 0 or bounds is None or bounds[1] - bounds[0] > band * middle:
            return False
    return True


# Idle seconds before each timed step (`time_steps`, more than one thread): a step's ONNX Runtime
# intra-op threads spin for work for a while after it returns, and the next session's step ran
# beside them. Measured (the densenet example's training graph, its default session against
# itself with optimizations off, two threads, 9 rounds, three pairs of runs in turn): with no
# pause the two steps measured 88.2 / 94.3, 85.8 / 96.7 and 103.6 / 118.5 ms, with 50 ms 59.1 /
# 65.4, 62.5 / 71.1 and 81.5 / 95.5 ms; the medians of the rounds' ratios 1.09, 1.12, 1.11 against
# 1.09, 1.13, 1.17.
IDLE_BEFORE_STEP_SECONDS = 0.05


def time_steps(
    sessions: list[tuple[str | os.PathLike, SessionSettings | None]],
    inputs_path: str | os.PathLike,
    *,
    provider: str | None = None,
    threads: int = 1,
    rounds: int = 7,
    max_seconds: float = 30.0,
    profile: tuple[int, ...] = (),
    timeout_seconds: float = 900,
    settle: float | None = None,
) -> StepTimes:
    """Median step seconds of each (model path, settings; None: its metadata) session, timed in
    turn: each session in a fresh process of its own with the allocator as users have it
    (graphopt/runtime/_timing_worker.py), all opened at once, then rounds of one step of
    each in turn, each step after `IDLE_BEFORE_STEP_SECONDS` idle (at more than one thread, more
    than one session)
    (`rounds`, or fewer once the timed steps took `max_seconds`, at least
    MIN_ROUNDS, or fewer once more rounds could not move the medians of the ratios by more than
    ``settle``: `settled`). The sessions whose
    index is in ``profile`` first run a few steps with ONNX Runtime's profiler on, alone, each in
    turn (`_timing_worker`'s ``profile``), and give their median seconds per node too; the
    profiler is off for their timed steps (its cost, 1-3% of the step by hand on the mlp and
    resnet examples, moved the time model's predictions by about 10 points when a profiled step
    was taken for the step time)."""
    import subprocess
    import tempfile
    import threading

    profiled = sorted(set(profile))
    with tempfile.TemporaryDirectory(prefix="graphopt-timing-") as tmp:
        entries = [{"model": os.fspath(path), "settings": None if s is None else s.to_dict(),
                    "profile_prefix": os.path.join(tmp, f"profile{i}") if i in profiled else None}
                   for i, (path, s) in enumerate(sessions)]
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump({"inputs": os.fspath(inputs_path), "provider": provider, "threads": int(threads),
                       "sessions": entries}, f)
        workers: list[tuple[subprocess.Popen | WarmProcess, object]] = []
        timer = threading.Timer(timeout_seconds, lambda: [w.kill() for w, _ in workers])
        timer.start()

        def reply(k: int) -> str:
            worker, stderr = workers[k]
            line = worker.stdout.readline()
            if not line:
                worker.wait()
                stderr.seek(0)
                tail = stderr.read()[-3000:]
                what = "timed out" if not timer.is_alive() else f"failed (exit {worker.returncode})"
                raise MeasurementError(f"timing of {entries[k]['model']} {what}; stderr tail:\n{tail}")
            return line.strip()

        try:
            # all at once: a session's creation and its warm-up step are not timed
            for k in range(len(entries)):
                stderr = tempfile.TemporaryFile("w+", dir=tmp)
                workers.append((popen_module("graphopt.runtime._timing_worker", [spec_path, str(k)],
                                             env=_worker_env(plain_allocator=True), stderr=stderr), stderr))
            for k in range(len(entries)):
                if reply(k) != "ready":
                    raise MeasurementError(f"timing worker of {entries[k]['model']} did not start")
            for k in profiled:   # alone: nothing else of ours runs meanwhile
                workers[k][0].stdin.write("profile\n")
                workers[k][0].stdin.flush()
                if reply(k) != "profiled":
                    raise MeasurementError(f"timing worker of {entries[k]['model']} did not profile")
            runs: list[list[float]] = [[] for _ in entries]
            for r in range(max(MIN_ROUNDS, int(rounds))):
                for k, (worker, _) in enumerate(workers):
                    if threads > 1 and len(workers) > 1:   # alone, no other session's threads spin
                        time.sleep(IDLE_BEFORE_STEP_SECONDS)
                    worker.stdin.write("run\n")
                    worker.stdin.flush()
                    runs[k].append(float(reply(k)))
                if r + 1 >= MIN_ROUNDS and (sum(map(sum, runs)) > max_seconds or settled(runs, settle, int(rounds))):
                    break
            ends = []
            for k, (worker, _) in enumerate(workers):
                worker.stdin.write("end\n")
                worker.stdin.flush()
                ends.append(json.loads(reply(k)))
                record_child("timing", ends[-1])
        finally:
            timer.cancel()
            for worker, stderr in workers:
                if worker.poll() is None:
                    worker.kill()
                worker.wait()
                stderr.close()
    return StepTimes(step_seconds=[statistics.median(t) for t in runs], runs=runs,
                     provider=provider or default_providers()[0],
                     node_seconds=[ends[i].get("node_seconds", {}) for i in profiled],
                     profiled_runs=[int(ends[i].get("profiled_runs", 0)) for i in profiled])


@dataclass
class LimitRun:
    """Training steps of a model run under a memory limit (`run_within_limit`)."""
    limit_bytes: int
    fits: bool                      # every step ran under the cap
    error: str | None               # ONNX Runtime's refusal when it did not
    shortfall_bytes: int | None     # how much more the refused allocation needed than was left
    cap_bytes: int                  # ONNX Runtime's arena cap: the limit less what is held outside it
    outside_bytes: int              # held outside the arena: weights, inputs, state buffers
    rss_bytes: int | None = None    # CPU: the process's resident growth over the session and its steps
    step_seconds: float | None = None  # the median step after the first (None: did not fit)
    session_rss_bytes: int | None = None  # CPU: the growth once the session is open (weights, kernels)
    steps_rss_bytes: int | None = None    # CPU: what the steps added to the open session at their peak

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def run_within_limit(
    model_path: str | os.PathLike,
    inputs_path: str | os.PathLike,
    limit_bytes: int,
    settings: SessionSettings | None = None,
    *,
    provider: str | None = None,
    threads: int = 1,
    steps: int = 2,
    timeout_seconds: float = 600,
) -> LimitRun:
    """Run `steps` training steps of the saved model under `limit_bytes` in a fresh process
    (graphopt/runtime/_limit_worker.py, graphopt/runtime/limit.py), with glibc's allocator as
    a trainer's process has it: whether they fit."""
    cmd = [os.fspath(model_path), os.fspath(inputs_path),
           "--limit", str(int(limit_bytes)), "--threads", str(int(threads)), "--steps", str(int(steps))]
    if settings is not None:
        cmd += ["--settings", settings.to_json()]
    if provider is not None:
        cmd += ["--provider", provider]
    # the allocator as a trainer's process has it: ONNX Runtime's capped arena refused a step with
    # glibc's defaults that it ran with the peak-measuring settings (`malloc_env`): the fused-AdamW
    # U-Net example's plan for 0.5x its need ran under them, and `graphopt train` refused it
    d = _run_worker("graphopt.runtime._limit_worker", cmd, _worker_env(plain_allocator=True), model_path,
                    timeout_seconds, "limit")
    return LimitRun(limit_bytes=int(d["limit_bytes"]), fits=bool(d["fits"]), error=d.get("error"),
                    shortfall_bytes=d.get("shortfall_bytes"), cap_bytes=int(d["cap_bytes"]),
                    outside_bytes=int(d["outside_bytes"]), rss_bytes=d.get("rss_bytes"),
                    step_seconds=d.get("step_seconds"), session_rss_bytes=d.get("session_rss_bytes"),
                    steps_rss_bytes=d.get("steps_rss_bytes"))
