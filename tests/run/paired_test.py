"""run.paired: the paired bootstrap interval of a difference between two evaluations."""

import json

import numpy as np
import pytest

from rag_jax.run import paired


def _rows(values, metric="exact_match"):
    return {f"q{i}": {"id": f"q{i}", metric: float(v)} for i, v in enumerate(values)}


def test_the_interval_matches_the_normal_approximation_on_a_large_sample():
    rng = np.random.default_rng(0)
    a = rng.random(4000) < 0.4
    b = a.copy()
    flip = rng.random(4000) < 0.1  # b differs on 10% of the questions, mostly for the better
    b[flip] = rng.random(flip.sum()) < 0.8
    r = paired.paired_difference(_rows(a), _rows(b), "exact_match", resamples=4000)
    d = b.astype(float) - a
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d))
    assert r["difference"] == pytest.approx(d.mean())
    assert r["low"] == pytest.approx(d.mean() - half, abs=0.15 * half)
    assert r["high"] == pytest.approx(d.mean() + half, abs=0.15 * half)
    assert r["b_better"] == int(np.sum(d > 0)) and r["a_better"] == int(np.sum(d < 0))
    assert r["p_value"] < 0.01 and r["questions"] == 4000


def test_pairing_narrows_the_interval_of_correlated_rows():
    """Two rows that agree on most questions: the paired interval is much narrower than the
    two rows' own binomial errors would make an unpaired one."""
    rng = np.random.default_rng(1)
    a = (rng.random(1000) < 0.5).astype(float)
    b = a.copy()
    b[:30] = 1.0
    r = paired.paired_difference(_rows(a), _rows(b), "exact_match", resamples=2000)
    unpaired_half = 1.96 * np.sqrt(a.var() / 1000 + b.var() / 1000)
    assert r["high"] - r["low"] < 0.5 * 2 * unpaired_half
    assert r["low"] > 0


def test_coverage_is_near_the_nominal_95_percent():
    rng = np.random.default_rng(2)
    covered = 0
    trials = 150
    for t in range(trials):
        a = rng.random(300) < 0.3
        b = rng.random(300) < 0.35  # true difference 0.05
        r = paired.paired_difference(_rows(a), _rows(b), "exact_match", resamples=1000, seed=t)
        covered += r["low"] <= 0.05 <= r["high"]
    assert 0.89 <= covered / trials <= 0.99, covered


def test_identical_rows_differ_by_nothing():
    values = np.random.default_rng(3).random(50)
    r = paired.paired_difference(_rows(values), _rows(values), "exact_match", resamples=200)
    assert (r["difference"], r["low"], r["high"], r["p_value"]) == (0.0, 0.0, 0.0, 1.0)


def test_different_questions_are_refused_by_name():
    a = _rows([1, 0, 1])
    b = _rows([1, 0])
    with pytest.raises(ValueError, match=r"the second lacks 1, e.g. 'q2'"):
        paired.paired_difference(a, b, "exact_match")
    with pytest.raises(ValueError, match="no question has it"):
        paired.paired_difference(a, a, "f1")


def test_per_question_files_are_read_by_id_and_bad_lines_named(tmp_path):
    path = tmp_path / "per_question.jsonl"
    path.write_text(json.dumps({"id": 7, "f1": 0.5}) + "\n\n" + json.dumps({"id": "8"}) + "\n")
    assert paired.read_per_question(path) == {"7": {"id": 7, "f1": 0.5}, "8": {"id": "8"}}
    path.write_text(json.dumps({"id": 1}) + "\n" + json.dumps({"id": 1}) + "\n")
    with pytest.raises(ValueError, match=r"per_question.jsonl:2: question '1' appears twice"):
        paired.read_per_question(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"per_question.jsonl:1: not JSON"):
        paired.read_per_question(path)
    r = paired.paired_difference(_rows([0, 1, 1]), _rows([1, 1, 1]), "exact_match", resamples=100)
    assert paired.describe(r).startswith("exact_match: 0.667 -> 1.000, +0.333 [")
