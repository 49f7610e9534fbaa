"""Lexical retrieval: BM25 over passage texts (on `bm25s`), and reciprocal rank fusion.

Legend: B batch of questions, C corpus size (passages), k results per question, M depth of one
ranking (its passages per question).

BM25 here is Lucene's variant (Kamphuis et al. 2020), as in Pyserini, computed by `bm25s`
(method "lucene"). Passage d scores for question q

    sum over the words t of q:  idf(t) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl)),
    idf(t) = ln(1 + (C - df(t) + 0.5) / (df(t) + 0.5)),

where words are `tokenize`'s, a word repeated in q counts each time (Pyserini's bag-of-words
query boosts a word by its count), tf(t, d) is the word's count in d, |d| d's word count, avgdl
the mean of |d| over the corpus and df(t) the number of passages holding t. k1 = 0.9, b = 0.4 are
Pyserini's defaults. Scores are not Pyserini's to the digit: Lucene stores |d| in one lossy byte
and Pyserini's analyzer stems words; here lengths are exact and words unstemmed.

    ix = Bm25Index.build([passage_text(p) for p in passages])
    scores, rows = ix.search(questions, k)   # -> [B, k] float32, [B, k] int64 corpus rows

The top-k is exact and ours, not `bm25s`'s: each question's [C] score vector comes from
`bm25s` and the k best are picked by descending score, the lower row first among equal scores
(`index._top_k_rows`, the order of `ExactIndex`). Ties are common in BM25: duplicate passages
tie, and a question sharing no word with the corpus scores 0 everywhere and gets rows 0..k-1.

`fuse` merges rankings of any origin (dense top-K and BM25 top-K) by reciprocal rank fusion
(Cormack et al. 2009): the hybrid retriever's candidates and its fused evaluation ranking.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from rag_jax.retrieval import files
from rag_jax.retrieval.corpus import Passage
from rag_jax.retrieval.index import _top_k_rows

# bm25s's default token pattern (scikit-learn CountVectorizer's): runs of 2+ word characters.
_TOKEN = re.compile(r"(?u)\b\w\w+\b")
# The tokenizer's identity in saved manifests: change it whenever `tokenize` changes, so that an
# index built with other words is refused rather than searched with mismatched questions.
TOKENIZER = "lowercase; regex (?u)\\b\\w\\w+\\b; bm25s STOPWORDS_EN removed; no stemmer"
FORMAT = "rag_jax.bm25"
VERSION = 1
# Scores held at once by `search` (float32): B questions are scored in chunks of this many / C.


@functools.cache
def _bm25s():
    """The `bm25s` module, imported on first use: importing it runs a JAX computation (its
    `selection` module probes `jax.lax.top_k`), which starts JAX's backends, and on several hosts
    `jax.distributed.initialize` must come before that. Importing this module starts nothing."""
    import bm25s

    # It logs each build at DEBUG through a handler of its own: a build is not news.
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s


@functools.cache
def _stopwords() -> frozenset[str]:
    """bm25s's English stopwords."""
    _bm25s()
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


_CHUNK_SCORES = 1 << 24
# `fuse`: float sums of reciprocal ranks closer than this (relative) are compared exactly; float
# rounding is ~1e-16 per term, so no pair that differs exactly is ever misordered by floats.
_FUSE_RTOL = 1e-9


def tokenize(text: str) -> list[str]:
    """The words BM25 matches, for passages and questions alike.

    `bm25s.tokenize(text, lower=True, stopwords="en", stemmer=None)`'s rule, one text at a time:
    the text lowercased, its runs of two or more word characters (`(?u)\\b\\w\\w+\\b`, Unicode
    aware), minus bm25s's English stopwords. No stemming: "river" and "rivers" are two words.
    """
    stopwords = _stopwords()
    return [token for token in _TOKEN.findall(text.lower()) if token not in stopwords]


