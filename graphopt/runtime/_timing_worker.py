"""Subprocess that times training steps of several sessions against each other. Run by
:func:`graphopt.runtime.measure.time_steps`:

    python -m graphopt.runtime._timing_worker SPEC.json

SPEC: {"inputs": NPZ, "provider": P|null, "threads": N, "rounds": R, "max_seconds": S,
       "sessions": [{"model": PATH, "settings": {...}|null}, ...],
       "profile": [INDEX, ...]}

Every session is opened (arena off, the allocator as users have it: no malloc settings) and
run once to warm up; then rounds of one run of each session in turn, R rounds or fewer once
the timed runs took S seconds (at least MIN_ROUNDS). Interleaved in one process, the sessions
see the same machine at the same moments: on a shared 2-core VM one process's median step
time differs from another's by 5-40% (resnet example: the same model measured 0.46-0.69 s in
different processes), while the ratio of two sessions' medians taken this way moves far less.
With "profile", each session listed is opened a second time with profiling on and runs in
the same rounds: each node's median seconds over its timed runs (`annotate.median_node_seconds`;
profiling slows the step, so these sessions' own step times are not reported).

Prints one JSON object on stdout (the last line): {"provider", "step_seconds": [median per
session], "runs": [[seconds...] per session], "node_seconds": [{...} per profiled session]}.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

MIN_ROUNDS = 3


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    import onnx
    import onnxruntime as ort

    from graphopt.annotate import median_node_seconds
    from graphopt.inputs import load_inputs
    from graphopt.runtime.session import DEFAULT_SETTINGS, SessionSettings, default_providers, read_settings, session_options

    provider = spec.get("provider") or default_providers()[0]
    device = "cuda" if provider == "CUDAExecutionProvider" else "cpu"
    providers = [provider] if device == "cpu" else [provider, "CPUExecutionProvider"]
    feeds_np = load_inputs(spec["inputs"])

    def open_one(entry: dict, profile_prefix: str | None = None):
        if entry.get("settings") is not None:
            settings = SessionSettings.from_dict(entry["settings"])
        else:
            settings = read_settings(onnx.load(entry["model"], load_external_data=False)) or DEFAULT_SETTINGS
        so = session_options(settings, threads=int(spec.get("threads") or 1), arena=False,
                             profile_prefix=profile_prefix)
        kwargs = {"disabled_optimizers": list(settings.disabled_optimizers)} if settings.disabled_optimizers else {}
        sess = ort.InferenceSession(entry["model"], so, providers=providers, **kwargs)
        known = {i.name for i in sess.get_inputs()}
        feeds = {k: ort.OrtValue.ortvalue_from_numpy(v, device, 0) for k, v in feeds_np.items() if k in known}
        names = [o.name for o in sess.get_outputs()]
        return sess, feeds, names

    profiled = set(spec.get("profile") or [])
    with tempfile.TemporaryDirectory(prefix="graphopt-timing-") as tmp:
        # the sessions timed, then one profiled session per index in "profile": all run in turn
        entries = list(spec["sessions"]) + [spec["sessions"][i] for i in sorted(profiled)]
        sessions = [open_one(entry, None if k < len(spec["sessions"]) else os.path.join(tmp, f"profile{k}"))
                    for k, entry in enumerate(entries)]
        runs: list[list[float]] = [[] for _ in sessions]
        for sess, feeds, names in sessions:
            sess.run_with_ort_values(names, feeds)  # warm-up
        rounds = max(MIN_ROUNDS, int(spec.get("rounds") or 7))
        max_seconds = float(spec.get("max_seconds") or 30.0)
        for r in range(rounds):
            for (sess, feeds, names), times in zip(sessions, runs):
                t0 = time.perf_counter()
                outs = sess.run_with_ort_values(names, feeds)
                times.append(time.perf_counter() - t0)  # Run synchronizes the device at its end
                del outs
            if r + 1 >= MIN_ROUNDS and sum(map(sum, runs)) > max_seconds:
                break
        timed = len(spec["sessions"])
        result: dict = {"provider": provider, "step_seconds": [statistics.median(t) for t in runs[:timed]],
                        "runs": runs[:timed], "node_seconds": []}
        for sess, _, _ in sessions[timed:]:
            result["node_seconds"].append(median_node_seconds(sess.end_profiling(), skip_runs=1))
        del sessions
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
