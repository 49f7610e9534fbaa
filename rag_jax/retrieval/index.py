"""Maximum-inner-product indexes over passage vectors: exact, ScaNN (host) and sharded (device).

Legend: B batch of queries, C corpus size (passages), D embedding width, k neighbours per query.

Every index answers the same call:

    scores, ids = ix.search(queries, k)   # queries: [B, D] float32 numpy
                                          # -> scores: [B, k] float32, ids: [B, k] int64 numpy

Rows are sorted by descending score; `ids` are row numbers of the vectors the index was built from
(the corpus order). `ExactIndex` and `DeviceIndex` break ties by the lower id; ScaNN's order among
equal scores is its own. Scores are float32 dot products with the stored vectors (see each class
for the rounding involved); the trainer recomputes doc scores from the stored vectors anyway, so an
index only decides *which* passages, never their weights.

- `ExactIndex` (here): brute force in float32, chunked over C so the [B, C] score matrix never
  exists.
- `ScannIndex` (`rag_jax.retrieval.scann_index`, public here as `index.ScannIndex`): Google's
  ScaNN (partitioning + anisotropic hashing + exact reordering), defaults chosen from C following
  ScaNN's rules of thumb; the host path for any corpus size. `build_and_save` tunes it to a
  recall target on held-out queries before saving (`rag_jax.retrieval.scann_recall`), and the
  loaded index says what was measured (`measured_recall`).
- `DeviceIndex` (`rag_jax.retrieval.device_index`): vectors sharded over a mesh axis, per-shard
  top-k inside `jax.shard_map` (`lax.approx_max_k` on TPU), then a global merge; a pytree, so it
  can be an argument of a jitted step.

All three derive from `rag_jax.retrieval.index_base.Index` (size, width, provenance, argument
checks). On disk an index is a folder holding `manifest.json` (kind, count, dim, dtype, optional
`encoder_fingerprint` and `corpus_checksum`, and the byte size and sha256 of every file) next to
its data files (`rag_jax.retrieval.index_format`). `load(directory, expect={...})` refuses an index
whose manifest disagrees with what the caller holds, and a file whose size or hash disagrees with
the manifest.

Hot swap (new corpus and index, same model): parameters never reference the index or the corpus,
so swapping them is rebinding two names between steps, e.g.

    ix, corpus = index.load(new_dir, expect={"corpus_checksum": checksum}), new_corpus

For a `DeviceIndex` passed as an argument of the jitted step, a new index of the same padded shape
(`DeviceIndex.load(new_dir, mesh)`) reuses the compiled step.
"""

from __future__ import annotations

import functools
import pathlib

import numpy as np

from rag_jax.retrieval import scann_recall, scann_shards
from rag_jax.retrieval.index_base import Index, check_vectors
from rag_jax.retrieval.index_format import load_vectors, provenance, read_manifest, save_vectors
from rag_jax.retrieval.scann_index import ScannIndex
from rag_jax.retrieval.scann_shards import ShardedScannIndex

_SAMPLE_STRIDE = 16  # ExactIndex: one score column in this many bounds the k-th best
_PAD_ID = np.iinfo(np.int64).max  # loses every tie; only ever paired with a -inf score


