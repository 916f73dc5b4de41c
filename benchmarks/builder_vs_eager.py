"""Lean graphs: the peak memory of one training step of graphopt's BUILT training graph in
ONNX Runtime, before any checkpointing, next to PyTorch eager's for the same model, batch and
inputs (issue 5: within 1.25x).

    python benchmarks/builder_vs_eager.py [--models mlp,gpt] [--scale auto|N|NAME=N,...]
        [--json out.json] [--explain K] [--keep DIR]

For each architecture of the torch model zoo (zoo/torch_zoo.py), with its batch multiplied
by --scale: N for every model, or by default ("auto") each model's entry of SCALES below,
sized so that each torch step peaks at tens of MiB (the zoo's own test sizes are so small
that a step's peak is mostly constant overhead); NAME=N,... overrides single models:

* inputs and labels of the same kind as the zoo entry's, built here (the zoo's constructors
  have no batch parameter): float inputs ~ N(mean, std) of the entry's, integer inputs (token
  ids) drawn per position from the values the entry has at that position (so ids stay in the
  vocabulary and a [CLS] column stays [CLS]), cross-entropy labels uniform over the classes,
  MSE targets ~ N(0, 1); one .npz that both sides read;
* the module exported with the scaled inputs (torch_zoo.export: shapes are static), turned
  into a training graph by graphopt.builder.train_graph.build_training_graph (the entry's loss
  and class axis) and measured by graphopt.runtime.measure.measure(..., threads=1) under the
  session graphopt measures originals with (graphopt.optimize.ORIGINAL_UNOPTIMIZED: graph
  optimizations, memory pattern and reuse off) and under a plain session
  (graphopt.runtime.session.DEFAULT_SETTINGS);
* PyTorch eager: the same module in train mode (its own Dropout and batch statistics),
  forward + the same loss (F.cross_entropy over the class axis / F.mse_loss, mean) +
  backward, every .grad None before the step, measured by benchmarks/pytorch_compare.py's
  own worker function (handed this step through a stand-in for the torch_twins module it
  imports): a fresh subprocess with graphopt.runtime.measure.malloc_env(), one thread,
  parameters and inputs created first and not counted, warm-up steps, gc + malloc_trim,
  VmHWM reset, one step, peak = VmHWM - VmRSS_before. Gradients are counted on both sides
  (ORT returns them as outputs; torch keeps .grad).

Prints one markdown table (peaks in MiB, ratios ORT / eager, the built graph's node count)
and a closing line with the range and median of each ratio and whether every row is within
1.25x. With --explain K, then, for the K rows with the highest ratio under optimizations off:
the tensors live at the peak of the cost model's simulation of the built graph (the cost
graph graphopt.optimize builds, i.e. analyze_model's tensor sizes and ONNX Runtime's
execution order, simulated by graphopt.costmodel.simulate), with their producing op.
The whole run takes about a minute on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import pytorch_compare  # noqa: E402  (benchmarks/pytorch_compare.py: the torch measurement)

# Each architecture's batch multiplier by default ("--scale auto"): the zoo's test batches
# (2-8) are so small that a step's peak is a few KiB to a few MiB, mostly constant overheads
# (an MLP of width 32 peaks at 0.1 MiB with 256 rows, 16 MiB with 32768). These make each
# torch eager step peak at tens of MiB (measured, onnxruntime 1.32 / torch 2.13 CPU); the
# GPT's zoo entry is already wide (8 x 128 tokens x 256) and stays as it is.
SCALES = {
    "mlp": 16384, "vgg": 256, "resnet": 80, "densenet": 80, "mobilenet": 64, "unet": 64,
    "lstm": 1024, "bert": 512, "gpt": 1, "vit": 256, "dropout_mlp": 16384, "randwire": 256,
    "fpn": 384,
}
FALLBACK_SCALE = 64    # a zoo architecture not in SCALES yet
TARGET = 1.25          # issue 5: the built graph's peak within 1.25x of PyTorch eager's
SEED = 2024


# -------------------------------------------------------------------- scaled inputs --

def _zoo():
    from graphopt_zoo.torch_zoo import ZOO
    return ZOO


def _class_axis(entry, rank: int) -> int:
    if entry.class_axis is not None:
        return entry.class_axis % rank
    return 1 if rank == 2 else rank - 1


def scaled_inputs(entry, scale: int, seed: int = SEED) -> dict[str, np.ndarray]:
    """The entry's inputs with the batch (axis 0) multiplied by `scale`, of the same kind."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, tensor in entry.inputs.items():
        a = tensor.detach().numpy()
        shape = (a.shape[0] * scale,) + a.shape[1:]
        if np.issubdtype(a.dtype, np.floating):
            mean, std = float(a.mean()), float(a.std()) or 1.0
            out[name] = (mean + std * rng.standard_normal(shape)).astype(a.dtype)
        else:
            # each element from the values the entry holds at that position (over its batch)
            rows = rng.integers(0, a.shape[0], size=shape)
            out[name] = _resample(a, rows)
    return out


