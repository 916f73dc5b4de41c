"""`graphopt optimize --sweep`: the memory-time front, its CSV, Markdown table and PNG plot."""
import json
import struct

import matplotlib.image
import onnx
import pytest

from graphopt.cli import main
from graphopt.examples import training_example
from graphopt.sweep import (SweepRow, budget_series, front_rows, markdown_cells, read_csv, sweep_paths,
                            write_csv)
from graphopt.plot import plot_front

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLAN_KINDS = {"front", "store-all", "chen-sqrt"}


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def markdown_rows(path):
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("|")]
    return [[cell.strip() for cell in ln.strip("|").split("|")] for ln in lines[2:]]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A 4-point sweep of an MLP whose activations (512 KiB) measure well above page noise."""
    folder = tmp_path_factory.mktemp("sweep")
    model, _ = training_example("mlp", batch=512, width=256, depth=8, d_in=64)
    path = folder / "mlp.onnx"
    onnx.save(model, path)
    out = folder / "opt" / "mlp_opt.onnx"
    rc = main(["optimize", str(path), "-o", str(out), "--sweep", "4", "--report", str(folder / "r.json")])
    assert rc == 0
    paths = {k: folder / "opt" / f"mlp_opt.sweep.{k}" for k in ("csv", "md", "png")}
    return out, paths, read_csv(paths["csv"]), json.loads((folder / "r.json").read_text())


def test_sweep_writes_model_and_files(swept):
    out, paths, rows, _ = swept
    assert {k: str(v) for k, v in paths.items()} == sweep_paths(out)
    for p in paths.values():
        assert p.exists()
    model = onnx.load(out)
    onnx.checker.check_model(model)
    plan = json.loads(next(p.value for p in model.metadata_props if p.key == "graphopt.plan"))
    least = next(r for r in rows if r.label == "least-peak")
    assert len(plan["checkpoints"]) == least.checkpoints and plan["recompute_nodes"] == least.recompute_nodes


def test_png_is_a_real_plot(swept):
    _, paths, _, _ = swept
    width, height = png_size(paths["png"])
    assert width >= 400 and height >= 300
    assert paths["png"].stat().st_size > 10_000
    pixels = matplotlib.image.imread(paths["png"])
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0.01  # not a blank canvas


def test_csv_agrees_with_markdown_and_report(swept):
    _, paths, rows, report = swept
    table = markdown_rows(paths["md"])
    assert [cells[0] for cells in table] == [r.label for r in rows]
    assert table == [markdown_cells(r) for r in rows]
    for cells, r in zip(table, rows):
        assert float(cells[3]) == pytest.approx(r.measured_peak_bytes / 2**20, abs=0.006)
        assert float(cells[4]) == pytest.approx(r.step_seconds, abs=6e-5)
    assert [rec["label"] for rec in report["rows"]] == [r.label for r in rows]
    assert [rec["measured_peak_bytes"] for rec in report["rows"]] == [r.measured_peak_bytes for r in rows]


def test_rows_cover_front_baselines_and_originals(swept):
    _, _, rows, report = swept
    kinds = {r.kind for r in rows}
    assert {"front", "store-all", "chen-sqrt", "original-default", "original-off"} <= kinds
    for r in rows:
        assert r.measured_peak_bytes > 0 and r.step_seconds > 0
        if r.kind in PLAN_KINDS:
            assert r.outputs_identical is True
    by_label = {r.label: r for r in rows}
    assert by_label["least-peak"].predicted_peak_bytes <= by_label["store-all"].predicted_peak_bytes
    budgets = report["budgets"]
    assert len(budgets) == 4 and budgets == sorted(budgets, reverse=True)
    assert budgets[0] == by_label["store-all"].predicted_peak_bytes
    assert budgets[-1] == by_label["least-peak"].predicted_peak_bytes


def test_each_budget_measured_once_and_plans_fit_their_budget(swept):
    _, _, rows, report = swept
    front = front_rows(rows)
    assert sorted(b for r in front for b in r.budgets) == sorted(report["budgets"])  # none infeasible here
    for r in front:
        if r.budget_bytes is not None:
            assert r.budget_bytes == min(r.budgets)
            assert r.predicted_peak_bytes <= r.budget_bytes
            assert r.budget_met == (r.measured_peak_bytes <= r.budget_bytes)
    # A budget of the least peak gets a plan no higher than it; store-all's budget a plan
    # with no recomputation: both ends are merged into those rows, measured once.
    plan_rows = [r for r in rows if r.kind in PLAN_KINDS]
    assert len({r.label for r in plan_rows}) == len(plan_rows)


def test_measured_peaks_fall_as_budgets_tighten(swept):
    _, _, rows, _ = swept
    front = front_rows(rows)  # loosest budget first, least peak last
    measured = [r.measured_peak_bytes for r in front]
    slack = 64 * 1024  # page-level measurement noise
    assert all(later <= earlier + slack for earlier, later in zip(measured, measured[1:])), measured
    assert measured[-1] < measured[0]


def test_identical_plans_are_measured_once(tmp_path):
    model, _ = training_example("mlp", small=True)
    path, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(model, path)
    # the file as given: after ORT's graph optimizations this small mlp has no front to sweep
    assert main(["optimize", str(path), "-o", str(out), "--sweep", "3", "--no-verify",
                 "--graph-optimizations", "none"]) == 0
    rows = read_csv(sweep_paths(out)["csv"])
    plan_rows = [r for r in rows if r.kind in PLAN_KINDS]
    names = [name for r in plan_rows for name in [r.label, *r.also]]
    # every plan asked for is in exactly one row: a plan planned twice is measured once
    assert sorted(names) == sorted(["least-peak", "store-all", "chen-sqrt", "budget 1/3", "budget 2/3",
                                    "budget 3/3"])
    # one budget is store-all's peak: the least recompute time under it is store-all itself
    store = next(r for r in plan_rows if r.stands_for("store-all"))
    assert any(store.stands_for(f"budget {k}/3") for k in (1, 2, 3)) and store.recompute_nodes == 0
    assert len(plan_rows) < len(names)
    assert all(r.outputs_identical is None for r in rows)  # --no-verify


def test_sweep_rejects_budget_and_zero_points(tmp_path, capsys):
    model, _ = training_example("mlp", small=True)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert main(["optimize", str(path), "-o", str(tmp_path / "o.onnx"), "--sweep", "3", "--budget", "1MiB"]) == 2
    assert main(["optimize", str(path), "-o", str(tmp_path / "o.onnx"), "--sweep", "0"]) == 2
    assert "--sweep" in capsys.readouterr().err
    assert not (tmp_path / "o.onnx").exists()
    # every point of the front is a budget: a strategy that takes none is refused at once
    assert main(["optimize", str(path), "-o", str(tmp_path / "o.onnx"), "--sweep", "3",
                 "--strategy", "feng-huang"]) == 2
    err = capsys.readouterr().err
    assert "feng-huang" in err and "takes none" in err and "Traceback" not in err
    assert not (tmp_path / "o.onnx").exists()


def test_budget_series_spans_least_to_store_all():
    assert budget_series(100, 200, 5) == [200, 175, 150, 125, 100]
    assert budget_series(100, 200, 1) == [150]
    assert budget_series(100, 100, 8) == [100]
    assert budget_series(100, 103, 8) == [103, 102, 101, 100]  # distinct only
    with pytest.raises(ValueError):
        budget_series(1, 2, 0)


def test_csv_round_trip_and_plot_from_rows(tmp_path):
    rows = [
        SweepRow("original (default session)", "original-default", measured_peak_bytes=9 << 20, step_seconds=1.0),
        SweepRow("store-all", "store-all", "store-all", 8 << 20, [8 << 20], 8 << 20, (8 << 20) + 4096, 1.0,
                 0.0, 30, 0, True, False, True, ["budget 1/3"], "also the budget 1/3 plan"),
        SweepRow("budget 2/3", "front", "greedy", 6 << 20, [6 << 20], 6 << 20, 6 << 20, 1.1, 0.1, 20, 5,
                 True, True, True),
        SweepRow("least-peak", "front", "greedy", 4 << 20, [4 << 20], 4 << 20, 4 << 20, 1.3, 0.3, 10, 12,
                 True, True, True),
    ]
    write_csv(rows, tmp_path / "f.csv")
    assert read_csv(tmp_path / "f.csv") == rows
    assert [r.label for r in front_rows(rows)] == ["store-all", "budget 2/3", "least-peak"]
    plot_front(rows, tmp_path / "f.png", title="synthetic")
    width, height = png_size(tmp_path / "f.png")
    assert width >= 400 and height >= 300
