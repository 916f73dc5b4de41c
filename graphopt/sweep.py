"""The memory-time front: plan, rewrite, verify and measure a series of budgets.

`sweep(model, options, points)` composes the pipeline's stages (graphopt/pipeline.py): it
prepares the training graph once (annotated, reference outputs on disk), plans the least-peak plan
(the strategy with no budget), store-all and Chen's sqrt(n), then `points` budgets evenly
spaced from the least-peak plan's predicted peak to store-all's (both ends included); under
each budget the strategy returns its least-recompute-time plan. Every distinct plan (its
checkpoint set) is rewritten, its outputs compared with the original's and measured once in
ONNX Runtime (a fresh process: peak bytes and step seconds); budgets that give an already
measured plan are merged into that plan's row; budgets the strategy cannot meet are skipped
with a note. The original model is measured too, under ONNX Runtime's default session and
with graph optimizations off.

The result is a list of `SweepRow`s (one per measured model) that `write_csv`,
`write_markdown` and `graphopt.plot.plot_front` turn into files. Nothing here knows of the CLI.
"""
from __future__ import annotations

import csv
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace

import onnx

from .errors import BudgetInfeasibleError, InvalidOptionError, VerificationError
from .options import OptimizeOptions
from .pipeline import (ORIGINAL_UNOPTIMIZED, Prepared, compare_in_child, measure_model, measure_original, plan,
                       prepare, rewrite_plan)
from .runtime.weights import Weights, save_model
from .runtime.session import DEFAULT_SETTINGS
from .search import Plan, get_strategy

DEFAULT_POINTS = 8

# Row kinds.
FRONT = "front"                          # a plan of the strategy (least peak, or least time under a budget)
STORE_ALL = "store-all"
CHEN = "chen-sqrt"
ORIGINAL_DEFAULT = "original-default"    # the original model, ONNX Runtime's default session
ORIGINAL_OFF = "original-off"            # the original model, graph optimizations off


@dataclass
class SweepRow:
    label: str
    kind: str
    strategy: str | None = None
    budget_bytes: int | None = None         # the tightest budget that gave this plan
    budgets: list[int] = field(default_factory=list)  # every budget that gave this plan
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    step_seconds: float | None = None
    recompute_seconds: float | None = None  # predicted (cost model)
    checkpoints: int | None = None
    recompute_nodes: int | None = None
    outputs_identical: bool | None = None    # None: not verified
    budget_met: bool | None = None           # measured peak <= budget_bytes (None: no budget)
    on_front: bool = False                   # the least-peak plan or a budget's plan
    also: list[str] = field(default_factory=list)  # labels of the other plans that were this same plan
    note: str = ""
    predicted_step_seconds: float | None = None  # predicted (cost model, seconds as timed in prepare)

    def stands_for(self, label: str) -> bool:
        """Whether this row is the `label` plan ("store-all", "chen-sqrt", ...), itself or merged."""
        return self.label == label or label in self.also

    def as_record(self) -> dict:
        d = asdict(self)
        d["budgets"] = " ".join(str(b) for b in self.budgets)
        d["also"] = ";".join(self.also)
        return d

    @classmethod
    def from_record(cls, record: dict) -> "SweepRow":
        """A row back from `as_record` (the rows of the sweep's JSON report, `SweepResult.report_dict`)."""
        unknown = set(record) - set(CSV_FIELDS)
        if unknown:
            raise ValueError(f"a sweep row has no field(s) {sorted(unknown)}")
        data = dict(record)
        data["budgets"] = [int(b) for b in str(data.get("budgets") or "").split()]
        data["also"] = data["also"].split(";") if data.get("also") else []
        return cls(**data)


CSV_FIELDS = [f.name for f in fields(SweepRow)]


@dataclass
class SweepResult:
    rows: list[SweepRow]
    model: onnx.ModelProto        # the least-peak plan's rewritten model (what `optimize` returns)
    plan: Plan                    # the least-peak plan
    budgets: list[int]            # the budgets tried, loosest first
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # where the caller keeps the weights on disk (`sweep(..., weights=...)`): the data of `model`'s
    # stubs, in a folder of its own (`OptimizeResult.weights`); `write_outputs` writes it from there
    weights: Weights | None = None

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()

    def row(self, label: str) -> SweepRow:
        return next(r for r in self.rows if r.label == label)

    def report_dict(self) -> dict:
        """The sweep's JSON report (`optimize --sweep --report`; the batch's report.json):
        the budgets, the notes, the seconds and the rows (`SweepRow.as_record`)."""
        return {"budgets": self.budgets, "notes": self.notes, "seconds": self.seconds,
                "rows": [r.as_record() for r in self.rows]}


