"""Which order a plan starts from, and what that is worth (issue 24, item 1): per model, the
cost model's peaks (MiB) of the original in the order ONNX Runtime ran it (optimizations off),
of the plan without recomputation (SA: store-all) from the file's order and from ORT's, of the
least-peak plan (`auto`) from each, and of the plan for the default objective with the order
it came from; then, with `--measure`, `optimize` end to end: the measured peaks of the original
(both sessions) and of what is returned, beside the prediction.

    python benchmarks/base_order.py [--examples resnet,transformer] [--corpus bert,gpt2]
        [--size tiny|full|large] [--exporter legacy|dynamo] [--measure]

Each model in a fresh process (one model's memory does not stay for the next); one thread.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

MiB = 2 ** 20


def _model(kind: str, name: str, size: str, exporter: str):
    if kind == "example":
        from graphopt.examples import training_example
        return training_example(name, **({"small": True} if size == "tiny" else {}))
    from graphopt_zoo import real_zoo
    from graphopt.builder.train_graph import build_training_graph
    model = real_zoo.CORPUS[name](size)
    train = build_training_graph(real_zoo.export(model, exporter), loss="cross_entropy", class_axis=model.class_axis)
    return train, real_zoo.model_feeds(model)


def run_one(kind: str, name: str, size: str, exporter: str, measure: bool) -> dict:
    from graphopt.optimize import OptimizeOptions, optimize
    from graphopt.pipeline import prepare, plan
    train, inputs = _model(kind, name, size, exporter)
    row = {"model": name if kind == "example" else f"{name}-{exporter}"}
    options = OptimizeOptions(inputs=inputs, threads=1, measure=False, verify=False)
    with prepare(train, options) as prepared:
        row["original_ort_order_mib"] = prepared.predicted_original.peak_bytes / MiB
        row["store_all_mib"] = {k: v / MiB for k, v in prepared.base_order_peaks.items()}
        chosen = plan(prepared, options)
        row["plan_mib"] = chosen.peak_bytes / MiB
        # the least-peak plan from each candidate order, to see which order pays
        from graphopt.search import STRATEGIES
        row["auto_by_order_mib"] = {label: STRATEGIES["auto"](graph).peak_bytes / MiB
                                    for label, graph in prepared.base_graphs.items()}
        row["plan_order"] = chosen.notes.get("base_order")
    if measure:
        report = optimize(train, OptimizeOptions(inputs=inputs, threads=1)).report.to_dict()
        m = report["measured"]
        row.update(outcome=report["outcome"], predicted_mib=report["predicted"]["optimized"]["peak_bytes"] / MiB,
                   default_mib=m["original_default_session"]["peak_bytes"] / MiB,
                   off_mib=m["original_optimizations_off"]["peak_bytes"] / MiB,
                   returned_mib=m["optimized"]["peak_bytes"] / MiB,
                   step_vs_default=report["ratios"]["step_time_vs_default_session"],
                   outputs_match=report["outputs_match"], order_followed=report["order_followed"])
    return row


def main() -> None:
    from memory_limit import add_model_arguments, model_jobs
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--measure", action="store_true", help="also optimize end to end and measure")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)   # (kind, name): in the worker process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args.size, args.exporter, args.measure)))
        return
    jobs = model_jobs(args)
    header = (f"{'model':22s} {'orig(ORT)':>9s} {'SA file':>8s} {'SA ORT':>8s} {'least file':>10s} "
              f"{'least ORT':>9s} {'plan':>8s} {'from':>11s}"
              + ("  measured: default / off / returned MiB (predicted), step, outcome" if args.measure else ""))
    print(header, flush=True)
    for kind, name in jobs:
        command = [sys.executable, __file__, "--one", kind, name, "--size", args.size, "--exporter", args.exporter]
        done = subprocess.run(command + (["--measure"] if args.measure else []), capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{name:22s} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        sa, least = r["store_all_mib"], r["auto_by_order_mib"]
        nan = float("nan")
        line = (f"{r['model']:22s} {r['original_ort_order_mib']:9.1f} {sa.get('file', nan):8.1f} "
                f"{sa.get('onnxruntime', nan):8.1f} {least.get('file', nan):10.1f} {least.get('onnxruntime', nan):9.1f} "
                f"{r['plan_mib']:8.1f} {r['plan_order']:>11s}")
        if args.measure:
            line += (f"  {r['default_mib']:.1f} / {r['off_mib']:.1f} / {r['returned_mib']:.1f} "
                     f"({r['predicted_mib']:.1f}), {r['step_vs_default']:.2f}x, {r['outcome']}, "
                     f"outputs {r['outputs_match']}, order {r['order_followed']}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
