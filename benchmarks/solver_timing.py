"""Solve time of every registered strategy on the graph families, side by side.

For each family (zoo/graph_families.py) and size (total training-graph ops) it
prints, in one markdown table, each strategy's wall-clock solve time and the cost-model
peak it reached relative to store-all's; then a second table with the time of one
`make_plan` evaluation (schedule_for + priority_order + simulate) per graph. Each solve
runs in its own forked process with a timeout, so an exponential solver shows "timeout"
instead of hanging the run. The strategies are graphopt.search.STRATEGIES as registered
when the script runs (plus --extra ones).

    python benchmarks/solver_timing.py [--sizes 100,1000,10000,20000] [--families chains,dense]
        [--strategies greedy,chen-sqrt] [--timeout 60] [--budget-fraction 0.5] [--json out.json]
        [--extra name=package.module:function ...]

A cell reads "1.23 s · 0.41": solved in 1.23 s, peak 0.41 x store-all's. "timeout" means the
solve did not finish within --timeout seconds; "error: ..." that it raised; "invalid" that
the schedule reads a tensor before it exists; "over" that a --budget-fraction budget was
missed (the peak is still shown).

    python benchmarks/solver_timing.py --corpus [resnet50,gpt2] [--cache DIR] [--rebuild]
        [--size full] [--exporter legacy] [--strategies auto,chen-sqrt] [--timeout 60]

`--corpus` times the same strategies on the real training graphs of the corpus
(zoo/real_zoo.py; default all its models at size "full", legacy exporter) instead of the
families. Each model is exported, built into a training graph (`build_training_graph`, loss
cross entropy) and annotated as `optimize` does (`graphopt.pipeline.prepare`: ONNX Runtime in
a child process, function ops ORT inlines at load written out), all in a fresh subprocess per
model; the cost graph is cached as `CostGraph.to_dict()` JSON in the cache folder
(`<model>.<size>.<exporter>.json`, with `.meta.json` beside it: node counts, timings, the
cost model's peak on ORT's own order) and reused on the next run (`--rebuild` builds again).
Annotations are measurements of this machine: a cached graph keeps the seconds and bytes it
was measured with.
"""
from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from graphopt_zoo.graph_families import FAMILIES, make_graph  # noqa: E402


def _solve_child(conn, solve, graph, budget):
    """Runs in the forked child: solve, time it, check the schedule, send a small dict."""
    from graphopt.costmodel import check_schedule
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # solver banners (HiGHS) would land in the table
    try:
        started, started_cpu = time.perf_counter(), time.process_time()
        plan = solve(graph, budget_bytes=budget)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
        try:
            check_schedule(graph, plan.schedule)
            valid = True
        except ValueError:
            valid = False
        conn.send(dict(status="ok", seconds=seconds, cpu_seconds=cpu_seconds, peak_bytes=int(plan.peak_bytes),
                       recompute_seconds=float(plan.recompute_seconds), recompute_ops=plan.recompute_ops,
                       valid=valid))
    except BaseException as exc:  # report anything, the parent prints it
        conn.send(dict(status="error", error=f"{type(exc).__name__}: {exc}",
                       trace=traceback.format_exc(limit=3)))
    finally:
        conn.close()


def run_solver(solve, graph, budget, timeout: float) -> dict:
    """One solve in a forked process (the graph is inherited, not pickled)."""
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_solve_child, args=(send, solve, graph, budget), daemon=True)
    started = time.perf_counter()
    proc.start()
    send.close()
    result = None
    if receive.poll(timeout):
        try:
            result = receive.recv()
        except EOFError:             # the child died without a word
            result = None
    elapsed = time.perf_counter() - started
    if proc.is_alive():
        proc.kill()
    proc.join()
    if result is None:
        if elapsed >= timeout:       # still running (or finishing) at the deadline
            return dict(status="timeout", seconds=timeout)
        return dict(status="error", error=f"child exited with code {proc.exitcode} (killed for memory?)")
    return result


def time_make_plan(graph, repeats: int = 5) -> dict:
    """Best-of-`repeats` wall seconds of one plan evaluation (what make_plan does, without its
    memory of recent evaluations: schedule_for, priority_order, simulate) on store-all's and
    Chen's checkpoint sets (the machine may be shared: the best of several is the least
    disturbed)."""
    from graphopt.costmodel import priority_order, simulate
    from graphopt.search.chen_sqrt import segment_checkpoints
    from graphopt.search.plan import schedule_for
    import math

    out = {}
    sets = {"store-all": graph.candidate_checkpoints,
            "chen": segment_checkpoints(graph, max(1, round(math.sqrt(len(graph.forward_order)))))}
    for name, checkpoints in sets.items():
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            simulation = simulate(graph, priority_order(graph, schedule_for(graph, frozenset(checkpoints))))
            best = min(best, time.perf_counter() - started)
        out[name] = best
        out[name + "_peak"] = simulation.peak_bytes
    return out