def _top_k_rows(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best (score, id) pairs of each row: descending score, lower id first among ties.

    Args:
      scores: [B, n] float32.
      ids: [B, n] int64, distinct within a row (except `_PAD_ID` padding, scored -inf).
      k: how many to keep; n may be smaller, then all n are kept.

    Returns:
      (scores [B, min(k, n)], ids [B, min(k, n)]), sorted.
    """
    if scores.shape[1] > k:
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        kept_scores = np.take_along_axis(scores, part, axis=1)
        kept_ids = np.take_along_axis(ids, part, axis=1)
        # argpartition keeps an arbitrary subset of the values equal to the k-th; rows where some
        # of them were left out get the lowest ids among the tied, so results are deterministic.
        kth = kept_scores.min(axis=1, keepdims=True)
        tied_all = (scores == kth).sum(axis=1)
        tied_kept = (kept_scores == kth).sum(axis=1)
        for row in np.flatnonzero(tied_all > tied_kept):
            above = np.flatnonzero(scores[row] > kth[row])
            tied = np.flatnonzero(scores[row] == kth[row])
            tied = tied[np.argsort(ids[row, tied], kind="stable")][: k - len(above)]
            take = np.concatenate([above, tied])
            kept_scores[row], kept_ids[row] = scores[row, take], ids[row, take]
        scores, ids = kept_scores, kept_ids
    order = np.lexsort((ids, -scores), axis=1)
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


class ExactIndex(Index):
    """Brute-force maximum inner product search; the reference every other index is checked against.

    The corpus is scanned in chunks of `chunk_size` rows: one float32 matmul per chunk; only the
    entries above both the running k-th best score and a bound from a sample of the chunk enter
    the merge with the running top-k. Memory beyond the vectors is O(B * chunk_size); results
    equal a full brute force, scores being float32 BLAS dot products.

    Attributes:
      vectors: [C, D] float32, float16 or bfloat16 storage; upcast to float32 chunk by chunk.
      chunk_size: rows of the corpus scored per matmul.
    """

    kind = "exact"

    def __init__(
        self,
        vectors,
        *,
        chunk_size: int | None = None,
        encoder_fingerprint: str | None = None,
        corpus_checksum: str | None = None,
    ):
        """Args:
        vectors: [C, D] passage vectors (see `check_vectors`).
        chunk_size: rows per matmul; default: 48 MiB of float32 rows (16,384 at D=768; fewer
          rows per matmul lose BLAS efficiency, more only add memory), at least 1,024.
        encoder_fingerprint: provenance string written to the manifest.
        corpus_checksum: provenance string written to the manifest.
        """
        self.vectors = check_vectors(vectors)
        self.count, self.dim = self.vectors.shape
        if chunk_size is None:
            chunk_size = max(1024, (48 << 20) // (4 * self.dim))
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = int(chunk_size)
        self.encoder_fingerprint = encoder_fingerprint
        self.corpus_checksum = corpus_checksum

    @property
    def nbytes(self) -> int:
        return self.vectors.nbytes

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k by inner product.

        Args:
          queries: [B, D] floating point.
          k: neighbours per query, 1 <= k <= C.

        Returns:
          (scores [B, k] float32, ids [B, k] int64), descending score, lower id first on ties.
        """
        queries = self._check_queries(queries)
        k = self._check_k(k)
        batch = len(queries)
        best_scores = np.full((batch, k), -np.inf, np.float32)
        best_ids = np.full((batch, k), _PAD_ID, np.int64)
        for start in range(0, self.count, self.chunk_size):
            chunk = self.vectors[start : start + self.chunk_size].astype(np.float32, copy=False)
            # [chunk, B], not [B, chunk]: BLAS splits the long axis over its threads (3x faster
            # for a few queries), and the selection below reads rows of B contiguous scores.
            scores = chunk @ queries.T  # -> [chunk, B]
            # Chunks come in id order, so a score equal to the running k-th loses its tie: only
            # strictly better entries can change the result.
            better = scores > best_scores[:, -1]
            if len(scores) >= _SAMPLE_STRIDE * k:
                # The k-th best of every _SAMPLE_STRIDE-th row bounds the chunk's k-th best from
                # below, so nothing under it can win: about _SAMPLE_STRIDE * k candidates remain
                # per query, found by two comparisons instead of an argpartition of the chunk.
                sample = scores[::_SAMPLE_STRIDE]
                kth = len(sample) - k
                better &= scores >= np.partition(sample, kth, axis=0)[kth]
            flat = np.flatnonzero(better)  # -> c * B + b, in chunk order
            if not flat.size:
                continue
            cols, rows = np.divmod(flat, batch)
            most = int(np.bincount(rows, minlength=batch).max())
            if 4 * most > len(scores):
                chunk_ids = np.broadcast_to(
                    np.arange(start, start + len(chunk)), (batch, len(chunk))
                )
                new_scores, new_ids = _top_k_rows(scores.T, chunk_ids, k)
            else:
                # Few candidates: gather them into a [B, most] block padded with -inf.
                order = np.argsort(rows, kind="stable")  # by query, chunk order within one
                rows, cols = rows[order], cols[order]
                slot = np.arange(len(rows)) - np.searchsorted(rows, rows)
                new_scores = np.full((batch, most), -np.inf, np.float32)
                new_ids = np.full((batch, most), _PAD_ID, np.int64)
                new_scores[rows, slot] = scores[cols, rows]
                new_ids[rows, slot] = start + cols
            best_scores, best_ids = _top_k_rows(
                np.concatenate([best_scores, new_scores], axis=1),
                np.concatenate([best_ids, new_ids], axis=1),
                k,
            )
        return best_scores, best_ids

    def save(self, directory: str, **extra) -> None:
        """Writes `vectors.bin` (raw rows, little-endian) and `manifest.json` to `directory`;
        `extra` fields go into the manifest."""
        save_vectors(self, self.vectors, directory, extra)

    @classmethod
    def load(
        cls,
        directory: str,
        expect: dict | None = None,
        *,
        verify: bool = True,
        mmap: bool = False,
        **kwargs,
    ) -> ExactIndex:
        """Reads an index written by `ExactIndex.save` or `DeviceIndex.save`.

        Args:
          directory: the index folder.
          expect: manifest fields the caller knows, e.g. {"corpus_checksum": ..., "count": ...};
            any difference raises ValueError naming each field with both values.
          verify: also check each file's sha256 (sizes are always checked).
          mmap: memory-map `vectors.bin` read-only instead of reading it into memory: a search
            then reads the stored rows (float16 stays float16) one chunk at a time, and the
            index costs no memory beyond the page cache and one chunk's float32 scores.
          **kwargs: passed to the constructor (`chunk_size`).
        """
        manifest, vectors = load_vectors(directory, expect, verify, kinds=("exact",), mmap=mmap)
        return cls(vectors, **provenance(manifest), **kwargs)


def load(
    directory: str, expect: dict | None = None, *, verify: bool = True, mmap: bool = False
) -> Index:
    """Reads any host index folder, choosing `ExactIndex` or `ScannIndex` by its manifest kind;
    `mmap` memory-maps an exact index's vectors (`ExactIndex.load`)."""
    kind = read_manifest(directory, None, kinds=("exact", "scann", ShardedScannIndex.kind))["kind"]
    if kind == "exact":
        return ExactIndex.load(directory, expect, verify=verify, mmap=mmap)
    if kind == ShardedScannIndex.kind:
        return ShardedScannIndex.load(directory, expect, verify=verify)
    return ScannIndex.load(directory, expect, verify=verify)


def index_vectors(
    out_dir,
    kind: str,
    encoder_fingerprint: str,
    corpus_checksum: str,
    *,
    recall: float = scann_recall.RECALL_TARGET,
    queries=None,
) -> dict:
    """Builds the host index of `kind` over the vectors folder `out_dir/vectors` (checked
    against the provenance) into `out_dir/index` (ScaNN to `recall` on `queries`: see
    `build_and_save`); returns the provenance, and a ScaNN index's `measured_recall`."""
    from rag_jax.retrieval.vectors import load_vectors as load_vector_shards

    provenance = {"encoder_fingerprint": encoder_fingerprint, "corpus_checksum": corpus_checksum}
    vectors = load_vector_shards(pathlib.Path(out_dir) / "vectors", expect=provenance)
    built = build_and_save(
        vectors, kind, pathlib.Path(out_dir) / "index", recall=recall, queries=queries, **provenance
    )
    measured = getattr(built, "measured_recall", None)
    return provenance if measured is None else provenance | {"measured_recall": measured}


def build_and_save(
    vectors,
    kind: str,
    directory: str,
    *,
    recall: float = scann_recall.RECALL_TARGET,
    queries=None,
    seed: int = 0,
    **provenance,
) -> Index:
    """Builds the host index of `kind` ("exact" or "scann") over `vectors` ([C, D]) with their
    provenance (`encoder_fingerprint`, `corpus_checksum`), saves it to `directory` (loadable
    with `load`) and returns it. ScaNN over more than `scann_shards.SHARD_ROWS` vectors is
    built in shards, each saved before the next (bounded memory; a killed build resumes).

    ScaNN is built to a recall target (`scann_recall`): its settings are tuned until recall@10
    on held-out queries, confirmed on a half not used to choose them, reaches `recall`; what was
    measured is saved in the manifest (`measured_recall` after `load`). A target out of reach
    raises `scann_recall.RecallNotReached` naming the best recall found, and nothing is saved:
    an index already in `directory` stays as it was (a sharded build keeps its saved shards,
    but without its manifest the folder does not load).

    Args:
      vectors: [C, D] passage vectors.
      kind: "exact" or "scann".
      directory: the index folder.
      recall: ScaNN's recall@10 target, in [0, 1]; 0: ScaNN's size-based defaults, unmeasured.
        An exact index ignores it (its recall is 1).
      queries: [Q, D] query vectors to measure recall on (e.g. question-encoder outputs for
        held-out questions), at least `scann_recall.MIN_QUERIES`; None: a stand-in drawn from
        the corpus with `seed` (`scann_recall.stand_in_queries`, which says what it over- and
        underestimates).
      seed: the stand-in queries and the split into halves.
      **provenance: `encoder_fingerprint`, `corpus_checksum`.
    """
    if kind == "exact":
        built = ExactIndex(vectors, **provenance)
        built.save(str(directory))
        return built
    if kind != "scann":
        raise ValueError(f"kind must be 'exact' or 'scann', got {kind!r}")
    if not 0 <= recall <= 1:
        raise ValueError(f"recall must be in [0, 1] (0: not measured), got {recall}")
    held = None
    if recall:  # the ground truth: brute force over the same vectors
        held = scann_recall.held_out(ExactIndex(vectors), queries, seed=seed)
    if len(vectors) > scann_shards.SHARD_ROWS:  # saved shard by shard
        tune_fn = None
        if held is not None:
            tune_fn = functools.partial(
                scann_recall.tune_to_recall, held=held, target=recall, log=print
            )
        return scann_shards.build_sharded(
            vectors, directory, log=print, tune_fn=tune_fn, **provenance
        )
    build_fn = functools.partial(ScannIndex.build, vectors, **provenance)
    if held is None:
        built = build_fn()
    else:
        built = scann_recall.build_to_recall(build_fn, held, recall, log=print)
        print(f"ScaNN index: {scann_recall.describe(built.measured_recall)}")
    built.save(str(directory))
    return built
