"""What a finished batch must look like, checked the same way wherever the batch ran: in
worker processes, on servers (tests/test_batch.py), on a Ray cluster, and on the deploy/
manifests under `podman kube play` (.ci/kube_play.py)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import onnx


def batch_models(zoo: Path) -> list[str]:
    return sorted(p.relative_to(zoo).as_posix() for p in zoo.rglob("*.onnx"))


def check_batch_outputs(zoo: Path, out: Path) -> dict[str, dict]:
    """Every model optimized with identical outputs; the summary files agree with the reports."""
    reports = {}
    for name in batch_models(zoo):
        folder = out / name[:-len(".onnx")]
        report = json.loads((folder / "report.json").read_text())
        assert report["graphopt_batch"]["status"] == "ok", report["graphopt_batch"]
        assert report["outputs_match"] is True and (folder / "optimized.onnx").is_file()
        onnx.checker.check_model(str(folder / "optimized.onnx"))
        reports[name] = report
    summary = json.loads((out / "summary.json").read_text())
    by_model = {row["model"]: row for row in summary["models"]}
    assert sorted(by_model) == batch_models(zoo) and summary["failed"] == []
    with open(out / "summary.csv") as f:
        csv_rows = {row["model"]: row for row in csv.DictReader(f)}
    markdown = (out / "summary.md").read_text()
    for name, report in reports.items():
        row = by_model[name]
        assert row["peak_after_bytes"] == report["measured"]["optimized"]["peak_bytes"]
        assert row["peak_before_bytes"] == report["measured"]["original_default_session"]["peak_bytes"]
        assert row["strategy"] == report["strategy"] and row["nodes"] == report["nodes"]["original"]
        assert int(csv_rows[name]["peak_after_bytes"]) == row["peak_after_bytes"]
        assert f"| {name} |" in markdown
    kinds = {name: r["graphopt_batch"]["kind"] for name, r in reports.items()}
    assert {kinds[n] for n in kinds if n.startswith("forward/")} == {"forward"}
    assert {kinds[n] for n in kinds if n.startswith("training/")} == {"training"}
    for png in ("peaks.png", "saving_vs_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return reports


# the summary's fields that no measurement decides (the measured peaks and step times, and the
# outcome and strategy they decide, move between two runs on a loaded machine: small models' peaks by up to a
# third, seen here)
UNMEASURED_FIELDS = ("model", "kind", "status", "nodes", "objective", "max_overhead", "outputs_match",
                     "error")


def unmeasured_summary(out: Path) -> dict[str, dict]:
    """Each model's UNMEASURED_FIELDS in the batch's summary.json."""
    rows = json.loads((out / "summary.json").read_text())["models"]
    return {row["model"]: {k: row.get(k) for k in UNMEASURED_FIELDS} for row in rows}
