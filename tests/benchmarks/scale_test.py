"""benchmarks/scale.py: the streamed vectors, the edit reference, the growth exponents and their
extrapolation, and (slow) the whole suite at 20k producing every JSON field."""

import json
import math

import numpy as np
import pytest

from benchmarks import scale
from rag_jax.retrieval import index


def test_vectors_are_written_chunkwise_as_unit_float16_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(scale, "CHUNK", 1000)  # chunks that straddle the corpus/query boundary
    queries = scale.write_vectors(tmp_path / "v.npy", 2_500, 700, seed=0)
    vectors = np.load(tmp_path / "v.npy", mmap_mode="r")
    assert vectors.dtype == np.float16 and vectors.shape == (2_500, scale.D)
    assert queries.dtype == np.float32 and queries.shape == (700, scale.D)
    np.testing.assert_allclose(np.linalg.norm(vectors.astype(np.float32), axis=1), 1, atol=2e-3)
    np.testing.assert_allclose(np.linalg.norm(queries, axis=1), 1, atol=1e-5)
    # Clustered (12 centres): a query's best passage is far closer than a random one.
    scores = queries @ vectors.astype(np.float32).T
    assert np.median(scores.max(axis=1)) > 0.4 > np.median(np.abs(scores))
    assert scores.max() < 0.99  # held out: no query is a row of the file


def test_edited_truth_is_exact_search_of_the_edited_vectors(tmp_path):
    queries = scale.write_vectors(tmp_path / "v.npy", 3_000, 50, seed=1)
    vectors = np.load(tmp_path / "v.npy").astype(np.float32)
    true_ids = index.ExactIndex(vectors).search(queries, scale.K)[1]
    ids, new = scale.make_edits(3_000, queries, true_ids, seed=2)
    assert len(ids) == 300 and len(np.unique(ids)) == 300
    assert np.isin(np.unique(true_ids[:, 0]), ids).all()  # the top-1s are replaced
    edited = vectors.copy()
    edited[ids] = new
    want = index.ExactIndex(edited).search(queries, scale.K)[1]
    got = scale.edited_truth(str(tmp_path / "v.npy"), queries, ids, new)
    np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(want, axis=1))
    assert (want[:, 0] != true_ids[:, 0]).all()  # new vectors near the queries come first


def test_growth_exponents_and_extrapolation():
    rows = [
        {"index": "a", "count": 1_000_000, "build_s": 100.0, "queries_per_s": 1000.0},
        {"index": "a", "count": 2_000_000, "build_s": 200.0, "queries_per_s": 700.0},
        {"index": "a", "count": 4_000_000, "build_s": 500.0, "queries_per_s": 500.0},
        {"index": "b", "count": 1_000_000, "build_s": 10.0},
    ]
    out = {(r["index"], r["figure"]): r for r in scale.growth(rows)}
    build = out[("a", "build_s")]
    assert build["exponents"] == pytest.approx([1.0, math.log(2.5, 2)])
    assert build["at_21015324"] == pytest.approx(500 * (21_015_324 / 4e6) ** math.log(2.5, 2))
    assert build["exponent_source"] == "measured 2000000->4000000"
    qps = out[("a", "queries_per_s")]
    assert qps["exponent_used"] == pytest.approx(math.log(500 / 700) / math.log(2))
    one = out[("b", "build_s")]  # one size: the model's exponent, and the row says so
    assert one["exponents"] == [] and one["exponent_used"] == 1.0
    assert one["exponent_source"].startswith("assumed")
    assert one["at_21015324"] == pytest.approx(10 * 21.015324)
    assert ("b", "queries_per_s") not in out


@pytest.mark.slow
def test_suite_end_to_end_at_20k(tmp_path):
    result = scale.run(quick=True, out=str(tmp_path))
    json.dumps(result)  # what run.py writes
    by_index = {row["index"]: row for row in result["rows"]}
    scann, exact = by_index["ScannIndex"], by_index["ExactIndex (mmap)"]
    assert scann["recall@10"] >= scale.RECALL and scann["edit_recall@10"] >= scale.RECALL
    assert scann["edited_found"] == 1.0
    for field in (
        "build_s",
        "peak_rss_mb",
        "peak_anon_mb",
        "disk_mb",
        "queries_per_s",
        "queries_per_s_b1",
        "p50_ms_b1",
        "edit_s",
    ):
        assert scann[field] > 0, field
    assert exact["queries_per_s"] > 0 and exact["recall@10"] == 1.0
    assert any(name.startswith("faiss HNSW") for name in by_index)
    assert any(name.startswith("faiss IVF") for name in by_index)
    for row in result["rows"]:
        if "recall@10" in row and "plateaued" not in row.get("setting", ""):
            assert row["recall@10"] >= scale.RECALL, row["index"]
    figures = {(r["index"], r["figure"]) for r in result["extrapolated"]}
    assert ("ScannIndex", "build_s") in figures and ("ScannIndex", "edit_s") in figures
    assert result["difficulty"]["synthetic"]["relative_contrast"] > 1


@pytest.mark.slow
def test_suite_runs_the_indexes_asked_for(tmp_path):
    result = scale.run(quick=True, out=str(tmp_path), indexes=["scann"])
    assert [row["index"] for row in result["rows"]] == ["ExactIndex (mmap)", "ScannIndex"]
    assert result["config"]["indexes"] == ["scann"]
    with pytest.raises(ValueError, match="unknown scale indexes \\['flat'\\]"):
        scale.run(quick=True, out=str(tmp_path), indexes=["flat"])
