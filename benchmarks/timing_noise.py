"""How far one timing of a plan against its original moves from the next on this machine (issue 25,
item 3: the time model is judged against these timings).

    python benchmarks/timing_noise.py [--examples resnet,densenet] [--repeats 6] [--threads N]

Each example's training graph is optimized once by the CLI as a user runs it (`graphopt
optimize`, its defaults); then the returned model is timed against the original under ONNX
Runtime's default session `--repeats` times, each time exactly as optimize's measure stage
times it (`runtime.measure.time_steps`, the pipeline's rounds and settle rule: fresh processes,
the sessions in turn, the median of the rounds' ratios). Printed per model: the report's
predicted and measured step of the plan it measured, every repeat's ratio, and their spread
(largest over smallest, and each repeat's distance from their median). A time model can be
checked against one timing no closer than that spread.
"""
from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", default="resnet,densenet,unet,randwire")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None, help="default: the CLI's (the machine's cores)")
    args = ap.parse_args()

    from memory_limit import write_model

    from graphopt import pipeline
    from graphopt.runtime.measure import time_steps
    from graphopt.runtime.session import DEFAULT_SETTINGS, machine_cores

    threads = args.threads or machine_cores()
    size = argparse.Namespace(size="full", exporter="legacy", optimizer=None)
    print(f"| model | threads | plan predicted / measured step by optimize (s) | returned / original, each repeat | "
          f"largest / smallest | repeats from their median |")
    print("|---|---|---|---|---|---|")
    for name in [n for n in args.examples.split(",") if n]:
        with tempfile.TemporaryDirectory(prefix="graphopt-noise-") as tmp:
            _, path, inputs_path = write_model("example", name, size, tmp)
            out, report_path = os.path.join(tmp, "opt.onnx"), os.path.join(tmp, "r.json")
            done = subprocess.run([sys.executable, "-m", "graphopt.cli", "optimize", path, "--inputs", inputs_path,
                                   "-o", out, "--report", report_path, "--threads", str(threads)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(f"| {name} | {threads} | optimize failed: {done.stderr.strip().splitlines()[-1:]} | | | |")
                continue
            with open(report_path) as f:
                report = json.load(f)
            plans = ", ".join(f"{p['predicted_step_seconds']:.3f} / {p['measured_step_seconds']:.3f}"
                              for p in report.get("plans_measured") or []
                              if p.get("predicted_step_seconds") and p.get("measured_step_seconds"))
            ratios = []
            for _ in range(args.repeats):
                times = time_steps([(path, DEFAULT_SETTINGS), (out, None)], inputs_path, threads=threads,
                                   rounds=pipeline.TIMING_ROUNDS, max_seconds=pipeline.TIMING_MAX_SECONDS,
                                   settle=pipeline.TIMING_SETTLE)
                ratios.append(times.ratio(1, 0))
            mid = statistics.median(ratios)
            print(f"| {name} | {threads} | {plans or report.get('outcome')} | {', '.join(f'{r:.3f}' for r in ratios)} | "
                  f"{max(ratios) / min(ratios):.3f} | {min(ratios) / mid - 1:+.1%} to {max(ratios) / mid - 1:+.1%} |",
                  flush=True)


if __name__ == "__main__":
    main()
