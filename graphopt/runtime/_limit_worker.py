"""Subprocess that runs training steps under a memory limit. Run by
:func:`graphopt.runtime.measure.run_within_limit`:

    python -m graphopt.runtime._limit_worker MODEL INPUTS --limit BYTES [--settings JSON]
        [--provider P] [--threads N] [--steps S]

The weights (the initializers' bytes), the inputs (host memory, or device memory on CUDA)
and the buffers the fed-back state is written into (bound as a trainer binds them,
`_measure_worker._step_runner`) are held outside ONNX Runtime's arena and counted against the
limit; the arena is capped at the rest (graphopt/runtime/limit.py) and runs `steps` steps (two by default: ONNX Runtime plans its
memory pattern on the first and allocates it on the second). Prints one JSON object on stdout
(the last line): ``fits``, and when it does not, ONNX Runtime's ``error`` and the
``shortfall_bytes`` it names; ``cap_bytes``, ``outside_bytes``; on the CPU ``rss_bytes``, the
process's resident growth from before the session to the end of the steps (everything the
process held for them, inside the cap or not; after the HWM was reset once the session was open,
so the peak of making it, when the weights are held twice, is not in it); ``session_rss_bytes``,
the growth once the session is open; ``steps_rss_bytes``, what the steps added to that at their
peak; ``step_seconds``, the median step time after the first step.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time


def _fed_back_bytes(model) -> int:
    """The bytes of the state outputs a trainer binds to buffers of its own (runtime.step_state.fed_back_outputs)."""
    import numpy as np
    import onnx

    from graphopt.runtime.step_state import fed_back_outputs
    declared = {o.name: o.type.tensor_type for o in model.graph.output}
    total = 0
    for name in fed_back_outputs(model):
        dims = declared[name].shape.dim
        if all(d.HasField("dim_value") for d in dims):
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(declared[name].elem_type).itemsize
            total += int(np.prod([d.dim_value for d in dims], dtype=np.int64)) * itemsize
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("inputs")
    ap.add_argument("--limit", type=int, required=True)
    ap.add_argument("--settings", default=None, help="SessionSettings JSON; absent: model metadata, else default")
    ap.add_argument("--provider", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--device-id", type=int, default=0)
    args = ap.parse_args(argv)

    import numpy as np
    import onnx
    import onnxruntime as ort

    import graphopt.runtime.step_state  # noqa: F401  (what _step_runner imports, counted in the baseline, not the session)
    from graphopt.runtime.arrays import load_arrays
    from graphopt.runtime._measure_worker import _step_runner, io_only
    from graphopt.runtime.limit import initializer_bytes, out_of_memory, shortfall_bytes
    from graphopt.runtime.rss import (malloc_trim, mark_session_start, reset_peak_rss, rss_bytes, session_footprint,
                                      status_kb)
    from graphopt.runtime.session import (DEFAULT_SETTINGS, SessionSettings, default_providers, open_session,
                                          read_settings)

    start_bytes = rss_bytes()   # after the imports, before anything is loaded
    model = onnx.load(args.model, load_external_data=False)
    settings = (SessionSettings.from_json(args.settings) if args.settings is not None
                else read_settings(model) or DEFAULT_SETTINGS)
    provider = args.provider or default_providers()[0]
    cuda = provider == "CUDAExecutionProvider"
    device = "cuda" if cuda else "cpu"
    graph_inputs = {i.name for i in model.graph.input}
    feeds_np = {k: v for k, v in load_arrays(args.inputs).items() if k in graph_inputs}
    outside = int(initializer_bytes(model) + sum(v.nbytes for v in feeds_np.values()) + _fed_back_bytes(model))
    cap = args.limit - outside
    result: dict = {"provider": provider, "limit_bytes": args.limit, "outside_bytes": outside, "cap_bytes": cap,
                    "steps": 0}
    if cap <= 0:
        result.update(fits=False, error=f"the weights, inputs and state buffers alone take {outside} bytes",
                      shortfall_bytes=-cap)
        sys.stdout.write("\n" + json.dumps(result) + "\n")
        return 0
    # the rest was read: what the file holds goes before the session opens (nothing here keeps a
    # part of it, which would keep all of it)
    model = io_only(model)
    gc.collect()
    malloc_trim()
    have_hwm = not cuda and reset_peak_rss()
    rss_before = status_kb("VmRSS") if have_hwm else None
    mark_session_start()
    try:
        sess = open_session(args.model, settings, providers=[provider], threads=args.threads, cap_bytes=cap,
                            spinning=False)
        feeds = {k: ort.OrtValue.ortvalue_from_numpy(v, device, args.device_id) for k, v in feeds_np.items()}
        out_names = [o.name for o in sess.get_outputs()]
        run, release = _step_runner(sess, model, feeds, out_names, device, args.device_id)
        if have_hwm:
            # what the steps add to the open session (apart from the peak of making it, when the
            # weights are held twice: as read from the file and as ONNX Runtime's initializers)
            result["session_rss_bytes"] = max(0, (status_kb("VmRSS") - rss_before) * 1024)
            step_before = status_kb("VmRSS")
            result["steps_hwm_reset"] = reset_peak_rss()
        seconds = []
        for _ in range(max(1, args.steps)):
            started = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - started)
            release()
            result["steps"] += 1
        # the steps after the first (ONNX Runtime plans its memory pattern on the first)
        timed = seconds[1:] or seconds
        result["step_seconds"] = float(np.median(timed))
        result.update(fits=True, error=None, shortfall_bytes=None)
    except Exception as exc:  # noqa: BLE001 - an allocation refused under the cap is the answer
        if not out_of_memory(exc):
            raise
        result.update(fits=False, error=str(exc).strip().splitlines()[-1][-600:], shortfall_bytes=shortfall_bytes(exc))
    if rss_before is not None:
        result["rss_bytes"] = max(0, (status_kb("VmHWM") - rss_before) * 1024)
        if result.pop("steps_hwm_reset", False):
            result["steps_rss_bytes"] = max(0, (status_kb("VmHWM") - step_before) * 1024)
    result.update(session_footprint(), start_bytes=start_bytes)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
