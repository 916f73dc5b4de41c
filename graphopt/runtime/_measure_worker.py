"""Subprocess that measures one training step. Run by :func:`graphopt.runtime.measure.measure`:

    python -m graphopt.runtime._measure_worker MODEL INPUTS [--settings JSON]
        [--provider P] [--threads N] [--repeats R]

Prints one JSON object on stdout (the last line). Everything here runs in a fresh
process so that nothing allocated before disturbs the memory numbers.

CPU peak: the session (arena off) is created and the inputs are wrapped as OrtValues
(no copy); one warm-up run; its outputs are dropped and ``malloc_trim`` returns freed
heap to the OS; then ``/proc/self/clear_refs`` ← 5 resets the kernel's peak-RSS
counter (VmHWM) to the current RSS, VmRSS is read, one ``run_with_ort_values`` runs (its
outputs stay ORT tensors, not copied into numpy), and peak = VmHWM − VmRSS_before.
Without a writable clear_refs the fallback is ru_maxrss − RSS_before, which is only
right when this run's peak is above every earlier one (method "ru_maxrss").

A training step that returns its state (outputs ``<input>_updated``, runtime.step_state.fed_back_outputs)
runs as a trainer runs it (graphopt.train): those outputs are bound with IOBinding to buffers
allocated before the baseline is read, so they are not part of the step's peak; the other
outputs are allocated by ONNX Runtime as usual.

CUDA peak: the CUDA EP's arena with ``arena_extend_strategy=kSameAsRequested`` grows by
exactly what is requested and does not shrink on its own. The warm-up run asks the
arena to shrink at its end (run config ``memory.enable_memory_arena_shrinkage``; a
second such run binds the outputs to host memory so that no device output keeps a
region alive), so the device memory it held returns; then the measured run (which does not
shrink) grows the arena by what it had to hold at once (its peak, plus fragmentation), plus
outputs. That growth is read off ONNX Runtime's own log: its "Extended allocation by N bytes"
lines (onnxruntime/core/framework/bfc_arena.cc), with the default logger at INFO and this
process's stderr sent to a file during the runs (method "arena log"). NVML's used memory of the
device before and after the run is recorded beside it (``nvml_peak_bytes``) and is the peak when
the warm-up's extensions were not logged (method "nvml"); it counts the driver's rounding of
each allocation, and other processes on the same GPU disturb it. Against the least memory limit
under which ONNX Runtime runs the step (benchmarks/peak_oracle.py, one H200): the log's number
was 0.85-1.61x that limit on the bundled examples and 0.96-1.08x at 8x their batch, NVML's
0.87-1.80x and 0.96-1.14x. NVML via ``pynvml`` when importable, else ``libnvidia-ml``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import statistics
import sys
import time

from graphopt.runtime.rss import malloc_trim as _malloc_trim, reset_peak_rss as _reset_hwm, status_kb as _status_kb


class _Nvml:
    """Used memory of one GPU, through pynvml or libnvidia-ml."""

    def __init__(self, index: int) -> None:
        try:
            import pynvml  # type: ignore

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._used = lambda: int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
            self.source = "pynvml"
            return
        except Exception:
            pass

        class _Mem(ctypes.Structure):
            _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit_v2 failed")
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
            raise RuntimeError(f"nvmlDeviceGetHandleByIndex_v2({index}) failed")

        def used() -> int:
            mem = _Mem()
            if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
                raise RuntimeError("nvmlDeviceGetMemoryInfo failed")
            return int(mem.used)

        self._used = used
        self.source = "libnvidia-ml"

    def used(self) -> int:
        return self._used()


def _arena_extensions(ort, run) -> list[int]:
    """run(), with ONNX Runtime's default logger at INFO and this process's stderr (fd 2) sent to
    a file meanwhile: the bytes of each extension of an arena it logged ("Extended allocation by
    N bytes.", onnxruntime/core/framework/bfc_arena.cc). Empty when none was logged."""
    import re
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        ort.set_default_logger_severity(1)
        try:
            run()
        finally:
            ort.set_default_logger_severity(3)
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        text = log.read().decode("utf-8", "replace")
    return [int(n) for n in re.findall(r"Extended allocation by (\d+) bytes", text)]


def _nvml_index(device_id: int) -> int:
    # NVML numbers devices physically; CUDA_VISIBLE_DEVICES renumbers them for CUDA.
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis:
        parts = [p.strip() for p in vis.split(",") if p.strip()]
        if device_id < len(parts) and parts[device_id].isdigit():
            return int(parts[device_id])
    return device_id


def io_only(model):
    """`model`'s graph inputs and outputs alone, in a message of its own, all that `_step_runner`
    reads: the caller drops the model loaded whole (weights a file holds inside it) and returns
    its memory (gc, malloc_trim) before a session opens; clearing its fields would not free it,
    protobuf's arena keeps a message's memory until the message goes."""
    import onnx
    light = onnx.ModelProto()
    light.graph.input.extend(model.graph.input)
    light.graph.output.extend(model.graph.output)
    return light


def _step_runner(sess, model, feeds: dict, out_names: list[str], device: str, device_id: int):
    """(run(run_options=None), release()): one step, and dropping what it returned. A step that
    returns state to feed back writes those outputs into buffers allocated here, once."""
    import onnxruntime as ort
    from onnx import helper

    from graphopt.runtime.step_state import fed_back_outputs

    declared = {o.name: o.type.tensor_type for o in model.graph.output}
    bound = {}
    for name in fed_back_outputs(model):
        dims = declared[name].shape.dim
        if all(d.HasField("dim_value") for d in dims):
            bound[name] = ort.OrtValue.ortvalue_from_shape_and_type(
                [d.dim_value for d in dims], helper.tensor_dtype_to_np_dtype(declared[name].elem_type),
                device, device_id)
    if not bound:
        held = []

        def run(options=None):
            held.append(sess.run_with_ort_values(out_names, feeds, options))

        return run, held.clear
    binding = sess.io_binding()
    for k, v in feeds.items():
        binding.bind_ortvalue_input(k, v)

    def run(options=None):
        binding.clear_binding_outputs()
        for name in out_names:
            if name in bound:
                binding.bind_ortvalue_output(name, bound[name])
            else:
                binding.bind_output(name, device, device_id)
        sess.run_with_iobinding(binding, options)

    return run, binding.clear_binding_outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("inputs")
    ap.add_argument("--settings", default=None, help="SessionSettings JSON; absent: model metadata, else default")
    ap.add_argument("--provider", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device-id", type=int, default=0)
    ap.add_argument("--arena", action="store_true",
                    help="ONNX Runtime's CPU arena on, as a plain session has it (the timed run; its peak is not the "
                         "step's: the arena keeps what it grew to)")
    args = ap.parse_args(argv)

    import numpy as np  # noqa: F401  (loaded before the baseline)
    import onnx
    import onnxruntime as ort

    import graphopt.runtime.step_state  # noqa: F401  (_step_runner's import, counted in the baseline, not the session)
    from graphopt.runtime.arrays import load_arrays
    from graphopt.runtime.rss import mark_session_start, rss_bytes, session_footprint
    from graphopt.runtime.session import (
        DEFAULT_SETTINGS, LOAD_ERRORS, SessionSettings, default_providers, read_settings, session_options,
    )

    start_bytes = rss_bytes()   # after the imports, before anything is loaded

    model = onnx.load(args.model, load_external_data=False)
    if args.settings is not None:
        settings = SessionSettings.from_json(args.settings)
    else:
        settings = read_settings(model) or DEFAULT_SETTINGS
    model = io_only(model)
    gc.collect()
    _malloc_trim()
    provider = args.provider or default_providers()[0]
    cuda = provider == "CUDAExecutionProvider"
    if cuda:
        providers = [(provider, {"device_id": str(args.device_id), "arena_extend_strategy": "kSameAsRequested"}),
                     "CPUExecutionProvider"]
    else:
        providers = [provider]

    # a peak run (no arena) is not timed: its threads need not spin, and it runs beside other work
    so = session_options(settings, threads=args.threads, arena=args.arena, spinning=args.arena)
    kwargs = {}
    if settings.disabled_optimizers:
        kwargs["disabled_optimizers"] = list(settings.disabled_optimizers)
    mark_session_start()
    try:
        sess = ort.InferenceSession(args.model, so, providers=providers, **kwargs)
    except LOAD_ERRORS as exc:   # a model ONNX Runtime refuses: bad input, said in a line, no traceback
        print(f"onnxruntime cannot load the model: {str(exc).strip()}", file=sys.stderr)
        return 2
    if sess.get_providers()[0] != provider:
        raise RuntimeError(f"provider {provider} not used; session has {sess.get_providers()}")

    feeds_np = load_arrays(args.inputs)
    known = {i.name for i in sess.get_inputs()}
    feeds_np = {k: v for k, v in feeds_np.items() if k in known}
    if cuda:
        feeds = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", args.device_id) for k, v in feeds_np.items()}
    else:
        feeds = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in feeds_np.items()}
    out_names = [o.name for o in sess.get_outputs()]
    run, release = _step_runner(sess, model, feeds, out_names,
                                "cuda" if cuda else "cpu", args.device_id)

    result: dict = {"provider": provider, "settings": settings.to_dict()}
    if cuda:
        nvml = _Nvml(_nvml_index(args.device_id))
        shrink = ort.RunOptions()
        shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", f"gpu:{args.device_id}")
        warm_up_extensions = _arena_extensions(ort, lambda: run(shrink))  # warm-up
        release()
        gc.collect()
        # Arena back to its start: outputs bound to host memory, so that no device
        # output buffer outlives the run and keeps an arena region from shrinking.
        try:
            binding = sess.io_binding()
            for k, v in feeds.items():
                binding.bind_ortvalue_input(k, v)
            for name in out_names:
                binding.bind_output(name, "cpu")
            sess.run_with_iobinding(binding, shrink)
            del binding
        except Exception:  # io binding unsupported for some output: shrink what can be
            sess.run_with_ort_values(out_names, feeds, shrink)
        gc.collect()
        before = nvml.used()
        extensions = _arena_extensions(ort, run)
        after = nvml.used()
        release()
        result["nvml_peak_bytes"] = max(0, after - before)
        if warm_up_extensions:   # ONNX Runtime's log reached us: what the arena grew by in the step
            result["peak_bytes"] = sum(extensions)
            result["method"] = "arena log"
        else:
            result["peak_bytes"] = result["nvml_peak_bytes"]
            result["method"] = f"nvml ({nvml.source})"
    else:
        run()  # warm-up
        release()
        gc.collect()
        _malloc_trim()
        have_hwm = _reset_hwm()
        rss_before = _status_kb("VmRSS")
        if rss_before is None:  # no /proc: growth of the lifetime maximum (a lower bound)
            have_hwm = False
            rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run()
        if have_hwm:
            peak_kb = _status_kb("VmHWM")
            result["method"] = "VmHWM"
        else:
            peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            result["method"] = "ru_maxrss"
        release()
        result["peak_bytes"] = max(0, (peak_kb - rss_before) * 1024)
        result["rss_before_bytes"] = rss_before * 1024

    times = []
    for _ in range(max(1, args.repeats)):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)  # Run synchronizes the device at its end
        release()
    result["step_seconds"] = statistics.median(times)
    result.update(session_footprint(), start_bytes=start_bytes)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
