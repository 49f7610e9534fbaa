"""`EditedIndex`: an index with some passages replaced, added or deleted, without rebuilding it.

Legend: B batch of queries, C corpus size (passages), D embedding width, E edited passages,
k neighbours per query.

Editing a bundle's knowledge (or hot-swapping a few passages) at 21M passages must not retrain
ScaNN's leaves and codebooks or rewrite its codes. An `EditedIndex` leaves the base index as it
is and puts the E edited vectors beside it in an exact side index; a search

1. asks the base for its top k + m (m grows while masked ids crowd a row's top), drops the ids
   that were replaced or deleted (masked),
2. searches the E edited vectors exactly,
3. merges the two by score (descending; lower id first among equal scores).

So every edited passage is found exactly, and the rest as well as the base finds them: over an
`ExactIndex` the result equals an exact search of the edited vectors, over a `ScannIndex` it has
the base's recall. A search costs the base's plus an E x B matmul.

Why not ScaNN's own `upsert`/`delete` (scann 1.4.2 has both): they change the searcher in place,
under whichever thread is searching it, and `delete` moves ScaNN's last row into the hole, so the
row -> passage map changes with it; built indexes here are immutable, and a hot swap makes a new
one while the old one serves (`EditedIndex.edit` of an edited index composes the edits, the base
is shared). Folding the edits into the base is a rebuild, for when they have grown large.
"""

from __future__ import annotations

import numpy as np

from rag_jax.retrieval.index import ExactIndex
from rag_jax.retrieval.index_base import Index, check_vectors

_EXTRA = 16  # base neighbours asked for beyond k, before any masked id is seen


