"""rag_jax.retrieval.lexical: BM25 against a numpy reference, exact tie order, RRF, errors."""

import json
import os
from fractions import Fraction

import bm25s
import numpy as np
import pytest

from rag_jax.retrieval import files, lexical
from rag_jax.retrieval.corpus import Passage
from rag_jax.retrieval.lexical import Bm25Index, fuse

# Repeated words, different lengths, two pairs of duplicate passages (3 = 13, 14 = 29) and a
# passage of stopwords only (11, length 0 after tokenising).
PASSAGES = [
    "Rivers carry water from mountains to the sea. A river delta forms where the river meets sea.",
    "The Nile is the longest river in Africa; the Nile delta is fertile.",
    "Mountains rise above the valley. Snow on the mountains melts into rivers in spring.",
    "Flood waters covered the river bank after heavy rain.",
    "Heavy rain and flood warnings: the bank of the river broke.",
    "A bank lends money; the bank also keeps savings.",
    "Savings accounts at the bank earn interest, and interest compounds.",
    "The Amazon river basin holds the largest rainforest.",
    "Rainforest trees store carbon; carbon storage slows warming.",
    "Glaciers are rivers of ice moving slowly down mountains.",
    "Flood plain farming relies on the river flooding each year.",
    "the of and to in",
    "Delta delta delta: the word delta repeated.",
    "Flood waters covered the river bank after heavy rain.",
    "Volcanoes erupt lava; lava cools into rock.",
    "Rock layers record the history of mountains and rivers.",
    "Interest rates at the central bank affect savings and loans.",
    "Loans from a bank must be repaid with interest.",
    "Ice ages carved valleys; glaciers left lakes behind.",
    "Lakes and rivers freeze in winter when ice forms.",
    "Ocean tides are pulled by the moon.",
    "The moon orbits the earth; the earth orbits the sun.",
    "Solar energy from the sun powers plants.",
    "Plants in the rainforest compete for sun light.",
    "Mountains mountains mountains everywhere in the alps.",
    "Ocean currents carry heat from the equator.",
    "Tides flood the salt marsh twice a day.",
    "A salt marsh lies where a river meets the ocean.",
    "Earthquakes shake mountains and move rock.",
    "Volcanoes erupt lava; lava cools into rock.",
]
QUESTIONS = [
    "Where does the river meet the sea?",
    "flood on the river bank",
    "bank interest savings",
    "the of and",  # stopwords only: no word, every score 0
    "zebra quantum xylophone",  # words the corpus lacks: every score 0
    "lava lava rock",  # a repeated word counts twice; passages 14 and 29 tie
    "Mountains, glaciers & ICE!",
    "delta",
    "moon tides ocean",
]


def _reference_bm25(texts, questions, k1, b):
    """[B, C] float64 BM25 scores, Lucene's variant (bm25s `_score_idf_lucene`,
    `_score_tfc_lucene`), from bm25s's own tokenizer's words."""
    docs = bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)
    queries = bm25s.tokenize(questions, stopwords="en", return_ids=False, show_progress=False)
    vocab = sorted({word for doc in docs for word in doc})
    tf = np.array([[doc.count(word) for word in vocab] for doc in docs], np.float64)  # [C, V]
    count, lengths = len(docs), tf.sum(axis=1)
    df = (tf > 0).sum(axis=0)
    idf = np.log(1 + (count - df + 0.5) / (df + 0.5))  # [V]
    norm = k1 * (1 - b + b * lengths / lengths.mean())  # [C]
    weight = idf * tf / (tf + norm[:, None])  # [C, V]
    scores = np.zeros((len(queries), count))
    for q, query in enumerate(queries):
        for word in query:  # with repeats
            if word in vocab:
                scores[q] += weight[:, vocab.index(word)]
    return scores


