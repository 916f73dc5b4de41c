"""Memory at a chosen time cost, measured: every example (and, with --corpus, the real-model
corpus) optimized under each objective, side by side in one run.

    python benchmarks/overhead_table.py [--examples mlp,resnet] [--objectives default,0.1,least-peak]
        [--corpus resnet50,bert] [--size full] [--json out.json]

Objectives: `default` (bounded-overhead at graphopt.options.DEFAULT_MAX_OVERHEAD), a number F
(`max_overhead=F`), `least-peak`. For each model and objective, one `optimize` (CPU, one
thread; its own measurements): the returned model's measured peak against the original's under
ONNX Runtime's default session, its measured step time against that session's (timed against
each other in one process: `pipeline.measure_plan`), the predicted step time against it, and
the prediction error of the step time (predicted / measured overhead - 1) for the returned plan
and for the graph planned with optimizations off (the original after ORT's offline graph
optimizations), and graphopt's settings with nothing recomputed against the faster of the
original's two sessions. Summary lines: the largest measured overhead and
the median peak ratio per objective, the largest step-time prediction errors. The load average
is printed before and after: timings taken while other work shares the cores move.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from graphopt.examples import EXAMPLES, training_example  # noqa: E402
from graphopt.optimize import OptimizeOptions, optimize  # noqa: E402
from graphopt.options import DEFAULT_MAX_OVERHEAD  # noqa: E402


def objective_options(objective: str) -> dict:
    if objective == "default":
        return {}
    if objective == "least-peak":
        return {"objective": "least-peak"}
    return {"max_overhead": float(objective)}


def corpus_models(names: list[str], size: str):
    """(name, training model, inputs) of the real-model corpus (zoo/real_zoo.py): exported by
    the legacy exporter and built with a cross-entropy loss, as benchmarks/real_models.py does."""
    from graphopt_zoo import real_zoo
    from graphopt.builder.train_graph import build_training_graph
    for name in names:
        model = real_zoo.CORPUS[name](size)
        train = build_training_graph(real_zoo.export(model, "legacy"), loss="cross_entropy",
                                     class_axis=model.class_axis)
        yield name, train, real_zoo.model_feeds(model)


def row(name: str, objective: str, report: dict) -> dict:
    m, r, e, o = report["measured"], report["ratios"], report["prediction_error"], report["objective"]
    baseline = o["baseline_step_seconds"]
    predicted_overhead = o["predicted_step_seconds"] / baseline if report["outcome"] == "optimized" else 1.0
    return {"model": name, "objective": objective, "outcome": report["outcome"],
            "peak_default_mib": m["original_default_session"]["peak_bytes"] / 2**20,
            "peak_off_mib": m["original_optimizations_off"]["peak_bytes"] / 2**20,
            "peak_mib": m["optimized"]["peak_bytes"] / 2**20,
            "peak_vs_default": r["peak_vs_default_session"],
            "step_vs_default": r["step_time_vs_default_session"],
            "predicted_step_vs_default": predicted_overhead,
            "step_error": e.get("optimized_step_time") if report["outcome"] == "optimized" else None,
            "original_step_error": e.get("original_optimizations_off_step_time"),
            "store_all_vs_faster": o.get("store_all_vs_faster_original"),
            "graph_optimizations": report.get("graph_optimizations", {}).get("level", "none"),
            "recompute_nodes": report["recompute_nodes"], "outputs_match": report["outputs_match"],
            "search_seconds": report["search_seconds"]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", default=",".join(EXAMPLES), help="comma-separated; empty: none")
    parser.add_argument("--corpus", default="", help="comma-separated names of zoo/real_zoo.py models")
    parser.add_argument("--size", default="full", help="corpus size (zoo/real_zoo.py)")
    parser.add_argument("--objectives", default="default,0.1,least-peak")
    parser.add_argument("--json", help="also write the rows and reports here")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    objectives = [o for o in args.objectives.split(",") if o]
    cases = [(n, *training_example(n)) for n in args.examples.split(",") if n]
    names = [n for n in args.corpus.split(",") if n]
    rows, reports = [], {}

    def run(name, model, inputs):
        for objective in objectives:
            print(f"optimizing {name} ({objective}) ...", file=sys.stderr, flush=True)
            report = optimize(model, OptimizeOptions(inputs=inputs, **objective_options(objective))).report.to_dict()
            reports[f"{name} {objective}"] = report
            rows.append(row(name, objective, report))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    for name, model, inputs in cases:
        run(name, model, inputs)
    if names:
        for name, model, inputs in corpus_models(names, args.size):
            run(name, model, inputs)

    print(f"\ndefault objective: bounded-overhead, max overhead {DEFAULT_MAX_OVERHEAD}")
    print("| model | objective | peak default session MiB | returned MiB | vs default | step vs default "
          "(measured) | predicted | step prediction error | original (opt. off) step prediction error "
          "| no recompute vs faster original session | graph optimizations | recompute nodes | outcome "
          "| outputs identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        err = "-" if x["step_error"] is None else f"{x['step_error']:+.1%}"
        original_err = "-" if x["original_step_error"] is None else f"{x['original_step_error']:+.1%}"
        print(f"| {x['model']} | {x['objective']} | {x['peak_default_mib']:.1f} | {x['peak_mib']:.1f} "
              f"| {x['peak_vs_default']:.2f}x | {x['step_vs_default']:.2f}x | {x['predicted_step_vs_default']:.2f}x "
              f"| {err} | {original_err} | {x['store_all_vs_faster']:.2f}x "
              f"| {x['graph_optimizations']} | {x['recompute_nodes']} | {x['outcome']} "
              f"| {x['outputs_match']} |")
    print()
    for objective in objectives:
        mine = [x for x in rows if x["objective"] == objective]
        worst = max(mine, key=lambda x: x["step_vs_default"])
        print(f"{objective}: largest step time vs default session {worst['step_vs_default']:.2f}x ({worst['model']}); "
              f"median peak vs default session {statistics.median(x['peak_vs_default'] for x in mine):.2f}x "
              f"over {len(mine)} models")
    errors = [(abs(x["step_error"]), x["model"], x["objective"]) for x in rows if x["step_error"] is not None]
    originals = [(abs(x["original_step_error"]), x["model"]) for x in rows if x["original_step_error"] is not None]
    if errors:
        print(f"largest |step prediction error| of a returned plan: {max(errors)[0]:.1%} ({max(errors)[1]}, "
              f"{max(errors)[2]}); above 10%: {sum(e[0] > 0.10 for e in errors)} of {len(errors)}")
    if originals:
        print(f"largest |step prediction error| of the original (optimizations off): {max(originals)[0]:.1%} "
              f"({max(originals)[1]})")
    timed = [x for x in rows if x["store_all_vs_faster"] is not None]   # one timing per optimize
    if timed:
        worst = max(timed, key=lambda x: x["store_all_vs_faster"])
        print(f"graphopt's settings with nothing recomputed vs the faster of the original's two sessions: "
              f"largest {worst['store_all_vs_faster']:.2f}x ({worst['model']}, {worst['objective']}); at most "
              f"1.02x in {sum(x['store_all_vs_faster'] <= 1.02 for x in timed)} of {len(timed)} runs")
    print(f"load average after: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "reports": reports}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
