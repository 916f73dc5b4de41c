"""Draw the memory-time front of a sweep (`graphopt.sweep.SweepRow`s) as a PNG, and the memory
of one step over its schedule (`plot_timeline`).

Measured peak (MiB) against measured step time (seconds): the strategy's front (the
least-peak plan and each budget's least-time plan) as a line with markers, from the loosest
budget to the tightest; store-all, Chen's sqrt(n) plan and the original model (ONNX Runtime's
default session; graph optimizations off) as labelled markers. Knows only the rows.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

# kind -> (marker, colour, legend label)
_MARKERS = {
    "store-all": ("s", "tab:green", "store-all (no recompute)"),
    "chen-sqrt": ("^", "tab:orange", "Chen \u221an"),
    "original-default": ("D", "tab:red", "original, ORT default session"),
    "original-off": ("X", "tab:purple", "original, optimizations off"),
}


def _mib(n) -> float:
    return n / 2**20


def plot_front(rows, path, title: str | None = None) -> None:
    """Write the plot of `rows` to `path` (PNG). Rows without a measurement are left out."""
    rows = [r for r in rows if r.measured_peak_bytes is not None and r.step_seconds is not None]
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    front = sorted((r for r in rows if r.on_front),
                   key=lambda r: -(r.budget_bytes if r.budget_bytes is not None else -1))
    if front:
        least = next((r for r in front if r.label == "least-peak"), front[-1])
        strategy = least.strategy or "strategy"
        ax.plot([r.step_seconds for r in front], [_mib(r.measured_peak_bytes) for r in front],
                "-o", color="tab:blue", markersize=6, linewidth=1.5, zorder=2,
                label=f"front: {strategy}, least time under each budget (MiB)")
        for r in front:
            if r.budget_bytes is not None:
                ax.annotate(f"{_mib(r.budget_bytes):.0f}", (r.step_seconds, _mib(r.measured_peak_bytes)),
                            textcoords="offset points", xytext=(-4, 7), fontsize=7, color="tab:blue",
                            ha="right")
        ax.annotate("least peak", (least.step_seconds, _mib(least.measured_peak_bytes)),
                    textcoords="offset points", xytext=(8, -12), fontsize=8, color="tab:blue")
        predicted = [r for r in front if r.predicted_step_seconds is not None and r.predicted_peak_bytes is not None]
        if predicted:
            ax.plot([r.predicted_step_seconds for r in predicted], [_mib(r.predicted_peak_bytes) for r in predicted],
                    "--o", color="tab:blue", markerfacecolor="none", markersize=6, linewidth=1, alpha=0.6,
                    zorder=1, label="the same plans, predicted (cost model)")
    bad = [r for r in rows if r.outputs_identical is False]
    if bad:  # never expected: a plan whose outputs differ from the original's
        ax.plot([r.step_seconds for r in bad], [_mib(r.measured_peak_bytes) for r in bad], "x",
                color="black", markersize=14, zorder=5, label="outputs differ")
    for kind, (marker, colour, text) in _MARKERS.items():
        for r in rows:
            if r.kind != kind and not (kind in ("store-all", "chen-sqrt") and r.stands_for(kind)):
                continue
            x, y = r.step_seconds, _mib(r.measured_peak_bytes)
            ax.plot(x, y, marker, color=colour, markersize=9, zorder=4, label=text,
                    markeredgecolor="black", markeredgewidth=0.6)
            ax.annotate(text.split(" (")[0], (x, y), textcoords="offset points", xytext=(8, 4),
                        fontsize=8, color=colour)
    ax.set_xlabel("step time (s, measured, median)")
    ax.set_ylabel("peak memory (MiB, measured)")
    ax.set_title(title or "Memory-time front (ONNX Runtime, one training step)")
    ax.grid(True, alpha=0.3)
    ax.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)



# the kinds of report.PEAK_KINDS, bottom to top, and their colours
_KIND_COLOURS = {"outputs": "tab:purple", "activations": "tab:blue", "recomputed": "tab:green",
                 "backward": "tab:orange", "unread": "tab:gray", "running": "tab:red"}


def plot_timeline(original, returned, path, title: str | None = None):
    """Draw the predicted bytes alive over the schedule (`explain.Timeline`s) to `path` (PNG or SVG
    by its suffix): the returned model's by kind, stacked, the original's total as a line on the
    same axes, each peak marked, the steps that recompute shaded. `returned` None: the original
    by kind. Returns the figure's data: {label: (x, y)} of every series drawn (MiB)."""
    shown = returned if returned is not None else original
    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=110)
    steps = list(range(len(shown.recomputed)))
    kinds = [k for k in _KIND_COLOURS if shown.by_kind[k].any()]
    data = {}
    ax.stackplot(steps, *[shown.by_kind[k] / 2**20 for k in kinds],
                 colors=[_KIND_COLOURS[k] for k in kinds], alpha=0.75,
                 labels=[f"{k}" + (", returned model" if returned is not None and k == kinds[0] else "")
                         for k in kinds])
    for k in kinds:
        data[k] = (steps, list(shown.by_kind[k] / 2**20))
    total = shown.total / 2**20
    data["total"] = (steps, list(total))
    ax.plot(shown.peak_step, shown.peak_bytes / 2**20, "v", color="black", markersize=8,
            label=f"peak {shown.peak_bytes / 2**20:.1f} MiB" + (" (returned)" if returned is not None else ""))
    if returned is not None:
        original_steps = list(range(len(original.recomputed)))
        original_total = original.total / 2**20
        ax.plot(original_steps, original_total, "-", color="black", linewidth=1.2, label="original, total")
        ax.plot(original.peak_step, original.peak_bytes / 2**20, "^", color="black", markerfacecolor="white",
                markersize=8, label=f"original's peak {original.peak_bytes / 2**20:.1f} MiB")
        data["original"] = (original_steps, list(original_total))
        # the recomputing stretches of the returned schedule
        recomputing = np.flatnonzero(returned.recomputed)
        if len(recomputing):
            runs = np.split(recomputing, np.flatnonzero(np.diff(recomputing) > 1) + 1)
            for k, run in enumerate(runs):
                ax.axvspan(run[0] - 0.5, run[-1] + 0.5, color="tab:green", alpha=0.12, linewidth=0,
                           label="recomputing" if k == 0 else None)
    ax.set_xlabel("step of the schedule (the order ONNX Runtime runs)")
    ax.set_ylabel("bytes alive (MiB, predicted)")
    ax.set_title(title or "Memory over one training step")
    ax.set_xlim(0, max(len(shown.recomputed), len(original.recomputed)) - 1)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    fig.tight_layout()
    suffix = str(path).rsplit(".", 1)[-1].lower()
    fig.savefig(path, format="svg" if suffix == "svg" else "png")
    plt.close(fig)
    return data


__all__ = ["plot_front", "plot_timeline"]
