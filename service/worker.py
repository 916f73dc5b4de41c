"""A worker process: runs the graphopt library on jobs sent by the server, one at a time.

Protocol: one JSON object per line. The server writes jobs to stdin (the options as
`OptimizeOptions.to_dict()`); the worker answers on its original stdout with
{"progress": stage, "fraction": f} events, then one {"result": {...}} (an optimize's report as
`Report.to_dict()`) or {"error": class name, "message": ...}. Anything else the libraries
print goes to stderr. The server kills the whole process group to stop a job.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

OPTIMIZED_MODEL_NAME = "optimized.onnx"


def run_job(job: dict, progress) -> dict:
    """`job["options"]` is `OptimizeOptions.to_dict()`'s form; `job["service"]` the service's own."""
    from graphopt.ingest import external_data_files, load_model
    from graphopt.optimize import OptimizeOptions, analyze_model, optimize, save_model
    tempfile.tempdir = job["tmp_dir"]  # whatever the library writes is inside the call's folder
    try:
        options = OptimizeOptions.from_dict(job["options"], progress=progress)
        model = load_model(job["model_path"])
        if job["kind"] == "analyze":
            return {"analysis": analyze_model(model, options, plan=job["service"].get("plan", False))}
        result = optimize(model, options)
        output = Path(job["output_dir"]) / OPTIMIZED_MODEL_NAME
        save_model(result.model, output)
        return {"report": result.report.to_dict(), "files": [OPTIMIZED_MODEL_NAME, *external_data_files(output)]}
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


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    import graphopt.optimize  # noqa: F401  (warm: the first job should not pay the imports)
    send({"ready": os.getpid()})
    for line in sys.stdin:
        job = json.loads(line)
        try:
            result = run_job(job, lambda stage, fraction: send({"progress": stage, "fraction": fraction}))
            send({"result": result})
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the server, typed
            send({"error": error_class_name(exc), "message": without_server_paths(str(exc), job),
                  "least_feasible_peak_bytes": getattr(exc, "least_feasible_peak_bytes", None),
                  "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
