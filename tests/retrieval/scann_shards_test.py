"""Tests for rag_jax.retrieval.scann_shards: searching shards and merging them equals searching
the corpus; a build is saved shard by shard and a killed one resumes at its first unsaved shard."""

import json

import numpy as np
import pytest

from rag_jax.retrieval import files, index, scann_index, scann_shards
from rag_jax.retrieval.index import ExactIndex
from rag_jax.retrieval.scann_index import ScannIndex
from rag_jax.retrieval.scann_shards import ShardedScannIndex, build_sharded

pytest.importorskip("scann")

PROVENANCE = {"encoder_fingerprint": "enc", "corpus_checksum": "corpus"}


def _vectors(count: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    vectors = rng.normal(size=(count, dim)).astype(np.float32)
    return vectors


def _exact(values: np.ndarray) -> np.ndarray:
    """`values` on a grid of 1/64 (|v| < 8): every dot product of 16 such is a multiple of 1/4,096
    below 2^10, exact in float32 whatever the summation order, so scores and their ties are the
    same on every BLAS kernel and in ScaNN's."""
    return (np.round(np.clip(values, -7.9, 7.9) * 64) / 64).astype(np.float32)


def test_brute_force_shards_search_exactly_as_the_whole_corpus(tmp_path):
    vectors = _exact(_vectors(1205))  # shards of 300: the last holds 5 rows, fewer than k
    vectors[7] = vectors[1200]  # a tie across shards: the lower id comes first
    queries = _exact(np.random.default_rng(1).normal(size=(9, 16)))
    queries[0] = vectors[1200]
    ix = build_sharded(vectors, tmp_path / "ix", shard_rows=300, **PROVENANCE)
    assert [s.count for s in ix.shards] == [300, 300, 300, 300, 5]
    assert all(s.config["scoring"] == "brute_force" for s in ix.shards)
    want_scores, want_ids = ExactIndex(vectors).search(queries, 10)
    for got in (ix, index.load(str(tmp_path / "ix"), PROVENANCE | {"count": 1205})):
        scores, ids = got.search(queries, 10)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(scores, want_scores, atol=1e-5)
    assert ids[0, :2].tolist() == [7, 1200]


def test_a_killed_build_keeps_its_saved_shards(tmp_path, monkeypatch):
    vectors = _vectors(1000)
    build = ScannIndex.build
    calls = []

    def dies_on_the_third(shard_vectors, **kwargs):
        calls.append(len(shard_vectors))
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return build(shard_vectors, **kwargs)

    monkeypatch.setattr(ScannIndex, "build", staticmethod(dies_on_the_third))
    with pytest.raises(KeyboardInterrupt):
        build_sharded(vectors, tmp_path / "ix", shard_rows=250, **PROVENANCE)
    assert not (tmp_path / "ix" / files.MANIFEST).exists()
    kept = (tmp_path / "ix" / "shard_00000" / files.MANIFEST).stat().st_ino
    lines = []
    ix = build_sharded(vectors, tmp_path / "ix", shard_rows=250, log=lines.append, **PROVENANCE)
    assert calls == [250, 250, 250, 250, 250]  # the third and fourth, once more
    assert [line.endswith("kept from before") for line in lines] == [True, True, False, False]
    assert (tmp_path / "ix" / "shard_00000" / files.MANIFEST).stat().st_ino == kept
    queries = vectors[:5] + 0.01
    fresh = build_sharded(vectors, tmp_path / "fresh", shard_rows=250, **PROVENANCE)
    for a, b in zip(ix.search(queries, 5), fresh.search(queries, 5), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileExistsError, match=r"holds a finished index"):
        build_sharded(vectors, tmp_path / "ix", shard_rows=250, **PROVENANCE)


def test_saved_shards_of_another_corpus_range_or_setting_are_built_again(tmp_path):
    vectors = _vectors(600)
    build_sharded(vectors, tmp_path / "ix", shard_rows=300, **PROVENANCE)
    (tmp_path / "ix" / files.MANIFEST).unlink()  # as if killed before the manifest
    for change, built in [
        ({"corpus_checksum": "other"}, [True, True]),
        ({"shard_rows": 200}, [True, True, True]),
        ({"reorder": 7}, [True, True]),
    ]:
        lines = []
        kwargs = PROVENANCE | {"shard_rows": 300} | change
        build_sharded(vectors, tmp_path / "ix", log=lines.append, **kwargs)
        assert [line.endswith("built") for line in lines] == built
        (tmp_path / "ix" / files.MANIFEST).unlink()
    lines = []
    build_sharded(vectors, tmp_path / "ix", shard_rows=300, log=lines.append)  # no checksum
    assert all(line.endswith("built") for line in lines)


def test_a_damaged_or_mislisted_shard_is_refused_naming_it(tmp_path):
    vectors = _vectors(600)
    build_sharded(vectors, tmp_path / "ix", shard_rows=300, **PROVENANCE)
    path = tmp_path / "ix" / "shard_00001" / "ids.npy"
    if not path.exists():  # a brute-force shard keeps ScaNN's files only
        path = next(p for p in (tmp_path / "ix" / "shard_00001").iterdir() if p.suffix == ".npy")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{path.name}.*corrupted"):
        index.load(str(tmp_path / "ix"))
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    index.load(str(tmp_path / "ix"))
    manifest = json.loads((tmp_path / "ix" / files.MANIFEST).read_text())
    manifest.pop("manifest_sha256", None)
    manifest["shards"] = [[0, 300], [200, 600]]
    files.write_manifest(tmp_path / "ix", manifest)
    with pytest.raises(ValueError, match=r"do not tile the corpus"):
        index.load(str(tmp_path / "ix"))
    with pytest.raises(ValueError, match=r"corpus_checksum"):
        index.load(str(tmp_path / "ix"), {"corpus_checksum": "another"})


def test_tuning_raises_every_shard_in_proportion_to_its_leaves(tmp_path):
    rng = np.random.default_rng(2)
    centres = rng.normal(size=(40, 32))
    vectors = (centres[rng.integers(0, 40, 40_000)] + rng.normal(size=(40_000, 32))).astype(
        np.float32
    )
    ix = build_sharded(vectors, tmp_path / "ix", shard_rows=20_000, num_leaves=40)
    assert [s.config["num_leaves"] for s in ix.shards] == [40, 40]
    assert ix.config["num_leaves_to_search"] == 2
    wider = ix.with_search_settings(num_leaves_to_search=10, reorder=50)
    assert [s.config["num_leaves_to_search"] for s in wider.shards] == [10, 10]
    assert [s.config["reorder"] for s in wider.shards] == [50, 50]
    queries = (centres[rng.integers(0, 40, 200)] + rng.normal(size=(200, 32))).astype(np.float32)
    true_ids = ExactIndex(vectors).search(queries, 10)[1]
    tuned, recall = scann_index.tune(ix, queries, true_ids, recall=0.95)
    assert recall >= 0.95 and isinstance(tuned, ShardedScannIndex)
    assert recall == scann_index.recall_at_k(tuned.search(queries, 10)[1], true_ids)
    uneven = ShardedScannIndex([ix.shards[0], ScannIndex.build(vectors[:5000], num_leaves=10)])
    assert [
        s.config["num_leaves_to_search"]
        for s in uneven.with_search_settings(num_leaves_to_search=8).shards
    ] == [8, 2]


def test_an_index_build_past_the_shard_size_is_sharded(tmp_path, monkeypatch):
    monkeypatch.setattr(scann_shards, "SHARD_ROWS", 400)
    vectors = _vectors(1000)
    built = index.build_and_save(vectors, "scann", tmp_path / "ix", **PROVENANCE)
    loaded = index.load(str(tmp_path / "ix"), PROVENANCE)
    assert isinstance(built, ShardedScannIndex) and isinstance(loaded, ShardedScannIndex)
    assert len(loaded.shards) == 3 and loaded.count == 1000
    loaded.save(str(tmp_path / "copy"))
    again = index.load(str(tmp_path / "copy"), PROVENANCE)
    for a, b in zip(again.search(vectors[:4], 3), loaded.search(vectors[:4], 3), strict=True):
        np.testing.assert_array_equal(a, b)
