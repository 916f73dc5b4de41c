"""Models past protobuf's 2 GB limit, as a user runs them (issue 44): every stage a `graphopt`
command in a process of its own, its wall time and the largest resident set of any process of
its tree, read from outside it (a small wrapper's RUSAGE_CHILDREN: see `run`), and graphopt's own
account of its memory from the report beside it.

    python benchmarks/past_2gb.py --model medium [--out DIR] [--steps 3] [--fraction 0.6]
    python benchmarks/past_2gb.py --model large --batch 1 --seq 64

``medium``: GPT-2 medium's sizes from transformers' config (24 layers, d 1024, 16 heads, 355M
parameters, 1.4 GB of float32 weights), batch 1x256, the legacy exporter; the training graph
with AdamW inside (lr 1e-3: the parameters and AdamW's two states are 4.3 GB of initializers);
then ``optimize`` at the default objective, and at ``--memory-limit`` `--fraction` of what the
original needs (the weights, its state and inputs held outside ONNX Runtime's arena, and the
step's peak measured under the default session: the step's own share capped at the fraction,
as benchmarks/memory_limit.py does for the share it names); then ``graphopt train`` `--steps`
steps of the un-optimized graph and of each returned model on the same batch, losses compared
(relative 1e-5).

``large``: GPT-2 large's sizes (36 layers, d 1280, 20 heads, 774M parameters, 3.1 GB), exported
with its weights as external data; the gradients-out training graph, then ``optimize`` at the
default objective.

Needs about 12 GB of memory and tens of minutes (medium) on this 2-core machine; not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GiB, MiB = 2**30, 2**20
SIZES = {"medium": dict(n_layer=24, n_embd=1024, n_head=16, batch=1, seq=256),
         "large": dict(n_layer=36, n_embd=1280, n_head=20, batch=1, seq=128)}


# A process's ru_maxrss counts the memory of the process it was forked from up to its exec: each
# command runs under a small wrapper of its own, whose children are the command's tree alone, and
# the wrapper prints their largest RSS (as benchmarks/memory_limit.py measures optimize).
_WRAPPER = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(done.returncode)")


def run(command: list[str], log: list[dict], label: str) -> dict:
    """`command` in a process of its own: its wall seconds and the largest resident set of any
    process of its tree (each descendant is waited for by its parent, so the largest counts)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _WRAPPER, *command], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    lines = done.stderr.strip().splitlines()
    rss = int(lines[-1]) * 1024 if lines and lines[-1].isdigit() else 0
    stderr = "\n".join(lines[:-1])
    entry = {"stage": label, "command": " ".join(command[2:]), "seconds": round(seconds, 1),
             "largest_process_bytes": rss, "returncode": done.returncode,
             "stdout_tail": done.stdout[-2500:], "stderr_tail": stderr[-2500:]}
    log.append(entry)
    print(f"[{label}] {seconds:.1f} s, exit {done.returncode}, largest process {rss / GiB:.2f} GiB", flush=True)
    if done.returncode != 0:
        print(stderr[-3000:], file=sys.stderr, flush=True)
    return entry


def export(size: str, folder: str) -> dict:
    """The forward model (weights as external data beside it) and its batch (data.npz)."""
    import numpy as np
    import torch
    from graphopt_zoo import real_zoo
    real_zoo.import_torchvision()
    from transformers import GPT2Config, GPT2LMHeadModel
    s = SIZES[size]
    cfg = real_zoo._no_dropout(GPT2Config(n_layer=s["n_layer"], n_embd=s["n_embd"], n_head=s["n_head"]))
    torch.manual_seed(real_zoo.SEED)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
    real = real_zoo._tokens("gpt2", model, cfg.vocab_size, s["batch"], s["seq"])
    os.makedirs(os.path.join(folder, "forward"), exist_ok=True)
    path = os.path.join(folder, "forward", "forward.onnx")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(real.module.eval(), tuple(real.inputs.values()), path, dynamo=False,
                          opset_version=real_zoo.LEGACY_OPSET, input_names=list(real.inputs),
                          output_names=["logits"], do_constant_folding=False)
    parameters = sum(p.numel() for p in model.parameters())
    data = {name: value.numpy() for name, value in real.inputs.items()}
    data["labels"] = real.labels.numpy()
    np.savez(os.path.join(folder, "data.npz"), **data)
    return {"path": path, "parameters": parameters, "files": sorted(os.listdir(os.path.dirname(path)))}


