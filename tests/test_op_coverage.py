"""The README's operator-coverage table is the one the tested architectures give."""
import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore")


def test_readme_op_coverage_table_is_current():
    from op_coverage import readme_table, table
    assert readme_table() == table(), "regenerate it: python tests/op_coverage.py --write"
