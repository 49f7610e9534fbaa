"""A ScaNN index built to a recall target (rag_jax.retrieval.scann_recall through
`index.build_and_save`): the defaults miss on clustered anisotropic data and the tuned build
reaches the target; a target out of reach is refused with nothing saved; what was measured
survives save and load; the stand-in queries and the halves they are split into.

Recall is checked against numpy brute force on fresh queries, drawn as the vectors are and used
by neither the build's tuning nor its confirmation. The corpora are a few thousand vectors, below
where `scann_defaults` builds a tree, so the tests lower its size thresholds (`_tree_defaults`):
the tree the defaults give from 100k vectors (sqrt(C) = 63 leaves, 4 searched, reorder 100).
"""

import json

import numpy as np
import pytest

from rag_jax.retrieval import files, index, scann_index, scann_recall, scann_shards

pytest.importorskip("scann")

C, D, K = 4000, 32, 10


def _clustered_anisotropic(count, dim, seed):
    """[count, dim] unit vectors: 20 Gaussian centres plus noise whose scale falls as 1/d along
    a random rotation (a few wide directions, many narrow ones), normalised. ScaNN's leaves cut
    such clusters badly, so the defaults' 5% of the leaves miss recall@10 0.95 here."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((20, dim), dtype=np.float32)
    scale = 3 / np.arange(1, dim + 1, dtype=np.float32)
    rotation = np.linalg.qr(rng.standard_normal((dim, dim)))[0].astype(np.float32)
    out = 0.5 * centres[rng.integers(20, size=count)]
    out += (rng.standard_normal((count, dim), dtype=np.float32) * scale) @ rotation
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def _brute_top_k(queries, vectors):
    return np.argsort(-(queries @ vectors.T), axis=1, kind="stable")[:, :K]  # -> [Q, k]


def _tree_defaults(monkeypatch):
    """`scann_defaults` as from 100k vectors (a tree of sqrt(C) leaves, 5% searched, AH,
    reorder 100) for these few thousand."""
    monkeypatch.setattr(scann_index, "AH_FROM", 0)
    monkeypatch.setattr(scann_index, "TREE_FROM", 0)


@pytest.fixture(scope="module")
def draw():
    """(vectors [C, D], the user's queries [1000, D], fresh queries [2000, D], their exact
    top-10 by numpy): all drawn alike, the queries never rows of the index."""
    data = _clustered_anisotropic(C + 3000, D, seed=1)
    vectors, queries, fresh = data[:C], data[C : C + 1000], data[C + 1000 :]
    return vectors, queries, fresh, _brute_top_k(fresh, vectors)


@pytest.fixture(scope="module")
def builds(draw, tmp_path_factory):
    """The index at the defaults (recall 0: not tuned) and the one built to recall 0.95 on the
    given queries, each saved."""
    vectors, queries, _, _ = draw
    folder = tmp_path_factory.mktemp("builds")
    with pytest.MonkeyPatch.context() as monkeypatch:
        _tree_defaults(monkeypatch)
        default = index.build_and_save(vectors, "scann", folder / "default", recall=0)
        tuned = index.build_and_save(vectors, "scann", folder / "tuned", queries=queries)
    return default, tuned, folder


def test_the_defaults_miss_the_target_and_the_tuned_build_reaches_it(draw, builds):
    _, _, fresh, fresh_ids = draw
    default, tuned, _ = builds
    assert default.config["num_leaves"] == 63 and default.config["num_leaves_to_search"] == 4
    assert default.measured_recall is None
    # Over 22 builds of this draw (OpenBLAS Haswell and Prescott kernels) the defaults gave
    # 0.79-0.91: the target is really missed.
    assert scann_index.recall_at_k(default.search(fresh, K)[1], fresh_ids) < 0.95

    measured = tuned.measured_recall
    assert measured["target"] == 0.95 and measured["k"] == K
    assert measured["query_source"] == "given"
    assert measured["queries"] == measured["tuning_queries"] == 500  # two disjoint halves
    assert measured["recall"] >= 0.95
    assert measured["tuning_recall"] >= 0.95 + measured["tuning_margin"] > 0.95
    assert measured["settings"]["num_leaves_to_search"] == tuned.config["num_leaves_to_search"]
    assert tuned.config["num_leaves_to_search"] > 4  # more leaves searched than the defaults'
    # Confirmed on 2,000 queries neither half saw, against numpy's brute force: 0.95 less 0.01
    # (about four standard errors of a 2,000-query mean; over the 22 builds, 0.957-0.986).
    assert scann_index.recall_at_k(tuned.search(fresh, K)[1], fresh_ids) >= 0.94


def test_the_measured_recall_and_settings_survive_save_and_load(draw, builds):
    _, _, fresh, _ = draw
    default, tuned, folder = builds
    manifest = json.loads((folder / "tuned" / files.MANIFEST).read_text())
    assert manifest["measured_recall"] == json.loads(json.dumps(tuned.measured_recall))
    assert manifest["scann"]["num_leaves_to_search"] == tuned.config["num_leaves_to_search"]
    loaded = index.load(str(folder / "tuned"))
    assert loaded.measured_recall == tuned.measured_recall and loaded.config == tuned.config
    for got, want in zip(loaded.search(fresh, K), tuned.search(fresh, K), strict=True):
        np.testing.assert_array_equal(got, want)
    assert index.load(str(folder / "default")).measured_recall is None
    # Other settings are not what was measured.
    assert loaded.with_search_settings(num_leaves_to_search=5).measured_recall is None


def test_a_target_out_of_reach_is_refused_naming_the_best_and_saving_nothing(
    draw, tmp_path, monkeypatch, capsys
):
    vectors, queries, _, _ = draw
    # 200 leaves of ~20 points, 1 searched: at the ladder's most, 8 leaves, the best recall over
    # 16 builds was 0.92-0.95, whatever the codes (the leaves miss the neighbours, not the
    # codes); 0.99 is out of reach.
    defaults = scann_index.scann_defaults
    narrow = {"scoring": "ah", "num_leaves": 200, "num_leaves_to_search": 1, "reorder": 100}
    monkeypatch.setattr(scann_index, "scann_defaults", lambda count: defaults(count) | narrow)
    index.build_and_save(vectors, "exact", tmp_path / "ix")  # the index a failed build keeps
    before = {p.name: p.read_bytes() for p in (tmp_path / "ix").iterdir()}
    with pytest.raises(scann_recall.RecallNotReached, match=r"recall@10 0.99 is out of reach") as e:
        index.build_and_save(vectors, "scann", tmp_path / "ix", recall=0.99, queries=queries)
    best = e.value.best
    assert 0.5 < best["tuning_recall"] < 0.99 and best["recall"] < 0.99
    assert f"{best['tuning_recall']:.4f}" in str(e.value) and f"{best['recall']:.4f}" in str(
        e.value
    )
    assert best["settings"]["num_leaves_to_search"] == 8 and "num_leaves_to_search" in str(e.value)
    assert capsys.readouterr().out.count("rebuilding ScaNN with") == 2  # every build step tried
    assert {p.name: p.read_bytes() for p in (tmp_path / "ix").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ix"]  # nothing written beside it
    with pytest.raises(scann_recall.RecallNotReached):
        index.build_and_save(vectors, "scann", tmp_path / "new", recall=0.99, queries=queries)
    assert not (tmp_path / "new").exists()


def test_a_sharded_build_records_its_tuned_search_settings(draw, tmp_path, monkeypatch):
    vectors, queries, fresh, fresh_ids = draw
    _tree_defaults(monkeypatch)
    monkeypatch.setattr(scann_shards, "SHARD_ROWS", C // 2)
    built = index.build_and_save(vectors, "scann", tmp_path / "ix", queries=queries)
    assert isinstance(built, scann_shards.ShardedScannIndex) and len(built.shards) == 2
    # The shards were saved at the defaults (45 leaves each, 3 searched); the manifest carries
    # the tuned setting, which load applies.
    shard = index.load(str(tmp_path / "ix" / "shard_00000"))
    assert shard.config["num_leaves_to_search"] == 3 < built.config["num_leaves_to_search"]
    loaded = index.load(str(tmp_path / "ix"))
    assert loaded.measured_recall == built.measured_recall and loaded.config == built.config
    assert loaded.measured_recall["recall"] >= 0.95
    assert scann_index.recall_at_k(loaded.search(fresh, K)[1], fresh_ids) >= 0.94


def test_stand_in_queries_are_seeded_perturbed_rows_and_the_halves_disjoint(draw):
    vectors = draw[0]
    queries = scann_recall.stand_in_queries(vectors, 300, seed=3)
    np.testing.assert_array_equal(queries, scann_recall.stand_in_queries(vectors, 300, seed=3))
    assert not np.allclose(queries, scann_recall.stand_in_queries(vectors, 300, seed=4))
    # Each lies off its row by noise as large as the corpus' spread per dimension: off every
    # row, and (the row being one of them) at most that far from the nearest.
    spread = np.sqrt(np.sum(vectors.var(axis=0)))
    gaps = np.linalg.norm(queries[:, None] - vectors[None], axis=2).min(axis=1)  # -> [300]
    assert gaps.min() > 0.1 * spread and np.median(gaps) < 1.5 * spread

    exact = index.ExactIndex(vectors)
    held = scann_recall.held_out(exact, seed=3, count=300)
    assert held.source == "stand-in" and len(held.tune_queries) == len(held.check_queries) == 150
    rows = {q.tobytes() for q in held.tune_queries}
    assert not rows & {q.tobytes() for q in held.check_queries}
    np.testing.assert_array_equal(exact.search(held.check_queries, K)[1], held.check_ids)
    given = scann_recall.held_out(exact, draw[1], count=200)  # 200 of the 1,000 given
    assert given.source == "given" and len(given.tune_ids) + len(given.check_ids) == 200
    with pytest.raises(ValueError, match=r"Q >= 100"):
        scann_recall.held_out(exact, draw[1][:99])