def losses(path: str) -> list[float]:
    with open(path) as f:
        return [float(line.split(",")[1]) for line in f.read().splitlines()[1:]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SIZES), default="medium")
    parser.add_argument("--out", default=None, help="working folder (default: a new one under /tmp)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=0.6)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--reuse", action="store_true",
                        help="keep the stages an earlier run in --out finished (its figures.json) and run the rest")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    if args.batch:
        SIZES[args.model]["batch"] = args.batch
    if args.seq:
        SIZES[args.model]["seq"] = args.seq
    import tempfile
    folder = args.out or tempfile.mkdtemp(prefix=f"graphopt-past2gb-{args.model}-")
    os.makedirs(folder, exist_ok=True)
    graphopt = [sys.executable, "-m", "graphopt.cli"]
    figures_path = os.path.join(folder, "figures.json")
    figures: dict = {}
    if args.reuse and os.path.exists(figures_path):
        with open(figures_path) as f:
            figures = json.load(f)
    figures.update({"model": args.model, "sizes": SIZES[args.model], "folder": folder})
    log: list[dict] = figures.setdefault("stages", [])

    def save() -> None:
        with open(figures_path, "w") as f:
            json.dump(figures, f, indent=1)

    if "export" not in figures:
        # the export in a process of its own (torch's memory is not graphopt's)
        started = time.perf_counter()
        exported = subprocess.run([sys.executable, "-c", (
            "import json, sys; sys.path.insert(0, %r); sys.path.insert(0, %r); import past_2gb; "
            "print(json.dumps(past_2gb.export(%r, %r)))") % (ROOT, HERE, args.model, folder)],
            capture_output=True, text=True)
        if exported.returncode != 0:
            print(exported.stderr[-3000:], file=sys.stderr)
            return 1
        figures["export"] = json.loads(exported.stdout.strip().splitlines()[-1])
        figures["export"]["seconds"] = round(time.perf_counter() - started, 1)
        forward_folder = os.path.dirname(figures["export"]["path"])
        figures["export"]["bytes"] = sum(os.path.getsize(os.path.join(forward_folder, f))
                                         for f in figures["export"]["files"])
        save()
    forward = figures["export"]["path"]
    print(f"exported {figures['export']['parameters'] / 1e6:.0f}M parameters, "
          f"{figures['export']['bytes'] / GiB:.2f} GiB in {len(figures['export']['files'])} file(s)", flush=True)

    data = os.path.join(folder, "data.npz")
    optimizer = ["--optimizer", "adamw", "--lr", "0.001"] if args.model == "medium" else []
    train = os.path.join(folder, "train", "train.onnx")
    if "training_graph_bytes" not in figures:
        run(graphopt + ["train-graph", forward, "-o", train, "--loss", "cross_entropy", "--class-axis", "-1",
                        *optimizer], log, "train-graph")
        if log[-1]["returncode"] != 0:
            return _finish(figures, log, args)
        figures["training_graph_bytes"] = sum(os.path.getsize(os.path.join(os.path.dirname(train), f))
                                              for f in os.listdir(os.path.dirname(train)))
        save()

    def optimize(label: str, *extra: str) -> dict | None:
        if label in figures.get("optimize", {}):
            return figures["optimize"][label]
        out = os.path.join(folder, label, "opt.onnx")
        report_path = os.path.join(folder, label, "report.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        run(graphopt + ["optimize", train, "-o", out, "--report", report_path, "--inputs", data, *extra],
            log, f"optimize {label}")
        if log[-1]["returncode"] != 0:
            return None
        with open(report_path) as f:
            report = json.load(f)
        measured = report.get("measured") or {}
        own = report.get("graphopt_memory") or {}
        summary = {"outcome": report.get("outcome"), "outputs_match": report.get("outputs_match"),
                   "order_followed": report.get("order_followed"),
                   "peaks_bytes": {k: (v or {}).get("peak_bytes") for k, v in measured.items()
                                   if isinstance(v, dict)},
                   "step_seconds": {k: (v or {}).get("step_seconds") for k, v in measured.items()
                                    if isinstance(v, dict)},
                   "memory_limit": report.get("memory_limit"), "graphopt_memory": own,
                   "stages": report.get("stages"), "total_seconds": report.get("total_seconds"),
                   "search_seconds": report.get("search_seconds"), "path": out,
                   "largest_process_bytes_outside": log[-1]["largest_process_bytes"]}
        figures.setdefault("optimize", {})[label] = summary
        save()
        return summary

    default = optimize("default")
    if args.model == "medium" and default is not None:
        # what the original needs: what `graphopt train` holds outside ONNX Runtime's arena (the
        # weights, two buffers of each fed-back state tensor, one batch: graphopt/train.py) + the
        # step's peak under the default session; the step's share capped at the fraction
        from graphopt.ingest import load_model
        from graphopt.inputs import load_inputs
        from graphopt.train import outside_session_bytes, plan_inputs
        model = load_model(train, weights_on_disk=True)
        batch = load_inputs(data)
        data_inputs, feedback = plan_inputs(model)
        held = outside_session_bytes(model, batch, data_inputs, SIZES[args.model]["batch"], set(feedback.values()))
        step = default["peaks_bytes"].get("original_default_session") or 0
        limit = int(held + args.fraction * step)
        figures["memory_limit"] = {"held_outside_bytes": held, "original_step_peak_bytes": step,
                                   "fraction": args.fraction, "limit_bytes": limit}
        save()
        optimize("limited", "--memory-limit", str(limit))
        # train: the un-optimized graph, then each returned model, the same steps on the same batch
        trained = figures.setdefault("losses", {})
        for label, path in [("original", train)] + [(k, v["path"]) for k, v in figures["optimize"].items()]:
            if label in trained:
                continue
            csv = os.path.join(folder, f"losses-{label}.csv")
            extra = ["--memory-limit", str(limit)] if label == "limited" else []
            run(graphopt + ["train", path, "--data", data, "--steps", str(args.steps), "--log", csv, "-q", *extra],
                log, f"train {label}")
            if log[-1]["returncode"] == 0:
                trained[label] = losses(csv)
                save()
        base = trained.get("original")
        if base:
            figures["losses_max_relative_difference"] = {
                k: max(abs(a - b) / abs(b) for a, b in zip(v, base)) for k, v in trained.items() if k != "original"}
    save()
    return _finish(figures, log, args)


def _finish(figures: dict, log: list[dict], args) -> int:
    print(json.dumps({k: v for k, v in figures.items() if k != "stages"}, indent=1))
    print("\n| stage | wall s | largest process |\n|---|---|---|")
    for entry in log:
        print(f"| {entry['stage']} | {entry['seconds']} | {entry['largest_process_bytes'] / GiB:.2f} GiB |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0 if all(e["returncode"] == 0 for e in log) else 1


if __name__ == "__main__":
    sys.exit(main())