class EditedIndex(Index):
    """A base index with passages replaced, added and deleted, searched as one index.

    Attributes:
      base: the unedited index (never changed).
      edited_ids: [E] int64, sorted: the ids whose vectors are `edited_vectors` (ids below
        `base.count` replace a base row; ids from `base.count` on are new passages).
      edited_vectors: [E, D] their vectors.
      deleted_ids: [X] int64, sorted: ids no search returns.
      count: C, base rows plus new passages (deleted ids keep their place).
    """

    kind = "edited"

    def __init__(self, base: Index, edited_ids, edited_vectors, deleted_ids=()):
        """Args:
        base: any host index (`ExactIndex`, `ScannIndex`).
        edited_ids: [E] ids, each once; new passages continue the base's ids without gaps
          (base.count, base.count + 1, ...).
        edited_vectors: [E, D] vectors of `edited_ids`, in the same order.
        deleted_ids: [X] ids no search returns, each below C (a deleted new passage keeps
          its id, so the ids after it stay).
        """
        if isinstance(base, EditedIndex):
            raise TypeError("edit an EditedIndex with its .edit(), which composes the edits")
        edited_ids = np.asarray(edited_ids, np.int64).reshape(-1)
        deleted_ids = np.asarray(deleted_ids, np.int64).reshape(-1)
        edited_vectors = (
            check_vectors(edited_vectors, "edited_vectors")
            if len(edited_ids)
            else (np.zeros((0, base.dim), np.float32))
        )
        if edited_vectors.shape != (len(edited_ids), base.dim):
            raise ValueError(
                f"edited_vectors must be [E, D] = {(len(edited_ids), base.dim)} for "
                f"{len(edited_ids)} edited ids, got shape {edited_vectors.shape}"
            )
        for name, ids in (("edited_ids", edited_ids), ("deleted_ids", deleted_ids)):
            if len(np.unique(ids)) != len(ids):
                raise ValueError(f"{name} repeat an id")
            if len(ids) and ids.min() < 0:
                raise ValueError(f"{name} hold a negative id: {int(ids.min())}")
        new = np.sort(edited_ids[edited_ids >= base.count])
        if not np.array_equal(new, np.arange(base.count, base.count + len(new))):
            raise ValueError(
                f"new passages must take the ids {base.count}, {base.count + 1}, ... in a row "
                f"after the base's {base.count}, got {new[:5].tolist()}..."
            )
        self.base = base
        self.count, self.dim = base.count + len(new), base.dim
        if len(deleted_ids) and deleted_ids.max() >= self.count:
            raise ValueError(f"deleted id {int(deleted_ids.max())} is not below C={self.count}")
        order = np.argsort(edited_ids)
        self.edited_ids, self.edited_vectors = edited_ids[order], edited_vectors[order]
        self.deleted_ids = np.sort(deleted_ids)
        # Ids the base must not return: replaced rows and deleted ones (sorted, for isin).
        self._masked = np.union1d(self.edited_ids[self.edited_ids < base.count], self.deleted_ids)
        self._masked = self._masked[self._masked < base.count]
        # A deleted new passage keeps its vector (and its id's place) but is never searched.
        live = ~np.isin(self.edited_ids, self.deleted_ids)
        self._side_ids = self.edited_ids[live]
        self._side = ExactIndex(self.edited_vectors[live]) if live.any() else None
        self._live_count = self.count - len(self.deleted_ids)
        self.encoder_fingerprint = base.encoder_fingerprint
        self.corpus_checksum = None  # the base's corpus, edited: no longer that checksum

    def edit(self, edited_ids, edited_vectors, deleted_ids=()) -> EditedIndex:
        """A new index: these edits applied over this one's (later edits win; the base shared).

        Ids are as in the constructor, relative to this index: an id below `self.count` is
        replaced, new ones continue from `self.count`; a deleted id may be one edited before.
        """
        edited_ids = np.asarray(edited_ids, np.int64).reshape(-1)
        deleted_ids = np.asarray(deleted_ids, np.int64).reshape(-1)
        keep = ~np.isin(self.edited_ids, edited_ids)
        vectors = np.asarray(edited_vectors).reshape(len(edited_ids), self.dim)
        dtype = np.result_type(self.edited_vectors.dtype, vectors.dtype)
        return EditedIndex(
            self.base,
            np.concatenate([self.edited_ids[keep], edited_ids]),
            np.concatenate([self.edited_vectors[keep].astype(dtype), vectors.astype(dtype)]),
            np.union1d(self.deleted_ids, deleted_ids),
        )

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + self.edited_vectors.nbytes

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by inner product over the edited passages.

        Args:
          queries: [B, D] floating point.
          k: neighbours per query, 1 <= k <= C minus the deleted.

        Returns:
          (scores [B, k] float32, ids [B, k] int64), descending score, lower id first on ties.
        """
        queries = self._check_queries(queries)
        k = self._check_k(k)
        if k > self._live_count:
            raise ValueError(f"k={k} is above the {self._live_count} passages left after deletes")
        base_scores, base_ids = self._search_base(queries, k)
        if self._side is None:
            return base_scores, base_ids
        side_scores, side_rows = self._side.search(queries, min(k, len(self._side_ids)))
        side_ids = self._side_ids[side_rows]  # -> [B, min(k, live E)]
        scores = np.concatenate([base_scores, side_scores], axis=1)
        ids = np.concatenate([base_ids, side_ids], axis=1)
        order = np.lexsort((ids, -scores), axis=1)[:, :k]
        return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)

    def _search_base(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The base's best k unmasked per query (fewer where the base holds fewer): [B, <= k],
        -inf scores padding a row short of k."""
        unmasked = self.base.count - len(self._masked)
        want = min(k, unmasked)
        if want == 0:
            return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
        asked = min(self.base.count, k + min(_EXTRA, len(self._masked)))
        while True:
            scores, ids = self.base.search(queries, asked)
            keep = ~np.isin(ids, self._masked)
            if keep.sum(axis=1).min() >= want or asked == self.base.count:
                break
            asked = min(self.base.count, 2 * asked + len(self._masked) // 8)
        # Masked entries sink below every real score; each row keeps its first `want` unmasked.
        scores = np.where(keep, scores, -np.inf).astype(np.float32)
        order = np.argsort(~keep, axis=1, kind="stable")[:, :want]
        return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


class LiveRowIndex(Index):
    """An `EditedIndex` whose ids are renumbered as the rows of a store that holds its live
    passages only, in id order: row = id - (deleted ids below it).

    A bundle's edit rewrites its passage store that way (unchanged passages in their order, a
    replaced one in its place, the deleted ones gone, new ones at the end), so its ScaNN base
    is never rebuilt: the store's rows are this index's ids. Live ids increase with their rows,
    so ties still resolve to the lower row.

    Attributes:
      edited: the `EditedIndex` (base and edits, in its own ids).
      count: C, the live passages (the store's rows).
    """

    kind = "edited"

    def __init__(self, edited: EditedIndex, corpus_checksum: str | None = None):
        """Args:
        edited: the base and its edits.
        corpus_checksum: the checksum of the store whose rows the ids are (provenance).
        """
        self.edited = edited
        self.count, self.dim = edited._live_count, edited.dim
        self.encoder_fingerprint = edited.encoder_fingerprint
        self.corpus_checksum = corpus_checksum

    @property
    def nbytes(self) -> int:
        return self.edited.nbytes

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The store rows of live `ids`."""
        ids = np.asarray(ids, np.int64)
        return ids - np.searchsorted(self.edited.deleted_ids, ids)

    def ids_of(self, rows) -> np.ndarray:
        """The live id of each store row in `rows`: the least id with `rows` live ids below it,
        found by iterating id = row + (deleted ids <= id) from id = row upwards."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        if len(rows) and not (0 <= rows.min() and rows.max() < self.count):
            raise ValueError(f"rows must be in [0, {self.count}), got {rows.min()}..{rows.max()}")
        ids = rows.copy()
        while True:
            moved = rows + np.searchsorted(self.edited.deleted_ids, ids, side="right")
            if np.array_equal(moved, ids):
                return ids
            ids = moved

    def edit(
        self, replaced_rows, replaced_vectors, new_vectors, deleted_rows, corpus_checksum=None
    ) -> LiveRowIndex:
        """A new index after a store edit: the passages at `replaced_rows` get
        `replaced_vectors`, `new_vectors` are appended (the store's new last rows, in order),
        the passages at `deleted_rows` go. Rows are this index's (the store before the edit)."""
        replaced = self.ids_of(replaced_rows)
        new_vectors = np.asarray(new_vectors).reshape(-1, self.dim)
        new_ids = np.arange(self.edited.count, self.edited.count + len(new_vectors))
        vectors = np.concatenate(
            [np.asarray(replaced_vectors).reshape(len(replaced), self.dim), new_vectors]
        )
        edited = self.edited.edit(
            np.concatenate([replaced, new_ids]), vectors, self.ids_of(deleted_rows)
        )
        return LiveRowIndex(edited, corpus_checksum)

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """`EditedIndex.search` with store rows for ids: (scores [B, k] float32, rows [B, k])."""
        scores, ids = self.edited.search(self._check_queries(queries), self._check_k(k))
        return scores, self.rows_of(ids)
