"""What a user would pick instead: the peak memory of one training step of each example in
PyTorch (CPU) next to ONNX Runtime and graphopt's plan, measured the same way.

    python benchmarks/pytorch_compare.py [--examples mlp,resnet] [--strategy greedy]
        [--json out.json] [--torch-configs eager,compile,compile-budget]

For each example at its default size, with the inputs of `training_example(name)`, on ONE
thread (torch.set_num_threads(1); ORT intra-op threads 1):

* ONNX Runtime and graphopt: `graphopt.optimize.optimize(model, OptimizeOptions(inputs,
  strategy))`; its report's measured peaks of the original training graph under the default
  session, with graph optimizations off, and of the rewritten (checkpointed) model.
* PyTorch, on the twin module of zoo/torch_twins.py (same parameters, same inputs,
  same loss and gradients), one step = forward + loss + backward, gradients produced (each
  `.grad` is None before the step, as ORT allocates its gradient outputs), no optimizer
  step:
    - eager;
    - torch.compile (default inductor; AOTAutograd's min-cut partitioner chooses what the
      forward saves for the backward);
    - torch.compile with torch._functorch.config.activation_memory_budget = 0.1 (the
      partitioner recomputes to keep the saved activations near 10% of the default's).

Each torch configuration is measured like graphopt measures ONNX Runtime
(graphopt/runtime/_measure_worker.py): a fresh subprocess with the same allocator settings,
graphopt.runtime.measure.malloc_env() (buffers of a page or more come from mmap and return to the OS when
freed, so RSS follows what is live); parameters and inputs are created first (resident, not
counted, like ORT's initializers and inputs); warm-up steps (compilation happens there);
their loss and gradients are dropped, gc, malloc_trim; /proc/self/clear_refs <- 5 resets
VmHWM; VmRSS is read; one step runs; peak = VmHWM - VmRSS_before. The step time is the
median of 3 steps in a second fresh subprocess with the allocator as users have it (as
graphopt's measure does).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from graphopt.runtime.measure import malloc_env  # noqa: E402
from graphopt.runtime.rss import malloc_trim as _malloc_trim  # noqa: E402
from graphopt.runtime.rss import reset_peak_rss as _reset_hwm  # noqa: E402
from graphopt.runtime.rss import status_kb as _status_kb  # noqa: E402

TORCH_CONFIGS = ("eager", "compile", "compile-budget")
BUDGET = 0.1
WARMUP_STEPS = 2


# ----------------------------------------------------------------- worker (subprocess) --

def parse_config(config: str) -> tuple[str, float | None]:
    """("eager" | "compile", activation_memory_budget or None) of a torch configuration:
    eager, compile, compile-budget (BUDGET) or compile-budget=B (0 < B <= 1)."""
    if config in ("eager", "compile"):
        return config, None
    if config == "compile-budget":
        return "compile", BUDGET
    if config.startswith("compile-budget="):
        budget = float(config.split("=", 1)[1])
        if not 0 < budget <= 1:
            raise ValueError("activation_memory_budget must be in (0, 1], got %r" % config)
        return "compile", budget
    raise ValueError("unknown torch configuration %r (eager, compile, compile-budget[=B])" % config)


# the optimizers a configuration may end with ("eager+adamw": the full training step,
# optimizer.step() included; benchmarks/fused_step.py builds the same ones into the graph)
OPTIMIZERS = {"sgd": lambda params, torch: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
              "adamw": lambda params, torch: torch.optim.AdamW(params, lr=1e-4)}


def worker(name: str, config: str, repeats: int, twins=None) -> dict:
    """One configuration, in this (fresh) process: peak (repeats == 1) or step time. A
    configuration ending in +sgd or +adamw runs that optimizer's step after the backward (its
    state exists before the measured step: the warm-up steps made it). `twins` gives the step:
    `twin_example(name)` -> (module returning the loss, _, inputs) and `torch_inputs(module,
    inputs)` (default: the bundled examples' twins, graphopt_zoo.torch_twins)."""
    import torch

    torch.set_num_threads(1)
    if twins is None:
        from graphopt_zoo import torch_twins as twins
    torch_inputs, twin_example = twins.torch_inputs, twins.twin_example

    config_base, _, optimizer_kind = config.partition("+")
    if optimizer_kind and optimizer_kind not in OPTIMIZERS:
        raise ValueError("unknown optimizer %r in configuration %r" % (optimizer_kind, config))
    mode, budget = parse_config(config_base)
    module, _, inputs = twin_example(name)
    args = torch_inputs(module, inputs)
    params = list(module.parameters())
    if mode == "eager":
        step_fn = module
    else:
        if budget is not None:     # read when compiling: set before torch.compile
            import torch._functorch.config as functorch_config
            functorch_config.activation_memory_budget = budget
        step_fn = torch.compile(module)

    optimizer = OPTIMIZERS[optimizer_kind](params, torch) if optimizer_kind else None

    def step():
        for p in params:
            p.grad = None
        loss = step_fn(*args)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        return loss

    started = time.perf_counter()
    for _ in range(WARMUP_STEPS):
        loss = step()
    warmup_seconds = time.perf_counter() - started
    result = {"config": config, "loss": float(loss.detach()), "warmup_seconds": warmup_seconds}
    del loss
    for p in params:
        p.grad = None
    gc.collect()

    if repeats == 1:
        _malloc_trim()
        have_hwm = _reset_hwm()
        rss_before = _status_kb("VmRSS")
        if not have_hwm or rss_before is None:
            raise RuntimeError("needs a writable /proc/self/clear_refs and /proc/self/status")
        loss = step()
        peak_kb = _status_kb("VmHWM")
        result["peak_bytes"] = max(0, (peak_kb - rss_before) * 1024)
        result["rss_before_bytes"] = rss_before * 1024
        result["grads_bytes"] = sum(p.grad.numel() * p.grad.element_size() for p in params
                                    if p.grad is not None)
        del loss
    else:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t0)
            del loss
        result["step_seconds"] = statistics.median(times)
    return result


