"""Where a retriever's candidates come from: the dense index, BM25, or both fused.

`retrieval.source` picks it for training candidates and evaluation alike:

- "dense": the index over the passage tower's vectors (`Retriever`'s own search);
- "bm25": BM25 over the passages' words (`lexical.Bm25Index`), the lexical baseline;
- "hybrid": the two rankings fused by reciprocal rank fusion (`lexical.fuse`) over each one's
  top `depth`, the best N kept: the candidates a production system retrieves.

Whichever source chose the rows, the retriever returns their stored vectors and the doc scores
are the question tower's `q . d` inside the jitted step, so RAG's marginal and the retriever
objectives train the dense side over BM25's or the hybrid's candidates (their gradient reaches
the question tower the same way), and decoding weighs them by `softmax(q . d)`.

Legend: B batch, N docs per question, C corpus size.
"""

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from rag_jax.retrieval import lexical
from rag_jax.retrieval.corpus import Passage
from rag_jax.retrieval.store import PassageStore

SOURCES = ("dense", "bm25", "hybrid")


def passage_words(store: PassageStore) -> list[str]:
    """What BM25 searches of each passage of `store` (`lexical.passage_text`), in row order."""
    return [
        lexical.passage_text(Passage(store.ids[i], store.title(i), store.text(i)))
        for i in range(len(store))
    ]


@dataclasses.dataclass(frozen=True)
class CandidateSource:
    """A non-dense source of candidates (`SOURCES`), over one passage store's rows.

    Attributes:
      kind: "bm25" | "hybrid".
      bm25: BM25 over the same store's passages (`passage_words`), row for row.
      depth: how deep each ranking is read before fusing ("hybrid"); at least N is read.
    """

    kind: str
    bm25: lexical.Bm25Index
    depth: int = 100

    def __post_init__(self):
        if self.kind not in ("bm25", "hybrid"):
            raise ValueError(f"a candidate source is 'bm25' or 'hybrid', got {self.kind!r}")
        if self.depth < 1:
            raise ValueError(f"depth must be positive, got {self.depth}")

    def rows(
        self,
        dense_search: Callable[[int], np.ndarray],
        questions: Sequence[str],
        n_docs: int,
        count: int,
    ) -> np.ndarray:
        """[B, N] passage rows of `questions`, best first.

        Args:
          dense_search: `k -> [B, k]` rows of the dense index's top k for the same questions.
          questions: the B question texts, in batch order.
          n_docs: N.
          count: C, the rows of the dense index (BM25 must cover the same store).
        """
        if self.bm25.count != count:
            raise ValueError(
                f"BM25 covers {self.bm25.count} passages, the dense index {count}: both must be "
                "built from the same passage store"
            )
        if len(questions) == 0:
            raise ValueError("no questions: a BM25 or hybrid search reads the question texts")
        depth = min(count, max(n_docs, self.depth))
        if self.kind == "bm25":
            return self.bm25.search(questions, n_docs)[1]
        lexical_rows = self.bm25.search(questions, depth)[1]  # -> [B, depth]
        dense_rows = np.asarray(dense_search(depth), np.int64)  # -> [B, depth]
        if dense_rows.shape != lexical_rows.shape:
            raise ValueError(
                f"dense rows {dense_rows.shape} and BM25 rows {lexical_rows.shape} must both be "
                f"[B, depth] = [{len(questions)}, {depth}]"
            )
        return lexical.fuse([dense_rows, lexical_rows], n_docs)  # -> [B, N]


_BUILT: dict = {}  # (corpus checksum, k1, b) -> the last BM25 built: a refresh reuses it


def candidate_source(store: PassageStore, kind: str, *, depth: int = 100, k1=0.9, b=0.4):
    """The `CandidateSource` of `store` for `retrieval.source` = `kind` (None for "dense").
    BM25 is built once per corpus (checksum) and settings in a process: an index refresh or a
    restore over the same store reuses it."""
    if kind not in SOURCES:
        raise ValueError(f"retrieval.source must be one of {' | '.join(SOURCES)}, got {kind!r}")
    if kind == "dense":
        return None
    key = (store.checksum, float(k1), float(b))
    if key not in _BUILT:
        _BUILT.clear()  # one corpus at a time: a hot swap's store replaces the last
        _BUILT[key] = lexical.Bm25Index.build(passage_words(store), k1=k1, b=b)
    return CandidateSource(kind, _BUILT[key], depth)
