"""The time model against measurement (issue 25, item 3): for each model, the plans `optimize`
would measure at several step-time limits and the least-peak plan, each plan's predicted step
time against its measured one; then the one fitted constant of the model, the cost of a
recomputed copy over its node's profiled seconds (`op_rules.RECOMPUTE_FACTOR`), fitted on some
models and checked on the others.

    python benchmarks/time_model.py [--examples mlp,resnet] [--corpus mobilenet_v2,qwen2]
        [--fit mlp,resnet,densenet] [--threads N] [--json out.json]

Per model (a fresh process each, `--one`): the training graph is prepared as `optimize` prepares
it (annotated, its nodes timed in graphopt's order against the original under ONNX Runtime's
default session: `pipeline._time_baseline`); plans are searched for max overheads 0.1, 0.25 and
0.5 and for the least peak (duplicates dropped); then the original (default session), the plan
without recomputation (store-all) and every plan are timed in turn, step by step, in one
`time_steps` (5 rounds), each against the original as `optimize` measures a plan. A plan's
predicted step is `Simulation.compute_seconds` (store-all's nodes plus its recomputed copies at
the factor), its measured step the original's timed seconds times the rounds' median ratio.

The fit: measured = predicted store-all + factor x the recomputed copies' profiled seconds, least
squares on the relative error over the plans of the `--fit` models (default: the bundled
examples); the errors are printed for every plan at the factor in use and at the fitted one,
and summarized on the models not fitted on. The error of store-all itself (nothing recomputed)
is the part no factor changes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

OVERHEADS = (0.1, 0.25, 0.5)
ROUNDS = 5


def measure_one(kind: str, name: str, args) -> list[dict]:
    """The plans of one model, predicted and measured (see the module docstring)."""
    import onnx

    from graphopt import pipeline
    from graphopt.inputs import load_inputs
    from graphopt.optimize import OptimizeOptions
    from graphopt.options import LEAST_PEAK
    from graphopt.runtime.measure import time_steps
    from graphopt.runtime.session import DEFAULT_SETTINGS
    from graphopt.search import store_all
    from memory_limit import write_model

    with tempfile.TemporaryDirectory(prefix="graphopt-time-model-") as tmp:
        label, path, inputs_path = write_model(kind, name, args, tmp)
        model, inputs = onnx.load(path), load_inputs(inputs_path)
        options = OptimizeOptions(inputs=inputs, verify=False, measure=True, threads=args.threads)
        with pipeline.prepare(model, options) as prepared:
            graph = prepared.graph
            candidates = [(f"within {overhead:g}", pipeline.plan(prepared, dataclasses.replace(
                options, max_overhead=overhead))) for overhead in OVERHEADS]
            candidates.append(("least peak", pipeline.plan(prepared, dataclasses.replace(
                options, objective=LEAST_PEAK, max_overhead=None))))
            plans, seen = [], set()
            for what, plan in candidates:
                key = (plan.notes.get("base_order"), plan.checkpoints, plan.refresh_gap)
                if key not in seen and plan.recompute_ops > 0:
                    seen.add(key)
                    plans.append((what, plan))
            store = store_all(graph)
            workspace = prepared.workspace
            sessions = [(workspace.path("original"), DEFAULT_SETTINGS),
                        (workspace.save(pipeline.rewrite_plan(prepared, store), "tm-store-all"), None)]
            for k, (_, plan) in enumerate(plans):
                sessions.append((workspace.save(pipeline.rewrite_plan(prepared, plan), f"tm-plan{k}"), None))
            prepared.overlap.quiet()
            times = time_steps(sessions, workspace.inputs_path, provider=options.provider, threads=options.threads,
                               rounds=ROUNDS, max_seconds=120.0)
            default = prepared.timing.default_session_seconds
            store_measured = default * times.ratio(1, 0)
            scale = prepared.timing.seconds_scale
            ran = [op for op, copy in store.schedule if copy == 0]
            rows = []
            for k, (what, plan) in enumerate(plans):
                simulation = plan.simulation
                copies = [op for op, copy in plan.schedule if copy > 0]
                rows.append(dict(
                    model=label, plan=what, threads=options.threads, recompute_ops=plan.recompute_ops,
                    default_seconds=default, store_all_predicted=store.simulation.compute_seconds,
                    store_all_measured=store_measured,
                    predicted=simulation.compute_seconds, measured=default * times.ratio(k + 2, 0),
                    copies_seconds=simulation.recompute_seconds / graph.recompute_factor,
                    factor_in_use=graph.recompute_factor,
                    # as profiled, before the time stage's scale: the store-all step's nodes, the copies
                    profiled_nodes=len(ran), profiled_seconds=sum(graph.ops[op].seconds for op in ran) / scale,
                    copies=len(copies), copies_profiled_seconds=sum(graph.ops[op].seconds for op in copies) / scale))
            return rows


def fit_factor(rows: list[dict]) -> float:
    """The factor f minimizing the squared relative errors of store-all predicted + f x copies."""
    num = sum(r["copies_seconds"] / r["measured"] * (r["measured"] - r["store_all_predicted"]) / r["measured"]
              for r in rows)
    den = sum((r["copies_seconds"] / r["measured"]) ** 2 for r in rows)
    return num / den if den > 0 else 1.0


def error(row: dict, factor: float) -> float:
    return (row["store_all_predicted"] + factor * row["copies_seconds"]) / row["measured"] - 1


def _summary(rows: list[dict], factor: float) -> str:
    errors = [error(r, factor) for r in rows]
    if not errors:
        return "no plans"
    return (f"{sum(abs(e) <= 0.10 for e in errors)} of {len(errors)} within 10%, median |error| "
            f"{statistics.median(abs(e) for e in errors):.1%}, worst {max(errors, key=abs):+.1%}")


def main() -> int:
    from memory_limit import add_model_arguments, model_jobs
    argv = sys.argv[1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="ONNX Runtime's threads (default: the machine's cores, as the CLI)")
    parser.add_argument("--fit", default=None, help="models to fit the factor on (default: the examples)")
    parser.add_argument("--json", help="also write every row here")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "NAME"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one[0], args.one[1], args)))
        return 0
    rows, failed = [], []
    for kind, name in model_jobs(args):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", kind, name, "--threads", str(args.threads),
               "--size", args.size, "--exporter", args.exporter]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or [str(done.returncode)]
            failed.append(f"{name}: {tail[0]}")
            print(f"[{name}] failed: {tail[0]}", file=sys.stderr, flush=True)
            continue
        got = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"[{name}] {len(got)} plans", file=sys.stderr, flush=True)
        rows.extend(got)
    if not rows:
        print("no plan measured" + ("; failed: " + "; ".join(failed) if failed else ""))
        return 1
    fit_names = (args.fit.split(",") if args.fit is not None
                 else [n for kind, n in model_jobs(args) if kind == "example"])
    fit_rows = [r for r in rows if r["model"] in fit_names]
    held = [r for r in rows if r["model"] not in fit_names]
    in_use = rows[0]["factor_in_use"]
    fitted = fit_factor(fit_rows) if fit_rows else in_use
    print(f"Threads {rows[0]['threads']}; factor in use {in_use:g}, fitted on {', '.join(fit_names) or 'none'}: "
          f"{fitted:.3f}\n")
    print(f"| model | plan | recomputed nodes | store-all predicted / measured - 1 | copies' profiled s "
          f"| measured step s | predicted / measured - 1 at {in_use:g} | at {fitted:.2f} | fitted on |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['plan']} | {r['recompute_ops']} | "
              f"{r['store_all_predicted'] / r['store_all_measured'] - 1:+.1%} | {r['copies_seconds']:.3f} | "
              f"{r['measured']:.3f} | {error(r, in_use):+.1%} | {error(r, fitted):+.1%} | "
              f"{'yes' if r in fit_rows else 'no'} |")
    print()
    for what, subset in (("fitted on", fit_rows), ("not fitted on", held)):
        print(f"- {what} ({len({r['model'] for r in subset})} models): at {in_use:g} {_summary(subset, in_use)}; "
              f"at {fitted:.2f} {_summary(subset, fitted)}")
    if failed:
        print("- failed: " + "; ".join(failed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(factor_in_use=in_use, fitted=fitted, fit_on=fit_names, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
