"""The batch's report: summary.json, summary.csv, summary.md and PNG plots, from the
per-model reports (each model's report.json is the source; the summary only gathers)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402

from .batch import TIMELINE_NAME  # noqa: E402
from .report import Report  # noqa: E402
from .sweep import FRONT, ORIGINAL_DEFAULT, ORIGINAL_OFF, SweepRow  # noqa: E402

COLUMNS = ["model", "kind", "status", "nodes", "peak_before_bytes", "peak_before_optimizations_off_bytes",
           "peak_after_bytes", "peak_ratio", "step_time_ratio", "objective", "max_overhead", "objective_met",
           "strategy", "outputs_match", "outcome", "peak_kind", "seconds", "error"]

# a peak's kind in one word (report.PEAK_KINDS -> what a zoo owner acts on): what recomputation
# helps (activations), what a fused optimizer step helps (gradients), what neither does
PEAK_WORDS = {"outputs": "gradients", "activations": "activations", "recomputed": "activations",
              "backward": "backward", "unread": "unread outputs", "running": "transients"}


def figures(report: dict) -> dict:
    """The summary's numbers from one model's report (an optimize report or a sweep's)."""
    batch = report.get("graphopt_batch", {})
    row = {"model": batch.get("model", ""), "kind": batch.get("kind", ""), "status": batch.get("status", ""),
           "error": batch.get("error", ""), "seconds": round(batch.get("seconds", 0.0), 2)}
    if "rows" in report:   # optimize --sweep: the original rows and the least-peak plan
        rows = [SweepRow.from_record(r) for r in report["rows"]]
        missing = SweepRow(label="", kind="")   # (every figure None)
        by_kind = {r.kind: r for r in rows if r.kind != FRONT}
        before, off = by_kind.get(ORIGINAL_DEFAULT, missing), by_kind.get(ORIGINAL_OFF, missing)
        after = next((r for r in rows if r.label == "least-peak"), missing)
        row.update(nodes=batch.get("nodes"), strategy=after.strategy, outputs_match=after.outputs_identical,
                   peak_before_bytes=before.measured_peak_bytes,
                   peak_before_optimizations_off_bytes=off.measured_peak_bytes,
                   peak_after_bytes=after.measured_peak_bytes)
        if before.step_seconds and after.step_seconds:
            row["step_time_ratio"] = after.step_seconds / before.step_seconds
    elif "strategy" in report:   # an optimize report (a failed model's has only graphopt_batch)
        typed = Report.from_dict({k: v for k, v in report.items() if k != "graphopt_batch"})
        row.update(nodes=typed.nodes.original, strategy=typed.strategy, outputs_match=typed.outputs_match,
                   outcome=typed.outcome)
        if typed.objective is not None:   # its measured overhead is step_time_ratio - 1
            row.update(objective=typed.objective.name, max_overhead=typed.objective.max_overhead,
                       objective_met=typed.objective.met)
        peaks = typed.peaks_explained
        if peaks is not None:   # the returned model's peak, the original's when it is returned
            explained = peaks.returned or peaks.original
            kind = max(explained.bytes_by_kind, key=explained.bytes_by_kind.get)
            row["peak_kind"] = PEAK_WORDS.get(kind, kind)
        if typed.measured is not None:
            row.update(peak_before_bytes=typed.measured.original_default_session.peak_bytes,
                       peak_before_optimizations_off_bytes=typed.measured.original_optimizations_off.peak_bytes,
                       peak_after_bytes=typed.measured.optimized.peak_bytes,
                       step_time_ratio=typed.ratios.step_time_vs_default_session)
    if row.get("peak_before_bytes") and row.get("peak_after_bytes"):
        row["peak_ratio"] = row["peak_after_bytes"] / row["peak_before_bytes"]
    return {column: row.get(column) for column in COLUMNS}


def _size(n) -> str:
    if n is None:
        return ""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _ratio(x) -> str:
    return "" if x is None else f"{x:.2f}x"


def _step_time(r: dict) -> str:
    """The step time ratio, with the objective's limit when it had one: '1.12x (limit 1.20x)'."""
    text = _ratio(r["step_time_ratio"])
    if r.get("max_overhead") is not None:
        text += f" (limit {1 + r['max_overhead']:.2f}x{', over' if r.get('objective_met') is False else ''})"
    return text


def _peak(r: dict, out_dir: Path | None) -> str:
    """The returned model's peak in one word, linked to its timeline when the batch drew one."""
    word = r.get("peak_kind") or ""
    if out_dir is not None and r["model"].endswith(".onnx"):
        timeline = Path(r["model"][:-len(".onnx")]) / TIMELINE_NAME
        if (out_dir / timeline).is_file():
            return f"[{word or 'timeline'}]({timeline.as_posix()})"
    return word


def markdown(rows: list[dict], out_dir: Path | None = None) -> str:
    lines = ["| model | nodes | peak before (default session) | peak after | after / before | "
             "step time ratio | objective | strategy | peak is (timeline) | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = r["status"] if r["status"] != "failed" else f"failed: {r['error']}"
        if r.get("outcome") == "original":
            status += " (not improved: the original is returned)"
        lines.append(f"| {r['model']} | {r['nodes'] or ''} | {_size(r['peak_before_bytes'])} | "
                     f"{_size(r['peak_after_bytes'])} | {_ratio(r['peak_ratio'])} | {_step_time(r)} | "
                     f"{r.get('objective') or ''} | {r['strategy'] or ''} | {_peak(r, out_dir)} | "
                     f"{status.replace('|', '/')} |")
    return "\n".join(lines)


def plot_peaks(rows: list[dict], path: Path) -> None:
    done = [r for r in rows if r["peak_before_bytes"] and r["peak_after_bytes"]]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(done) + 2), 4.5), dpi=120)
    xs = range(len(done))
    ax.bar([x - 0.2 for x in xs], [r["peak_before_bytes"] / 2**20 for r in done], 0.4,
           label="before (ORT default session)", color="tab:red")
    ax.bar([x + 0.2 for x in xs], [r["peak_after_bytes"] / 2**20 for r in done], 0.4,
           label="after (graphopt)", color="tab:blue")
    ax.set_xticks(list(xs), [r["model"] for r in done], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("measured peak of one training step (MiB)")
    ax.set_title("Peak memory before and after, per model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_saving_vs_time(rows: list[dict], path: Path) -> None:
    done = [r for r in rows if r["peak_ratio"] is not None and r["step_time_ratio"] is not None]
    fig, ax = plt.subplots(figsize=(6.5, 4.5), dpi=120)
    ax.scatter([r["step_time_ratio"] for r in done], [100 * (1 - r["peak_ratio"]) for r in done], color="tab:blue")
    for r in done:
        ax.annotate(r["model"], (r["step_time_ratio"], 100 * (1 - r["peak_ratio"])), fontsize=7,
                    textcoords="offset points", xytext=(4, 3))
    ax.set_xlabel("step time, optimized / original (default session)")
    ax.set_ylabel("peak memory saved (%)")
    ax.set_title("Saving against time overhead")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_fronts(out_dir: Path, rows: list[dict], path: Path) -> bool:
    """Each model's memory-time front (from its optimized.sweep.csv) in one figure."""
    from .sweep import read_csv
    fronts = []
    for r in rows:
        csv_path = out_dir / r["model"][:-len(".onnx")] / "optimized.sweep.csv"
        if csv_path.is_file():
            fronts.append((r["model"], read_csv(csv_path)))
    if not fronts:
        return False
    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    for name, sweep_rows in fronts:
        original = next((s for s in sweep_rows if s.kind == "original-default" and s.measured_peak_bytes), None)
        front = sorted((s for s in sweep_rows if s.on_front and s.measured_peak_bytes and s.step_seconds),
                       key=lambda s: s.step_seconds)
        if original is None or not front:
            continue
        ax.plot([s.step_seconds / original.step_seconds for s in front],
                [s.measured_peak_bytes / original.measured_peak_bytes for s in front], "-o", markersize=4, label=name)
    ax.set_xlabel("step time / original's (default session)")
    ax.set_ylabel("peak / original's (default session)")
    ax.set_title("Memory-time fronts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_summary(out_dir: Path, reports: list[dict]) -> dict[str, Path]:
    rows = [figures(report) for report in reports]
    paths = {"json": out_dir / "summary.json", "csv": out_dir / "summary.csv", "md": out_dir / "summary.md",
             "peaks": out_dir / "peaks.png", "saving_vs_time": out_dir / "saving_vs_time.png"}
    failed = [r["model"] for r in rows if r["status"] == "failed"]
    paths["json"].write_text(json.dumps({"models": rows, "failed": failed,
                                         "ok": sum(r["status"] == "ok" for r in rows)}, indent=2))
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    paths["md"].write_text("# Batch summary\n\n" + markdown(rows, out_dir) + "\n")
    plot_peaks(rows, paths["peaks"])
    plot_saving_vs_time(rows, paths["saving_vs_time"])
    if plot_fronts(out_dir, rows, out_dir / "fronts.png"):
        paths["fronts"] = out_dir / "fronts.png"
    return paths
