"""The `Index` base every passage index derives from: its size, width and provenance, and the
checks of what it is given (the vectors to index, the queries, k).

The indexes themselves: `ExactIndex` (`rag_jax.retrieval.index`), `ScannIndex`
(`rag_jax.retrieval.scann_index`), `DeviceIndex` (`rag_jax.retrieval.device_index`); their
folders on disk, `rag_jax.retrieval.index_format`.

Legend: B batch of queries, C corpus size (passages), D embedding width, k neighbours per query.
"""

import numpy as np

from rag_jax.retrieval.files import DTYPES, IO_BLOCK


class Index:
    """What every index shares: size, width, provenance strings and the argument checks.

    Attributes:
      count: C, the number of vectors (passages).
      dim: D, the vector width.
      encoder_fingerprint: string identifying the passage encoder, or None.
      corpus_checksum: string identifying the corpus the vectors came from, or None.
    """

    kind = ""
    count: int
    dim: int
    encoder_fingerprint: str | None
    corpus_checksum: str | None

    def _check_k(self, k) -> int:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise TypeError(f"k must be an int, got {k!r}")
        if not 1 <= k <= self.count:
            raise ValueError(f"k={k} is outside [1, C={self.count}] for this index of {self.count}")
        return int(k)

    def _check_queries(self, queries) -> np.ndarray:
        """Returns `queries` as C-contiguous float32 [B, D], or raises naming the bad shape/row."""
        queries = np.asarray(queries)
        check_query_shape(queries.shape, self.count, self.dim)
        if not np.issubdtype(queries.dtype, np.floating) and queries.dtype != DTYPES["bfloat16"]:
            raise TypeError(f"queries must be floating point, got dtype {queries.dtype}")
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        bad = ~np.isfinite(queries).all(axis=1)
        if bad.any():
            raise ValueError(f"queries row {int(np.argmax(bad))} is not finite (nan or inf)")
        return queries


def check_query_shape(shape, count: int, dim: int) -> None:
    if len(shape) != 2 or shape[1] != dim:
        raise ValueError(
            f"queries must be [B, D] with D={dim}, got shape {tuple(shape)}; the index holds "
            f"vectors of shape [C, D] = {(count, dim)}"
        )
    if shape[0] == 0:
        raise ValueError(f"queries are empty: shape {tuple(shape)}")


def check_vectors(vectors, name: str = "vectors") -> np.ndarray:
    """Validates passage vectors for indexing.

    Args:
      vectors: [C, D] float32, float16 or bfloat16 (float64 is stored as float32).
      name: what to call the array in errors.

    Returns:
      The vectors as a C-contiguous numpy array of a storage dtype.

    Raises:
      ValueError: not 2-D, empty, or a row holding nan/inf (the first such row is named).
      TypeError: not floating point.
    """
    vectors = np.asarray(vectors)
    if vectors.ndim != 2:
        raise ValueError(f"{name} must be [C, D], got shape {vectors.shape}")
    if vectors.shape[0] == 0 or vectors.shape[1] == 0:
        raise ValueError(f"{name} are empty: shape {vectors.shape}")
    if vectors.dtype == np.float64:
        vectors = vectors.astype(np.float32)
    if vectors.dtype.name not in DTYPES:
        raise TypeError(f"{name} must be one of {sorted(DTYPES)}, got dtype {vectors.dtype}")
    vectors = np.ascontiguousarray(vectors)
    # In row blocks: a boolean copy of a corpus-sized array would be as large as the corpus.
    rows = max(1, IO_BLOCK // vectors[0].nbytes)
    for start in range(0, len(vectors), rows):
        finite = np.isfinite(vectors[start : start + rows]).all(axis=1)
        if not finite.all():
            row = start + int(np.argmin(finite))
            raise ValueError(f"{name} row {row} is not finite (nan or inf)")
    return vectors
