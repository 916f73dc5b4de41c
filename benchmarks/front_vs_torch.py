"""graphopt's measured memory-time front against torch.compile's activation_memory_budget
(issue 13, item 6): at equal step-time overhead over each one's own baseline, whose peak is
lower.

    python benchmarks/front_vs_torch.py [--examples mlp,resnet] [--models resnet50 --size full]
        [--points 8] [--budgets 0.1,0.2,...,1.0] [--levels 1.05,1.1,1.25,1.5,2]
        [--overheads 0.05,0.1,0.25,0.5,1] [--json out.json]

Same model, batch, inputs, threads (one) and measurement on both sides, per example of
graphopt/examples.py (default: all six) and per corpus model (``--models``, zoo/real_zoo.py
at ``--size``; none by default):

* **torch** (the twin module of zoo/torch_twins.py for an example; for a corpus model
  the torch module itself, in train mode with its stochastic layers off, with cross entropy
  over its class axis, as benchmarks/real_vs_eager.py): eager, and ``torch.compile`` with
  ``torch._functorch.config.activation_memory_budget`` = each of ``--budgets`` (set before
  ``torch.compile`` in each fresh process; 1.0 is torch's default, i.e. plain
  ``torch.compile``). Each point is measured by benchmarks/pytorch_compare.py's worker: the
  peak (RSS growth during one step: forward, loss, backward, gradients produced) in a fresh
  process with graphopt's allocator settings, the step time (median of 3 steps) in a second
  fresh process with the plain allocator, one thread. **torch's baseline is eager** (its
  step time: the median of ``--baseline-repeats`` (3) such timing processes).
* **graphopt**, on the training graph of the same model and inputs:
  ``graphopt.sweep.sweep(model, OptimizeOptions(inputs=...), points=--points, repeats=7)``:
  every distinct plan of the front, store-all, Chen's sqrt(n), and the original under ONNX
  Runtime's default session and with graph optimizations off, each measured in fresh
  processes (peak RSS growth of one ``run``; median of 7 step times). Plans whose outputs
  differ from the original's are left out (graphopt would not return them). When
  ``OptimizeOptions`` has the field ``max_overhead`` (feature-detected), also ``optimize`` at
  ``max_overhead`` = each of ``--overheads`` and at ``objective="least-peak"``: what each
  returns (``report.measured.optimized``). **graphopt's baseline is the original training
  graph under ONNX Runtime's default session**: the median of its measurements in this run
  (the sweep's, each optimize report's ``measured.original_default_session``, and more by
  ``graphopt.runtime.measure`` until there are ``--baseline-repeats``). One noisy baseline
  would shift every overhead of its side, hence the repeats.

A point's overhead is its step time / its side's baseline step time; each baseline is a
point at overhead exactly 1. For each level L of ``--levels``, each side's candidate is its
least measured peak among its points with overhead <= L (the baselines make one always
exist). The lower absolute peak (MiB: same model and batch, so the bytes compare directly)
wins the level; the ratio to the side's own baseline peak is printed beside it.

**graphopt is below torch on a model** when its candidate's peak is strictly lower at EVERY
level. The summary line counts those models ("graphopt below torch at equal overhead on N of
M examples"); a second count uses a majority of the levels instead.

**At equal peak, in absolute seconds** (issue 25, item 5: the comparison users make): for
each of torch's points (eager, each ``torch.compile`` budget), graphopt's fastest measured point
whose peak is at or below that point's, its step time in seconds beside torch's (same machine,
same thread), and their ratio; "-" when no graphopt point is that low. The summary line
counts the torch points graphopt matches or beats in time at no more memory.

Step times on a shared 2-core machine are noisy: the load average is printed before and
after, and a point near a level's boundary can fall on either side of it from run to run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import fields

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import pytorch_compare  # noqa: E402  (the torch worker and its measurement)

BUDGETS = tuple(round(0.1 * i, 1) for i in range(1, 11))
LEVELS = (1.05, 1.10, 1.25, 1.5, 2.0)
OVERHEADS = (0.05, 0.1, 0.25, 0.5, 1.0)
POINTS = 8
SWEEP_REPEATS = 7          # optimize's own measurement takes the median of 7 steps
MiB = 2 ** 20


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def has_max_overhead() -> bool:
    """Whether OptimizeOptions has the field `max_overhead` (issue 13, item 1)."""
    from graphopt.options import OptimizeOptions
    return "max_overhead" in {f.name for f in fields(OptimizeOptions)}


# ------------------------------------------------------------------------ torch side --

def torch_configs(budgets) -> list[str]:
    return ["eager"] + ["compile-budget=%g" % b for b in budgets]


def _torch_label(config: str) -> str:
    mode, budget = pytorch_compare.parse_config(config)
    if mode == "eager":
        return "eager"
    return "compile" if budget is None else "compile budget %g" % budget


def torch_side(name: str, budgets, timeout: float, corpus: dict | None = None, baseline_repeats: int = 3,
               log=print) -> dict:
    """Every torch configuration of example `name` (or corpus model `name`: corpus =
    {"size", "inputs_path"}), each in fresh processes: {"baseline", "points", "errors"}.
    Eager's step time is measured `baseline_repeats` times in all (fresh processes; the
    baseline takes their median)."""
    points, errors = [], []

    def argv_of(config):
        if corpus is None:
            return None
        return [os.path.abspath(__file__), "--worker", name, config, corpus["size"], corpus["inputs_path"]]

    for config in torch_configs(budgets):
        d = pytorch_compare.measure_torch(name, config, timeout, worker_argv=argv_of(config))
        label = _torch_label(config)
        if "error" in d:
            errors.append({"label": label, "config": config, "error": d["error"]})
            log("  torch %s: error %s" % (label, d["error"]))
            continue
        points.append({"label": label, "config": config, "peak_bytes": int(d["peak_bytes"]),
                       "step_seconds": float(d["step_seconds"]), "loss": d.get("loss"),
                       "warmup_seconds": d.get("warmup_seconds")})
        log("  torch %s: %.1f MiB, %.3f s (%.0f s)" % (label, d["peak_bytes"] / MiB, d["step_seconds"],
                                                      d["wall_seconds"]))
    eager = next((p for p in points if p["config"] == "eager"), None)
    baseline = None
    if eager is not None:
        steps = [eager["step_seconds"]]
        for _ in range(baseline_repeats - 1):
            try:
                steps.append(float(pytorch_compare._run_worker(name, "eager", 3, timeout,
                                                               argv_of("eager"))["step_seconds"]))
            except Exception as e:  # noqa: BLE001
                errors.append({"label": "eager (again)", "config": "eager", "error": str(e)[:300]})
        baseline = {"label": "eager", "peak_bytes": eager["peak_bytes"],
                    "step_seconds": float(statistics.median(steps)), "step_seconds_measured": steps}
        log("  torch eager step seconds %s: baseline %.3f s" % (
            ", ".join("%.3f" % x for x in steps), baseline["step_seconds"]))
    return {"baseline": baseline, "points": [p for p in points if p is not eager], "errors": errors}


# --------------------------------------------------------------------- graphopt side --

def measure_original_default(model, inputs: dict) -> tuple[int, float]:
    """(peak bytes, step seconds) of training graph `model` under ONNX Runtime's default
    session, measured by graphopt.runtime.measure (fresh processes, one thread)."""
    from graphopt.inputs import save_inputs
    from graphopt.runtime.isolated import save_model
    from graphopt.runtime.measure import measure
    from graphopt.runtime.session import DEFAULT_SETTINGS
    with tempfile.TemporaryDirectory(prefix="front-vs-torch-original-") as tmp:
        model_path, inputs_path = os.path.join(tmp, "original.onnx"), os.path.join(tmp, "inputs.npz")
        save_model(model, model_path)
        save_inputs(inputs_path, inputs)
        m = measure(model_path, inputs_path, DEFAULT_SETTINGS, threads=1, repeats=SWEEP_REPEATS)
    return int(m.peak_bytes), float(m.step_seconds)


def graphopt_side(model, inputs: dict, points: int, overheads, baseline_repeats: int = 3, log=print) -> dict:
    """graphopt's measured points on training graph `model` with `inputs`:
    {"baseline", "points", "errors", "sweep_seconds", "max_overhead": bool}. The original
    under the default session is measured by the sweep, by each optimize run, and again
    until there are `baseline_repeats` measurements; the baseline takes their median."""
    from graphopt.optimize import OptimizeOptions, optimize
    from graphopt.sweep import ORIGINAL_DEFAULT, sweep

    out = {"points": [], "errors": [], "max_overhead": has_max_overhead()}
    baselines = []           # (peak, step) of each measurement of the original, default session
    started = time.perf_counter()
    try:
        result = sweep(model, OptimizeOptions(inputs=inputs), points=points, repeats=SWEEP_REPEATS)
    except Exception as e:  # noqa: BLE001  (a failing side is a table cell)
        out["errors"].append({"label": "sweep", "error": "%s: %s" % (type(e).__name__, str(e)[:300])})
        log("  graphopt sweep: error %s" % out["errors"][-1]["error"])
        result = None
    out["sweep_seconds"] = time.perf_counter() - started
    if result is not None:
        for row in result.rows:
            if row.kind == ORIGINAL_DEFAULT:      # folded into the baseline
                baselines.append((row.measured_peak_bytes, row.step_seconds))
                continue
            if row.outputs_identical is False:
                out["errors"].append({"label": "sweep " + row.label, "error": "outputs differ: " + row.note})
                continue
            label = "sweep " + row.label + ("".join(" = " + a for a in row.also) if row.also else "")
            out["points"].append({"label": label, "kind": row.kind, "peak_bytes": int(row.measured_peak_bytes),
                                  "step_seconds": float(row.step_seconds),
                                  "predicted_peak_bytes": row.predicted_peak_bytes,
                                  "recompute_nodes": row.recompute_nodes})
        log("  graphopt sweep: %d rows (%.0f s)" % (len(result.rows), out["sweep_seconds"]))

    if out["max_overhead"]:
        runs = [("max_overhead %g" % f, {"max_overhead": f}) for f in overheads]
        runs.append(("objective least-peak", {"objective": "least-peak"}))
        for label, extra in runs:
            t0 = time.perf_counter()
            try:
                report = optimize(model, OptimizeOptions(inputs=inputs, **extra)).report
            except Exception as e:  # noqa: BLE001
                out["errors"].append({"label": label, "error": "%s: %s" % (type(e).__name__, str(e)[:300])})
                log("  graphopt %s: error %s" % (label, out["errors"][-1]["error"]))
                continue
            m = report.measured
            base = m.original_default_session
            baselines.append((base.peak_bytes, base.step_seconds))
            point = {"label": "optimize " + label, "kind": "optimize", "options": extra,
                     "peak_bytes": int(m.optimized.peak_bytes), "step_seconds": float(m.optimized.step_seconds),
                     "own_baseline_step_seconds": float(base.step_seconds),
                     "ratios": report.ratios.to_dict() if report.ratios is not None else None,
                     "objective": (report.objective.to_dict()
                                   if getattr(report, "objective", None) is not None else None),
                     "recompute_nodes": getattr(report, "recompute_nodes", None)}
            out["points"].append(point)
            log("  graphopt %s: %.1f MiB, %.3f s (own baseline %.3f s; %.0f s)" % (
                label, point["peak_bytes"] / MiB, point["step_seconds"], base.step_seconds,
                time.perf_counter() - t0))
    while len(baselines) < baseline_repeats:
        try:
            baselines.append(measure_original_default(model, inputs))
        except Exception as e:  # noqa: BLE001
            out["errors"].append({"label": "original (again)", "error": "%s: %s" % (type(e).__name__, str(e)[:300])})
            break
    log("  graphopt original, default session, step seconds %s" % ", ".join("%.3f" % s for _, s in baselines))
    out["baseline"] = None if not baselines else {
        "label": "original, ORT default session",
        "peak_bytes": int(statistics.median(p for p, _ in baselines)),
        "step_seconds": float(statistics.median(s for _, s in baselines)),
        "measurements": [{"peak_bytes": p, "step_seconds": s} for p, s in baselines]}
    return out


# ------------------------------------------------------------------------ comparison --

def with_overheads(side: dict) -> list[dict]:
    """The side's points with "overhead" (step / baseline step) and "peak_ratio" (peak /
    baseline peak); the baseline itself first, at overhead exactly 1."""
    base = side.get("baseline")
    if not base:
        return []
    pts = [dict(base, label="baseline: " + base["label"], overhead=1.0, peak_ratio=1.0)]
    for p in side["points"]:
        pts.append(dict(p, overhead=p["step_seconds"] / base["step_seconds"],
                        peak_ratio=p["peak_bytes"] / base["peak_bytes"]))
    return pts


def least_at(points: list[dict], level: float) -> dict | None:
    """The point of least peak among `points` (with_overheads') whose overhead <= level."""
    ok = [p for p in points if p["overhead"] <= level]
    return min(ok, key=lambda p: (p["peak_bytes"], p["overhead"])) if ok else None


def compare(graphopt: dict, torch: dict, levels=LEVELS) -> dict:
    """Per level: each side's least peak at overhead <= level and the winner; then the
    model's verdicts (see the module docstring)."""
    g_pts, t_pts = with_overheads(graphopt), with_overheads(torch)
    rows = []
    for level in levels:
        g, t = least_at(g_pts, level), least_at(t_pts, level)
        if g is None or t is None:
            winner = "-"
        elif g["peak_bytes"] < t["peak_bytes"]:
            winner = "graphopt"
        elif t["peak_bytes"] < g["peak_bytes"]:
            winner = "torch"
        else:
            winner = "tie"
        rows.append({"level": level, "graphopt": g, "torch": t, "winner": winner})
    both = [r for r in rows if r["winner"] != "-"]
    won = sum(r["winner"] == "graphopt" for r in both)
    return {"levels": rows, "levels_compared": len(both), "levels_won": won,
            "below_at_every_level": bool(both) and won == len(both),
            "below_at_majority": bool(both) and 2 * won > len(both)}


def at_equal_peak(graphopt: dict, torch: dict) -> list[dict]:
    """For each torch point (its baseline first): graphopt's fastest point whose peak is at or
    below it (None when none is), in absolute step seconds."""
    g_pts, rows = with_overheads(graphopt), []
    for t in with_overheads(torch):
        fitting = [g for g in g_pts if g["peak_bytes"] <= t["peak_bytes"]]
        g = min(fitting, key=lambda p: (p["step_seconds"], p["peak_bytes"])) if fitting else None
        rows.append({"torch": t, "graphopt": g,
                     "seconds_ratio": None if g is None else g["step_seconds"] / t["step_seconds"]})
    return rows


# ----------------------------------------------------------------------------- tables --

def _mib(n) -> str:
    return "%.1f" % (n / MiB)


def _short(label: str) -> str:
    label = label.replace("baseline: ", "").replace("original, ORT default session", "ORT default")
    return label.replace("sweep ", "").replace("optimize objective ", "objective ").replace("optimize ", "")


def _cand(p: dict | None) -> str:
    if p is None:
        return "-"
    return "%s (%.2fx) %s @%.2fx" % (_mib(p["peak_bytes"]), p["peak_ratio"], _short(p["label"]), p["overhead"])


def summary_table(results: dict, levels) -> str:
    """One row per model: at each level, graphopt's and torch's least peak (MiB) and who is lower."""
    head = ["model", "graphopt base MiB / s", "torch eager MiB / s"] + ["<= %.2fx" % L for L in levels] \
        + ["graphopt lower at"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
    for name, r in results.items():
        c = r.get("comparison")
        g_base, t_base = r["graphopt"].get("baseline"), r["torch"].get("baseline")
        if c is None:
            lines.append("| %s | %s |" % (name, r.get("error", "-")) + " - |" * (len(head) - 2))
            continue
        cells = [name,
                 "-" if not g_base else "%s / %.3f" % (_mib(g_base["peak_bytes"]), g_base["step_seconds"]),
                 "-" if not t_base else "%s / %.3f" % (_mib(t_base["peak_bytes"]), t_base["step_seconds"])]
        for row in c["levels"]:
            g, t = row["graphopt"], row["torch"]
            if g is None or t is None:
                cells.append("-")
                continue
            mark = {"graphopt": "**g**", "torch": "**t**", "tie": "="}[row["winner"]]
            cells.append("%s vs %s %s" % (_mib(g["peak_bytes"]), _mib(t["peak_bytes"]), mark))
        cells.append("%d of %d" % (c["levels_won"], c["levels_compared"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def level_table(name: str, r: dict) -> str:
    """The chosen point of each side per level: MiB (x own baseline peak), which point, its overhead."""
    lines = ["| %s: overhead <= | graphopt MiB (x base) point @overhead | torch MiB (x base) point @overhead | lower |"
             % name, "|---:|---|---|---|"]
    for row in r["comparison"]["levels"]:
        lines.append("| %.2fx | %s | %s | %s |" % (row["level"], _cand(row["graphopt"]), _cand(row["torch"]),
                                                    row["winner"]))
    return "\n".join(lines)


def points_table(name: str, r: dict) -> str:
    """Every measured point of both sides."""
    lines = ["| %s | point | peak MiB | x base peak | step s | overhead |" % name, "|---|---|---:|---:|---:|---:|"]
    for side in ("graphopt", "torch"):
        for p in sorted(with_overheads(r[side]), key=lambda p: p["overhead"]):
            lines.append("| %s | %s | %s | %.2f | %.3f | %.2f |" % (
                side, _short(p["label"]), _mib(p["peak_bytes"]), p["peak_ratio"], p["step_seconds"], p["overhead"]))
        for e in r[side].get("errors", []):
            lines.append("| %s | %s | error: %s | | | |" % (side, e["label"], e["error"].replace("|", "/")[:100]))
    return "\n".join(lines)


def equal_peak_table(name: str, r: dict) -> str:
    """Per torch point: graphopt's fastest point at no more peak, absolute seconds side by side."""
    lines = ["| %s: torch point | torch MiB / s | graphopt point at <= its peak | graphopt MiB / s | "
             "graphopt s / torch s |" % name, "|---|---:|---|---:|---:|"]
    for row in at_equal_peak(r["graphopt"], r["torch"]):
        t, g = row["torch"], row["graphopt"]
        lines.append("| %s | %s / %.3f | %s | %s | %s |" % (
            _short(t["label"]), _mib(t["peak_bytes"]), t["step_seconds"], "-" if g is None else _short(g["label"]),
            "-" if g is None else "%s / %.3f" % (_mib(g["peak_bytes"]), g["step_seconds"]),
            "-" if g is None else "%.2fx" % row["seconds_ratio"]))
    return "\n".join(lines)


def equal_peak_lines(results: dict) -> list[str]:
    out = []
    for name, r in results.items():
        if not r.get("comparison"):
            continue
        rows = at_equal_peak(r["graphopt"], r["torch"])
        matched = [x for x in rows if x["graphopt"] is not None]
        faster = [x for x in matched if x["seconds_ratio"] <= 1.0]
        out.append("%s at equal peak: graphopt has a point at or below %d of torch's %d points' peaks, as fast or "
                   "faster on %d; seconds ratio %s" % (
                       name, len(matched), len(rows), len(faster),
                       "-" if not matched else "%.2f-%.2fx" % (min(x["seconds_ratio"] for x in matched),
                                                               max(x["seconds_ratio"] for x in matched))))
    return out


def verdict_lines(results: dict, levels) -> list[str]:
    compared = {n: r["comparison"] for n, r in results.items() if r.get("comparison")}
    out = []
    for kind, names in (("examples", [n for n in compared if not results[n].get("corpus")]),
                        ("corpus models", [n for n in compared if results[n].get("corpus")])):
        if not names:
            continue
        every = [n for n in names if compared[n]["below_at_every_level"]]
        most = [n for n in names if compared[n]["below_at_majority"]]
        out.append("graphopt below torch at equal overhead on %d of %d %s (at every level of %s: %s)"
                   % (len(every), len(names), kind, ", ".join("%.2fx" % L for L in levels),
                      ", ".join(every) or "none"))
        out.append("  at the majority of levels: %d of %d (%s)" % (len(most), len(names), ", ".join(most) or "none"))
    return out


def report_text(results: dict, levels, load_before, load_after) -> str:
    parts = ["Least measured peak at step-time overhead <= level over each side's own baseline "
             "(graphopt: the original under ORT's default session; torch: eager), MiB, graphopt vs torch; "
             "**g** / **t**: whose peak is lower", "", summary_table(results, levels), ""]
    parts += verdict_lines(results, levels) + [""]
    parts += ["At equal peak, absolute step seconds (same machine, one thread):", ""] + equal_peak_lines(results) + [""]
    for name, r in results.items():
        if r.get("comparison"):
            parts += [level_table(name, r), "", equal_peak_table(name, r), "", points_table(name, r), ""]
    parts.append("load average before %s, after %s" % (_load(load_before), _load(load_after)))
    return "\n".join(parts)


def _load(load) -> str:
    return "%.2f %.2f %.2f" % tuple(load)


# ------------------------------------------------------------------------------ runs --

def run_example(name: str, args, log) -> dict:
    from graphopt.examples import training_example
    log("%s: graphopt ..." % name)
    model, inputs = training_example(name)
    r = {"graphopt": graphopt_side(model, inputs, args.points, args.overheads, args.baseline_repeats, log)}
    del model
    log("%s: torch ..." % name)
    r["torch"] = torch_side(name, args.budgets, args.timeout, baseline_repeats=args.baseline_repeats, log=log)
    return r


def run_corpus(name: str, args, folder: str, log) -> dict:
    import onnx

    import real_vs_eager
    from graphopt.inputs import load_inputs
    log("%s (%s): export and build ..." % (name, args.size))
    prepared = real_vs_eager.prepare(name, args.size, args.exporter, folder)
    r = {"corpus": {"size": args.size, "exporter": args.exporter, "inputs": prepared.get("inputs")}}
    if "error" in prepared:
        r["error"] = prepared["error"]
        r["graphopt"] = {"points": [], "errors": [{"label": "build", "error": prepared["error"]}]}
    else:
        log("%s: graphopt ..." % name)
        r["graphopt"] = graphopt_side(onnx.load(prepared["model_path"]), load_inputs(prepared["inputs_path"]),
                                      args.points, args.overheads, args.baseline_repeats, log)
    log("%s: torch ..." % name)
    r["torch"] = torch_side(name, args.budgets, args.timeout,
                            corpus={"size": args.size, "inputs_path": prepared["inputs_path"]},
                            baseline_repeats=args.baseline_repeats, log=log)
    return r


def _worker(argv) -> int:
    """Corpus model's torch step, measured by pytorch_compare.worker in this process."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "CONFIG", "SIZE", "INPUTS"))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    name, config, size, inputs_path = args.worker
    import builder_vs_eager
    import real_vs_eager
    return pytorch_compare.worker_main(lambda: builder_vs_eager.step_worker(
        real_vs_eager._CorpusStep(size, inputs_path), name, config, args.repeats))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return _worker(argv)
    from graphopt.examples import EXAMPLES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES),
                        help="comma-separated examples (default: all six; '' for none)")
    parser.add_argument("--models", default="", help="comma-separated corpus models (zoo/real_zoo.py)")
    parser.add_argument("--size", default="full", help="corpus size: tiny | full | large")
    parser.add_argument("--exporter", default="legacy", help="corpus exporter: legacy | dynamo")
    parser.add_argument("--points", type=int, default=POINTS, help="sweep budgets (default %(default)s)")
    parser.add_argument("--budgets", type=_floats, default=BUDGETS, help="activation_memory_budget values")
    parser.add_argument("--levels", type=_floats, default=LEVELS, help="overhead levels (step / own baseline)")
    parser.add_argument("--overheads", type=_floats, default=OVERHEADS,
                        help="graphopt max_overhead values, when OptimizeOptions has the field")
    parser.add_argument("--baseline-repeats", type=int, default=3,
                        help="step-time measurements of each baseline (fresh processes; median)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per torch subprocess")
    parser.add_argument("--keep", help="keep the corpus models and inputs in this folder")
    parser.add_argument("--json", help="also write every measurement here")
    args = parser.parse_args(argv)

    def log(message):
        print(message, file=sys.stderr, flush=True)

    examples = [n for n in args.examples.split(",") if n]
    models = [n for n in args.models.split(",") if n]
    unknown = [n for n in examples if n not in EXAMPLES]
    if unknown:
        parser.error("unknown example(s) %s (known: %s)" % (unknown, ", ".join(EXAMPLES)))
    if models:
        from graphopt_zoo import real_zoo
        unknown = [n for n in models if n not in real_zoo.CORPUS]
        if unknown:
            parser.error("unknown model(s) %s (corpus: %s)" % (unknown, ", ".join(real_zoo.CORPUS)))
    for b in args.budgets:
        pytorch_compare.parse_config("compile-budget=%g" % b)   # (0, 1]

    load_before = os.getloadavg()
    log("load average %s; max_overhead in OptimizeOptions: %s" % (_load(load_before), has_max_overhead()))
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="front-vs-torch-") as tmp:
        folder = args.keep or tmp
        os.makedirs(folder, exist_ok=True)
        for name in examples + models:
            t0 = time.perf_counter()
            try:
                r = run_example(name, args, log) if name in examples else run_corpus(name, args, folder, log)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                r = {"error": "%s: %s" % (type(e).__name__, str(e)[:300]), "graphopt": {}, "torch": {}}
            if r["graphopt"].get("baseline") and r["torch"].get("baseline"):
                r["comparison"] = compare(r["graphopt"], r["torch"], args.levels)
            r["wall_seconds"] = time.perf_counter() - t0
            results[name] = r
            log("%s: %.0f s" % (name, r["wall_seconds"]))
    load_after = os.getloadavg()
    total = time.perf_counter() - started
    print(report_text(results, args.levels, load_before, load_after))
    print("\nmax_overhead points: %s; whole run %.0f s" % ("yes" if has_max_overhead() else
                                                          "no (OptimizeOptions has no max_overhead)", total))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"levels": list(args.levels), "budgets": list(args.budgets), "points": args.points,
                       "overheads": list(args.overheads), "max_overhead": has_max_overhead(),
                       "load_before": list(load_before), "load_after": list(load_after),
                       "total_seconds": total, "results": results}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
