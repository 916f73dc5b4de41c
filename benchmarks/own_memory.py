"""graphopt's own memory (issue 24, item 5): `graphopt optimize` (no limit, the default objective,
one thread) on each model, in a wrapper process whose children are graphopt's process tree
alone, and the largest process of that tree measured from outside it (RUSAGE_CHILDREN: every
descendant is waited for), beside the report's own account (graphopt/report.py GraphoptMemory):

* the largest single session a child ran (the weights as ONNX Runtime holds them, its
  structures, the inputs and the steps, in a process that held only that session) and the
  kind of child that ran it;
* the baseline: the largest RSS of a child after its imports, before it loaded anything;
* the bound, 1.25x that session + the baseline, and whether every process kept within it (the
  CLI's own process counted with what it grew by during the call);
* what the CLI's process held when optimize was called (the interpreter, graphopt, the model as
  read): the outside figure includes it, the bound does not; "outside ok" is whether the outside
  figure is within the bound plus that (less a baseline, which the bound already counts once).

    python benchmarks/own_memory.py [--examples mlp,transformer] [--corpus resnet50,gpt2]
        [--size tiny|full|large] [--exporter legacy|dynamo]

Each model in a fresh process. `benchmarks/memory_limit.py` prints the same columns for
`optimize --memory-limit`.
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

MiB = 2 ** 20


def run_one(kind: str, name: str, args) -> dict:
    from memory_limit import optimize_measured_from_outside, write_model
    with tempfile.TemporaryDirectory(prefix="graphopt-own-") as tmp:
        label, path, inputs_path = write_model(kind, name, args, tmp)
        row = {"model": label}
        out, report_path = os.path.join(tmp, "opt.onnx"), os.path.join(tmp, "r.json")
        started = time.perf_counter()
        done, largest_kib = optimize_measured_from_outside(path, inputs_path, out, report_path)
        row["seconds"] = time.perf_counter() - started
        row["outside_mib"] = largest_kib / 1024
        if done.returncode != 0:
            row["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else str(done.returncode)
            return row
        report = json.load(open(report_path))
    own = report["graphopt_memory"]
    row.update(step_mib=(own["largest_step_bytes"] or 0) / MiB, main_mib=(own["main_process_bytes"] or 0) / MiB,
               child_mib=(own["largest_child_bytes"] or 0) / MiB, child=own["largest_child"],
               session_mib=(own["largest_session_bytes"] or 0) / MiB, session=own["largest_session"],
               baseline_mib=(own["baseline_bytes"] or 0) / MiB, bound_mib=(own["bound_bytes"] or 0) / MiB,
               within_bound=own["within_bound"], caller_mib=(own["main_process_start_bytes"] or 0) / MiB,
               outcome=report["outcome"])
    row["outside_ok"] = row["outside_mib"] <= row["bound_mib"] + max(0.0, row["caller_mib"] - row["baseline_mib"])
    return row


def main() -> None:
    from memory_limit import add_model_arguments, model_jobs
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)   # (kind, name): in the worker process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args)))
        return
    jobs = model_jobs(args)
    print("| model | step measured MiB | outside MiB | largest child MiB | largest session MiB | baseline MiB "
          "| bound MiB | within (report) | caller MiB | outside ok | outcome | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for kind, name in jobs:
        done = subprocess.run([sys.executable, __file__, "--one", kind, name, "--size", args.size,
                               "--exporter", args.exporter], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"| {name} | failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode} |")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        if "error" in r:
            print(f"| {r['model']} | optimize: {r['error']} |", flush=True)
            continue
        rows.append(r)
        print(f"| {r['model']} | {r['step_mib']:.1f} | {r['outside_mib']:.1f} | {r['child_mib']:.1f} ({r['child']}) "
              f"| {r['session_mib']:.1f} ({r['session']}) | {r['baseline_mib']:.1f} | {r['bound_mib']:.1f} "
              f"| {r['within_bound']} | {r['caller_mib']:.1f} | {r['outside_ok']} | {r['outcome']} | {r['seconds']:.0f} |",
              flush=True)
    if rows:
        print(f"\nwithin the bound (report): {sum(bool(r['within_bound']) for r in rows)} of {len(rows)}; "
              f"outside figure within the bound + the caller's hold: {sum(r['outside_ok'] for r in rows)} of {len(rows)}; "
              f"largest process / largest session: "
              f"{min(r['outside_mib'] / r['session_mib'] for r in rows):.2f}-"
              f"{max(r['outside_mib'] / r['session_mib'] for r in rows):.2f}x")


if __name__ == "__main__":
    main()