def passage_text(passage: Passage) -> str:
    """The text a passage is searched by: its title, a space, its text (as DPR's BM25 baseline
    and Pyserini's Wikipedia indexes do)."""
    return f"{passage.title} {passage.text}"


class Bm25Index:
    """BM25 over C passage texts, searched exactly; immutable once built.

    Attributes:
      count: C, the passages indexed; `search` returns their rows 0..C-1 (build order).
      k1: BM25's term-frequency saturation.
      b: BM25's length normalisation.
    """

    def __init__(self, bm25):
        """Wraps a built or loaded `bm25s.BM25`; use `build` or `load`."""
        self._bm25 = bm25
        self.count = int(bm25.scores["num_docs"])
        self.k1, self.b = float(bm25.k1), float(bm25.b)

    @classmethod
    def build(cls, texts: Sequence[str], *, k1: float = 0.9, b: float = 0.4) -> Bm25Index:
        """Indexes `texts`, row i being texts[i].

        The vocabulary numbers words in order of first appearance, so the same texts always give
        the same index. Memory while building: every passage's word ids as Python lists
        (`bm25s`'s input), then the sparse [C, V] score matrix (float32 per word of a passage).

        Args:
          texts: C >= 1 strings, usually `passage_text(p)` of each passage in corpus order.
          k1: >= 0.
          b: in [0, 1].

        Raises:
          ValueError: naming the bad argument: texts not a non-empty list of strings, k1 or b
            out of range, or no text holding a single word (nothing could ever match).
        """
        _check_texts(texts, "texts")
        if not (isinstance(k1, int | float) and math.isfinite(k1) and k1 >= 0):
            raise ValueError(f"k1 must be a finite number >= 0, got {k1!r}")
        if not (isinstance(b, int | float) and 0 <= b <= 1):
            raise ValueError(f"b must be a number in [0, 1], got {b!r}")
        vocab: dict[str, int] = {}
        token_ids = [[vocab.setdefault(t, len(vocab)) for t in tokenize(text)] for text in texts]
        if not vocab:
            raise ValueError(
                f"texts: none of the {len(texts)} texts holds a word (runs of 2+ letters or "
                "digits that are not stopwords); BM25 could match nothing"
            )
        bm25 = _bm25s().BM25(
            k1=float(k1), b=float(b), method="lucene", backend="numpy", csc_backend="numpy"
        )
        # A (token ids, vocab) pair: bm25s then keeps our vocabulary as is.
        bm25.index((token_ids, vocab), create_empty_token=False, show_progress=False)
        return cls(bm25)

    def search(self, questions: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k passages of highest BM25 score for each question, exactly.

        Questions are scored in chunks (at most 2^24 scores, 64 MiB, at once) and each chunk's
        top-k taken from its full score matrix; `bm25s`'s own top-k is not used.

        Args:
          questions: B >= 1 strings.
          k: in [1, C].

        Returns:
          (scores [B, k] float32, rows [B, k] int64): descending score, the lower row first among
          equal scores; scores are `bm25s`'s float32 sums.
        """
        _check_texts(questions, "questions")
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 1 <= k <= self.count:
            raise ValueError(
                f"k must be an integer in [1, {self.count}] (the passages in the BM25 index), "
                f"got {k!r}"
            )
        k = int(k)
        all_rows = np.arange(self.count, dtype=np.int64)
        chunk = max(1, _CHUNK_SCORES // self.count)
        scores = np.empty((len(questions), k), np.float32)
        rows = np.empty((len(questions), k), np.int64)
        for start in range(0, len(questions), chunk):
            part = questions[start : start + chunk]
            chunk_scores = np.stack([self._scores(q) for q in part])  # -> [b, C]
            ids = np.broadcast_to(all_rows, chunk_scores.shape)
            top_scores, top_rows = _top_k_rows(chunk_scores, ids, k)  # -> [b, k]
            scores[start : start + len(part)] = top_scores
            rows[start : start + len(part)] = top_rows
        return scores, rows

    def _scores(self, question: str) -> np.ndarray:
        """[C] float32 BM25 scores of one question (all 0 when it shares no word)."""
        word_ids = self._bm25.get_tokens_ids(tokenize(question))  # words not in the corpus dropped
        return np.asarray(self._bm25.get_scores_from_ids(word_ids), np.float32)

    def save(self, directory, **extra) -> None:
        """Writes the index to `directory` atomically: `bm25s`'s files (`BM25.save`) and a
        sealed `manifest.json` (count, k1, b, `TOKENIZER`, the bm25s version, the sizes and
        sha256s of the files, and `extra` fields such as `corpus_checksum`)."""
        manifest = {"format": FORMAT, "version": VERSION, "count": self.count}
        manifest |= {"k1": self.k1, "b": self.b, "tokenizer": TOKENIZER}
        manifest |= {"bm25s_version": _bm25s().__version__, **extra}

        def write_fn(tmp):
            self._bm25.save(tmp, show_progress=False)  # no corpus: passages live elsewhere

        files.swap_dir(directory, write_fn, manifest, what="BM25 index")

    @classmethod
    def load(
        cls, directory, expect: dict | None = None, *, verify: bool = True, mmap: bool = False
    ) -> Bm25Index:
        """Reads an index written by `save`.

        Args:
          directory: the index folder.
          expect: manifest fields the caller knows, e.g. {"corpus_checksum": ..., "count": ...};
            any difference raises ValueError naming each field with both values.
          verify: also check each file's sha256 (sizes are always checked).
          mmap: memory-map the score matrix read-only instead of reading it into memory.

        Raises:
          ValueError: naming the file, for a damaged manifest or file, an index built with
            another tokenizer, or a difference from `expect`.
        """
        directory = os.fspath(directory)
        manifest = files.read_manifest(
            directory,
            {FORMAT: (VERSION,)},
            what="BM25 index",
            required=("count", "k1", "b", "tokenizer", "files"),
        )
        path = os.path.join(directory, files.MANIFEST)
        if manifest["tokenizer"] != TOKENIZER:
            raise ValueError(
                f"{path}: field 'tokenizer' is {manifest['tokenizer']!r}, this rag_jax "
                f"tokenizes {TOKENIZER!r}; rebuild the BM25 index"
            )
        files.check_expected(manifest, expect, path, what="BM25 index")
        for name, record in manifest["files"].items():
            files.check_file(
                os.path.join(directory, name), record, verify=verify, what="BM25 index file"
            )
        ix = cls(_bm25s().BM25.load(directory, mmap=mmap, show_progress=False))
        if ix.count != manifest["count"]:
            raise ValueError(
                f"{path}: field 'count' is {manifest['count']} but the bm25s files hold "
                f"{ix.count} passages"
            )
        return ix


def fuse(rankings: Sequence[np.ndarray], k: int, *, c: int = 60) -> np.ndarray:
    """Reciprocal rank fusion (Cormack et al. 2009) of rankings of the same B questions.

    A question's candidates are the distinct rows of its rankings; each scores
    sum_i 1 / (c + rank_i) over the rankings i that hold it (rank_i 1-based). Order: descending
    fused score, then the best rank the row has in any ranking, then the earlier ranking holding
    that best rank, then the lower row (never reached: a ranking holds one row per rank). Scores
    are compared exactly (equal rational sums tie even where their float sums differ in the last
    bit), so the result is fully deterministic.

    Args:
      rankings: one or more [B, M_i] integer arrays of passage rows (>= 0), best first, no row
        twice within a question's ranking; depths M_i may differ.
      k: rows to keep per question, >= 1.
      c: the rank offset, >= 0 (60 in the paper).

    Returns:
      [B, k] int64 rows.

    Raises:
      ValueError: naming the ranking and question, for a bad shape, dtype, negative or
        repeated row, or a question whose rankings hold fewer than k distinct rows (pass
        deeper rankings).
    """
    if isinstance(rankings, np.ndarray) or not isinstance(rankings, Sequence) or not rankings:
        raise ValueError("rankings must be a non-empty list of [B, M] arrays of passage rows")
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 0:
        raise ValueError(f"c must be an integer >= 0, got {c!r}")
    k, c = int(k), int(c)
    lists = [_check_ranking(rankings[0], 0, None)]
    lists += [_check_ranking(r, i, len(lists[0])) for i, r in enumerate(rankings) if i > 0]
    batch, depth = len(lists[0]), max(len(r[0]) if r else 0 for r in lists)
    inverse = [1.0 / (c + rank) for rank in range(1, depth + 1)]
    fused = np.empty((batch, k), np.int64)
    for q in range(batch):
        # row -> [float score, its ranks, best rank, the first ranking with the best rank]
        candidates: dict[int, list] = {}
        for i, ranking in enumerate(lists):
            for rank, row in enumerate(ranking[q], start=1):
                entry = candidates.get(row)
                if entry is None:
                    candidates[row] = [inverse[rank - 1], [rank], rank, i]
                else:
                    entry[0] += inverse[rank - 1]
                    entry[1].append(rank)
                    if rank < entry[2]:
                        entry[2], entry[3] = rank, i
        if len(candidates) < k:
            raise ValueError(
                f"fuse: question {q} has {len(candidates)} distinct rows across its "
                f"{len(lists)} rankings, fewer than k={k}; pass deeper rankings"
            )
        fused[q] = _fused_order(candidates, k, c)
    return fused


def _fused_order(candidates: dict[int, list], k: int, c: int) -> list[int]:
    """The k best rows of one question's `fuse` candidates."""
    order = sorted(candidates, key=lambda row: (-candidates[row][0], *candidates[row][2:], row))
    # Float sums can split an exact tie (at c=60, ranks 3 and 80 sum to 29/1260 as 24 and 30 do,
    # but not in float64): each run of scores within _FUSE_RTOL is re-sorted with exact fractions.
    start = 0
    while start < k:
        end = start + 1
        while end < len(order) and (
            candidates[order[end - 1]][0] - candidates[order[end]][0]
            <= _FUSE_RTOL * candidates[order[end - 1]][0]
        ):
            end += 1
        if end - start > 1:
            run = order[start:end]
            exact = {row: sum(Fraction(1, c + r) for r in candidates[row][1]) for row in run}
            order[start:end] = sorted(run, key=lambda row: (-exact[row], *candidates[row][2:], row))
        start = end
    return order[:k]


def _check_ranking(ranking, i: int, batch: int | None) -> list[list[int]]:
    """One `fuse` ranking as [B][M] Python ints (B = `batch` unless None), or a ValueError
    naming what is wrong."""
    array = np.asarray(ranking)
    if (
        array.ndim != 2
        or (batch is not None and len(array) != batch)
        or not np.issubdtype(array.dtype, np.integer)
    ):
        same = "" if batch is None else f" with B={batch} (as rankings[0])"
        raise ValueError(
            f"rankings[{i}]: expected a [B, M] integer array{same}, got shape {array.shape} "
            f"of {array.dtype}"
        )
    if array.size and array.min() < 0:
        q = int(np.flatnonzero((array < 0).any(axis=1))[0])
        raise ValueError(f"rankings[{i}], question {q}: negative row {array[q].min()}")
    ordered = np.sort(array, axis=1)
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    if repeated.any():
        q = int(np.flatnonzero(repeated)[0])
        row = ordered[q, 1:][ordered[q, 1:] == ordered[q, :-1]][0]
        raise ValueError(f"rankings[{i}], question {q}: row {row} appears twice")
    return array.tolist()


def _check_texts(texts, what: str) -> None:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise ValueError(f"{what} must be a list of strings, got {type(texts).__name__}")
    if not texts:
        raise ValueError(f"{what} is empty; expected at least one string")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"{what}[{i}]: expected a string, got {type(text).__name__}")
