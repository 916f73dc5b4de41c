"""benchmarks/front_vs_torch.py: the comparison at equal overhead (pure functions on given
points; the measurements themselves are the benchmark's) and the torch configuration names."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import front_vs_torch as fvt  # noqa: E402
import pytorch_compare  # noqa: E402

MiB = 2 ** 20


def _side(base_peak, base_step, points):
    return {"baseline": {"label": "base", "peak_bytes": base_peak * MiB, "step_seconds": base_step},
            "points": [{"label": label, "peak_bytes": peak * MiB, "step_seconds": step}
                       for label, peak, step in points]}


def test_least_peak_at_each_level_against_own_baseline():
    # graphopt: baseline 1.0 s; torch: baseline 0.5 s (overheads are against each side's own)
    g = _side(100, 1.0, [("a", 60, 1.04), ("b", 30, 1.2), ("c", 20, 1.9)])
    t = _side(80, 0.5, [("x", 50, 0.52), ("y", 25, 0.74), ("z", 10, 1.5)])
    c = fvt.compare(g, t, levels=(1.05, 1.25, 1.5, 2.0))
    got = [(r["level"], r["graphopt"]["label"], r["torch"]["label"], r["winner"]) for r in c["levels"]]
    assert got == [(1.05, "a", "x", "torch"),          # 60 vs 50
                   (1.25, "b", "x", "graphopt"),       # 30 vs 50 (y is at 1.48x)
                   (1.5, "b", "y", "torch"),           # 30 vs 25
                   (2.0, "c", "y", "graphopt")]        # 20 vs 25 (z is at 3.0x)
    assert c["levels_compared"] == 4 and c["levels_won"] == 2
    assert not c["below_at_every_level"] and not c["below_at_majority"]
    # the chosen point carries its overhead and its ratio to the side's baseline peak
    row = c["levels"][1]["graphopt"]
    assert row["overhead"] == pytest.approx(1.2) and row["peak_ratio"] == pytest.approx(0.3)


def test_baseline_is_a_point_at_overhead_one_and_ties_are_not_wins():
    g = _side(40, 1.0, [("slow", 10, 5.0)])
    t = _side(40, 1.0, [])
    c = fvt.compare(g, t, levels=(1.05, 2.0))
    assert [r["winner"] for r in c["levels"]] == ["tie", "tie"]
    assert [r["graphopt"]["overhead"] for r in c["levels"]] == [1.0, 1.0]
    assert not c["below_at_every_level"]

    g = _side(30, 1.0, [])
    c = fvt.compare(g, t, levels=(1.05, 2.0))
    assert c["below_at_every_level"] and c["below_at_majority"] and c["levels_won"] == 2


def test_no_baseline_no_comparison():
    assert fvt.with_overheads({"baseline": None, "points": []}) == []
    c = fvt.compare({"baseline": None, "points": []}, _side(10, 1.0, []), levels=(1.5,))
    assert c["levels"][0]["winner"] == "-" and c["levels_compared"] == 0 and not c["below_at_every_level"]


def test_torch_configurations():
    assert pytorch_compare.parse_config("eager") == ("eager", None)
    assert pytorch_compare.parse_config("compile") == ("compile", None)
    assert pytorch_compare.parse_config("compile-budget") == ("compile", pytorch_compare.BUDGET)
    assert pytorch_compare.parse_config("compile-budget=0.3") == ("compile", 0.3)
    for bad in ("compile-budget=0", "compile-budget=1.5", "jit"):
        with pytest.raises(ValueError):
            pytorch_compare.parse_config(bad)
    assert fvt.torch_configs((0.1, 1.0)) == ["eager", "compile-budget=0.1", "compile-budget=1"]


def test_tables_render():
    r = {"graphopt": _side(100, 1.0, [("a", 60, 1.04)]), "torch": _side(80, 0.5, [("x", 50, 0.52)])}
    r["comparison"] = fvt.compare(r["graphopt"], r["torch"], levels=(1.05, 2.0))
    text = fvt.report_text({"mlp": r}, (1.05, 2.0), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0))
    assert "| mlp |" in text and "60.0 vs 50.0 **t**" in text
    assert "graphopt below torch at equal overhead on 0 of 1 examples" in text


def test_at_equal_peak_takes_graphopt_fastest_point_at_no_more_memory():
    """Each torch point against graphopt's fastest point whose peak is at or below it, in
    absolute seconds; checked against a filter of every point, on random sides."""
    import random
    rng = random.Random(0)
    for _ in range(50):
        g = _side(rng.randint(20, 100), rng.uniform(0.2, 1.0),
                  [(f"g{i}", rng.randint(5, 100), rng.uniform(0.2, 2.0)) for i in range(rng.randint(0, 6))])
        t = _side(rng.randint(20, 100), rng.uniform(0.2, 1.0),
                  [(f"t{i}", rng.randint(5, 100), rng.uniform(0.2, 2.0)) for i in range(rng.randint(0, 6))])
        rows = fvt.at_equal_peak(g, t)
        g_pts, t_pts = fvt.with_overheads(g), fvt.with_overheads(t)
        assert [r["torch"]["label"] for r in rows] == [p["label"] for p in t_pts]
        for row, tp in zip(rows, t_pts):
            pairs = [gp for gp in g_pts if gp["peak_bytes"] <= tp["peak_bytes"]]
            if not pairs:
                assert row["graphopt"] is None and row["seconds_ratio"] is None
                continue
            fastest = min(gp["step_seconds"] for gp in pairs)
            assert row["graphopt"]["step_seconds"] == fastest and row["graphopt"]["peak_bytes"] <= tp["peak_bytes"]
            assert row["seconds_ratio"] == pytest.approx(fastest / tp["step_seconds"])
