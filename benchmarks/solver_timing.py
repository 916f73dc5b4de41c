"""Solve time of every registered strategy on the graph families, side by side.

For each family (benchmarks/graph_families.py) and size (total training-graph ops) it
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
"""
from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_families import FAMILIES, make_graph  # noqa: E402


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
    """Best-of-`repeats` wall seconds of one make_plan on store-all's and Chen's checkpoint sets
    (the machine may be shared: the best of several is the least disturbed)."""
    from graphopt.search.chen_sqrt import segment_checkpoints
    from graphopt.search.plan import make_plan
    import math

    out = {}
    sets = {"store-all": graph.candidate_checkpoints,
            "chen": segment_checkpoints(graph, max(1, round(math.sqrt(len(graph.forward_order)))))}
    for name, checkpoints in sets.items():
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            plan = make_plan(graph, name, checkpoints)
            best = min(best, time.perf_counter() - started)
        out[name] = best
        out[name + "_peak"] = plan.peak_bytes
    return out


def load_extra(specs: list[str]) -> dict:
    extra = {}
    for spec in specs:
        name, _, target = spec.partition("=")
        module, _, attr = target.partition(":")
        if not (name and module and attr):
            raise SystemExit(f"--extra wants name=package.module:function, got {spec!r}")
        extra[name] = getattr(importlib.import_module(module), attr)
    return extra


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000,20000",
                        help="total training-graph op counts, comma-separated")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--strategies", default=None, help="default: every registered strategy")
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
    strategies.update(load_extra(args.extra))
    if args.strategies:
        wanted = args.strategies.split(",")
        unknown = [s for s in wanted if s not in strategies]
        if unknown:
            raise SystemExit(f"unknown strategies {unknown}; registered: {', '.join(strategies)}")
        strategies = {s: strategies[s] for s in wanted}
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
            cells = []
            for name, solve in strategies.items():
                print(f"[{family} {size}] {name} ...", file=sys.stderr, flush=True)
                result = run_solver(solve, graph, budget, args.timeout)
                cells.append(cell(result, reference, budget))
                records.append(dict(family=family, size=size, strategy=name, forward_ops=forward,
                                    candidates=candidates, store_all_peak=reference, budget=budget,
                                    **{k: v for k, v in result.items() if k != "trace"}))
                if result["status"] == "error":
                    print(result.get("trace", result["error"]), file=sys.stderr)
            rows.append(f"| {family} | {size} | {reference / 2**20:.0f} | " + " | ".join(cells) + " |")

    budget_note = ("no budget" if args.budget_fraction is None
                   else f"budget {args.budget_fraction:g} x store-all peak")
    print(f"\nSolve time and cost-model peak / store-all peak ({budget_note}; "
          f"timeout {args.timeout:g} s, seed {args.seed}, {os.cpu_count()} CPUs, load average at the end "
          f"{os.getloadavg()[0]:.1f}); a cell is wall-clock solve seconds · peak / store-all peak\n")
    print("| family | ops | store-all MiB | " + " | ".join(strategies) + " |")
    print("|---|---:|---:|" + "---:|" * len(strategies))
    print("\n".join(rows))
    print("\nOne make_plan evaluation (schedule_for + priority_order + simulate), best of 5\n")
    print("| family | ops | forward ops | candidates | generate s | make_plan store-all ms | make_plan chen ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(plan_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
