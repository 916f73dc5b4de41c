"""Lean graphs on real architectures (issue 11, item 4): the one-step peak of graphopt's BUILT
training graph of each corpus model (zoo/real_zoo.py) in ONNX Runtime, before any
checkpointing, next to PyTorch eager's for the same module, inputs and loss.

    python benchmarks/real_vs_eager.py [--models t5,llama] [--size full|tiny|large]
        [--exporter legacy|dynamo] [--explain K] [--keep DIR] [--json out.json]

Per model (default: every transformers model of the corpus, ViT-B/16 and a few CNNs):

* ``real_zoo.CORPUS[name](size)``, exported by ``real_zoo.export(model, exporter)`` (eval mode,
  no loss), built by ``build_training_graph(forward, loss="cross_entropy",
  class_axis=model.class_axis)``; its inputs and labels are the corpus model's own;
* ONNX Runtime: ``graphopt.runtime.measure.measure(..., threads=1)`` under the session graphopt
  measures originals with (``graphopt.optimize.ORIGINAL_UNOPTIMIZED``: graph optimizations,
  memory pattern and reuse off) and under a plain session (``DEFAULT_SETTINGS``), by
  benchmarks/builder_vs_eager.py's ``measure_ort``;
* PyTorch eager: the same module in train mode with its stochastic layers off
  (``real_zoo._train_mode``, as ``real_zoo.torch_step``), forward + cross entropy over the class
  axis (mean) + backward, on the same inputs and labels, measured by
  benchmarks/pytorch_compare.py's worker in a fresh process with graphopt's allocator settings
  and one thread (builder_vs_eager's ``step_worker``/``run_worker``). Gradients are counted on
  both sides (ORT returns them as outputs; torch keeps ``.grad``).

Prints a markdown table (model, training-graph nodes, eager MiB, built graph under
optimizations off MiB and its ratio to eager, default session MiB and its ratio) and a closing
line per ratio. ``--explain K``: for the K rows with the highest ratio under optimizations off,
what is live at the peak of the cost model's simulation of the built graph
(builder_vs_eager's ``explain``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import builder_vs_eager  # noqa: E402  (the ORT and torch measurements, --explain)

TRANSFORMERS = ("gpt2", "bert", "bert_classifier", "t5", "llama", "qwen2")
DEFAULT_MODELS = TRANSFORMERS + ("vit_b_16", "swin_t", "resnet50", "mobilenet_v3_large", "convnext_tiny")
TARGET = 1.05          # issue 11: built graph <= 1.05x PyTorch eager's peak


# ------------------------------------------------------------------ torch (subprocess) --

class _CorpusStep:
    """builder_vs_eager.step_worker's step for a corpus model: real_zoo.torch_step's semantics
    (train mode, stochastic layers off, cross entropy over the class axis, mean) on the saved
    inputs and labels."""

    def __init__(self, size: str, inputs_path: str):
        self.size, self.inputs_path = size, inputs_path

    def twin_example(self, name: str):
        import torch
        from torch.nn import functional as F

        from graphopt_zoo import real_zoo
        from graphopt.inputs import load_inputs

        model = real_zoo.CORPUS[name](self.size)
        feeds = load_inputs(self.inputs_path)
        labels = torch.from_numpy(feeds.pop("labels"))
        inner = real_zoo._train_mode(model.module)
        class_axis, input_names = model.class_axis, list(model.inputs)

        class Step(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner
                self.input_names = input_names

            def forward(self, *args):
                out = self.inner(*args)
                axis = class_axis if class_axis is not None else (1 if out.dim() == 2 else out.dim() - 1)
                return F.cross_entropy(out.movedim(axis, 1), labels)

        del model                # its own copy of the inputs
        return Step(), None, feeds

    @staticmethod
    def torch_inputs(module, inputs):
        import torch
        return tuple(torch.from_numpy(inputs[n]) for n in module.input_names)


def eager_measurement(name: str, size: str, feeds: dict, folder: str, timeout: float = 1800) -> dict:
    """PyTorch eager's one-step peak of corpus model `name` at `size` on `feeds` (inputs and
    labels), in a fresh process: {"peak_bytes", "loss", ...} or {"error"}."""
    from graphopt.inputs import save_inputs
    inputs_path = os.path.join(folder, name + ".eager.npz")
    save_inputs(inputs_path, feeds)
    return builder_vs_eager.run_worker([os.path.abspath(__file__), "--worker", name, size, inputs_path],
                                       timeout)


# ------------------------------------------------------------------ one architecture --

def prepare(name: str, size: str, exporter: str, folder: str) -> dict:
    """Export, save the inputs (folder/NAME.npz), build and save the training graph
    (folder/NAME.onnx, the names builder_vs_eager.explain reads)."""
    from graphopt_zoo import real_zoo
    from graphopt.builder.train_graph import build_training_graph
    from graphopt.inputs import save_inputs
    from graphopt.optimize import save_model

    model = real_zoo.CORPUS[name](size)
    feeds = real_zoo.model_feeds(model)
    r = {"inputs_path": os.path.join(folder, name + ".npz"),
         "inputs": {k: list(v.shape) for k, v in feeds.items()}}
    save_inputs(r["inputs_path"], feeds)
    started = time.perf_counter()
    forward = real_zoo.export(model, exporter)
    r["export_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    try:
        train = build_training_graph(forward, loss="cross_entropy", class_axis=model.class_axis)
    except Exception as e:  # noqa: BLE001  (a model the builder cannot do yet is a table cell)
        r["error"] = "%s: %s" % (type(e).__name__, str(e)[:300])
        return r
    r["build_seconds"] = time.perf_counter() - started
    r["nodes"] = len(train.graph.node)
    r["model_path"] = os.path.join(folder, name + ".onnx")
    save_model(train, r["model_path"])
    return r


def run_one(name: str, size: str, exporter: str, folder: str) -> dict:
    from graphopt.inputs import load_inputs
    started = time.perf_counter()
    try:
        r = prepare(name, size, exporter, folder)
    except Exception as e:  # noqa: BLE001
        return {"error": "%s: %s" % (type(e).__name__, str(e)[:300]),
                "wall_seconds": time.perf_counter() - started}
    if "error" not in r:
        r["ort"] = builder_vs_eager.measure_ort(r["model_path"], r["inputs_path"])
    r["torch"] = eager_measurement(name, size, load_inputs(r["inputs_path"]), folder)
    r["wall_seconds"] = time.perf_counter() - started
    return r


# ----------------------------------------------------------------------------- table --

def table(results: dict, size: str, exporter: str) -> str:
    peak, ratio = builder_vs_eager._peak, builder_vs_eager._ratio
    head = ["model", "nodes", "eager MiB", "built, optimizations off MiB", "ratio",
            "default session MiB", "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = {"optimizations_off": [], "default_session": []}
    for name, r in results.items():
        if "error" in r:
            lines.append("| %s | - | %s | %s | - | - | - |" % (name, peak(r.get("torch")), peak(r)))
            continue
        cells = [name, str(r["nodes"]), peak(r["torch"])]
        for label in ("optimizations_off", "default_session"):
            x = ratio(r, label)
            if x is not None:
                ratios[label].append(x)
            cells += [peak(r["ort"][label]), "-" if x is None else "%.2fx" % x]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Peak of one training step (MiB), one thread, size %s, %s exporter." % (size, exporter))
    for label, title in (("optimizations_off", "optimizations off"), ("default_session", "default session")):
        values = ratios[label]
        if values:
            lines.append("built / eager, %s: %.2f-%.2fx; %d of %d at or below %.2fx." % (
                title, min(values), max(values), sum(v <= TARGET for v in values), len(values), TARGET))
    return "\n".join(lines)


def explain_in_subprocess(name: str, folder: str, top: int, timeout: float = 1800) -> dict:
    """builder_vs_eager.explain of folder/NAME.onnx in a fresh process (a full-size model's
    cost graph and annotation run stay out of this one)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--explain-worker", name, folder, str(top)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after %d s" % timeout}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()
        return {"error": tail[-1] if tail else "exit %d" % proc.returncode}
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------ main --

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated corpus names (default: %(default)s)")
    parser.add_argument("--size", default="full", help="tiny | full | large (default: full)")
    parser.add_argument("--exporter", default="legacy", help="legacy | dynamo (default: legacy)")
    parser.add_argument("--explain", type=int, default=0, metavar="K",
                        help="then show what is live at the predicted peak of the K worst rows")
    parser.add_argument("--top", type=int, default=15, help="tensors listed per explained row")
    parser.add_argument("--keep", help="keep the built models and inputs in this folder")
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "SIZE", "INPUTS"), help=argparse.SUPPRESS)
    parser.add_argument("--explain-worker", nargs=3, metavar=("MODEL", "FOLDER", "TOP"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.explain_worker:
        name, folder, top = args.explain_worker
        print(json.dumps(builder_vs_eager.explain(name, folder, top=int(top)), default=str))
        return 0

    if args.worker:
        name, size, inputs_path = args.worker
        return builder_vs_eager.pytorch_compare.worker_main(
            lambda: builder_vs_eager.step_worker(_CorpusStep(size, inputs_path), name))

    import warnings
    warnings.filterwarnings("ignore")
    from graphopt_zoo import real_zoo
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in real_zoo.CORPUS]
    if unknown:
        parser.error("unknown model(s) %s (corpus: %s)" % (unknown, ", ".join(real_zoo.CORPUS)))
    if args.size not in real_zoo.SIZES:
        parser.error("--size must be one of %s" % (real_zoo.SIZES,))
    if args.exporter not in real_zoo.EXPORTERS:
        parser.error("--exporter must be one of %s" % (real_zoo.EXPORTERS,))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="real-vs-eager-") as tmp:
        folder = args.keep or tmp
        os.makedirs(folder, exist_ok=True)
        results = {}
        for name in names:
            print("%s ..." % name, file=sys.stderr, flush=True)
            r = results[name] = run_one(name, args.size, args.exporter, folder)
            print("  %.0f s%s" % (r["wall_seconds"], "" if "error" not in r else " " + r["error"]),
                  file=sys.stderr, flush=True)
        total = time.perf_counter() - started
        print(table(results, args.size, args.exporter), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"size": args.size, "exporter": args.exporter, "total_seconds": total,
                           "results": results}, f, indent=2, default=str)
        print("\nwhole run %.0f s" % total)
        explained = {}
        if args.explain:
            ratio = builder_vs_eager._ratio
            ranked = sorted((n for n in results if ratio(results[n], "optimizations_off") is not None),
                            key=lambda n: -ratio(results[n], "optimizations_off"))
            for name in ranked[:args.explain]:
                explained[name] = explain_in_subprocess(name, folder, args.top)
                print()
                print(builder_vs_eager.explain_text(name, explained[name]) if "error" not in explained[name]
                      else "%s: explain failed: %s" % (name, explained[name]["error"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "exporter": args.exporter, "total_seconds": total,
                       "results": results, "explained": explained}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