def budget_series(low: int, high: int, points: int) -> list[int]:
    """`points` budgets evenly spaced from `high` down to `low` (both included), distinct,
    loosest first; one point is the midpoint."""
    if points < 1:
        raise ValueError("a sweep needs at least one point")
    if high <= low:
        return [low]
    if points == 1:
        return [(low + high) // 2]
    out: list[int] = []
    for i in range(points):
        b = int(round(high - (high - low) * i / (points - 1)))
        if b not in out:
            out.append(b)
    return out


def sweep(model: onnx.ModelProto, options: OptimizeOptions | None = None,
          points: int = DEFAULT_POINTS, *, repeats: int = 5, weights: Weights | None = None) -> SweepResult:
    """Measure the memory-time front of `model` (left untouched); see the module docstring.

    `options.strategy` plans every point; `options.budget_bytes` is ignored; `options.progress`
    gets one line per point; `repeats` timed steps per measurement (their median is the step
    time: a busy machine shows in it, the peak is not affected). Raises VerificationError when
    the least-peak plan's outputs differ (another plan whose outputs differ is kept in the rows,
    marked, so the table shows it). `weights`: as for `optimize` (the weights kept on disk; the
    result's `weights` then holds the returned model's: `close` it when written).
    """
    # the front's least-peak end is the least peak, whatever the time (the points between trade it)
    options = replace(options or OptimizeOptions(), objective="least-peak", max_overhead=None)
    strategy = get_strategy(options.strategy)
    if not strategy.takes_budget:       # refused before any work: every point is a budget
        raise InvalidOptionError(f"the sweep plans the front under budgets, and strategy {strategy.name!r} "
                                 f"takes none; use a strategy that does (e.g. auto)")
    progress = options.progress or (lambda message, fraction: None)
    started = time.perf_counter()
    stages = replace(options, budget_bytes=None, progress=lambda stage, fraction: progress(f"sweep: {stage}", 0.0))
    # function ops ORT inlines at load are written out first, as optimize does
    with prepare(model, stages, weights=weights) as prepared:
        return _sweep(prepared, options, points, repeats, progress, started)


def _sweep(prepared: Prepared, options: OptimizeOptions, points: int, repeats: int, progress,
           started: float) -> SweepResult:
    def plan_for(budget):
        return plan(prepared, options, budget)

    progress("sweep: plan least peak, store-all, chen-sqrt", 0.05)
    least = plan_for(None)
    store = plan(prepared, options, None, strategy="store-all")
    chen = plan(prepared, options, None, strategy="chen-sqrt")
    budgets = budget_series(least.peak_bytes, store.peak_bytes, points)

    # Distinct plans in measuring order, by checkpoint set.
    entries: dict[frozenset, SweepRow] = {}
    plans: dict[frozenset, Plan] = {}
    notes: list[str] = []

    def add(plan: Plan, label: str, kind: str, on_front: bool) -> SweepRow:
        key = plan.checkpoints
        if key in entries:
            row = entries[key]
            row.on_front = row.on_front or on_front
            row.also.append(label)
            row.note = _join(row.note, f"also the {label} plan")
            return row
        row = SweepRow(label=label, kind=kind, strategy=plan.strategy, predicted_peak_bytes=plan.peak_bytes,
                       recompute_seconds=plan.recompute_seconds,
                       predicted_step_seconds=plan.simulation.compute_seconds, checkpoints=len(plan.checkpoints),
                       recompute_nodes=plan.recompute_ops, on_front=on_front)
        entries[key], plans[key] = row, plan
        return row

    add(least, "least-peak", FRONT, True)
    add(store, "store-all", STORE_ALL, False)
    add(chen, "chen-sqrt", CHEN, False)
    for i, budget in enumerate(budgets):
        fraction = 0.05 + 0.15 * (i + 1) / len(budgets)
        try:
            plan_i = plan_for(budget)
        except BudgetInfeasibleError as exc:
            notes.append(f"budget {budget} bytes ({_mib(budget)}) skipped: {exc}")
            progress(f"sweep: budget {i + 1}/{len(budgets)} {_mib(budget)}: infeasible, skipped", fraction)
            continue
        label = f"budget {i + 1}/{len(budgets)}"
        row = add(plan_i, label, FRONT, True)
        row.budgets.append(budget)
        row.budget_bytes = min(row.budgets)
        same = "" if row.label == label else f" (the {row.label} plan)"
        progress(f"sweep: {label} {_mib(budget)}: planned peak {_mib(plan_i.peak_bytes)}, "
                 f"recompute {plan_i.recompute_seconds:.4f} s{same}", fraction)

    rows: list[SweepRow] = []
    least_model = None
    todo = len(entries) + 2
    done = 0

    def report(row: SweepRow):
        nonlocal done
        done += 1
        parts = [f"sweep: measured {done}/{todo} {row.label}:"]
        if row.budget_bytes is not None:
            parts.append(f"budget {_mib(row.budget_bytes)},")
        if row.predicted_peak_bytes is not None:
            parts.append(f"predicted {_mib(row.predicted_peak_bytes)},")
        parts.append(f"measured {_mib(row.measured_peak_bytes)}, step {row.step_seconds:.3f} s"
                     + ("," if row.outputs_identical is not None else ""))
        if row.outputs_identical is not None:
            parts.append("outputs identical" if row.outputs_identical else "OUTPUTS DIFFER")
        progress(" ".join(parts), 0.2 + 0.8 * done / todo)

    for label, kind, settings, predicted in (
            ("original (default session)", ORIGINAL_DEFAULT, DEFAULT_SETTINGS, None),
            ("original (optimizations off)", ORIGINAL_OFF, ORIGINAL_UNOPTIMIZED,
             prepared.predicted_original.peak_bytes)):
        m = measure_original(prepared, options, settings, repeats=repeats)
        predicted_seconds = (prepared.timing.predicted_original_seconds
                             if kind == ORIGINAL_OFF and prepared.timing is not None else None)
        row = SweepRow(label=label, kind=kind, predicted_peak_bytes=predicted,
                       measured_peak_bytes=m.peak_bytes, step_seconds=m.step_seconds,
                       predicted_step_seconds=predicted_seconds,
                       recompute_seconds=0.0, recompute_nodes=0,
                       note="the reference for outputs" if kind == ORIGINAL_OFF and options.verify else "")
        rows.append(row)
        report(row)

    for key, row in entries.items():
        plan_k = plans[key]
        rewritten = rewrite_plan(prepared, plan_k)
        if options.verify:
            comparison, _, _ = compare_in_child(prepared, rewritten, options, order=False)
            row.outputs_identical = comparison.match
            if not comparison.match:
                message = (f"output {comparison.worst_output()!r} differs from the original (relative "
                           f"difference {comparison.max_relative_difference:.3g} > {options.tolerance})")
                if plan_k is least:
                    raise VerificationError(f"the least-peak plan's {message}; nothing was returned")
                row.note = _join(row.note, message)
        m = measure_model(prepared, rewritten, options, repeats=repeats)
        row.measured_peak_bytes, row.step_seconds = m.peak_bytes, m.step_seconds
        if row.budget_bytes is not None:
            row.budget_met = m.peak_bytes <= row.budget_bytes
        if plan_k is least:
            least_model = rewritten
        rows.append(row)
        report(row)

    # Table order: originals, store-all, chen-sqrt, then the front from the loosest budget to
    # the least peak.
    def order(row: SweepRow):
        rank = {ORIGINAL_DEFAULT: 0, ORIGINAL_OFF: 1, STORE_ALL: 2, CHEN: 3, FRONT: 4}[row.kind]
        return (rank, -(row.budget_bytes if row.budget_bytes is not None else -1))
    rows.sort(key=order)
    model, weights = prepared.leaving(least_model)     # its weights loaded, or handed over
    return SweepResult(rows=rows, model=model, plan=least, budgets=budgets, notes=notes,
                       seconds=time.perf_counter() - started, weights=weights)


def front_rows(rows: list[SweepRow]) -> list[SweepRow]:
    """The rows on the front (the least-peak plan and the budgets' plans), loosest budget first."""
    on = [r for r in rows if r.on_front]
    return sorted(on, key=lambda r: -(r.budget_bytes if r.budget_bytes is not None else -1))


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


# --- files ------------------------------------------------------------------------------

def write_csv(rows: list[SweepRow], path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.as_record().items()})


