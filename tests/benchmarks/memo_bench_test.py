"""benchmarks/memo.py: the quick suite (a tiny random Llama). Timings are not checked (they
depend on the machine); what is: both sides compute the same log-probabilities, the workload
shares its passages, and the ratio is the two rates' quotient."""

import pytest

from benchmarks import memo


def test_quick_suite_compares_the_same_pairs():
    result = memo.run(quick=True)
    (row,) = result["rows"]
    sizes = result["sizes"]
    assert row["pairs"] == sizes["passages"] * sizes["questions"]
    assert row["groups"] == sizes["passages"]  # the questions of a passage share its prefix
    assert row["max_abs_diff"] < 1e-4
    assert row["ratio"] == pytest.approx(row["ours_pairs_s"] / row["ref_pairs_s"])
    assert row["ours_pairs_s"] > 0 and row["ref_pairs_s"] > 0
    assert set(result["columns"]) <= set(row)