def _reference_top_k(scores, k):
    """Descending score, lower row first among equal scores, by sorting every row."""
    return np.array([sorted(range(len(s)), key=lambda r: (-s[r], r))[:k] for s in scores])


def _assert_clear_gaps(scores):
    """The test's data: scores of a question are equal or differ by > 1e-4 relative, so no
    order below depends on float rounding."""
    for s in scores:
        distinct = np.unique(s)
        gaps = np.diff(distinct) / distinct[1:]
        assert (gaps > 1e-4).all(), f"near-tie in the test data: {distinct}"


@pytest.mark.parametrize("k1, b", [(0.9, 0.4), (1.5, 0.75)])
def test_search_equals_reference_bm25_with_exact_ties(k1, b):
    reference = _reference_bm25(PASSAGES, QUESTIONS, k1, b)
    _assert_clear_gaps(reference)
    ix = Bm25Index.build(PASSAGES, k1=k1, b=b)
    assert ix.count == len(PASSAGES) == 30
    assert (ix.k1, ix.b) == (k1, b)
    for k in (1, 4, 7, 30):
        scores, rows = ix.search(QUESTIONS, k)
        assert scores.shape == rows.shape == (len(QUESTIONS), k)
        assert scores.dtype == np.float32 and rows.dtype == np.int64
        np.testing.assert_array_equal(rows, _reference_top_k(reference, k))
        np.testing.assert_allclose(
            scores, np.take_along_axis(reference, rows, axis=1), rtol=1e-5, atol=0
        )
    scores, rows = ix.search(QUESTIONS, 30)
    # The ties the data was built for, in the order the rule asks.
    np.testing.assert_array_equal(rows[3], np.arange(30))  # no word: rows 0..29, all 0
    np.testing.assert_array_equal(rows[4], np.arange(30))
    assert (scores[3] == 0).all() and (scores[4] == 0).all()
    assert list(rows[5, :2]) == [14, 29] and scores[5, 0] == scores[5, 1] > 0
    at = list(rows[1]).index(3)  # duplicates 3 and 13: adjacent, equal, lower row first
    assert rows[1, at + 1] == 13 and scores[1, at] == scores[1, at + 1] > 0
    # Past the matching passages the zeros come in row order.
    zeros = rows[7][scores[7] == 0]
    np.testing.assert_array_equal(zeros, np.sort(zeros))


def test_search_in_chunks_equals_one_chunk(monkeypatch):
    ix = Bm25Index.build(PASSAGES)
    whole = ix.search(QUESTIONS, 6)
    monkeypatch.setattr(lexical, "_CHUNK_SCORES", 2 * len(PASSAGES))  # two questions a chunk
    chunked = ix.search(QUESTIONS, 6)
    np.testing.assert_array_equal(chunked[0], whole[0])
    np.testing.assert_array_equal(chunked[1], whole[1])


def test_tokenize_is_bm25s_tokenizer():
    texts = [
        "The QUICK brown-fox's 2 dogs, a1 b c_d Ünïcode 中文字 naïve x",
        "it is what it is; THE end.",
        "",
        "tabs\tand\nnewlines  here",
    ]
    expected = bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)
    assert [lexical.tokenize(t) for t in texts] == expected
    assert lexical.tokenize("The Rivers, the river!") == ["rivers", "river"]  # no stemming


def test_passage_text_is_title_space_text():
    assert lexical.passage_text(Passage("7", "Nile", "A river.")) == "Nile A river."