def default_objective(graph, budget_bytes=None):
    """The search `optimize` runs under its default objective, on this graph's order alone: the
    least peak whose predicted step is within (1 + DEFAULT_MAX_OVERHEAD) x store-all's predicted
    step (store-all's stands in for the measured original's), by `auto`'s bisection on the
    budget and the local search after it, each budget solved once (as `pipeline._remembered`).
    `optimize` runs it from each base order (the file's, ONNX Runtime's), where their least
    peaks are close, and for a share of the overhead (`pipeline.PLANNED_OVERHEAD_SHARES`): here
    the whole overhead, as before that share."""
    from graphopt.options import DEFAULT_MAX_OVERHEAD
    from graphopt.search import STRATEGIES, store_all
    from graphopt.search.front import least_peak_within
    auto_module = sys.modules["graphopt.search.auto"]
    if budget_bytes is not None:
        raise ValueError("default-objective plans for a step-time limit, not a budget")
    solved = {}

    def solve(g, budget_bytes=None):
        if budget_bytes not in solved:
            solved[budget_bytes] = STRATEGIES["auto"](g, budget_bytes=budget_bytes)
        return solved[budget_bytes]
    limit = (1 + DEFAULT_MAX_OVERHEAD) * store_all(graph).simulation.compute_seconds
    return least_peak_within(graph, solve, limit, refine=auto_module.least_peak_local)


BUILTIN_EXTRA = {"default-objective": default_objective}


def load_extra(specs: list[str]) -> dict:
    extra = {}
    for spec in specs:
        name, _, target = spec.partition("=")
        module, _, attr = target.partition(":")
        if not (name and module and attr):
            raise SystemExit(f"--extra wants name=package.module:function, got {spec!r}")
        extra[name] = getattr(importlib.import_module(module), attr)
    return extra


# ------------------------------------------------------------------ the corpus's real graphs --

CORPUS_CACHE = os.path.join(tempfile.gettempdir(), "graphopt-corpus-graphs")
BUILD_TIMEOUT_SECONDS = 3600


def corpus_graph_path(cache: str, model: str, size: str, exporter: str) -> str:
    return os.path.join(cache, f"{model}.{size}.{exporter}.json")


def annotated_cost_graph(training, options) -> tuple[object, dict]:
    """The cost graph of `training` (an ONNX training graph) as `optimize` annotates it, and
    a few facts of the preparation: through the pipeline's public `prepare` stage (no
    reference outputs) where it exists, else through optimize.py's own preparation."""
    try:
        from graphopt.pipeline import prepare
    except ImportError:
        prepare = None
    if prepare is not None:
        with prepare(training, options, reference=False) as prepared:
            return prepared.graph, dict(
                training_nodes=len(prepared.training.model.graph.node),
                functions_expanded=dict(prepared.functions_expanded),
                predicted_original_peak_bytes=int(prepared.predicted_original.peak_bytes))
    from graphopt import optimize as optimize_module          # before graphopt/pipeline.py
    trained, inputs = optimize_module._prepare(training, options)
    trained, annotations, graph, expanded, _ = optimize_module._runtime_graph(trained, inputs, options)
    return graph, dict(training_nodes=len(trained.model.graph.node), functions_expanded=dict(expanded))


def _commit() -> str | None:
    """The repository's commit (with "+changes" when the working tree differs): what a cached
    graph's op rules and builder were."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "graphopt"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+changes" if dirty else "")) or None


def build_corpus_graph(model: str, size: str, exporter: str, path: str) -> dict:
    """Export, build and annotate one corpus model; write its cost graph (`CostGraph.to_dict`)
    to `path` and the facts of its making to `<path minus .json>.meta.json`. Runs in its own
    process (see `corpus_graph`): a model's torch and ONNX memory does not stay."""
    from graphopt_zoo import real_zoo
    from graphopt.builder.train_graph import build_training_graph
    from graphopt.optimize import OptimizeOptions

    meta = dict(model=model, size=size, exporter=exporter, made_at_commit=_commit())
    real = real_zoo.CORPUS[model](size)
    started = time.perf_counter()
    forward = real_zoo.export(real, exporter)
    meta["export_seconds"] = time.perf_counter() - started
    meta["forward_nodes"] = len(forward.graph.node)
    started = time.perf_counter()
    training = build_training_graph(forward, loss="cross_entropy", class_axis=real.class_axis)
    meta["build_seconds"] = time.perf_counter() - started
    del forward
    feeds = real_zoo.model_feeds(real)
    del real
    started = time.perf_counter()
    # the options `optimize` annotates with by default (one thread), nothing verified or measured
    options = OptimizeOptions(inputs=feeds, verify=False, measure=False)
    graph, facts = annotated_cost_graph(training, options)
    meta["annotate_seconds"] = time.perf_counter() - started
    meta.update(facts)
    meta["cost_graph_ops"] = len(graph)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    for target, data in ((path, graph.to_dict()), (path[:-len(".json")] + ".meta.json", meta)):
        partial = target + ".partial"
        with open(partial, "w") as f:
            json.dump(data, f)
        os.replace(partial, target)      # a killed build leaves no half-written cache entry
    return meta


