"""Subprocess that holds ONE session and runs its steps when told to. Run by
:func:`graphopt.runtime.measure.time_steps`, one per session timed, in lockstep:

    python -m graphopt.runtime._timing_worker SPEC.json INDEX

SPEC: {"inputs": NPZ, "provider": P|null, "threads": N,
       "sessions": [{"model": PATH, "settings": {...}|null, "profile_prefix": PREFIX|null}, ...]}

The worker opens session INDEX (as users have it: ONNX Runtime's CPU arena on, no malloc
settings; profiling on when it has a prefix), runs one step to warm up and prints ``ready``;
on ``profile`` it runs PROFILE_STEPS steps and ends the profiling (ONNX Runtime profiles no
step after `end_profiling`: checked by hand, a second call returns no file and the steps after
took what a session without the profiler took, 0.217 against 0.220 s on the MLP example) and
prints ``profiled``; for each line ``run`` on stdin, it runs one step and prints its seconds;
on ``end`` it prints ``{"process_peak_bytes": ..., "session_bytes": ..., "start_bytes": ...,
"node_seconds": {...}, "profiled_runs": N}`` (runtime/rss.py's `ChildPeaks` says what the
memory fields are; node seconds for a profiled session: each node's median seconds over its
profiled runs after the warm-up, `runtime.profile.median_node_seconds`, and how many those were), and
exits.

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

# steps run with the profiler on by ``profile`` (their node seconds' medians: the warm-up is not counted)
PROFILE_STEPS = 3


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    entry = spec["sessions"][int(argv[1])]
    import onnx
    import onnxruntime as ort

    from graphopt.runtime.profile import median_node_seconds
    from graphopt.runtime.arrays import load_arrays
    from graphopt.runtime.rss import mark_session_start, process_peak_bytes, rss_bytes, session_footprint
    from graphopt.runtime.session import DEFAULT_SETTINGS, SessionSettings, default_providers, read_settings, session_options

    start_bytes = rss_bytes()   # after the imports, before anything is loaded

    provider = spec.get("provider") or default_providers()[0]
    device = "cuda" if provider == "CUDAExecutionProvider" else "cpu"
    providers = [provider] if device == "cpu" else [provider, "CPUExecutionProvider"]
    if entry.get("settings") is not None:
        settings = SessionSettings.from_dict(entry["settings"])
    else:
        settings = read_settings(onnx.load(entry["model"], load_external_data=False)) or DEFAULT_SETTINGS
    # ONNX Runtime's CPU arena on, as a plain InferenceSession has it: with it off, glibc kept
    # 1.6-2.6x the step in this process (the MLP example: its original under graphopt's
    # settings 402 MiB after 8 steps against 223 with the arena, its plan 387 against 146; a
    # profiled session grew by about a step per run); measured ratios of two sessions moved
    # within the run-to-run noise (MLP example, plan over the default session: 1.10-1.16x off,
    # 1.16x on)
    so = session_options(settings, threads=int(spec.get("threads") or 1), arena=True,
                         profile_prefix=entry.get("profile_prefix"))
    kwargs = {"disabled_optimizers": list(settings.disabled_optimizers)} if settings.disabled_optimizers else {}
    mark_session_start()
    sess = ort.InferenceSession(entry["model"], so, providers=providers, **kwargs)
    known = {i.name for i in sess.get_inputs()}
    feeds = {k: ort.OrtValue.ortvalue_from_numpy(v, device, 0) for k, v in load_arrays(spec["inputs"]).items()
             if k in known}
    names = [o.name for o in sess.get_outputs()]
    sess.run_with_ort_values(names, feeds)  # warm-up
    print("ready", flush=True)
    profile = None
    for line in sys.stdin:
        command = line.strip()
        if command == "profile" and entry.get("profile_prefix") and profile is None:
            for _ in range(PROFILE_STEPS):
                sess.run_with_ort_values(names, feeds)
            profile = sess.end_profiling()   # the steps timed after this are not profiled
            print("profiled", flush=True)
        elif command == "run":
            t0 = time.perf_counter()
            outs = sess.run_with_ort_values(names, feeds)
            print(repr(time.perf_counter() - t0), flush=True)   # Run synchronizes the device at its end
            del outs
        elif command == "end":
            result = dict(session_footprint(), start_bytes=start_bytes)
            if entry.get("profile_prefix"):
                # the session's memory is given back before its profile is read, and the process's
                # peak is taken again after: reading the profile is this process's too
                if profile is None:   # (never told to `profile`: every step was profiled)
                    profile = sess.end_profiling()
                del sess, feeds
                result["node_seconds"], result["profiled_runs"] = median_node_seconds(profile, skip_runs=1)
                result["process_peak_bytes"] = process_peak_bytes()
            print(json.dumps(result), flush=True)
            return 0
        else:
            raise ValueError(f"unknown command {command!r}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
