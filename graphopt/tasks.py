"""The pipeline's ONNX Runtime tasks, each run in a child process of its own
(:func:`run_task`, forked from the warm parent of `runtime.warm`):

    python -m graphopt.tasks TASK   (arguments as JSON on stdin)

Tasks (paths are files of a :class:`~graphopt.runtime.isolated.Workspace`):

* ``graph-optimize``: ORT's graph optimizations at ``level`` applied to ``model`` offline
  (``runtime.offline.optimize_offline``), the optimized graph saved to ``out``.
* ``annotate``: ``annotate(model, inputs, settings)`` (every session capped at ``cap_bytes`` when
  given); the annotations' JSON written to ``out``. With a ``reference``, the timed run's
  outputs are compared with it too (as ``verify`` does: ``comparison``).
* ``reference``: every output of one deterministic run (``verify.run_outputs``), saved to
  ``out`` (``verify.save_outputs``).
* ``verify``: the model's outputs (its metadata session) compared with ``reference`` one array
  at a time; if they match and ``order`` is asked, the node order of one profiled run under
  ``order_settings`` (``verify.executed_order``), in a new session after the first is closed.

Prints one JSON object on stdout (the last line); a failure is ``{"error": {...}}``.
"""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import traceback

from graphopt import errors
from graphopt.errors import GraphoptError
from graphopt.runtime import warm
from graphopt.runtime.isolated import IsolatedTaskError, child_env
from graphopt.runtime.rss import record_child
from graphopt.runtime.warm import run_module

# the warm parent imports these before it forks a task's child
warm.preload("graphopt.annotate", "graphopt.verify", "graphopt.tasks")


def run_task(task: str, args: dict, timeout_seconds: float | None = None) -> dict:
    """Run ``task`` of this module with ``args`` (JSON) in a child;
    its JSON result. A graphopt error in the child is raised here with its type and message."""
    try:
        proc = run_module("graphopt.tasks", [task], input=json.dumps(args),
                          timeout=timeout_seconds, env=child_env())
    except subprocess.TimeoutExpired:
        raise IsolatedTaskError(f"{task} of {args.get('model')} timed out after {timeout_seconds} s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else None
    record_child(task, result)
    if result is not None and "error" in result:
        err = result["error"]
        cls = getattr(errors, err.get("type", ""), None)
        if isinstance(cls, type) and issubclass(cls, GraphoptError) and cls is not errors.BudgetInfeasibleError:
            raise cls(err["message"])
        raise IsolatedTaskError(f"{task} of {args.get('model')} failed: {err.get('type')}: {err['message']}\n"
                                f"{err.get('traceback', '')[-3000:]}")
    if proc.returncode != 0 or result is None:
        raise IsolatedTaskError(f"{task} of {args.get('model')} failed (exit {proc.returncode}); stderr tail:\n"
                                f"{proc.stderr[-3000:]}")
    return result


def _settings(value):
    from graphopt.runtime.session import SessionSettings
    return None if value is None else SessionSettings.from_dict(value)


def run(task: str, args: dict) -> dict:
    import onnx

    if task == "graph-optimize":
        from graphopt.runtime.offline import optimize_offline
        optimize_offline(args["model"], args["out"], args["level"], providers=args.get("providers"),
                         external_data=bool(args.get("external_data")))
        return {"out": args["out"]}
    from graphopt.runtime.arrays import load_arrays
    from graphopt.runtime.rss import malloc_trim
    inputs = load_arrays(args["inputs"])
    if task == "annotate":
        from graphopt.annotate import annotate
        # the graph without its weights; the sessions open the file (one copy of the weights, ONNX
        # Runtime's, instead of the proto's, its serialization's and ONNX Runtime's)
        model = onnx.load(args["model"], load_external_data=False)
        outputs = {} if args.get("reference") else None
        ann = annotate(model, inputs, _settings(args["settings"]), providers=args.get("providers"),
                       threads=args.get("threads", 1), cap_bytes=args.get("cap_bytes"), model_path=args["model"],
                       outputs_into=outputs, node_times=args.get("node_times", "profile"))
        with open(args["out"], "w") as f:
            f.write(ann.to_json())
        result = {"tensors": len(ann.tensor_bytes)}
        if outputs is not None:
            from graphopt.verify import compare_with_saved
            result["comparison"] = compare_with_saved(args["reference"], outputs, args["tolerance"]).to_dict()
        return result
    from graphopt.verify import compare_with_saved, executed_order, run_outputs, save_outputs
    if task == "reference":
        outputs = run_outputs(args["model"], inputs, _settings(args["settings"]), threads=args.get("threads", 1))
        save_outputs(args["out"], outputs)
        return {"outputs": len(outputs)}
    if task == "verify":
        outputs = run_outputs(args["model"], inputs, _settings(args.get("settings")), threads=args.get("threads", 1))
        comparison = compare_with_saved(args["reference"], outputs, args["tolerance"])
        del outputs
        gc.collect()
        malloc_trim()
        result = {"comparison": comparison.to_dict(), "executed": None, "inserted": None}
        if comparison.match and args.get("order"):
            result["inserted"] = []
            result["executed"] = executed_order(args["model"], inputs, _settings(args["order_settings"]),
                                                threads=args.get("order_threads", 1),
                                                providers=args.get("providers"), inserted_into=result["inserted"])
        return result
    raise ValueError(f"unknown task {task!r}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = json.loads(sys.stdin.read())
    from graphopt.runtime.rss import process_peak_bytes, rss_bytes
    import onnx  # noqa: F401  (the baseline counts the libraries every task imports)
    import onnxruntime  # noqa: F401
    import graphopt.annotate  # noqa: F401
    import graphopt.verify  # noqa: F401
    start_bytes = rss_bytes()
    try:
        result = run(argv[0], args)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it typed
        result = {"error": {"type": type(exc).__name__, "message": str(exc),
                            "traceback": traceback.format_exc()}}
    result["process_peak_bytes"] = process_peak_bytes()
    result["start_bytes"] = start_bytes
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