def read_csv(path) -> list[SweepRow]:
    """Rows back from `write_csv` (the plot can be redrawn from a CSV)."""
    ints = {"budget_bytes", "predicted_peak_bytes", "measured_peak_bytes", "checkpoints", "recompute_nodes"}
    floats = {"step_seconds", "recompute_seconds", "predicted_step_seconds"}
    bools = {"outputs_identical", "budget_met", "on_front"}
    rows = []
    with open(path, newline="") as f:
        for rec in csv.DictReader(f):
            kw = {}
            for k, v in rec.items():
                if k == "budgets":
                    kw[k] = [int(b) for b in v.split()]
                elif k == "also":
                    kw[k] = v.split(";") if v else []
                elif v == "":
                    kw[k] = {"on_front": False, "note": ""}.get(k)
                elif k in ints:
                    kw[k] = int(v)
                elif k in floats:
                    kw[k] = float(v)
                elif k in bools:
                    kw[k] = v == "True"
                else:
                    kw[k] = v
            rows.append(SweepRow(**kw))
    return rows


MARKDOWN_COLUMNS = ["label", "budget (MiB)", "predicted peak (MiB)", "measured peak (MiB)", "step (s)",
                    "predicted step (s)", "recompute (s)", "checkpoints", "recompute nodes", "outputs identical", "budget met"]