def test_save_load_round_trip_and_refusals(tmp_path):
    ix = Bm25Index.build(PASSAGES)
    directory = tmp_path / "bm25"
    ix.save(directory, corpus_checksum="abc")
    loaded = Bm25Index.load(directory, expect={"corpus_checksum": "abc", "count": 30})
    for a, b in zip(ix.search(QUESTIONS, 8), loaded.search(QUESTIONS, 8)):
        np.testing.assert_array_equal(a, b)
    mapped = Bm25Index.load(directory, mmap=True)
    np.testing.assert_array_equal(mapped.search(QUESTIONS, 8)[1], ix.search(QUESTIONS, 8)[1])

    with pytest.raises(ValueError, match="corpus_checksum"):
        Bm25Index.load(directory, expect={"corpus_checksum": "other"})
    manifest = files.read_manifest(directory, {lexical.FORMAT: (lexical.VERSION,)}, what="t")
    files.write_manifest(directory, {**manifest, "tokenizer": "stemmed"})
    with pytest.raises(ValueError, match="tokenizer.*rebuild the BM25 index"):
        Bm25Index.load(directory)
    files.write_manifest(directory, manifest)
    data = directory / "data.csc.index.npy"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1  # same size, another sha256
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="data.csc.index.npy is corrupted"):
        Bm25Index.load(directory)
    assert json.loads((directory / "manifest.json").read_text())["bm25s_version"] == "0.3.16"
    assert not [n for n in os.listdir(tmp_path) if n != "bm25"]  # no temporary folder left


# ---------------------------------------------------------------------------------------------
# fuse


def _reference_fuse(rankings, k, c):
    """Reciprocal rank fusion by brute force: exact fractions, every candidate sorted."""
    out = []
    for q in range(len(rankings[0])):
        score, best = {}, {}  # row -> fused score; row -> (best rank, first list with it)
        for i, ranking in enumerate(rankings):
            for position, row in enumerate(ranking[q].tolist()):
                rank = position + 1
                score[row] = score.get(row, Fraction(0)) + Fraction(1, c + rank)
                if row not in best or rank < best[row][0]:
                    best[row] = (rank, i)
        out.append(sorted(score, key=lambda r: (-score[r], best[r][0], best[r][1], r))[:k])
    return np.array(out, np.int64)


def test_fuse_equals_brute_force_on_random_rankings():
    rng = np.random.default_rng(0)
    for case in range(300):
        batch, lists = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        pool, most = (14, 10) if case % 3 else (120, 100)  # deep lists: float-split exact ties
        rankings = [
            np.stack([rng.permutation(pool)[:depth] for _ in range(batch)])  # overlapping rows
            for depth in rng.integers(1, most + 1, size=lists)
        ]
        union = min(len(set(np.concatenate([r[q] for r in rankings]))) for q in range(batch))
        k = int(rng.integers(1, union + 1))
        c = int(rng.choice([0, 1, 60]))
        got = fuse(rankings, k, c=c)
        assert got.dtype == np.int64 and got.shape == (batch, k), case
        np.testing.assert_array_equal(got, _reference_fuse(rankings, k, c), err_msg=f"{case}")
        assert all(len(set(row)) == k for row in got.tolist())  # deduplicated


def test_fuse_hand_checked_cases():
    # c=0: row 1 scores 1/1 + 1/2, row 3 1/3 + 1/1, row 2 1/2, row 4 1/3.
    assert fuse([np.array([[1, 2, 3]]), np.array([[3, 1, 4]])], 4, c=0).tolist() == [[1, 3, 2, 4]]
    # Equal scores and best ranks: the row whose best rank is in the earlier list first.
    assert fuse([np.array([[5, 6]]), np.array([[6, 5]])], 2, c=0).tolist() == [[5, 6]]
    assert fuse([np.array([[9]]), np.array([[4]])], 2).tolist() == [[9, 4]]
    # Dedup across lists; 7 and 9 tie (1/61 + 1/63), both above 8 (2/62); 7 holds rank 1 first.
    fused = fuse([np.array([[7, 8, 9], [1, 2, 3]]), np.array([[9, 8, 7], [3, 4, 5]])], 3)
    assert fused.tolist() == [[7, 9, 8], [3, 1, 2]]
    # Lists of different depths; k below the union.
    assert fuse([np.array([[0]]), np.array([[2, 0, 1]])], 2).tolist() == [[0, 2]]


