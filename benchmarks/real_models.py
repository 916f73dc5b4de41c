"""Real architectures through the whole road (issue 11): every model of the corpus
(zoo/real_zoo.py: torchvision and transformers, random init from their own configs),
exported by the legacy and the dynamo exporter, built into a training graph, checked against
torch, optimized and measured, printed side by side in one table.

    python benchmarks/real_models.py [--models resnet50,gpt2] [--size full|tiny|large]
        [--exporters legacy,dynamo] [--no-eager] [--no-grad-check] [--json out.json]
    python benchmarks/real_models.py --from-json a.json,b.json   # one table from saved runs

Per model and exporter, in a fresh subprocess (a model's memory does not stay for the next):

* export (eval mode, no loss), ``build_training_graph(..., loss="cross_entropy")``;
* gradients against torch (``real_zoo.gradient_check``): the worst max |g - g64| / max |g64|
  over all parameters against torch float64, beside the float32 floor on the same measure:
  the larger of torch's own float32-vs-float64 difference and how far float64 gradients move
  when parameters and inputs are nudged by one float32 epsilon;
* PyTorch eager's one-step peak for the same module, inputs and loss (train mode, stochastic
  layers off), measured like ONNX Runtime's: a fresh process, one thread, the same allocator
  settings, peak RSS growth during the step (benchmarks/real_vs_eager.py);
* ``graphopt.optimize`` with the model's own inputs and labels (strategy ``auto``, one
  thread): the measured peaks of the original under ONNX Runtime's default session and with
  graph optimizations off, and of what graphopt returns; step-time ratio against the default
  session; outputs identical; ORT's profile in the planned order; the report's outcome.

"built / eager" is the training graph before checkpointing, in the session graphopt runs
originals in (optimizations off), against PyTorch eager. Sizes: see zoo/real_zoo.py
("full" = the libraries' real configs at small inputs; "large" = activation-heavy).
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
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

MiB = 2 ** 20


def run_one(name: str, size: str, exporter: str, eager: bool, grad_check: bool) -> dict:
    """Everything measured for one model and exporter (runs in the worker process)."""
    import onnx

    from graphopt_zoo import real_zoo
    from graphopt.builder.train_graph import build_training_graph
    from graphopt.optimize import OptimizeOptions, optimize

    row = {"model": name, "exporter": exporter, "size": size}
    model = real_zoo.CORPUS[name](size)
    started = time.perf_counter()
    forward = real_zoo.export(model, exporter)
    row["export_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    train = build_training_graph(forward, loss="cross_entropy", class_axis=model.class_axis)
    row["build_seconds"] = time.perf_counter() - started
    row["nodes_forward"], row["nodes_training"] = len(forward.graph.node), len(train.graph.node)
    onnx.checker.check_model(train)
    feeds = real_zoo.model_feeds(model)
    if grad_check:
        check = real_zoo.gradient_check(model, forward, train, sensitivity_samples=2)
        row.update({k: check[k] for k in ("loss_error", "grad_error_fp64", "grad_error_fp32",
                                          "torch_fp32_vs_fp64", "fp32_sensitivity", "worst_fp64",
                                          "unmatched")})
    if eager:
        import real_vs_eager
        with tempfile.TemporaryDirectory(prefix="real-models-") as tmp:
            row["eager"] = real_vs_eager.eager_measurement(name, size, feeds, tmp)
    del forward
    result = optimize(train, OptimizeOptions(inputs=feeds, threads=1))
    report = result.report.to_dict()
    row["report"] = {k: report.get(k) for k in (
        "strategy", "nodes", "recompute_nodes", "search_seconds", "outputs_match",
        "max_relative_difference", "order_followed", "measured", "ratios", "prediction_error",
        "outcome", "total_seconds")}
    return row


def _worker_main(argv) -> int:
    name, size, exporter, eager, grad_check = argv[0], argv[1], argv[2], argv[3] == "1", argv[4] == "1"
    try:
        row = run_one(name, size, exporter, eager, grad_check)
    except Exception as exc:   # one model's failure is a row of the table, not the end of it
        row = {"model": name, "exporter": exporter, "size": size,
               "error": "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else ""),
               "traceback": traceback.format_exc()}
    print(json.dumps(row, default=float))
    return 0


def measure(name: str, size: str, exporter: str, eager: bool, grad_check: bool,
            timeout_seconds: float = 3600) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, size, exporter,
           "1" if eager else "0", "1" if grad_check else "0"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_seconds, env=env)
    except subprocess.TimeoutExpired:
        return {"model": name, "exporter": exporter, "error": "timed out after %d s" % timeout_seconds}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = proc.stderr.strip().splitlines()
        return {"model": name, "exporter": exporter,
                "error": "worker exit %d: %s" % (proc.returncode, tail[-1] if tail else "")}
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- table --

def _mib(value) -> str:
    return "%.1f" % (value / MiB) if value else "-"


def _ratio(a, b) -> str:
    return "%.2fx" % (a / b) if a and b else "-"


HEADER = ("| model | exporter | nodes | grad error vs fp64 (float32 floor) | eager MiB "
          "| built MiB (opt. off) | built / eager | default session MiB | returned MiB "
          "| vs opt. off | vs default | step time vs default | prediction error opt / orig | search s "
          "| outputs identical | order followed | outcome |")


def table_row(row: dict) -> str:
    if "error" in row:
        return "| %s | %s | - | %s |" % (row["model"], row["exporter"], row["error"].replace("|", "/"))
    report = row["report"]
    measured = report.get("measured") or {}
    off = (measured.get("original_optimizations_off") or {}).get("peak_bytes")
    default = (measured.get("original_default_session") or {}).get("peak_bytes")
    returned = (measured.get("optimized") or {}).get("peak_bytes")
    ratios = report.get("ratios") or {}
    eager = (row.get("eager") or {}).get("peak_bytes")
    grads = ("%.1e (%.1e)" % (row["grad_error_fp64"],
                              max(row["torch_fp32_vs_fp64"], row.get("fp32_sensitivity", 0.0)))
             if "grad_error_fp64" in row else "-")
    step = ratios.get("step_time_vs_default_session")
    errors = report.get("prediction_error") or {}
    predicted = ("%+.1f%% / %+.1f%%" % (100 * errors["optimized"], 100 * errors["original_optimizations_off"])
                 if errors else "-")
    search = report.get("search_seconds")
    return "| %s | %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
        row["model"], row["exporter"], row["nodes_training"], grads, _mib(eager), _mib(off),
        _ratio(off, eager), _mib(default), _mib(returned), _ratio(returned, off),
        _ratio(returned, default), "%.2fx" % step if step else "-", predicted,
        "%.1f" % search if search is not None else "-", report.get("outputs_match"),
        report.get("order_followed"), report.get("outcome", "-"))


def summary(rows: list[dict]) -> list[str]:
    ok = [r for r in rows if "error" not in r]
    lines = ["%d of %d model-exporter pairs went through the whole road." % (len(ok), len(rows))]
    built = [r["report"]["measured"]["original_optimizations_off"]["peak_bytes"] / r["eager"]["peak_bytes"]
             for r in ok if (r.get("eager") or {}).get("peak_bytes") and r["report"].get("measured")]
    if built:
        lines.append("built / eager: %.2f-%.2fx, median %.2fx; %d of %d at or below 1.05x."
                     % (min(built), max(built), statistics.median(built),
                        sum(b <= 1.05 for b in built), len(built)))
    returned = [r["report"]["ratios"]["peak_vs_default_session"] for r in ok if r["report"].get("ratios")]
    if returned:
        lines.append("returned / default session: %.2f-%.2fx, median %.2fx."
                     % (min(returned), max(returned), statistics.median(returned)))
    worse = [f"{r['model']}/{r['exporter']}" for r in ok if r["report"].get("ratios")
             and r["report"]["ratios"]["peak_vs_optimizations_off"] > 1.0
             and r["report"]["ratios"]["peak_vs_default_session"] > 1.0]
    lines.append("returned above the original under both sessions: %s." % (", ".join(worse) or "none"))
    lines.extend(prediction_summary(ok))
    return lines


def prediction_summary(rows: list[dict]) -> list[str]:
    """The largest |predicted / measured - 1| of the plan and of the original (optimizations
    off), naming the model, and the models above 3% (the goal)."""
    lines = []
    for key, label in (("optimized", "the plan"), ("original_optimizations_off", "the original, optimizations off")):
        errors = [(abs(e[key]), e[key], f"{r['model']}/{r['exporter']}") for r in rows
                  for e in [r["report"].get("prediction_error") or {}] if e.get(key) is not None]
        if errors:
            worst = max(errors)
            over = [f"{name} {value:+.1%}" for _, value, name in errors if abs(value) > 0.03]
            lines.append(f"max |prediction error|, {label}: {worst[0]:.1%} ({worst[2]}, {worst[1]:+.1%}); "
                         f"above 3%: {', '.join(over) or 'none'}.")
    return lines


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return _worker_main(sys.argv[2:])
    from graphopt_zoo import real_zoo
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(real_zoo.CORPUS))
    parser.add_argument("--size", default="full", choices=real_zoo.SIZES)
    parser.add_argument("--exporters", default=",".join(real_zoo.EXPORTERS))
    parser.add_argument("--no-eager", action="store_true", help="skip PyTorch eager's peak")
    parser.add_argument("--no-grad-check", action="store_true", help="skip the comparison with torch")
    parser.add_argument("--json", help="also write every row here")
    parser.add_argument("--from-json", help="print the table of rows saved by earlier runs' --json "
                        "(comma-separated files, e.g. runs of model subsets in parallel), in the "
                        "corpus's order; measures nothing")
    args = parser.parse_args()
    if args.from_json:
        order = {name: k for k, name in enumerate(real_zoo.CORPUS)}
        rows = [row for path in args.from_json.split(",") for row in json.load(open(path))]
        rows.sort(key=lambda r: (order.get(r["model"], len(order)),
                                 real_zoo.EXPORTERS.index(r["exporter"])
                                 if r["exporter"] in real_zoo.EXPORTERS else 0))
        print_table(rows)
        return 0
    rows = []
    for name in args.models.split(","):
        for exporter in args.exporters.split(","):
            started = time.perf_counter()
            print("%s (%s, %s) ..." % (name, exporter, args.size), file=sys.stderr, flush=True)
            row = measure(name, args.size, exporter, not args.no_eager, not args.no_grad_check)
            row["seconds"] = time.perf_counter() - started
            print("  %s in %.0f s" % ("error: " + row["error"] if "error" in row else "done",
                                      row["seconds"]), file=sys.stderr, flush=True)
            rows.append(row)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1, default=float)
    print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for row in rows:
        print(table_row(row))
    print()
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    sys.exit(main())
