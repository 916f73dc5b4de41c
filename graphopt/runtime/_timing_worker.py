"""Subprocess that holds ONE session and runs its steps when told to. Run by
:func:`graphopt.runtime.measure.time_steps`, one per session timed, in lockstep:

    python -m graphopt.runtime._timing_worker SPEC.json INDEX

SPEC: {"inputs": NPZ, "provider": P|null, "threads": N,
       "sessions": [{"model": PATH, "settings": {...}|null, "profile_prefix": PREFIX|null}, ...]}

The worker opens session INDEX (arena off, the allocator as users have it: no malloc
settings; profiling and the arena on when it has a prefix), runs one step to warm up and prints ``ready``;
then, for each line ``run`` on stdin, runs one step and prints its seconds; on ``end`` it prints
``{"node_seconds": {...}}`` (a profiled session: each node's median seconds over its timed
runs, `annotate.median_node_seconds`) or ``{}``, and exits.

One session per process, so that no process holds more than one session's memory (several in
one process held 4-10x a step: each keeps its weights, and glibc keeps the heap of each
step's freed buffers); the parent runs the sessions in turn, step by step, so that they see the
same machine at the same moments: on a shared 2-core VM one process's median step time differs
from another's by 5-40% (resnet example: the same model measured 0.46-0.69 s in different
processes), while the ratio of two sessions' medians taken this way moves far less.
"""
from __future__ import annotations

import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    entry = spec["sessions"][int(argv[1])]
    import onnx
    import onnxruntime as ort

    from graphopt.annotate import median_node_seconds
    from graphopt.inputs import load_inputs
    from graphopt.runtime.session import DEFAULT_SETTINGS, SessionSettings, default_providers, read_settings, session_options

    provider = spec.get("provider") or default_providers()[0]
    device = "cuda" if provider == "CUDAExecutionProvider" else "cpu"
    providers = [provider] if device == "cpu" else [provider, "CPUExecutionProvider"]
    if entry.get("settings") is not None:
        settings = SessionSettings.from_dict(entry["settings"])
    else:
        settings = read_settings(onnx.load(entry["model"], load_external_data=False)) or DEFAULT_SETTINGS
    # a profiled session with the arena: without it, its process grew by about a step per run
    # (the MLP of tests/test_runtime.py: 74 -> 731 MiB in 6 runs of a 60 MiB step; glibc's heap,
    # pinned by the profiler's small allocations between the step's buffers), and its own step
    # time is not reported (its node seconds are scaled to a timed session's)
    profiled = entry.get("profile_prefix") is not None
    so = session_options(settings, threads=int(spec.get("threads") or 1), arena=profiled,
                         profile_prefix=entry.get("profile_prefix"))
    kwargs = {"disabled_optimizers": list(settings.disabled_optimizers)} if settings.disabled_optimizers else {}
    sess = ort.InferenceSession(entry["model"], so, providers=providers, **kwargs)
    known = {i.name for i in sess.get_inputs()}
    feeds = {k: ort.OrtValue.ortvalue_from_numpy(v, device, 0) for k, v in load_inputs(spec["inputs"]).items()
             if k in known}
    names = [o.name for o in sess.get_outputs()]
    sess.run_with_ort_values(names, feeds)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "run":
            t0 = time.perf_counter()
            outs = sess.run_with_ort_values(names, feeds)
            print(repr(time.perf_counter() - t0), flush=True)   # Run synchronizes the device at its end
            del outs
        elif command == "end":
            result = {}
            if entry.get("profile_prefix"):
                result["node_seconds"] = median_node_seconds(sess.end_profiling(), skip_runs=1)
            print(json.dumps(result), flush=True)
            return 0
        else:
            raise ValueError(f"unknown command {command!r}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