def test_fuse_breaks_exact_ties_that_floats_split():
    # At c=60, ranks (3, 80) and (24, 30) both sum to 29/1260, but not in float64: the float
    # sums alone would put y (best rank 24) before x (best rank 3).
    assert Fraction(1, 63) + Fraction(1, 140) == Fraction(1, 84) + Fraction(1, 90)
    assert 1 / 63 + 1 / 140 < 1 / 84 + 1 / 90
    x, y = 1000, 1001
    first, second = list(range(100)), list(range(200, 300))
    first[2], first[23] = x, y  # ranks 3 and 24
    second[79], second[29] = x, y  # ranks 80 and 30
    fused = fuse([np.array([first]), np.array([second])], 198)[0].tolist()
    assert fused.index(x) < fused.index(y)
    np.testing.assert_array_equal(
        fuse([np.array([first]), np.array([second])], 198),
        _reference_fuse([np.array([first]), np.array([second])], 198, 60),
    )


# ---------------------------------------------------------------------------------------------
# Errors


def test_search_and_build_errors():
    ix = Bm25Index.build(PASSAGES)
    for k in (0, 31, 2.0, True):
        with pytest.raises(ValueError, match=r"k must be an integer in \[1, 30\]"):
            ix.search(QUESTIONS, k)
    with pytest.raises(ValueError, match="questions is empty"):
        ix.search([], 3)
    with pytest.raises(ValueError, match="questions must be a list of strings, got str"):
        ix.search("river", 3)
    with pytest.raises(ValueError, match=r"questions\[1\]: expected a string, got int"):
        ix.search(["river", 5], 3)
    with pytest.raises(ValueError, match="texts is empty"):
        Bm25Index.build([])
    with pytest.raises(ValueError, match="none of the 2 texts holds a word"):
        Bm25Index.build(["the of", "a"])
    with pytest.raises(ValueError, match="k1 must be"):
        Bm25Index.build(PASSAGES, k1=-1.0)
    with pytest.raises(ValueError, match=r"b must be a number in \[0, 1\]"):
        Bm25Index.build(PASSAGES, b=1.5)


def test_fuse_errors():
    a = np.array([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="question 1 has 3 distinct rows .* fewer than k=4; pass"):
        fuse([a, np.array([[5, 6], [4, 3]]), np.array([[9, 1], [5, 3]])[:, :1]], 4)
    with pytest.raises(ValueError, match="non-empty list"):
        fuse([], 1)
    with pytest.raises(ValueError, match=r"rankings\[1\]: expected a \[B, M\] integer array"):
        fuse([a, np.array([[1, 2]])], 1)  # another B
    with pytest.raises(ValueError, match=r"rankings\[0\]: expected a \[B, M\] integer array"):
        fuse([np.array([1, 2])], 1)
    with pytest.raises(ValueError, match="integer array"):
        fuse([a.astype(np.float32)], 1)
    with pytest.raises(ValueError, match=r"rankings\[1\], question 0: negative row -1"):
        fuse([a, np.array([[-1, 2], [3, 4]])], 1)
    with pytest.raises(ValueError, match=r"rankings\[0\], question 1: row 3 appears twice"):
        fuse([np.array([[1, 2], [3, 3]])], 1)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        fuse([a], 0)
    with pytest.raises(ValueError, match="c must be an integer >= 0"):
        fuse([a], 1, c=-1)


def test_importing_the_library_starts_no_jax_backend():
    """bm25s runs a JAX computation when imported; on several hosts `jax.distributed.initialize`
    must come before any, so the library imports it on first use only."""
    import subprocess
    import sys

    code = (
        "from jax._src import xla_bridge\n"
        "from rag_jax.training import experiment, loop\n"
        "from rag_jax.retrieval import lexical, sources\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        "lexical.Bm25Index.build(['a bb cc', 'dd ee']).search(['bb'], 1)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
