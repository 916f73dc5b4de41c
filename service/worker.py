"""A worker process: runs the graphopt library on jobs sent by the server, one at a time.

Protocol: one JSON object per line. The server writes jobs to stdin (the options as
`OptimizeOptions.to_dict()`); the worker answers on its original stdout with
{"progress": stage, "fraction": f} events, then one {"result": {...}} (an optimize's report as
`Report.to_dict()`) or {"error": class name, "message": ...}. Anything else the libraries
print goes to stderr. The server kills the whole process group to stop a job.

The worker dies with its server: a thread reads the jobs from stdin, and its end (nobody holds
the pipe's write end any more: the server is gone, even killed with SIGKILL) kills the worker's
process group, the measuring processes of a job in progress included.
"""
from __future__ import annotations

import errno
import json
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path

from .memory_cap import allocation_failed, enter_from_environment, human_bytes

OPTIMIZED_MODEL_NAME = "optimized.onnx"


def run_job(job: dict, progress) -> dict:
    """`job["options"]` is `OptimizeOptions.to_dict()`'s form; `job["service"]` the service's own."""
    from graphopt.ingest import external_data_files, load_graph
    from graphopt.optimize import OptimizeOptions, analyze_model, optimize
    from graphopt.runtime.weights import save_model
    from google.protobuf.message import EncodeError
    tempfile.tempdir = job["tmp_dir"]  # whatever the library writes is inside the call's folder
    try:
        options = OptimizeOptions.from_dict(job["options"], progress=progress)
        # the graph alone: the weights stay in the uploaded files (at any size)
        model, weights = load_graph(job["model_path"])
        if job["kind"] == "analyze":
            return {"analysis": analyze_model(model, options, plan=job["service"].get("plan", False),
                                              weights=weights).to_dict()}
        output = Path(job["output_dir"]) / OPTIMIZED_MODEL_NAME
        with optimize(model, options, weights=weights) as result:
            del model
            save_model(result.model, output, result.weights)
        return {"report": result.report.to_dict(), "files": [OPTIMIZED_MODEL_NAME, *external_data_files(output)]}
    except EncodeError as exc:         # a model serialized whole past 2 GB: the limit named, and what to do
        from graphopt.runtime.weights import past_limit_error
        raise past_limit_error(exc, f"the service's {job['kind']}") from exc
    finally:
        tempfile.tempdir = None


def without_server_paths(message: str, job: dict) -> str:
    """The caller knows its files by their relative paths, not by this server's folders."""
    upload = str(Path(job["model_path"]).parent)
    return message.replace(upload + os.sep, "").replace(upload, ".")


def error_class_name(exc: BaseException) -> str:
    """The most specific graphopt.errors class of `exc` (the server maps those to statuses)."""
    for cls in type(exc).__mro__:
        if cls.__module__ == "graphopt.errors":
            return cls.__name__
    return type(exc).__name__


def _disk_full(exc: BaseException, job: dict) -> bool:
    """Whether `exc` is (or was caused by) the work disk running full: ENOSPC anywhere in its
    chain, or a failure while the disk has less than 1 MiB free (a truncated file read back, say)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(job.get("tmp_dir") or tempfile.gettempdir()).free < (1 << 20)
    except OSError:
        return False


# RLIMIT_DATA's bytes when the worker's memory cap is that (memory_cap.py), else None
RLIMIT_DATA_BYTES: int | None = None


def error_message(exc: BaseException, job: dict) -> tuple[str, str]:
    """(error class name, message without server paths) of a failed job."""
    if _disk_full(exc, job):
        return "LimitExceededError", "the server's work disk is full; try again later"
    failed = allocation_failed(exc) if RLIMIT_DATA_BYTES is not None else None
    if failed is not None:
        return "LimitExceededError", (
            f"the job needed more memory than this server's limit of {human_bytes(RLIMIT_DATA_BYTES)} a job "
            f"(--job-memory): an allocation failed ({failed})")
    if isinstance(exc, MemoryError):
        return "LimitExceededError", f"the job ran out of memory ({type(exc).__name__}: {exc})"
    return error_class_name(exc), without_server_paths(str(exc), job)


def _read_jobs(jobs: queue.Queue) -> None:
    for line in sys.stdin.buffer:
        jobs.put(line)
    # end of input: the server is gone. Nothing of ours may outlive it.
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main() -> int:
    # first thing, before the imports: every page of this worker and its processes is charged
    # to its memory cap's group (or bounded by its RLIMIT_DATA)
    global RLIMIT_DATA_BYTES
    RLIMIT_DATA_BYTES = enter_from_environment()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    import graphopt.optimize  # noqa: F401  (warm: the first job should not pay the imports)
    import graphopt.tasks  # noqa: F401  (what the warm parent preloads)
    from graphopt.runtime import warm
    warm.warm_parent()       # started now, not in the first job: its measuring runs fork from it at once
    jobs: queue.Queue = queue.Queue()
    threading.Thread(target=_read_jobs, args=(jobs,), name="jobs", daemon=True).start()
    send({"ready": os.getpid()})
    while True:
        job = json.loads(jobs.get())
        try:
            result = run_job(job, lambda stage, fraction: send({"progress": stage, "fraction": fraction}))
            send({"result": result})
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the server, typed
            name, message = error_message(exc, job)
            send({"error": name, "message": message,
                  "least_feasible_peak_bytes": getattr(exc, "least_feasible_peak_bytes", None),
                  "traceback": traceback.format_exc()})


if __name__ == "__main__":
    sys.exit(main())
