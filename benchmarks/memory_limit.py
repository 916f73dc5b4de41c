"""The step that does not fit (issue 24): per model, what its original needs in ONNX Runtime
(the weights, the inputs and its step's peak measured under the default session), a memory limit
at `--fraction` of that, the original run under the limit (ONNX Runtime capped at it, two
steps), then `graphopt optimize --memory-limit` in a process of its own: whether what it
returns runs under the limit (in a run of its own, not the report's), its step peak and step
time against the original's, measured here without a limit (the step time timed in turn with the
original's), the batches graphopt annotated at (`full`, or the two reduced batches when the
original did not run under the limit), whether the outputs matched, and graphopt's largest process
(the peak resident memory of its process tree, measured from outside it) against the original's
step; then the report's own account (graphopt/report.py GraphoptMemory): its largest child, the
largest single session a child ran, the bound 1.25x that + the children's baseline, whether
every process kept within it, and what the CLI's process held when optimize was called (the
model as loaded: the caller's, which the bound leaves out and the outside figure includes). With `--optimizer adamw` the models are built with the optimizer step inside and both are
trained `--steps` steps: the original without a limit, the returned model under it; the
largest difference of their losses is printed.

    python benchmarks/memory_limit.py [--examples mlp,transformer] [--corpus resnet18,bert]
        [--size tiny|full|large] [--exporter legacy|dynamo] [--fraction 0.6]
        [--optimizer adamw --steps 4]

Each model in a fresh process; one thread.
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
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MiB = 2 ** 20


LARGE_BATCH_SCALE = 8   # `--size large` for a bundled example: its batch times this (a GPU-sized step)


def scaled_batch(name: str, scale: int) -> dict:
    """The size arguments of bundled example `name` at `scale` times its default batch (1: as bundled)."""
    if scale == 1:
        return {}
    import inspect

    from graphopt import examples
    return {"batch": inspect.signature(getattr(examples, name)).parameters["batch"].default * scale}


def _example_size(name: str, size: str) -> dict:
    """The size arguments of bundled example `name` at `size` (tiny, full, large)."""
    if size == "tiny":
        return {"small": True}
    return scaled_batch(name, LARGE_BATCH_SCALE if size == "large" else 1)


def _model(kind: str, name: str, size: str, exporter: str, optimizer: str | None):
    from graphopt.builder.optimizer import OptimizerSpec
    from graphopt.builder.train_graph import build_training_graph
    spec = OptimizerSpec(optimizer, lr=1e-3) if optimizer else None
    if kind == "example":
        from graphopt.examples import example_inputs, forward_example
        forward = forward_example(name, **_example_size(name, size))
        return build_training_graph(forward, optimizer=spec), example_inputs(forward)
    from graphopt_zoo import real_zoo
    model = real_zoo.CORPUS[name](size)
    train = build_training_graph(real_zoo.export(model, exporter), loss="cross_entropy", class_axis=model.class_axis,
                                 optimizer=spec)
    return train, real_zoo.model_feeds(model)


def add_model_arguments(parser) -> None:
    """The models a benchmark of this family runs: bundled examples, corpus models, their size
    and exporter (`model_jobs`, `write_model`)."""
    parser.add_argument("--examples", default="mlp,resnet,densenet,unet,transformer,randwire")
    parser.add_argument("--corpus", default="")
    parser.add_argument("--size", default="full", choices=("tiny", "full", "large"))
    parser.add_argument("--exporter", default="legacy", choices=("legacy", "dynamo"))


def model_jobs(args) -> list[tuple[str, str]]:
    """(kind, name) of every model `add_model_arguments`' flags name, examples first."""
    return ([("example", n) for n in args.examples.split(",") if n]
            + [("corpus", n) for n in args.corpus.split(",") if n])