def worker_main(run) -> int:
    """A worker process's end: `run()`'s result as the last stdout line (JSON), exit 0; or
    the traceback and a one-line error (what _run_worker reports) on stderr, exit 1."""
    try:
        result = run()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        sys.stderr.write("\n%s: %s\n" % (type(e).__name__, str(e).replace("\n", " ")[:300]))
        return 1
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    return 0


def _worker_env(plain_allocator: bool) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        env.pop(key, None)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    if not plain_allocator:
        env.update(malloc_env())   # exactly what graphopt's ORT measurements use
    return env


def _run_worker(name: str, config: str, repeats: int, timeout: float,
                worker_argv: list[str] | None = None) -> dict:
    cmd = [sys.executable] + (worker_argv or [os.path.abspath(__file__), "--worker", name, config]) \
        + ["--repeats", str(repeats)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=_worker_env(plain_allocator=repeats > 1))
    except subprocess.TimeoutExpired:
        raise RuntimeError("timed out after %d s" % timeout) from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()
        raise RuntimeError(tail[-1] if tail else "exit %d" % proc.returncode)
    return json.loads(lines[-1])


def measure_torch(name: str, config: str, timeout: float = 1800,
                  worker_argv: list[str] | None = None) -> dict:
    """{"peak_bytes", "step_seconds", "warmup_seconds", "loss", "wall_seconds"} or {"error"}.

    `worker_argv`: another script's worker command (``[script, args...]``, given
    ``--repeats N`` after them) that runs `worker` on its own step (e.g. a corpus model's),
    measured the same way; default this file's ``--worker NAME CONFIG``."""
    started = time.perf_counter()
    try:
        peak = _run_worker(name, config, 1, timeout, worker_argv)
        timing = _run_worker(name, config, 3, timeout, worker_argv)
    except Exception as e:  # noqa: BLE001  (a failing configuration is a table cell)
        return {"error": str(e)[:300], "wall_seconds": time.perf_counter() - started}
    return dict(peak, step_seconds=timing["step_seconds"],
                wall_seconds=time.perf_counter() - started)


# ----------------------------------------------------------------------------- table --

def measure_graphopt(name: str, strategy: str) -> dict:
    from graphopt.examples import training_example
    from graphopt.optimize import OptimizeOptions, optimize
    started = time.perf_counter()
    try:
        model, inputs = training_example(name)
        report = optimize(model, OptimizeOptions(inputs=inputs, strategy=strategy)).report.to_dict()
    except Exception as e:  # noqa: BLE001
        return {"error": "%s: %s" % (type(e).__name__, str(e)[:300]),
                "wall_seconds": time.perf_counter() - started}
    report["wall_seconds"] = time.perf_counter() - started
    return report