def corpus_graph(model: str, size: str, exporter: str, cache: str, rebuild: bool = False):
    """(cost graph, meta) of a corpus model: from the cache, else built in a fresh subprocess."""
    from graphopt.costgraph import CostGraph
    path = corpus_graph_path(cache, model, size, exporter)
    meta_path = path[:-len(".json")] + ".meta.json"
    if os.path.exists(path) and not rebuild:
        try:
            with open(path) as f:
                graph = CostGraph.from_dict(json.load(f))
            meta = {}
            if os.path.exists(meta_path):
                with open(meta_path) as f:
                    meta = json.load(f)
            return graph, dict(meta, cached=True)
        except (ValueError, KeyError, TypeError) as exc:   # an older format: build it again
            print(f"[{model}] cached graph {path} unreadable ({type(exc).__name__}: {exc}); building again",
                  file=sys.stderr, flush=True)
    print(f"[{model}] export, build and annotate ({size}, {exporter}) ...", file=sys.stderr, flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, os.path.abspath(__file__), "--build-graph", model, size, exporter, path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=BUILD_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"building {model}'s graph took over {BUILD_TIMEOUT_SECONDS} s")
    if proc.returncode != 0 or not os.path.exists(path):
        tail = proc.stderr.strip().splitlines()[-15:]
        raise RuntimeError(f"building {model}'s graph failed (exit {proc.returncode}):\n" + "\n".join(tail))
    with open(path) as f:
        graph = CostGraph.from_dict(json.load(f))
    with open(meta_path) as f:
        meta = json.load(f)
    return graph, dict(meta, cached=False)


def mib(nbytes) -> str:
    """Bytes as MiB, with a decimal below 10 MiB."""
    value = nbytes / 2**20
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def cell(result: dict, reference_peak: int, budget) -> str:
    if result["status"] == "timeout":
        return "timeout"
    if result["status"] != "ok":
        return "error: " + result["error"].splitlines()[0][:60].replace("|", "/")
    text = f"{result['seconds']:.2f} s · {result['peak_bytes'] / max(1, reference_peak):.2f}"
    if not result["valid"]:
        text += " invalid"
    if budget is not None and result["peak_bytes"] > budget:
        text += " over"
    return text


def time_strategies(graph, strategies: dict, budget, timeout: float, label: str) -> list[dict]:
    """Each strategy on `graph`, each in its own forked child (see run_solver)."""
    results = []
    for name, solve in strategies.items():
        print(f"[{label}] {name} ...", file=sys.stderr, flush=True)
        result = run_solver(solve, graph, budget, timeout)
        if result["status"] == "error":
            print(result.get("trace", result["error"]), file=sys.stderr)
        results.append(result)
    return results


def _machine_note(args) -> str:
    budget_note = ("no budget" if args.budget_fraction is None
                   else f"budget {args.budget_fraction:g} x store-all peak")
    return (f"{budget_note}; timeout {args.timeout:g} s, {os.cpu_count()} CPUs, "
            f"load average at the end {os.getloadavg()[0]:.1f}")


def _auto_goal(records: list[dict], where: str, goal_seconds: float, name: str = "auto") -> str:
    """One line: how many of `records` (`name`'s) were planned within `goal_seconds`."""
    if not records:
        return ""
    ok = [r for r in records if r["status"] == "ok"]
    within = [r for r in ok if r["cpu_seconds"] <= goal_seconds]
    worst = max(ok, key=lambda r: r["cpu_seconds"], default=None)
    text = f"{name} within {goal_seconds:g} s of CPU: {len(within)} of {len(records)} {where}"
    if worst is not None:
        text += (f"; slowest {worst['seconds']:.2f} s wall, {worst['cpu_seconds']:.2f} s CPU "
                 f"({worst.get('model') or worst.get('family')})")
    failed = [r.get("model") or r.get("family") for r in records if r["status"] != "ok"]
    if failed:
        text += f"; not planned: {', '.join(map(str, failed))}"
    return text


