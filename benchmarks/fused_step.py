"""The optimizer step inside the training graph (issue 14, item 5): one training step's
measured peak and time with the update fused into the graph, against the same training graph
without it, and against PyTorch's full training step (forward, backward, optimizer.step()).

    python benchmarks/fused_step.py [--corpus gpt2,bert,t5] [--size full|tiny]
        [--optimize] [--torch eager,compile] [--json out.json]

Per corpus model (zoo/real_zoo.py, legacy exporter, cross entropy over the class axis):

* ``plain``: ``build_training_graph(forward)``: outputs the loss and every gradient, so all
  gradients are alive at the end of the step;
* ``sgd`` / ``adamw``: ``build_training_graph(forward, optimizer=...)`` with SGD (lr 1e-3,
  momentum 0.9) and AdamW (lr 1e-4, torch's defaults otherwise): each update right after its
  gradient, the updated parameters and state written into buffers bound before the step (as
  ``graphopt train`` runs it: graphopt/runtime/_measure_worker.py);
* ``plain, optimized`` and ``adamw, optimized`` (``--optimize``): graphopt's ``optimize`` of
  the plain and the AdamW graph at the default objective, the returned model's measured peak
  and step time, and where its predicted peak falls (the node and the bytes by kind);
* PyTorch: the same module, inputs and loss in train mode with SGD / AdamW of the same
  hyper-parameters, one thread, peak RSS growth of one full step after two warm-up steps (so
  the optimizer state exists before it, like the graph's), by benchmarks/pytorch_compare.py's
  worker, in eager and (``--torch eager,compile``) torch.compile.

Every ONNX Runtime figure is ``graphopt.runtime.measure`` in a fresh process under the
graph's own session settings (graph optimizations, memory pattern and reuse off). "limit" is
the issue's bound: the plain step's peak + 0.5 x the gradient bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import builder_vs_eager  # noqa: E402
import real_vs_eager  # noqa: E402

SPECS = {"sgd": dict(kind="sgd", lr=1e-3, momentum=0.9), "adamw": dict(kind="adamw", lr=1e-4)}


def run_one(name: str, size: str, folder: str, optimize_it: bool, torch_modes: list[str]) -> dict:
    import numpy as np
    import onnx

    from graphopt_zoo import real_zoo
    from graphopt.builder.optimizer import OptimizerSpec
    from graphopt.builder.train_graph import build_training_graph
    from graphopt.inputs import save_inputs
    from graphopt.optimize import save_model
    from graphopt.runtime.measure import measure

    model = real_zoo.CORPUS[name](size)
    feeds = real_zoo.model_feeds(model)
    inputs_path = os.path.join(folder, name + ".npz")
    save_inputs(inputs_path, feeds)
    forward = real_zoo.export(model, "legacy")
    row: dict = {"model": name, "size": size}
    paths = {}
    for label in ("plain", "sgd", "adamw"):
        spec = None if label == "plain" else OptimizerSpec(**SPECS[label])
        train = build_training_graph(forward, loss="cross_entropy", class_axis=model.class_axis, optimizer=spec)
        if label == "plain":
            row["gradient_bytes"] = sum(
                int(np.prod([d.dim_value for d in o.type.tensor_type.shape.dim]))
                * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type)).itemsize
                for o in train.graph.output if o.name.endswith("_grad"))
        paths[label] = os.path.join(folder, f"{name}.{label}.onnx")
        save_model(train, paths[label])
        del train
        m = measure(paths[label], inputs_path, repeats=3)
        row[label] = {"peak_bytes": m.peak_bytes, "step_seconds": m.step_seconds, "method": m.method}
        print(f"  {label}: {m.peak_bytes / 2**20:.1f} MiB, {m.step_seconds:.3f} s", flush=True)
    if optimize_it:
        from graphopt.ingest import load_model
        from graphopt.inputs import load_inputs
        from graphopt.optimize import OptimizeOptions, optimize
        for label in ("plain", "adamw"):
            result = optimize(load_model(paths[label]), OptimizeOptions(inputs=load_inputs(inputs_path)))
            out = os.path.join(folder, f"{name}.{label}.optimized.onnx")
            save_model(result.model, out)
            explained = result.report.peaks_explained
            returned = explained.returned if explained is not None else None
            del result.model
            m = measure(out, inputs_path, repeats=3)
            row[f"{label}_optimized"] = {
                "peak_bytes": m.peak_bytes, "step_seconds": m.step_seconds, "outcome": result.report.outcome,
                "recompute_nodes": result.report.recompute_nodes, "outputs_match": result.report.outputs_match,
                "peak_node": returned.node if returned is not None else None,
                "peak_kinds": dict(returned.bytes_by_kind) if returned is not None else None}
            print(f"  {label}, optimized: {m.peak_bytes / 2**20:.1f} MiB, {m.step_seconds:.3f} s "
                  f"({result.report.outcome}; peak at {row[f'{label}_optimized']['peak_node']})", flush=True)
    eager_inputs = os.path.join(folder, name + ".eager.npz")
    save_inputs(eager_inputs, feeds)
    for mode in torch_modes:
        for kind in ("sgd", "adamw"):
            config = f"{mode}+{kind}"
            peak = builder_vs_eager.run_worker(
                [os.path.join(HERE, "fused_step.py"), "--torch-worker", name, size, eager_inputs, config, "1"])
            timed = builder_vs_eager.run_worker(
                [os.path.join(HERE, "fused_step.py"), "--torch-worker", name, size, eager_inputs, config, "3"])
            row[f"torch_{config}"] = {"peak_bytes": peak.get("peak_bytes"), "step_seconds": timed.get("step_seconds"),
                                       "error": peak.get("error") or timed.get("error")}
            print(f"  torch {config}: {row[f'torch_{config}']}", flush=True)
    return row


def _mib(d: dict | None) -> str:
    value = (d or {}).get("peak_bytes")
    return "-" if value is None else f"{value / 2**20:.1f}"


def _ratio(a: dict | None, b: dict | None) -> str:
    x, y = (a or {}).get("peak_bytes"), (b or {}).get("peak_bytes")
    return "-" if not x or not y else f"{x / y:.2f}x"


def _seconds(d: dict | None) -> str:
    value = (d or {}).get("step_seconds")
    return "-" if value is None else f"{value:.3f}"


def table(rows: list[dict], torch_modes: list[str]) -> str:
    head = ["model", "gradients MiB", "plain step MiB", "limit MiB", "fused SGD MiB", "vs plain",
            "fused AdamW MiB", "vs plain", "plain optimized MiB", "AdamW optimized MiB", "vs plain optimized"]
    for mode in torch_modes:
        head += [f"torch {mode} SGD MiB", f"torch {mode} AdamW MiB", "fused AdamW vs torch"]
    head += ["plain s", "fused SGD s", "fused AdamW s"] + [f"torch {m} AdamW s" for m in torch_modes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | " + " | ".join(["-"] * (len(head) - 2)) + f" | {r['error'][:80]} |")
            continue
        limit = r["plain"]["peak_bytes"] + 0.5 * r["gradient_bytes"]
        cells = [r["model"], f"{r['gradient_bytes'] / 2**20:.1f}", _mib(r["plain"]), f"{limit / 2**20:.1f}",
                 _mib(r["sgd"]), _ratio(r["sgd"], r["plain"]), _mib(r["adamw"]), _ratio(r["adamw"], r["plain"]),
                 _mib(r.get("plain_optimized")), _mib(r.get("adamw_optimized")),
                 _ratio(r.get("adamw_optimized"), r.get("plain_optimized"))]
        for mode in torch_modes:
            cells += [_mib(r.get(f"torch_{mode}+sgd")), _mib(r.get(f"torch_{mode}+adamw")),
                      _ratio(r.get("adamw_optimized") or r["adamw"], r.get(f"torch_{mode}+adamw"))]
        cells += [_seconds(r["plain"]), _seconds(r["sgd"]), _seconds(r["adamw"])]
        cells += [_seconds(r.get(f"torch_{m}+adamw")) for m in torch_modes]
        lines.append("| " + " | ".join(cells) + " |")
    ok = [r for r in rows if "error" not in r]
    within = [r for r in ok if r["adamw"]["peak_bytes"] <= r["plain"]["peak_bytes"] + 0.5 * r["gradient_bytes"]
              and r["sgd"]["peak_bytes"] <= r["plain"]["peak_bytes"] + 0.5 * r["gradient_bytes"]]
    lines += ["", f"fused SGD and AdamW within plain + 0.5 x gradient bytes: {len(within)} of {len(ok)} models"]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--torch-worker":
        name, size, inputs_path, config, repeats = argv[1:6]
        from pytorch_compare import worker_main
        return worker_main(lambda: builder_vs_eager.step_worker(
            real_vs_eager._CorpusStep(size, inputs_path), name, config, int(repeats)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="gpt2,bert,t5")
    parser.add_argument("--size", default="full")
    parser.add_argument("--optimize", action="store_true",
                        help="also graphopt's optimize of the plain and the AdamW graph (default objective)")
    parser.add_argument("--torch", default="eager", help="PyTorch modes: eager, compile (comma-separated; "
                                                         "empty: none)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    torch_modes = [m for m in args.torch.split(",") if m]
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="graphopt-fused-") as folder:
        for name in [n for n in args.corpus.split(",") if n]:
            print(f"{name} ...", flush=True)
            try:
                rows.append(run_one(name, args.size, folder, args.optimize, torch_modes))
            except Exception as e:  # noqa: BLE001  (one model's failure is a table row)
                rows.append({"model": name, "error": f"{type(e).__name__}: {e}"})
            for path in os.listdir(folder):
                if path.startswith(name + "."):
                    os.remove(os.path.join(folder, path))
    print()
    print(table(rows, torch_modes))
    print(f"\n{time.perf_counter() - started:.0f} s; load average {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