def _mib(n) -> str:
    return "%.1f" % (n / 2**20)


def _cell(d: dict) -> str:
    if "error" in d:
        return "error: " + d["error"].replace("|", "/").replace("\n", " ")[:120]
    return _mib(d["peak_bytes"])


def _time_cell(d: dict) -> str:
    return "-" if "error" in d or d.get("step_seconds") is None else "%.3f" % d["step_seconds"]


def table(results: dict, configs) -> str:
    ort_labels = (("original_default_session", "ORT default session"),
                  ("original_optimizations_off", "ORT optimizations off"),
                  ("optimized", "graphopt"))
    torch_labels = {"eager": "torch eager", "compile": "torch.compile",
                    "compile-budget": "torch.compile budget %g" % BUDGET}
    head = ["model"] + [label for _, label in ort_labels] + [torch_labels[c] for c in configs] \
        + ["graphopt / best torch"]
    lines = ["Peak memory of one training step, MiB (measured, one thread)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    times = ["Step time, seconds (median of 3)", "",
             "| " + " | ".join(head[:-1] + ["graphopt / best torch"]) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        g = r["graphopt"]
        if "error" in g:
            ort = [{"error": g["error"]}] * 3
        else:
            ort = [g["measured"][key] for key, _ in ort_labels]
        tor = [r["torch"][c] for c in configs]
        ok = [t for t in tor if "error" not in t]
        if ok and "error" not in ort[2]:
            best = min(t["peak_bytes"] for t in ok)
            best_t = min(t["step_seconds"] for t in ok)
            ratio = "%.2fx" % (ort[2]["peak_bytes"] / max(1, best))
            ratio_t = "%.2fx" % (ort[2]["step_seconds"] / best_t)
        else:
            ratio = ratio_t = "-"
        lines.append("| " + " | ".join([name] + [_cell(d) for d in ort + tor] + [ratio]) + " |")
        times.append("| " + " | ".join([name] + [_time_cell(d) for d in ort + tor] + [ratio_t]) + " |")
    return "\n".join(lines + [""] + times)


def main(argv=None) -> int:
    from graphopt.examples import EXAMPLES
    from graphopt.search import DEFAULT_STRATEGY

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--strategy", default=DEFAULT_STRATEGY)
    parser.add_argument("--torch-configs", default=",".join(TORCH_CONFIGS))
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds per torch measuring subprocess")
    parser.add_argument("--worker", nargs=2, metavar=("EXAMPLE", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        return worker_main(lambda: worker(args.worker[0], args.worker[1], args.repeats))

    configs = [c for c in args.torch_configs.split(",") if c]
    for c in configs:
        if c not in TORCH_CONFIGS:
            parser.error("unknown torch configuration %r (known: %s)" % (c, ", ".join(TORCH_CONFIGS)))
    started = time.perf_counter()
    results = {}
    for name in args.examples.split(","):
        print("%s: graphopt (%s) ..." % (name, args.strategy), file=sys.stderr, flush=True)
        r = {"graphopt": measure_graphopt(name, args.strategy), "torch": {}}
        print("  %.0f s" % r["graphopt"]["wall_seconds"], file=sys.stderr, flush=True)
        for c in configs:
            print("%s: torch %s ..." % (name, c), file=sys.stderr, flush=True)
            r["torch"][c] = measure_torch(name, c, args.timeout)
            d = r["torch"][c]
            print("  %.0f s%s" % (d["wall_seconds"], " " + d["error"] if "error" in d else
                                  " peak %s MiB" % _mib(d["peak_bytes"])), file=sys.stderr, flush=True)
        results[name] = r
    total = time.perf_counter() - started
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"strategy": args.strategy, "total_seconds": total, "budget": BUDGET,
                       "results": results}, f, indent=2, default=str)
    print(table(results, configs))
    print("\nstrategy %s; whole run %.0f s" % (args.strategy, total))
    return 0


if __name__ == "__main__":
    sys.exit(main())