def write_model(kind: str, name: str, args, folder: str) -> tuple[str, str, str]:
    """The training graph of (kind, name) and its inputs written in `folder` (its optimizer inside
    when `args` has one): (the row's label, the model's path, the inputs' path)."""
    import onnx

    from graphopt.inputs import save_inputs
    optimizer = getattr(args, "optimizer", None)
    train, inputs = _model(kind, name, args.size, args.exporter, optimizer)
    path, inputs_path = os.path.join(folder, "train.onnx"), os.path.join(folder, "inputs.npz")
    onnx.save(train, path)
    save_inputs(inputs_path, inputs)
    label = name if kind == "example" else f"{name}-{args.exporter}"
    notes = [n for n in (args.size if args.size != "full" else None, optimizer) if n]
    return (f"{label} ({', '.join(notes)})" if notes else label), path, inputs_path


def optimize_measured_from_outside(path: str, inputs_path: str, out: str, report_path: str, *flags: str):
    """`graphopt optimize` (one thread) in a wrapper process of its own, whose children are
    graphopt's process tree alone (every descendant is waited for by its parent, so the largest
    counts): (the wrapper's CompletedProcess, the largest RSS of that tree in KiB)."""
    wrapper = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(done.returncode)")
    done = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "graphopt.cli", "optimize", path,
                           "--inputs", inputs_path, "-o", out, "--report", report_path, "--threads", "1", *flags],
                          capture_output=True, text=True)
    return done, int(done.stdout.strip().splitlines()[-1])


