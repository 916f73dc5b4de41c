"""Optimize every bundled example and print, side by side, the measured peak memory of one
training step in ONNX Runtime (original under the default session, original with graph
optimizations off, Chen's sqrt(n) plan, optimized), step-time ratios, the cost model's
prediction error, and whether the outputs are identical.

    python benchmarks/zoo_table.py [--examples mlp,resnet] [--strategy auto] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# this checkout's graphopt, not whichever one is installed (`python benchmarks/zoo_table.py`
# puts benchmarks/ first on the path, not the repository)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from graphopt.examples import EXAMPLES, training_example
from graphopt.optimize import OptimizeOptions, optimize
from graphopt.pipeline import measure_model, prepare, rewrite_plan
from graphopt.search import chen_sqrt
from graphopt.search import DEFAULT_STRATEGY


def _x(ratio) -> str:
    """A ratio, or "-" where it was not measured."""
    return "-" if ratio is None else f"{ratio:.2f}x"


def mib(n):
    return f"{n / 2**20:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--strategy", default=DEFAULT_STRATEGY)
    parser.add_argument("--json", help="also write the reports here")
    args = parser.parse_args()
    rows, reports = [], {}
    header = ("| model | nodes | peak default session MiB | peak optimizations off MiB | peak Chen sqrt(n) MiB "
              "| peak optimized MiB | vs default | vs off | vs Chen | step time vs default | vs off "
              "| prediction error opt / orig | recompute nodes | outputs identical |")
    for name in args.examples.split(","):
        print(f"optimizing {name} ...", file=sys.stderr, flush=True)
        model, inputs = training_example(name)
        report = optimize(model, OptimizeOptions(inputs=inputs, strategy=args.strategy)).report.to_dict()
        options = OptimizeOptions(inputs=inputs, verify=False)
        with prepare(model, options) as prepared:
            chen = measure_model(prepared, rewrite_plan(prepared, chen_sqrt(prepared.graph)), options)
        report["measured"]["chen_sqrt"] = {"peak_bytes": chen.peak_bytes, "step_seconds": chen.step_seconds}
        reports[name] = report
        m, r, e = report["measured"], report["ratios"], report["prediction_error"]
        rows.append(
            f"| {name} | {report['nodes']['original']} | {mib(m['original_default_session']['peak_bytes'])} "
            f"| {mib(m['original_optimizations_off']['peak_bytes'])} | {mib(m['chen_sqrt']['peak_bytes'])} "
            f"| {mib(m['optimized']['peak_bytes'])} "
            f"| {r['peak_vs_default_session']:.2f}x | {r['peak_vs_optimizations_off']:.2f}x "
            f"| {m['optimized']['peak_bytes'] / m['chen_sqrt']['peak_bytes']:.2f}x "
            f"| {r['step_time_vs_default_session']:.2f}x | {_x(r.get('step_time_vs_optimizations_off'))} "
            f"| {e['optimized']:+.1%} / {e['original_optimizations_off']:+.1%} "
            f"| {report['recompute_nodes']} | {report['outputs_match']} |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    print("\n".join(rows))
    print()
    for key, label in (("optimized", "the plan"), ("original_optimizations_off", "the original, optimizations off")):
        errors = {name: r["prediction_error"][key] for name, r in reports.items()}
        worst = max(errors, key=lambda name: abs(errors[name]))
        over = [f"{name} {e:+.1%}" for name, e in errors.items() if abs(e) > 0.03]
        print(f"max |prediction error|, {label}: {abs(errors[worst]):.1%} ({worst}, {errors[worst]:+.1%}); "
              f"above 3%: {', '.join(over) or 'none'}.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
