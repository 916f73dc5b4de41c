"""The fast subset of mutation testing (tests/mutation.py) that CI runs: every mutant mutmut makes
of the cost model, against the cost model's own tests (step-by-step references). A mutant that
survives is a change to the one cost model no test of it notices; the share killed may not fall
below what it was when this test was written (MIN_FAST_SCORE; `python tests/mutation.py` runs
every module with its full test selection)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mutation  # noqa: E402

# measured when written: 515 of 553 mutants killed, 38 listed as equivalent, none surviving or
# uncovered (100.0%), with tests/test_costmodel.py alone (its small graphs worked by hand,
# resolve_versions, check_schedule); 458 (82.8%) before those, 359 (64.9%) before its tests of the
# empty schedule and of priority_order's general path
MIN_FAST_SCORE = 0.98


def test_the_cost_models_own_tests_kill_its_mutants():
    (name,) = mutation.FAST
    counts = mutation.run_module(name, children=os.cpu_count() or 1, survivors=False, modules=mutation.FAST)
    assert counts["killed"] > 0 and mutation.score(counts) >= MIN_FAST_SCORE, dict(counts)
    # every mutant listed as equivalent is still the one judged (its diff's digest): an edit of
    # the cost model renumbers its mutants, and the list must then be judged again
    assert counts["stale equivalent"] == 0, dict(counts)
