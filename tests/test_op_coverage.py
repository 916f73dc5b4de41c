"""The operator-coverage table of docs/reference/ops.md is the one the tested architectures give."""
import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore")


def test_docs_op_coverage_table_is_current():
    from op_coverage import committed_table, table
    assert committed_table() == table(), "regenerate it: python tests/op_coverage.py --write"
