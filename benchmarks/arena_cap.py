"""The least CPU arena cap under which a plan runs, per arena configuration (issue 24: the arena
held 30-40% more than the step's buffers, and plans the cost model put under a limit were
refused).

    python benchmarks/arena_cap.py [--examples densenet,mlp] [--configs default,same,split]

Per example: its leanest plan (`optimize`, objective least-peak, no verification), its step's
peak measured as graphopt measures it (arena off), then, per arena configuration, the least cap
(bisected to 0.5 MiB) under which two steps run in a fresh process. Each run registers a capped
arena with ONNX Runtime's environment and opens the session as graphopt's limit runs do
(graphopt/runtime/limit.py LIMIT_SESSION_CONFIG, the weights outside the arena). Configurations
(`OrtArenaCfg(max_mem, arena_extend_strategy, initial_chunk_size_bytes,
max_dead_bytes_per_chunk)`):

* ``default``: ONNX Runtime's defaults, kNextPowerOfTwo from 1 MiB, chunks split only when at
  least twice the request;
* ``same``: kSameAsRequested;
* ``region``: one region of the whole cap, default splitting;
* ``split``: one region of the whole cap, every free chunk split to the request (what
  graphopt's limit uses, `providers_within`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MiB = 2 ** 20
CONFIGS = {"default": lambda cap: (cap, 0, -1, -1), "same": lambda cap: (cap, 1, -1, -1),
           "region": lambda cap: (cap, 0, cap, -1), "split": lambda cap: (cap, 0, cap, 256)}


def _worker(model_path: str, inputs_path: str, config: str, cap: int) -> int:
    """Two steps under an arena capped at `cap` bytes; prints fits."""
    import onnx
    import onnxruntime as ort

    from graphopt.runtime.limit import LIMIT_SESSION_CONFIG, out_of_memory
    from graphopt.inputs import load_inputs
    from graphopt.runtime.session import DEFAULT_SETTINGS, read_settings, session_options

    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, ort.OrtArenaCfg(*CONFIGS[config](cap)))
    settings = read_settings(onnx.load(model_path, load_external_data=False)) or DEFAULT_SETTINGS
    so = session_options(settings, threads=1, arena=True)
    for key, value in LIMIT_SESSION_CONFIG:
        so.add_session_config_entry(key, value)
    kwargs = {"disabled_optimizers": list(settings.disabled_optimizers)} if settings.disabled_optimizers else {}
    session = ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"], **kwargs)
    known = {i.name for i in session.get_inputs()}
    feeds = {k: v for k, v in load_inputs(inputs_path).items() if k in known}
    try:
        for _ in range(2):
            session.run(None, feeds)
    except Exception as error:   # noqa: BLE001 - ONNX Runtime raises its own Fail for a refused allocation
        if not out_of_memory(error):
            raise
        print(json.dumps({"fits": False}))
        return 0
    print(json.dumps({"fits": True}))
    return 0


def _fits(model_path: str, inputs_path: str, config: str, cap: int) -> bool:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", model_path, inputs_path, config,
                          str(cap)], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": ROOT})
    if out.returncode != 0:
        raise RuntimeError(f"arena worker failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["fits"]


def least_cap(model_path: str, inputs_path: str, config: str, high: int) -> int:
    low = 0
    while not _fits(model_path, inputs_path, config, high):
        low, high = high, high * 2
    while high - low > MiB // 2:
        middle = (low + high) // 2
        if _fits(model_path, inputs_path, config, middle):
            high = middle
        else:
            low = middle
    return high


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return _worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", default="densenet,randwire,mlp,resnet")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    import onnx

    from graphopt.examples import training_example
    from graphopt.inputs import save_inputs
    from graphopt.optimize import optimize
    from graphopt.options import LEAST_PEAK, OptimizeOptions
    from graphopt.runtime.measure import measure

    configs = [c for c in args.configs.split(",") if c]
    print("| example | step MiB (arena off) | " + " | ".join(f"least cap MiB, {c}" for c in configs) + " |")
    print("|---|---|" + "---|" * len(configs))
    with tempfile.TemporaryDirectory(prefix="graphopt-arena-") as tmp:
        for name in [e for e in args.examples.split(",") if e]:
            model, inputs = training_example(name)
            inputs_path = os.path.join(tmp, f"{name}.npz")
            save_inputs(inputs_path, inputs)
            result = optimize(model, OptimizeOptions(inputs=inputs, objective=LEAST_PEAK, verify=False,
                                                     measure=False))
            model_path = os.path.join(tmp, f"{name}.onnx")
            onnx.save(result.model, model_path)
            step_bytes = measure(model_path, inputs_path, None, timing=False).peak_bytes
            caps = [least_cap(model_path, inputs_path, c, int(step_bytes)) for c in configs]
            print(f"| {name} | {step_bytes / MiB:.1f} | " + " | ".join(f"{c / MiB:.1f}" for c in caps) + " |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