def families_main(args, strategies: dict) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    families = args.families.split(",")
    for family in families:
        if family not in FAMILIES:
            raise SystemExit(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")

    rows, plan_rows, records = [], [], []
    for family in families:
        for size in sizes:
            started = time.perf_counter()
            graph = make_graph(family, size, seed=args.seed)
            generated = time.perf_counter() - started
            timing = time_make_plan(graph)
            reference = timing["store-all_peak"]
            budget = None if args.budget_fraction is None else int(args.budget_fraction * reference)
            forward = len(graph.forward_order)
            candidates = len(graph.candidate_checkpoints)
            plan_rows.append(f"| {family} | {size} | {forward} | {candidates} | {generated:.2f} "
                             f"| {timing['store-all'] * 1e3:.1f} | {timing['chen'] * 1e3:.1f} |")
            results = time_strategies(graph, strategies, budget, args.timeout, f"{family} {size}")
            for name, result in zip(strategies, results):
                records.append(dict(family=family, size=size, strategy=name, forward_ops=forward,
                                    candidates=candidates, store_all_peak=reference, budget=budget,
                                    **{k: v for k, v in result.items() if k != "trace"}))
            rows.append(f"| {family} | {size} | {reference / 2**20:.0f} | "
                        + " | ".join(cell(r, reference, budget) for r in results) + " |")

    print(f"\nSolve time and cost-model peak / store-all peak ({_machine_note(args)}, seed {args.seed}); "
          f"a cell is wall-clock solve seconds · peak / store-all peak\n")
    print("| family | ops | store-all MiB | " + " | ".join(strategies) + " |")
    print("|---|---:|---:|" + "---:|" * len(strategies))
    print("\n".join(rows))
    print("\nOne make_plan evaluation (schedule_for + priority_order + simulate), best of 5\n")
    print("| family | ops | forward ops | candidates | generate s | make_plan store-all ms | make_plan chen ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(plan_rows))
    auto_10k = [r for r in records if r["strategy"] == "auto" and r["size"] == 10_000]
    if auto_10k:
        print("\n" + _auto_goal(auto_10k, "family graphs of 10,000 ops", 3.0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


def _made(meta: dict) -> str:
    """How a corpus graph came: the seconds to export, build and annotate it, or from the cache
    (with the commit it was made at, where known)."""
    if meta.get("cached"):
        return ("cache " + (meta.get("made_at_commit") or "")).strip()
    return "%.0f s" % (meta["export_seconds"] + meta["build_seconds"] + meta["annotate_seconds"])


def corpus_main(args, strategies: dict) -> int:
    from graphopt_zoo.real_zoo import CORPUS, EXPORTERS, SIZES
    models = list(CORPUS) if args.corpus == "all" else args.corpus.split(",")
    unknown = [m for m in models if m not in CORPUS]
    if unknown:
        raise SystemExit(f"unknown corpus models {unknown}; known: {', '.join(CORPUS)}")
    if args.size not in SIZES:
        raise SystemExit(f"unknown size {args.size!r}; known: {', '.join(SIZES)}")
    if args.exporter not in EXPORTERS:
        raise SystemExit(f"unknown exporter {args.exporter!r}; known: {', '.join(EXPORTERS)}")
    others = [s for s in strategies if s != "auto"]

    rows, plan_rows, records, failed = [], [], [], []
    for model in models:
        try:
            graph, meta = corpus_graph(model, args.size, args.exporter, args.cache, args.rebuild)
        except RuntimeError as exc:      # one model's failure is a line of the report, not the end
            print(f"[{model}] {exc}", file=sys.stderr, flush=True)
            failed.append(f"{model}: {str(exc).splitlines()[0]}")
            continue
        timing = time_make_plan(graph)
        reference = timing["store-all_peak"]
        budget = None if args.budget_fraction is None else int(args.budget_fraction * reference)
        forward = len(graph.forward_order)
        candidates = len(graph.candidate_checkpoints)
        results = dict(zip(strategies, time_strategies(graph, strategies, budget, args.timeout, model)))
        for name, result in results.items():
            records.append(dict(model=model, size=args.size, exporter=args.exporter, strategy=name, ops=len(graph),
                                forward_ops=forward, candidates=candidates, store_all_peak=reference,
                                budget=budget, ort_order_peak=meta.get("predicted_original_peak_bytes"),
                                **{k: v for k, v in result.items() if k != "trace"}))
        original = meta.get("predicted_original_peak_bytes")
        auto_cells = ["", "", "", ""]
        if "auto" in results:
            a = results["auto"]
            auto_cells = (["%.2f" % a["seconds"], "%.2f" % a["cpu_seconds"],
                           "%.2f" % (a["peak_bytes"] / max(1, reference))
                           + (" invalid" if not a["valid"] else "")
                           + (" over" if budget is not None and a["peak_bytes"] > budget else ""),
                           "" if original is None else "%.2f" % (a["peak_bytes"] / max(1, original))]
                          if a["status"] == "ok" else [cell(a, reference, budget), "", "", ""])
        rows.append(f"| {model} | {len(graph)} | {candidates} | {mib(reference)} | "
                    + " | ".join(auto_cells + [cell(results[name], reference, budget) for name in others]) + " |")
        plan_rows.append(f"| {model} | {meta.get('forward_nodes', '')} | {meta.get('training_nodes', '')} "
                         f"| {len(graph)} | {forward} | "
                         f"{'' if original is None else mib(original)} | "
                         f"{timing['store-all'] * 1e3:.1f} | {timing['chen'] * 1e3:.1f} | "
                         f"{_made(meta)} |")

    print(f"\nReal training graphs of the corpus (zoo/real_zoo.py, size {args.size}, {args.exporter} exporter; "
          f"cost graphs in {args.cache}): solve time and cost-model peak / store-all peak ({_machine_note(args)}); "
          f"a solver's cell is wall-clock solve seconds · peak / store-all peak; \"ORT order\": the "
          f"cost model's peak on ONNX Runtime's own order of the unchanged graph, what optimize starts from\n")
    print("| model | ops | candidates | store-all MiB | auto s | auto CPU s | auto peak / store-all "
          "| auto peak / ORT order |" + "".join(f" {name} |" for name in others))
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(others))
    print("\n".join(rows))
    print("\nThe graphs: ONNX nodes of the forward model and of the training graph as annotated (function "
          "ops ORT inlines at load written out), cost-graph ops, forward ops, the cost model's peak on ONNX "
          "Runtime's own order, one make_plan evaluation (best of 5), and the time to export, build and "
          "annotate (or: read from the cache)\n")
    print("| model | forward nodes | training nodes | ops | forward ops | ORT order MiB | make_plan store-all ms "
          "| make_plan chen ms | made |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(plan_rows))
    for name in ("auto", "default-objective"):
        solved = [r for r in records if r["strategy"] == name]
        if solved:
            print("\n" + _auto_goal(solved, "corpus graphs", 2.0, name))
    if failed:
        print("\nNot built: " + "; ".join(failed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--build-graph"]:            # the subprocess of corpus_graph
        model, size, exporter, path = argv[1:5]
        build_corpus_graph(model, size, exporter, path)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000,20000",
                        help="total training-graph op counts, comma-separated")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--corpus", nargs="?", const="all", default=None, metavar="MODELS",
                        help="time the corpus's real training graphs instead of the families: "
                             "comma-separated model names of zoo/real_zoo.py (default all)")
    parser.add_argument("--size", default="full", help="--corpus: the models' size (tiny, full, large)")
    parser.add_argument("--exporter", default="legacy", help="--corpus: legacy or dynamo")
    parser.add_argument("--cache", default=CORPUS_CACHE,
                        help=f"--corpus: folder of the cached cost graphs (default {CORPUS_CACHE})")
    parser.add_argument("--rebuild", action="store_true", help="--corpus: build the graphs again, ignore the cache")
    parser.add_argument("--strategies", default=None,
                        help="default: every registered strategy; default-objective: the search optimize "
                             "runs by default (the least peak within its step-time limit), on one order")
    parser.add_argument("--extra", action="append", default=[],
                        help="also time an unregistered solver: name=package.module:function")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per solve (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-fraction", type=float, default=None,
                        help="solve with budget = this fraction of store-all's peak (default: no budget)")
    parser.add_argument("--json", help="also write every measurement here")
    args = parser.parse_args(argv)

    from graphopt.search import STRATEGIES  # at run time: the registry grows while we work
    strategies = dict(STRATEGIES)
    strategies.update(BUILTIN_EXTRA)
    strategies.update(load_extra(args.extra))
    if args.strategies:
        wanted = args.strategies.split(",")
        unknown = [s for s in wanted if s not in strategies]
        if unknown:
            raise SystemExit(f"unknown strategies {unknown}; registered: {', '.join(strategies)}")
        strategies = {s: strategies[s] for s in wanted}
    if args.corpus is not None:
        return corpus_main(args, strategies)
    return families_main(args, strategies)


if __name__ == "__main__":
    sys.exit(main())
