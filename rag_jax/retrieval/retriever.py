"""Retrieval on the host: question vectors -> top-k passages -> generator inputs.

The index decides *which* passages; their stored vectors come back with them so that the doc
scores can be recomputed inside the jitted step from the trainable question encoder (DESIGN
decision 4): the approximate search never sets the weights the loss uses.

Legend: B batch, N docs per question, S context length, D vector width, C corpus size.
"""

import dataclasses

import numpy as np

from rag_jax.retrieval.index import Index
from rag_jax.retrieval.store import PassageStore


@dataclasses.dataclass
class Retrieved:
    """What retrieval hands to the step for a batch of questions."""

    doc_ids: np.ndarray  # [B, N] int64 passage rows, best first
    index_scores: np.ndarray  # [B, N] float32 scores the index returned
    doc_vectors: np.ndarray  # [B, N, D] float32 stored passage vectors
    context_input_ids: np.ndarray  # [B * N, S] int32, row b * N + n
    context_attention_mask: np.ndarray  # [B * N, S] int32


class Retriever:
    """An index over a passage store's vectors, plus the store that turns hits into contexts."""

    def __init__(
        self,
        index: Index,
        store: PassageStore,
        vectors: np.ndarray,
        *,
        n_docs: int,
        max_combined_length: int,
    ):
        """Args:
        index: any host index over `vectors` (`search(queries [B, D], k)`).
        store: the passage store the vectors were encoded from (same row order).
        vectors: [C, D] stored passage vectors.
        n_docs: N, passages per question.
        max_combined_length: S, generator context length.
        """
        if len(store) != index.count or vectors.shape[0] != index.count:
            raise ValueError(
                f"index has {index.count} vectors, the store {store.directory} has {len(store)} "
                f"passages and the vector array {vectors.shape[0]} rows; they must be equal"
            )
        if vectors.ndim != 2 or vectors.shape[1] != index.dim:
            raise ValueError(f"vectors {vectors.shape} must be [C, D] with D = {index.dim}")
        if not 1 <= n_docs <= index.count:
            raise ValueError(
                f"n_docs={n_docs} must be in [1, {index.count}] (the corpus has {index.count} "
                "passages)"
            )
        self.index, self.store, self.vectors = index, store, vectors
        self.n_docs, self.max_combined_length = n_docs, max_combined_length

    def __call__(self, question_vectors: np.ndarray, question_pieces: list[list[int]]) -> Retrieved:
        """Retrieves for a batch.

        Args:
          question_vectors: [B, D] float32 from the current question encoder.
          question_pieces: B id lists from `store.tokenize_questions` (the generator's question
            tokens as they follow the passage in the context).

        Returns:
          Retrieved arrays for the step.
        """
        scores, ids = self.index.search(np.asarray(question_vectors, np.float32), self.n_docs)
        return self.gather(ids, question_pieces, scores)

    def gather(self, doc_ids, question_pieces: list[list[int]], scores=None) -> Retrieved:
        """The step's inputs for passages already chosen (e.g. by a search inside the step).

        Args:
          doc_ids: [B, N] passage rows, best first.
          question_pieces: B id lists from `store.tokenize_questions`.
          scores: [B, N] index scores when known; NaN otherwise.

        Returns:
          Retrieved arrays for the step.
        """
        ids = np.asarray(doc_ids).astype(np.int64)  # -> [B, N]
        if ids.ndim != 2 or ids.shape != (len(question_pieces), self.n_docs):
            raise ValueError(
                f"doc_ids {ids.shape} must be [B, N] = [{len(question_pieces)}, {self.n_docs}] "
                "(one row per question piece)"
            )
        if ids.size and not 0 <= ids.min() <= ids.max() < self.index.count:
            raise ValueError(
                f"doc_ids hold rows outside [0, {self.index.count}): {ids.min()}..{ids.max()}"
            )
        if scores is None:
            scores = np.full(ids.shape, np.nan, np.float32)
        vectors = np.asarray(self.vectors[ids.reshape(-1)], np.float32)
        vectors = vectors.reshape(ids.shape + (self.vectors.shape[1],))  # -> [B, N, D]
        context_ids, context_mask = self.store.context_tokens(
            ids, question_pieces, self.max_combined_length
        )
        return Retrieved(ids, np.asarray(scores, np.float32), vectors, context_ids, context_mask)

    def swap(self, index: Index, store: PassageStore, vectors: np.ndarray) -> "Retriever":
        """The same retriever over another corpus (hot-swap): model parameters are untouched."""
        return Retriever(
            index,
            store,
            vectors,
            n_docs=self.n_docs,
            max_combined_length=self.max_combined_length,
        )


class ClosedBook:
    """No retrieval: each question's only "passage" is empty, so the generator sees the question
    alone and must answer from its parameters (the closed-book baseline).

    It stands in for a `Retriever` with N = 1: the one doc gets a zero vector, so p(z|x) = 1 and
    the question encoder receives no gradient; doc ids are -1 (no passage), which the metrics
    count as a miss.
    """

    n_docs = 1

    def __init__(self, tokenizer, dim: int, *, max_combined_length: int):
        """Args:
        tokenizer: the generator's tokenizer (adds its special tokens around the question).
        dim: D, the question encoder's output width.
        max_combined_length: S, generator context length.
        """
        self.tokenizer, self.dim = tokenizer, dim
        self.max_combined_length = max_combined_length
        # The special tokens of an empty input: [CLS] [SEP] (BERT) or <s> </s> (BART).
        self.special = list(tokenizer("")["input_ids"])
        self.num_special = len(self.special)
        if max_combined_length <= self.num_special:
            raise ValueError(
                f"max_combined_length={max_combined_length} leaves no room for the question "
                f"next to {self.num_special} special tokens"
            )

    def __call__(self, question_vectors: np.ndarray, question_pieces: list[list[int]]) -> Retrieved:
        """Contexts `[B, S]` holding only each question (its piece from `tokenize_questions`)."""
        batch, length = len(question_pieces), self.max_combined_length
        pad = self.tokenizer.pad_token_id
        ids = np.full((batch, length), pad, np.int32)
        mask = np.zeros((batch, length), np.int32)
        for b, piece in enumerate(question_pieces):
            body = list(piece)[: length - self.num_special]
            row = self.special[:1] + body + self.special[1:]
            ids[b, : len(row)], mask[b, : len(row)] = row, 1
        return Retrieved(
            doc_ids=np.full((batch, 1), -1, np.int64),
            index_scores=np.zeros((batch, 1), np.float32),
            doc_vectors=np.zeros((batch, 1, self.dim), np.float32),
            context_input_ids=ids,
            context_attention_mask=mask,
        )
