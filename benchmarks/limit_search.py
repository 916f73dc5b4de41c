"""The search for the least peak within a step-time limit: the bisection on the budget alone,
and followed by the local search within the limit (`auto.least_peak_local`,
`pipeline.LIMIT_SEARCH_REFINE`), side by side on the same cost graphs.

    python benchmarks/limit_search.py [--examples mlp,resnet] [--shares 0.03,0.1,0.25,0.5]

Each example is prepared once (annotated in ONNX Runtime as `optimize` does, no timing:
the cost graph's seconds are its profile's); for each limit, `share` of the way from
store-all's predicted step time to the least-peak plan's, `pipeline.plan` searches with the
bisection alone and then with the local search after it, every remembered plan forgotten
before each. Printed per row: the predicted peak of each (and its ratio to the bisection's),
whether the step is within the limit, and the search's CPU seconds; then the mean, best and
worst ratio over the rows and the CPU seconds in all. The cost model's numbers: no plan is
run here.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from graphopt import pipeline
from graphopt.examples import EXAMPLES, training_example
from graphopt.optimize import OptimizeOptions
from graphopt.search import store_all

auto_module = sys.modules["graphopt.search.auto"]
VARIANTS = {"bisection": False, "bisection + local search": True}


def rows_for(name: str, shares: list[float]) -> list[dict]:
    model, inputs = training_example(name)
    options = OptimizeOptions(inputs=inputs, verify=False, measure=False)
    rows = []
    with pipeline.prepare(model, options) as prepared:
        least = pipeline.plan(prepared, OptimizeOptions(inputs=inputs, verify=False, measure=False,
                                                        objective="least-peak"))
        fastest = store_all(prepared.graph).simulation.compute_seconds
        slowest = least.simulation.compute_seconds
        for share in shares:
            limit = fastest + share * (slowest - fastest)
            row = {"model": name, "share": share, "limit_seconds": limit}
            for label, refine in VARIANTS.items():
                pipeline.LIMIT_SEARCH_REFINE = refine
                prepared.plans.clear()
                auto_module._BUDGETLESS_SEEDS.clear()
                started = time.process_time()
                found = pipeline.plan(prepared, options, seconds_limit=limit)
                row[label] = {"cpu_seconds": time.process_time() - started, "peak_bytes": found.peak_bytes,
                              "within": found.simulation.compute_seconds <= limit * (1 + 1e-12)}
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--shares", default="0.03,0.1,0.25,0.5",
                        help="limits, as shares of the way from store-all's step time to the least peak's")
    args = parser.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    labels = list(VARIANTS)
    print("| model | limit (share) | " + " | ".join(f"{label}: peak MiB, CPU s" for label in labels)
          + " | with / without local search |")
    print("|---|---|" + "---|" * len(labels) + "---|")
    rows = []
    for name in [n for n in args.examples.split(",") if n]:
        for row in rows_for(name, shares):
            rows.append(row)
            cells = [f"{row[label]['peak_bytes'] / 2**20:.2f}{'' if row[label]['within'] else ' (over)'}, "
                     f"{row[label]['cpu_seconds']:.2f}" for label in labels]
            ratio = row[labels[1]]["peak_bytes"] / row[labels[0]]["peak_bytes"]
            print(f"| {name} | {row['share']:.2f} | " + " | ".join(cells) + f" | {ratio:.4f} |", flush=True)
    pipeline.LIMIT_SEARCH_REFINE = True
    ratios = [r[labels[1]]["peak_bytes"] / r[labels[0]]["peak_bytes"] for r in rows]
    cpu = {label: sum(r[label]["cpu_seconds"] for r in rows) for label in labels}
    print()
    print(f"- peak with the local search / without, over {len(rows)} limits: mean {statistics.mean(ratios):.4f}, "
          f"best {min(ratios):.4f}, worst {max(ratios):.4f}; lower on {sum(r < 1 for r in ratios)}")
    print(f"- search CPU in all: {cpu[labels[0]]:.1f} s without, {cpu[labels[1]]:.1f} s with "
          f"({cpu[labels[1]] / max(cpu[labels[0]], 1e-9):.2f}x)")
    print(f"- every plan within its limit: {all(r[label]['within'] for r in rows for label in labels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