def markdown_cells(row: SweepRow) -> list[str]:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    def flag(v):
        return "-" if v is None else ("yes" if v else "NO")
    return [row.label, num(None if row.budget_bytes is None else row.budget_bytes / 2**20, ".2f"),
            num(None if row.predicted_peak_bytes is None else row.predicted_peak_bytes / 2**20, ".2f"),
            num(None if row.measured_peak_bytes is None else row.measured_peak_bytes / 2**20, ".2f"),
            num(row.step_seconds, ".4f"), num(row.predicted_step_seconds, ".4f"), num(row.recompute_seconds, ".4f"),
            num(row.checkpoints, "d"), num(row.recompute_nodes, "d"),
            flag(row.outputs_identical), flag(row.budget_met)]


def markdown_table(rows: list[SweepRow]) -> str:
    lines = ["| " + " | ".join(MARKDOWN_COLUMNS) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(MARKDOWN_COLUMNS))) + "|"]
    lines += ["| " + " | ".join(markdown_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def write_markdown(result: SweepResult, path, title: str = "Memory-time front") -> None:
    text = [f"# {title}", "",
            f"Strategy `{result.plan.strategy}`; {len(result.budgets)} budgets from "
            f"{_mib(result.budgets[-1])} to {_mib(result.budgets[0])}; every distinct plan measured once "
            "in a fresh ONNX Runtime process (peak: memory growth during one training step; step: median "
            "step seconds). Predicted peak and recompute seconds: the cost model.", "",
            markdown_table(result.rows), ""]
    notes = [f"- {r.label}: {r.note}" for r in result.rows if r.note] + [f"- {n}" for n in result.notes]
    if notes:
        text += ["Notes:", ""] + notes + [""]
    with open(path, "w") as f:
        f.write("\n".join(text))


def sweep_paths(output) -> dict[str, str]:
    """`<OUT stem>.sweep.{csv,md,png}` next to the output model."""
    output = os.fspath(output)
    folder, name = os.path.split(output)
    stem = os.path.splitext(name)[0]
    return {ext: os.path.join(folder, f"{stem}.sweep.{ext}") for ext in ("csv", "md", "png")}


def write_outputs(result: SweepResult, output, title: str | None = None) -> dict[str, str]:
    """Write the least-peak model to `output` and the CSV, Markdown table and PNG plot beside it."""
    from .plot import plot_front
    paths = sweep_paths(output)
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(output))), exist_ok=True)
    save_model(result.model, output, result.weights)
    write_csv(result.rows, paths["csv"])
    write_markdown(result, paths["md"], title or f"Memory-time front of {os.path.basename(os.fspath(output))}")
    plot_front(result.rows, paths["png"], title=title)
    return paths


__all__ = ["SweepRow", "SweepResult", "sweep", "budget_series", "front_rows", "write_csv", "read_csv",
           "write_markdown", "markdown_table", "sweep_paths", "write_outputs", "DEFAULT_POINTS"]
