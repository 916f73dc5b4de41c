"""Draw the memory-time front of a sweep (`graphopt.sweep.SweepRow`s) as a PNG.

Measured peak (MiB) against measured step time (seconds): the strategy's front (the
least-peak plan and each budget's least-time plan) as a line with markers, from the loosest
budget to the tightest; store-all, Chen's sqrt(n) plan and the original model (ONNX Runtime's
default session; graph optimizations off) as labelled markers. Knows only the rows.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402

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


__all__ = ["plot_front"]
