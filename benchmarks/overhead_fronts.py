"""What each step-time overhead buys, on the cost model: for each example, the least peak
`auto` finds within (1 + F) x the original's step time under ONNX Runtime's default session,
for several F, and the least peak whatever the time. No plan is rewritten or measured here (the
peaks are predicted; the baseline's peak and step time, and the time model's seconds, are
measured once per example by `prepare`): it is how the default overhead was chosen
(docs/design.md, "Choices, and why"); benchmarks/overhead_table.py measures the chosen points.

    python benchmarks/overhead_fronts.py [--examples mlp,resnet] [--overheads 0.05,0.1,0.25,0.5]

Each cell: predicted peak / the original's measured peak under the default session, and the
predicted step time / the default session's (timed in the same process as the baseline).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from graphopt.examples import EXAMPLES, training_example  # noqa: E402
from graphopt.options import OptimizeOptions  # noqa: E402
from graphopt.pipeline import measure_original, prepare  # noqa: E402
from graphopt.runtime.session import DEFAULT_SETTINGS  # noqa: E402
from graphopt.search import STRATEGIES, least_peak_within  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--overheads", default="0.05,0.1,0.15,0.2,0.25,0.3,0.5")
    args = parser.parse_args()
    overheads = [float(f) for f in args.overheads.split(",")]
    print(f"load average before: {os.getloadavg()}", flush=True)
    solve = STRATEGIES["auto"]
    rows = {}
    for name in args.examples.split(","):
        print(f"{name} ...", file=sys.stderr, flush=True)
        model, inputs = training_example(name)
        options = OptimizeOptions(inputs=inputs)
        with prepare(model, options, reference=False) as prepared:
            timing = prepared.timing
            base = timing.default_session_seconds
            peak = measure_original(prepared, options, DEFAULT_SETTINGS, timing=False).peak_bytes
            least = solve(prepared.graph)
            cells = {}
            for f in overheads:
                plan = least_peak_within(prepared.graph, solve, (1 + f) * base, least_peak=least)
                cells[f] = (plan.peak_bytes / peak, plan.simulation.compute_seconds / base)
            cells["least"] = (least.peak_bytes / peak, least.simulation.compute_seconds / base)
            rows[name] = (timing.store_all_seconds / base, cells)
    keys = overheads + ["least"]
    print("| model | no recomputation: step vs default | " + " | ".join(
        f"F = {k}" if k != "least" else "least peak" for k in keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for name, (store_all, cells) in rows.items():
        print(f"| {name} | {store_all:.2f}x | " + " | ".join(
            f"{cells[k][0]:.2f} at {cells[k][1]:.2f}x" for k in keys) + " |")
    print("| median | | " + " | ".join(
        f"{statistics.median(c[k][0] for _, c in rows.values()):.2f}" for k in keys) + " |")
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