def run_one(kind: str, name: str, args) -> dict:
    import numpy as np
    import onnx

    from graphopt.inputs import save_inputs
    from graphopt.runtime.limit import initializer_bytes
    from graphopt.runtime.measure import measure, run_within_limit
    from graphopt.runtime.session import DEFAULT_SETTINGS
    train, inputs = _model(kind, name, args.size, args.exporter, args.optimizer)
    row = {"model": name if kind == "example" else f"{name}-{args.exporter}"}
    with tempfile.TemporaryDirectory(prefix="graphopt-limit-") as tmp:
        path, inputs_path, out = (os.path.join(tmp, f) for f in ("train.onnx", "inputs.npz", "opt.onnx"))
        onnx.save(train, path)
        save_inputs(inputs_path, inputs)
        step = measure(path, inputs_path, DEFAULT_SETTINGS, timing=False).peak_bytes
        if args.optimizer:   # what `graphopt train` holds outside ONNX Runtime's arena
            from graphopt.train import outside_session_bytes, plan_inputs
            data_inputs, feedback = plan_inputs(train)
            batch = next(iter(inputs.values())).shape[0]
            outside = outside_session_bytes(train, inputs, data_inputs, batch, set(feedback.values()))
        else:
            outside = initializer_bytes(train) + sum(v.nbytes for v in inputs.values())
        need = outside + step
        limit = int(args.fraction * need)
        row.update(step_mib=step / MiB, need_mib=need / MiB, limit_mib=limit / MiB)
        row["original_fits"] = run_within_limit(path, inputs_path, limit, DEFAULT_SETTINGS).fits
        started = time.perf_counter()
        done, largest_kib = optimize_measured_from_outside(path, inputs_path, out, os.path.join(tmp, "r.json"),
                                                          "--memory-limit", str(limit))
        row["optimize_seconds"] = time.perf_counter() - started
        row["graphopt_largest_mib"] = largest_kib / 1024
        if done.returncode != 0:
            row["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else str(done.returncode)
            return row
        report = json.load(open(os.path.join(tmp, "r.json")))
        own = report["graphopt_memory"]
        # the report's bound (graphopt/report.py GraphoptMemory) and what the CLI's process held
        # when optimize was called (the model as loaded, the interpreter), which the bound does
        # not count but the outside measurement does
        row.update(session_mib=(own["largest_session_bytes"] or 0) / MiB, bound_mib=(own["bound_bytes"] or 0) / MiB,
                   within_bound=own["within_bound"], caller_mib=(own["main_process_start_bytes"] or 0) / MiB,
                   largest_child_mib=(own["largest_child_bytes"] or 0) / MiB)
        # measured here, from outside graphopt, without a limit: the returned model's step peak, and
        # its step time against the original's (default session) timed in turn
        from graphopt.runtime.measure import time_steps
        times = time_steps([(path, DEFAULT_SETTINGS), (out, None)], inputs_path, rounds=5)
        reduced = report.get("reduced")
        row.update(outcome=report["outcome"], returned_mib=measure(out, inputs_path, None, timing=False).peak_bytes / MiB,
                   step_vs_default=times.ratio(1, 0), outputs_match=report["outputs_match"],
                   plans_tried=len(report["memory_limit"]["attempts"]),
                   annotated_at="full" if reduced is None else "/".join(map(str, reduced["annotated_batches"])))
        row["returned_fits"] = run_within_limit(out, inputs_path, limit).fits
        if args.optimizer:
            from graphopt.train import train as run_training
            data = {k: np.concatenate([v] * 2) for k, v in inputs.items()}
            free = run_training(path, data, args.steps, threads=1).losses
            limited = run_training(out, data, args.steps, threads=1, memory_limit_bytes=limit).losses
            row["loss_max_difference"] = float(np.max(np.abs(np.subtract(free, limited))))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--fraction", type=float, default=0.6, help="the limit, as a fraction of the original's need")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), help="build the optimizer step in, and train")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)   # (kind, name): in the worker process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args)))
        return
    jobs = model_jobs(args)
    print(f"{'model':22s} {'step':>7s} {'need':>7s} {'limit':>7s} {'original':>9s} {'returned':>9s} "
          f"{'ret. step':>9s} {'time':>6s} {'annotated':>9s} {'outputs':>7s} {'plans':>5s} {'graphopt':>9s} {'/step':>6s} "
          f"{'child':>7s} {'session':>7s} {'bound':>7s} {'within':>6s} {'caller':>7s} {'secs':>6s}"
          + ("  loss diff" if args.optimizer else ""), flush=True)
    print(f"{'':22s} {'MiB':>7s} {'MiB':>7s} {'MiB':>7s} {'at limit':>9s} {'at limit':>9s} {'MiB':>9s} "
          f"{'x':>6s} {'at batch':>9s} {'same':>7s} {'tried':>5s} {'MiB':>9s} {'x':>6s} "
          f"{'MiB':>7s} {'MiB':>7s} {'MiB':>7s} {'':>6s} {'MiB':>7s} {'':>6s}", flush=True)
    for kind, name in jobs:
        command = [sys.executable, __file__, "--one", kind, name, "--size", args.size, "--exporter", args.exporter,
                   "--fraction", str(args.fraction), "--steps", str(args.steps)]
        if args.optimizer:
            command += ["--optimizer", args.optimizer]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{name:22s} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        head = (f"{r['model']:22s} {r['step_mib']:7.1f} {r['need_mib']:7.1f} {r['limit_mib']:7.1f} "
                f"{'runs' if r['original_fits'] else 'FAILS':>9s}")
        if "error" in r:
            print(f"{head}  optimize: {r['error']}", flush=True)
            continue
        line = (f"{head} {'runs' if r['returned_fits'] else 'FAILS':>9s} {r['returned_mib']:9.1f} "
                f"{r['step_vs_default']:6.2f} {r['annotated_at']:>9s} {str(r['outputs_match']):>7s} {r['plans_tried']:5d} "
                f"{r['graphopt_largest_mib']:9.1f} {r['graphopt_largest_mib'] / r['step_mib']:6.1f} "
                f"{r['largest_child_mib']:7.1f} {r['session_mib']:7.1f} {r['bound_mib']:7.1f} {str(r['within_bound']):>6s} "
                f"{r['caller_mib']:7.1f} {r['optimize_seconds']:6.0f}")
        if args.optimizer:
            line += f"  {r['loss_max_difference']:.1e}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
