"""Savings where activations dominate (issue 11, item 5): the least-peak plan of graphopt's
`auto` on transformers at training-like sizes, measured, next to PyTorch eager and
torch.compile for the same step.

    python benchmarks/activation_heavy.py [--models gpt2,bert] [--size large]
        [--exporter legacy] [--no-torch] [--json out.json]

Per model, in fresh subprocesses (one model's memory does not stay for the next):

* ``real_zoo.CORPUS[name](size)`` (default "large": GPT-2 6 layers at 4 x 256 tokens, BERT-base
  at 8 x 256, T5-small 8 x 256, Llama / Qwen2 4 x 512, ViT-B/16 at 224 px batch 8), exported
  (eval mode, no loss) and built by ``build_training_graph(..., loss="cross_entropy")``, saved;
* in another process, ``graphopt.optimize.optimize(train, OptimizeOptions(inputs=its own inputs
  and labels, threads=1))`` (strategy ``auto``) on the saved graph: that process's peak RSS
  (column "optimize's own peak RSS": its ModelProtos; ONNX Runtime runs in its children, one at
  a time, each about one step), and from its report, the measured one-step peaks of the
  original under ONNX Runtime's default session and with graph optimizations off, of the
  returned model, step-time ratios, outputs identical, the profile in the planned order, the
  recompute nodes, the search seconds and the cost model's floor (no plan's predicted peak is
  below it: what the backward holds whatever is recomputed);
* PyTorch eager and torch.compile (default inductor) for the same module, inputs and loss
  (train mode, stochastic layers off, cross entropy mean), one thread, measured in a fresh
  process with graphopt's allocator settings by benchmarks/pytorch_compare.py's worker
  (through real_vs_eager's corpus step and builder_vs_eager's ``step_worker``); gradients are
  counted on both sides.

Prints one markdown table, peaks in MiB and ratios (optimized / original with optimizations
off, / default session, / eager, / compile). Slow: a large GPT-2 step takes tens of seconds
on one CPU thread and graphopt runs it about a dozen times (annotate, verify, order check,
three measurements with timing repeats); expect 10-20 minutes per model on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

MiB = 2 ** 20
TARGET = 0.6        # issue 11: optimized <= 0.6 x the original with optimizations off
DEFAULT_MODELS = ("gpt2", "bert")
TORCH_CONFIGS = ("eager", "compile")


# --------------------------------------------------------------- torch (subprocess) --

def torch_worker(name: str, size: str, inputs_path: str, config: str) -> dict:
    import builder_vs_eager
    import real_vs_eager
    return builder_vs_eager.step_worker(real_vs_eager._CorpusStep(size, inputs_path), name, config)


def measure_torch(name: str, size: str, inputs_path: str, config: str, timeout: float = 3600) -> dict:
    import builder_vs_eager
    return builder_vs_eager.run_worker(
        [os.path.abspath(__file__), "--torch-worker", name, size, inputs_path, config], timeout)


# ----------------------------------------------------------------- graphopt (subprocess) --

def build_row(name: str, size: str, exporter: str, folder: str) -> dict:
    """Export and build; the training graph and its inputs saved in `folder` (a worker
    process, so that torch's memory is gone before optimize runs)."""
    from graphopt_zoo import real_zoo
    from graphopt.builder.train_graph import build_training_graph
    from graphopt.inputs import save_inputs
    from graphopt.optimize import save_model

    row = {"model": name, "size": size, "exporter": exporter}
    model = real_zoo.CORPUS[name](size)
    feeds = real_zoo.model_feeds(model)
    row["inputs_path"] = os.path.join(folder, name + ".npz")
    save_inputs(row["inputs_path"], feeds)
    row["inputs"] = {k: list(v.shape) for k, v in feeds.items()}
    forward = real_zoo.export(model, exporter)
    train = build_training_graph(forward, loss="cross_entropy", class_axis=model.class_axis)
    row["nodes"] = len(train.graph.node)
    row["train_path"] = os.path.join(folder, name + ".train.onnx")
    save_model(train, row["train_path"])
    return row


def graphopt_row(row: dict) -> dict:
    """Optimize the saved training graph: the report's figures (a worker process of its own;
    ``optimize_peak_rss_bytes`` is its peak RSS, ONNX Runtime's children not counted)."""
    import onnx

    from graphopt.inputs import load_inputs
    from graphopt.optimize import OptimizeOptions, optimize

    train = onnx.load(row["train_path"])
    feeds = load_inputs(row["inputs_path"])
    result = optimize(train, OptimizeOptions(inputs=feeds, threads=1))
    report = result.report.to_dict()
    notes = result.plan.notes
    row["report"] = {k: report.get(k) for k in (
        "strategy", "nodes", "recompute_nodes", "search_seconds", "outputs_match",
        "max_relative_difference", "order_followed", "measured", "predicted", "ratios",
        "prediction_error", "outcome", "total_seconds")}
    row["peak_floor_bytes"] = notes.get("peak_floor_bytes")
    row["reached_floor"] = notes.get("reached_floor")
    from graphopt.runtime.rss import peak_rss_bytes
    row["optimize_peak_rss_bytes"] = peak_rss_bytes()
    return row


def _worker_main(argv) -> int:
    stage, name, size, exporter, folder = argv
    try:
        if stage == "build":
            row = build_row(name, size, exporter, folder)
        else:
            with open(os.path.join(folder, name + ".row.json")) as f:
                row = graphopt_row(json.load(f))
    except Exception as exc:   # one model's failure is a row of the table
        row = {"model": name, "size": size, "exporter": exporter,
               "error": "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else ""),
               "traceback": traceback.format_exc()}
    print(json.dumps(row, default=float))
    return 0


def _run_stage(stage: str, name: str, size: str, exporter: str, folder: str, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", stage, name, size, exporter, folder]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model": name, "error": "%s timed out after %d s" % (stage, timeout)}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = proc.stderr.strip().splitlines()
        return {"model": name, "error": "%s worker exit %d: %s" % (stage, proc.returncode, tail[-1] if tail else "")}
    return json.loads(lines[-1])


def measure_graphopt(name: str, size: str, exporter: str, folder: str, timeout: float = 7200) -> dict:
    """Build in one worker, optimize in another (torch's memory gone by then)."""
    row = _run_stage("build", name, size, exporter, folder, timeout)
    if "error" in row:
        return row
    with open(os.path.join(folder, name + ".row.json"), "w") as f:
        json.dump(row, f)
    return _run_stage("optimize", name, size, exporter, folder, timeout)


# ------------------------------------------------------------------------------ table --

def _mib(value) -> str:
    return "%.1f" % (value / MiB) if value else "-"


def _ratio(a, b) -> str:
    return "%.2fx" % (a / b) if a and b else "-"


def table(rows: list[dict]) -> str:
    head = ("| model | size | nodes | original, default session MiB | original, optimizations off MiB "
            "| optimized MiB | vs opt. off | vs default | eager MiB | vs eager | compile MiB | vs compile "
            "| step time vs opt. off | outputs identical | order followed | recompute nodes | floor MiB "
            "| search s | optimize's own peak RSS MiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        if "error" in row:
            lines.append("| %s | %s | error: %s |" % (row["model"], row.get("size", ""), row["error"]))
            continue
        rep = row["report"]
        measured = rep.get("measured") or {}
        default = (measured.get("original_default_session") or {}).get("peak_bytes")
        off = (measured.get("original_optimizations_off") or {}).get("peak_bytes")
        opt = (measured.get("optimized") or {}).get("peak_bytes")
        torch = row.get("torch", {})
        eager = torch.get("eager", {}).get("peak_bytes")
        comp = torch.get("compile", {}).get("peak_bytes")
        ratios = rep.get("ratios") or {}
        step = ratios.get("step_time_vs_optimizations_off")
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            row["model"], row["size"], row.get("nodes", "-"), _mib(default), _mib(off), _mib(opt),
            _ratio(opt, off), _ratio(opt, default), _mib(eager) if eager else torch.get("eager", {}).get("error", "-")[:40],
            _ratio(opt, eager), _mib(comp) if comp else torch.get("compile", {}).get("error", "-")[:40],
            _ratio(opt, comp), "%.2fx" % step if step else "-",
            rep.get("outputs_match"), rep.get("order_followed"), rep.get("recompute_nodes"),
            _mib(row.get("peak_floor_bytes")), "%.1f" % rep["search_seconds"] if rep.get("search_seconds") else "-",
            _mib(row.get("optimize_peak_rss_bytes"))))
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r and (r["report"].get("ratios") or {})]
    if not ok:
        return "no model measured"
    ratios = [r["report"]["ratios"]["peak_vs_optimizations_off"] for r in ok]
    met = sum(1 for x in ratios if x <= TARGET)
    return "optimized / original (optimizations off): %s; %d of %d at or below %.1fx" % (
        ", ".join("%s %.2fx" % (r["model"], x) for r, x in zip(ok, ratios)), met, len(ok), TARGET)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--size", default="large")
    parser.add_argument("--exporter", default="legacy")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--torch-worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker_main(args.worker)
    if args.torch_worker:
        name, size, inputs_path, config = args.torch_worker
        try:
            result = torch_worker(name, size, inputs_path, config)
        except Exception as exc:  # noqa: BLE001
            result = {"error": "%s: %s" % (type(exc).__name__, str(exc)[:300])}
        print(json.dumps(result, default=float))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="activation-heavy-") as folder:
        for name in args.models.split(","):
            started = time.perf_counter()
            row = measure_graphopt(name, args.size, args.exporter, folder)
            if not args.no_torch and "inputs_path" in row:
                row["torch"] = {config: measure_torch(name, args.size, row["inputs_path"], config)
                                for config in TORCH_CONFIGS}
            row["wall_seconds"] = time.perf_counter() - started
            rows.append(row)
            print("%s done in %.0f s" % (name, row["wall_seconds"]), file=sys.stderr, flush=True)
            if args.json:       # after each model: a long run keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1, default=float)
    print(table(rows))
    print()
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