def _resample(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """new[b, i...] = a[rows[b, i...], i...]."""
    index = np.indices(rows.shape[1:])
    return np.ascontiguousarray(a[(rows,) + tuple(np.broadcast_to(ix, rows.shape) for ix in index)])


def scaled_labels(entry, logits_shape, seed: int = SEED) -> np.ndarray:
    """Labels for logits of `logits_shape` (already scaled): class indices or MSE targets."""
    rng = np.random.default_rng(seed + 1)
    if entry.loss == "cross_entropy":
        axis = _class_axis(entry, len(logits_shape))
        classes = logits_shape[axis]
        shape = tuple(d for i, d in enumerate(logits_shape) if i != axis)
        return rng.integers(0, classes, size=shape, dtype=np.int64)
    return rng.standard_normal(tuple(logits_shape)).astype(np.float32)


# ------------------------------------------------------------ torch (subprocess) --

class _ZooStep:
    """Stand-in for zoo/torch_twins.py inside the torch worker: pytorch_compare.worker
    asks `twin_example(name)` for a module whose call returns the loss and `torch_inputs` for
    its arguments. Here: the zoo module + the builder's loss, on the saved scaled inputs."""

    def __init__(self, inputs_path: str):
        self.inputs_path = inputs_path

    def twin_example(self, name: str):
        import torch
        from torch.nn import functional as F

        from graphopt.inputs import load_inputs

        entry = _zoo()[name]()
        feeds = load_inputs(self.inputs_path)
        labels = torch.from_numpy(feeds.pop("labels"))
        inner = entry.module
        inner.train()
        kind, class_axis, input_names = entry.loss, entry.class_axis, list(entry.inputs)

        class Step(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner
                self.input_names = input_names

            def forward(self, *args):
                out = self.inner(*args)
                if kind == "cross_entropy":
                    axis = class_axis % out.dim() if class_axis is not None else \
                        (1 if out.dim() == 2 else out.dim() - 1)
                    return F.cross_entropy(out.movedim(axis, 1), labels)
                return F.mse_loss(out, labels)

        del entry                # its small default inputs
        return Step(), None, feeds

    @staticmethod
    def torch_inputs(module, inputs):
        import torch
        return tuple(torch.from_numpy(inputs[n]) for n in module.input_names)


def step_worker(shim, name: str, config: str = "eager", repeats: int = 1) -> dict:
    """pytorch_compare.worker's peak measurement (repeats 1; else the median step time of
    `repeats`) of the step `shim` builds (an object with
    pytorch_compare's twin_example(name) -> (module returning the loss, _, inputs) and
    torch_inputs(module, inputs)), in this process (run it in a fresh one: run_worker)."""
    return pytorch_compare.worker(name, config, repeats, twins=shim)


def torch_worker(name: str, inputs_path: str, config: str) -> dict:
    return step_worker(_ZooStep(inputs_path), name, config)


def measure_torch(name: str, inputs_path: str, config: str = "eager", timeout: float = 900) -> dict:
    """pytorch_compare's peak measurement of the zoo step, in a fresh subprocess."""
    return run_worker([os.path.abspath(__file__), "--worker", name, inputs_path, config], timeout)


def run_worker(argv: list[str], timeout: float = 900) -> dict:
    """Run `python argv...` in a fresh process with pytorch_compare's measuring environment
    (graphopt's allocator settings, one thread); its last stdout line is the JSON result."""
    cmd = [sys.executable] + list(argv)
    env = pytorch_compare._worker_env(plain_allocator=False)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after %d s" % timeout}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()
        return {"error": tail[-1] if tail else "exit %d" % proc.returncode}
    return json.loads(lines[-1])


# ------------------------------------------------------------------ one architecture --

def prepare(name: str, scale: int, folder: str) -> dict:
    """Export at the scaled batch and save the inputs, then build the training graph and save
    it (a build error is recorded as "error"; the inputs are there for torch anyway)."""
    import torch
    from graphopt.builder.train_graph import build_training_graph
    from graphopt.inputs import save_inputs
    from graphopt.optimize import save_model
    from graphopt_zoo.torch_zoo import export

    entry = _zoo()[name]()
    inputs = scaled_inputs(entry, scale)
    entry.inputs = {k: torch.from_numpy(v) for k, v in inputs.items()}
    forward = export(entry)
    logits = forward.graph.output[0].type.tensor_type.shape
    logits_shape = [d.dim_value for d in logits.dim]
    feeds = dict(inputs, labels=scaled_labels(entry, logits_shape))
    inputs_path = os.path.join(folder, name + ".npz")
    save_inputs(inputs_path, feeds)
    r = {"inputs_path": inputs_path, "batch": int(next(iter(inputs.values())).shape[0]),
         "inputs": {k: list(v.shape) for k, v in feeds.items()}}
    started = time.perf_counter()
    kwargs = {"loss": entry.loss}
    if entry.class_axis is not None:
        kwargs["class_axis"] = entry.class_axis
    try:
        train = build_training_graph(forward, **kwargs)
    except Exception as e:  # noqa: BLE001  (a model the builder cannot do yet is a table cell)
        r["error"] = "%s: %s" % (type(e).__name__, str(e)[:300])
        return r
    r["build_seconds"] = time.perf_counter() - started
    r["nodes"] = len(train.graph.node)
    r["model_path"] = os.path.join(folder, name + ".onnx")
    save_model(train, r["model_path"])
    return r


def measure_ort(model_path: str, inputs_path: str) -> dict:
    from graphopt.optimize import ORIGINAL_UNOPTIMIZED
    from graphopt.runtime.measure import measure
    from graphopt.runtime.session import DEFAULT_SETTINGS
    out = {}
    sessions = (("optimizations_off", ORIGINAL_UNOPTIMIZED), ("default_session", DEFAULT_SETTINGS))
    for label, settings in sessions:
        try:
            m = measure(model_path, inputs_path, settings, threads=1)
            out[label] = {"peak_bytes": m.peak_bytes, "step_seconds": m.step_seconds, "method": m.method}
        except Exception as e:  # noqa: BLE001  (a failing measurement is a table cell)
            out[label] = {"error": "%s: %s" % (type(e).__name__, str(e).strip().splitlines()[-1][:200])}
    return out


def run_one(name: str, scale: int, folder: str) -> dict:
    started = time.perf_counter()
    try:
        r = prepare(name, scale, folder)
    except Exception as e:  # noqa: BLE001
        return {"error": "%s: %s" % (type(e).__name__, str(e)[:300]), "scale": scale,
                "wall_seconds": time.perf_counter() - started}
    if "error" not in r:
        r["ort"] = measure_ort(r["model_path"], r["inputs_path"])
    r["torch"] = measure_torch(name, r["inputs_path"])
    r["scale"] = scale
    r["wall_seconds"] = time.perf_counter() - started
    return r


# ----------------------------------------------------------------------------- table --

def _ratio(r: dict, label: str) -> float | None:
    o, t = r.get("ort", {}).get(label, {}), r.get("torch", {})
    if "peak_bytes" not in o or not t.get("peak_bytes"):
        return None
    return o["peak_bytes"] / t["peak_bytes"]


def _peak(d: dict | None) -> str:
    if not d:
        return "-"
    if "error" in d:
        return "error: " + d["error"].replace("|", "/").replace("\n", " ")[:100]
    return pytorch_compare._mib(d["peak_bytes"])


def _summary(values: list[float]) -> str:
    if not values:
        return "no rows"
    return "%.2f-%.2fx, median %.2fx, every row <= %.2fx: %s (%d of %d)" % (
        min(values), max(values), statistics.median(values), TARGET,
        "yes" if all(v <= TARGET for v in values) else "no",
        sum(v <= TARGET for v in values), len(values))


def table(results: dict) -> str:
    head = ["model", "batch (zoo x scale)", "torch eager MiB", "ORT optimizations off MiB",
            "ORT default session MiB", "off / eager", "default / eager", "builder nodes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = {"optimizations_off": [], "default_session": []}
    for name, r in results.items():
        if "error" in r:
            batch = "%d (x%d)" % (r["batch"], r["scale"]) if "batch" in r else "-"
            lines.append("| %s | %s | %s | builder %s |%s" % (
                name, batch, _peak(r.get("torch")), _peak(r), " - |" * (len(head) - 4)))
            continue
        cells = [name, "%d (x%d)" % (r["batch"], r["scale"]), _peak(r["torch"]),
                 _peak(r["ort"]["optimizations_off"]), _peak(r["ort"]["default_session"])]
        for label in ("optimizations_off", "default_session"):
            x = _ratio(r, label)
            if x is not None:
                ratios[label].append(x)
            cells.append("-" if x is None else "%.2fx" % x)
        cells.append(str(r["nodes"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Peak of one training step (MiB), one thread. ORT / eager: optimizations off %s; "
                 "default session %s." % (_summary(ratios["optimizations_off"]),
                                          _summary(ratios["default_session"])))
    return "\n".join(lines)


# --------------------------------------------------------------------------- explain --

def explain(name: str, folder: str, top: int = 15) -> dict:
    """What is live at the peak of the cost model's simulation of the built graph in the
    order ONNX Runtime ran it (optimizations off): tensor, producing op, bytes. The cost
    graph is optimize's own (graphopt.pipeline.prepare, as analyze_model)."""
    import onnx

    from graphopt.costmodel import simulate
    from graphopt.inputs import load_inputs
    from graphopt.optimize import OptimizeOptions, prepare

    model = onnx.load(os.path.join(folder, name + ".onnx"))
    inputs = load_inputs(os.path.join(folder, name + ".npz"))
    options = OptimizeOptions(inputs=inputs, verify=False)
    with prepare(model, options, expand=False) as prepared:
        training, annotations, graph = prepared.training, prepared.annotations, prepared.graph
    order = [(op, 0) for op in annotations.execution_order if op in graph]
    sim = simulate(graph, order)
    live = live_at(graph, order, sim.peak_step)
    workspace = int(graph.ops[order[sim.peak_step][0]].workspace_bytes)
    producer = {o: n for n in training.model.graph.node for o in n.output}
    rows = []
    for tensor, nbytes in sorted(live.items(), key=lambda kv: -kv[1]):
        node = producer.get(tensor)
        phase = graph.phase(node.name) if node is not None and node.name in graph else "-"
        rows.append({"tensor": tensor, "op": node.op_type if node else "-",
                     "node": node.name if node else "-", "phase": phase, "bytes": nbytes})
    op = order[sim.peak_step][0]
    return {"predicted_peak_bytes": sim.peak_bytes, "peak_step": sim.peak_step, "steps": len(order),
            "peak_op": op, "peak_op_type": graph.ops[op].op_type,
            "peak_phase": graph.phase(op), "workspace_bytes": workspace,
            "live_bytes": sum(live.values()), "live": rows, "top": top}


def explain_text(name: str, e: dict) -> str:
    mib = pytorch_compare._mib
    lines = ["%s: predicted peak %s MiB (optimizations off) at step %d of %d, while %s (%s, %s) runs; "
             "%d tensors live (%s MiB) + work buffer %s MiB. The largest:"
             % (name, mib(e["predicted_peak_bytes"]), e["peak_step"], e["steps"], e["peak_op"],
                e["peak_op_type"], e["peak_phase"], len(e["live"]), mib(e["live_bytes"]),
                mib(e["workspace_bytes"])),
             "", "| tensor | op | phase | MiB |", "|---|---|---|---|"]
    for row in e["live"][:e["top"]]:
        lines.append("| %s | %s | %s | %s |" % (row["tensor"], row["op"], row["phase"], mib(row["bytes"])))
    return "\n".join(lines)


def live_at(graph, schedule, step: int) -> dict[str, int]:
    """Tensor -> bytes of the storages live while `step` runs, by graphopt.costmodel.simulate's
    rules (a storage lives from its producer to its last reader, graph outputs and never-read
    tensors to the end, aliases share their input's storage, folded/resident ones cost 0),
    each named by the tensor that allocated it."""
    tensor_bytes = graph.tensor_bytes
    resident, kept = graph.resident, graph.kept
    droppable = graph.droppable
    current: dict[str, int] = {}          # tensor -> storage index, -1 = resident
    names, born, last, is_kept = [], [], [], []
    for i, (op, copy) in enumerate(schedule):
        attrs = graph.ops[op]
        inputs = attrs.inputs
        for t in inputs:
            s = current.get(t)
            if s is not None and s >= 0:
                last[s] = i
        if attrs.folded:
            for t in attrs.outputs:
                current[t] = -1
            continue
        alias = attrs.alias and inputs
        for k, t in enumerate(attrs.outputs):
            if k == 0 and alias:
                s = current.get(inputs[0])
                if s is None and inputs[0] in resident:
                    s = -1
                if s is not None:
                    current[t] = s
                    if s >= 0 and copy == 0 and t in kept:
                        is_kept[s] = True
                    continue
            current[t] = len(names)
            names.append(t)
            born.append(i)
            last.append(i)
            is_kept.append(copy == 0 and t in kept)
    live = {}
    for s, t in enumerate(names):
        if last[s] == born[s]:               # never read: kept to the end unless droppable
            end = -1 if t in droppable else len(schedule)
        else:
            end = len(schedule) if is_kept[s] else last[s]
        if born[s] <= step <= end:
            live[t] = int(tensor_bytes.get(t, 0))
    return live


# ------------------------------------------------------------------------------ main --

def parse_scales(text: str, names) -> dict[str, int]:
    """'auto' | 'N' | 'NAME=N,...' -> model -> batch multiplier."""
    scales = {n: SCALES.get(n, FALLBACK_SCALE) for n in names}
    text = (text or "auto").strip()
    if text == "auto":
        return scales
    if text.isdigit():
        value = int(text)
        if value < 1:
            raise ValueError("--scale must be >= 1")
        return {n: value for n in names}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if not value.isdigit() or int(value) < 1 or name not in scales:
            raise ValueError("--scale: %r is not NAME=N for a selected model and N >= 1" % part)
        scales[name] = int(value)
    return scales


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help="comma-separated zoo names (default: all)")
    parser.add_argument("--scale", default="auto",
                        help="batch multiplier: N for every model, 'auto' (default: SCALES, tens of "
                             "MiB per torch step), or NAME=N,... (the rest auto)")
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--explain", type=int, default=0, metavar="K",
                        help="then show what is live at the predicted peak of the K worst rows")
    parser.add_argument("--keep", help="keep the built models and inputs in this folder")
    parser.add_argument("--unit-axes-kept", action="store_true",
                        help="build with the axes of extent 1 kept (graphopt/builder/unit_axes.py off: as before "
                             "issue 48)")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "INPUTS", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        return pytorch_compare.worker_main(lambda: torch_worker(*args.worker))

    import warnings
    warnings.filterwarnings("ignore")
    if args.unit_axes_kept:
        from graphopt.builder import train_graph
        train_graph.UNIT_AXES_DROPPED = False
    names = args.models.split(",") if args.models else list(_zoo())
    unknown = [n for n in names if n not in _zoo()]
    if unknown:
        parser.error("unknown model(s) %s (zoo: %s)" % (unknown, ", ".join(_zoo())))
    try:
        scales = parse_scales(args.scale, names)
    except ValueError as e:
        parser.error(str(e))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="builder-vs-eager-") as tmp:
        folder = args.keep or tmp
        os.makedirs(folder, exist_ok=True)
        results = {}
        for name in names:
            print("%s ..." % name, file=sys.stderr, flush=True)
            r = results[name] = run_one(name, scales[name], folder)
            print("  %.0f s%s" % (r["wall_seconds"], "" if "error" not in r else " " + r["error"]),
                  file=sys.stderr, flush=True)
        total = time.perf_counter() - started
        print(table(results))
        print("\nwhole run %.0f s" % total)
        explained = {}
        if args.explain:
            ranked = sorted((n for n in results if _ratio(results[n], "optimizations_off") is not None),
                            key=lambda n: -_ratio(results[n], "optimizations_off"))
            for name in ranked[:args.explain]:
                explained[name] = explain(name, folder)
                print()
                print(explain_text(name, explained[name]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scales": scales, "total_seconds": total, "results": results,
                       "explained": explained}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
