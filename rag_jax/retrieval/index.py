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

- `ExactIndex`: brute force in float32, chunked over C so the [B, C] score matrix never exists.
- `ScannIndex`: Google's ScaNN (partitioning + anisotropic hashing + exact reordering), defaults
  chosen from C following ScaNN's rules of thumb; the host path for any corpus size.
- `DeviceIndex` (`rag_jax.retrieval.device_index`): vectors sharded over a mesh axis, per-shard
  top-k inside `jax.shard_map` (`lax.approx_max_k` on TPU), then a global merge; a pytree, so it
  can be an argument of a jitted step.

On disk an index is a folder holding `manifest.json` (kind, count, dim, dtype, optional
`encoder_fingerprint` and `corpus_checksum`, and the byte size and sha256 of every file) next to
its data files (`rag_jax.retrieval.files`). `load(directory, expect={...})` refuses an index whose
manifest disagrees with what the caller holds, and a file whose size or hash disagrees with the
manifest.

Hot swap (new corpus and index, same model): parameters never reference the index or the corpus,
so swapping them is rebinding two names between steps, e.g.

    ix, corpus = index.load(new_dir, expect={"corpus_checksum": checksum}), new_corpus

For a `DeviceIndex` passed as an argument of the jitted step, a new index of the same padded shape
(`DeviceIndex.load(new_dir, mesh)`) reuses the compiled step.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

import numpy as np

from rag_jax.retrieval import files
from rag_jax.retrieval.files import DTYPES, IO_BLOCK, MANIFEST

_SAMPLE_STRIDE = 16  # ExactIndex: one score column in this many bounds the k-th best
_PAD_ID = np.iinfo(np.int64).max  # loses every tie; only ever paired with a -inf score


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

    def _manifest(self, dtype: str, **extra) -> dict:
        manifest = {"format": FORMAT, "version": VERSION, "kind": self.kind, "dtype": dtype}
        manifest.update(extra)
        for field in ("count", "dim", "encoder_fingerprint", "corpus_checksum"):
            if getattr(self, field) is not None:
                manifest[field] = getattr(self, field)
        return manifest


# ------------------------------------------------------------------------------------------------
# Index folders: `manifest.json` (`rag_jax.retrieval.files`) beside the data files.

FORMAT = "rag_jax.index"
VERSION = 2  # 2: the manifest carries its checksum (1: `format_version` 1, read as before)
VECTORS = "vectors.bin"
# Who holds the expected value of a manifest field, for the mismatch message.
_EXPECT_SOURCE = {"corpus_checksum": "the corpus", "count": "the corpus"}
_EXPECT_SOURCE |= {"encoder_fingerprint": "the encoder", "dim": "the encoder"}


def provenance(manifest: dict) -> dict:
    """The encoder fingerprint and corpus checksum a manifest records (None where it has none)."""
    return {name: manifest.get(name) for name in ("encoder_fingerprint", "corpus_checksum")}


def read_manifest(directory, expect: dict | None, kinds: tuple[str, ...]) -> dict:
    """Parses `<directory>/manifest.json`, checks its fields and the caller's expectations."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            legacy = json.load(f)
    except (OSError, ValueError):
        legacy = None
    if isinstance(legacy, dict) and "format" not in legacy and legacy.get("format_version") == 1:
        manifest = legacy  # written before manifests were sealed
    else:
        manifest = files.read_manifest(directory, {FORMAT: (VERSION,)}, what="index")
    for field in ("kind", "count", "dim", "dtype", "files"):
        if field not in manifest:
            raise ValueError(f"index manifest {path} lacks the field {field!r}")
    if manifest["kind"] not in kinds:
        raise ValueError(
            f"index manifest {path} has kind {manifest['kind']!r}, not one of {kinds}; "
            "`rag_jax.retrieval.index.load` picks the class by kind"
        )
    files.check_expected(manifest, expect, path, _EXPECT_SOURCE, what="index")
    return manifest


def save_vectors(index: Index, vectors: np.ndarray, directory, extra: dict | None = None):
    """Writes an exact index folder: `vectors.bin` (raw little-endian rows) and the manifest
    (with `extra` fields, e.g. how the vectors were encoded)."""
    little = vectors.astype(vectors.dtype.newbyteorder("<"), copy=False)  # no copy on x86/ARM

    def write_fn(tmp):
        with open(os.path.join(tmp, VECTORS), "wb") as f:
            files.write_bytes(f, np.ascontiguousarray(little).view(np.uint8))

    manifest = index._manifest(vectors.dtype.name, **(extra or {}))
    files.swap_dir(directory, write_fn, manifest, what="index")


def load_vectors(directory, expect, verify, kinds) -> tuple[dict, np.ndarray]:
    """Checks and reads an index folder's `vectors.bin`; returns (manifest, [C, D] vectors)."""
    directory = os.fspath(directory)
    manifest = read_manifest(directory, expect, kinds)
    shape, dtype = (manifest["count"], manifest["dim"]), DTYPES.get(manifest["dtype"])
    record = manifest["files"].get(VECTORS, {})
    if dtype is None or record.get("bytes") != math.prod(shape) * np.dtype(dtype).itemsize:
        raise ValueError(
            f"index manifest {os.path.join(directory, MANIFEST)} is inconsistent: {VECTORS} "
            f"listed as {record}, count x dim = {shape}, dtype {manifest['dtype']!r}"
        )
    path = os.path.join(directory, VECTORS)
    files.check_file(path, record, verify=verify, what="index file")
    vectors = np.fromfile(path, np.dtype(dtype).newbyteorder("<")).reshape(shape)
    return manifest, vectors.astype(dtype, copy=False)


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


# ------------------------------------------------------------------------------------------------
# Exact search on the host.


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
        cls, directory: str, expect: dict | None = None, *, verify: bool = True, **kwargs
    ) -> ExactIndex:
        """Reads an index written by `ExactIndex.save` or `DeviceIndex.save`.

        Args:
          directory: the index folder.
          expect: manifest fields the caller knows, e.g. {"corpus_checksum": ..., "count": ...};
            any difference raises ValueError naming each field with both values.
          verify: also check each file's sha256 (sizes are always checked).
          **kwargs: passed to the constructor (`chunk_size`).
        """
        manifest, vectors = load_vectors(directory, expect, verify, kinds=("exact",))
        return cls(vectors, **provenance(manifest), **kwargs)


# ------------------------------------------------------------------------------------------------
# ScaNN on the host.


def scann_defaults(count: int) -> dict:
    """ScaNN settings for a corpus of C=`count` vectors, after ScaNN's rules of thumb.

    ScaNN's guidance (docs/algorithms.md): brute force below ~20k points; asymmetric hashing (AH)
    plus exact reordering below ~100k; above that also partition into ~sqrt(C) leaves;
    `dimensions_per_block=2` for AH. ScaNN leaves the leaves searched and the reordering depth to
    the user; the defaults here, 5% of the leaves and 100 candidates, are the proportions of the
    ScaNN README's example (100 of 2,000 leaves, reorder 100). On 200k clustered 768-d vectors
    (benchmarks/index.py) they give recall@10 0.99; half the leaves gives 0.96.

    Returns:
      {"scoring": "brute_force" | "ah", "num_leaves": int (0: no tree), "num_leaves_to_search",
       "training_sample_size", "reorder": int (0: no reordering)}.
    """
    if count < 20_000:
        return {
            "scoring": "brute_force",
            "num_leaves": 0,
            "num_leaves_to_search": 0,
            "training_sample_size": count,
            "reorder": 0,
        }
    num_leaves = round(math.sqrt(count)) if count >= 100_000 else 0
    return {
        "scoring": "ah",
        "num_leaves": num_leaves,
        "num_leaves_to_search": max(1, math.ceil(num_leaves * 0.05)) if num_leaves else 0,
        "training_sample_size": min(count, 100_000),  # ScaNN's builder default
        "reorder": 100,
    }


class ScannIndex(Index):
    """Approximate maximum inner product search with ScaNN (`scann` 1.4).

    Scores: with exact reordering (the default whenever AH scoring is used) or brute-force scoring,
    the returned scores are float32 dot products recomputed against the stored float32 vectors, so
    they match `ExactIndex` up to float rounding; with `reorder=0` they are the AH approximations.
    Which ids come back is approximate (recall < 1), except with brute-force scoring.

    Build with `ScannIndex.build`; the constructor wraps an existing searcher.
    """

    kind = "scann"

    def __init__(
        self,
        searcher,
        *,
        count: int,
        dim: int,
        config: dict,
        encoder_fingerprint: str | None = None,
        corpus_checksum: str | None = None,
    ):
        self.searcher = searcher
        self.count, self.dim = int(count), int(dim)
        self.config = dict(config)
        self.encoder_fingerprint = encoder_fingerprint
        self.corpus_checksum = corpus_checksum

    @classmethod
    def build(
        cls,
        vectors,
        *,
        num_leaves: int | None = None,
        num_leaves_to_search: int | None = None,
        training_sample_size: int | None = None,
        dimensions_per_block: int = 2,
        anisotropic_quantization_threshold: float = 0.2,
        reorder: int | None = None,
        scoring: str | None = None,
        hash_type: str = "lut16",
        training_threads: int = 0,
        encoder_fingerprint: str | None = None,
        corpus_checksum: str | None = None,
    ) -> ScannIndex:
        """Trains a ScaNN searcher on `vectors`; every None takes `scann_defaults(C)`.

        Args:
          vectors: [C, D] passage vectors (stored by ScaNN as float32).
          num_leaves: k-means partitions; 0 disables partitioning.
          num_leaves_to_search: partitions scanned per query (the main speed/recall knob).
          training_sample_size: points sampled to train the partitioner and the AH codebooks.
          dimensions_per_block: AH sub-space width (ScaNN recommends 2).
          anisotropic_quantization_threshold: AH loss weighting for inner products (ScaNN's
            score-aware quantisation); nan disables it.
          reorder: candidates rescored exactly per query (raised to k when k is larger); 0: none.
            Default: 100 with AH scoring, 0 with brute force.
          scoring: "ah" (asymmetric hashing) or "brute_force".
          hash_type: "lut16" (fast in-register lookups) or "lut256".
          training_threads: 0 uses every core.
          encoder_fingerprint: provenance string written to the manifest.
          corpus_checksum: provenance string written to the manifest.
        """
        import scann  # here, not at the top: scann ships Linux wheels only; the rest runs anywhere

        vectors = np.ascontiguousarray(check_vectors(vectors), dtype=np.float32)
        count, dim = vectors.shape
        config = scann_defaults(count)
        if num_leaves:  # a tree asked for on a corpus of any size searches 5% of it by default
            config["num_leaves_to_search"] = max(1, math.ceil(num_leaves * 0.05))
        given = {
            "num_leaves": num_leaves,
            "num_leaves_to_search": num_leaves_to_search,
            "training_sample_size": training_sample_size,
            "reorder": reorder,
            "scoring": scoring,
        }
        config |= {key: value for key, value in given.items() if value is not None}
        if reorder is None:  # ScaNN: rescoring is "highly recommended" whenever AH scores
            config["reorder"] = 100 if config["scoring"] == "ah" else 0
        config["training_sample_size"] = min(count, config["training_sample_size"])
        config |= {
            "dimensions_per_block": dimensions_per_block,
            "anisotropic_quantization_threshold": anisotropic_quantization_threshold,
            "hash_type": hash_type,
        }
        if config["scoring"] not in ("ah", "brute_force"):
            raise ValueError(f"scoring must be 'ah' or 'brute_force', got {config['scoring']!r}")
        if config["num_leaves"] and not 1 <= config["num_leaves_to_search"] <= config["num_leaves"]:
            raise ValueError(
                f"num_leaves_to_search={config['num_leaves_to_search']} must be in "
                f"[1, num_leaves={config['num_leaves']}]"
            )
        # ScaNN wants a default k at build time; `search` always passes its own.
        builder = scann.scann_ops_pybind.builder(vectors, 10, "dot_product")
        if config["num_leaves"]:
            builder = builder.tree(
                config["num_leaves"],
                config["num_leaves_to_search"],
                training_sample_size=config["training_sample_size"],
            )
        if config["scoring"] == "ah":
            builder = builder.score_ah(
                dimensions_per_block,
                anisotropic_quantization_threshold,
                training_sample_size=config["training_sample_size"],
                hash_type=hash_type,
            )
        else:
            builder = builder.score_brute_force()
        if config["reorder"]:
            builder = builder.reorder(config["reorder"])
        builder.set_n_training_threads(training_threads)
        provenance = {
            "encoder_fingerprint": encoder_fingerprint,
            "corpus_checksum": corpus_checksum,
        }
        return cls(builder.build(), count=count, dim=dim, config=config, **provenance)

    @property
    def nbytes(self) -> int:
        """Bytes of the serialised searcher (vectors, codes, codebooks, partitioner)."""
        with tempfile.TemporaryDirectory() as tmp:
            self.searcher.serialize(tmp, True)
            return sum(os.path.getsize(os.path.join(tmp, name)) for name in os.listdir(tmp))

    def search(
        self,
        queries,
        k: int,
        *,
        leaves_to_search: int | None = None,
        reorder: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Approximate top-k by inner product.

        Args:
          queries: [B, D] floating point.
          k: neighbours per query, 1 <= k <= C.
          leaves_to_search: overrides the built `num_leaves_to_search` for this call.
          reorder: overrides the built reordering depth for this call (raised to k).

        Returns:
          (scores [B, k] float32, ids [B, k] int64), descending score.

        Raises:
          RuntimeError: the searched leaves held fewer than k points for some query.
        """
        queries = self._check_queries(queries)
        k = self._check_k(k)
        depth = self.config["reorder"] if reorder is None else reorder
        # Mini-batches spread over the cores, as BLAS and faiss spread a batch.
        ids, scores = self.searcher.search_batched_parallel(
            queries,
            k,
            max(depth, k) if depth else None,
            leaves_to_search,
            batch_size=-(-len(queries) // (os.cpu_count() or 1)),
        )
        # ScaNN pads a short result with nan scores and id 0; returning those would be a silent lie.
        found = np.isfinite(scores).sum(axis=1)
        if (found < k).any():
            row = int(np.argmin(found))
            raise RuntimeError(
                f"ScaNN found {found[row]} < k={k} neighbours for query row {row}: the searched "
                f"leaves are too few (num_leaves_to_search="
                f"{leaves_to_search or self.config['num_leaves_to_search']} of "
                f"{self.config['num_leaves']}); search more leaves or lower k"
            )
        return scores.astype(np.float32, copy=False), ids.astype(np.int64)

    def save(self, directory: str) -> None:
        """Writes ScaNN's serialised searcher and `manifest.json` to `directory`."""

        # Relative asset paths, so the folder can be moved or copied.
        write_fn = lambda tmp: self.searcher.serialize(tmp, True)
        files.swap_dir(
            directory, write_fn, self._manifest("float32", scann=self.config), what="index"
        )

    @classmethod
    def load(cls, directory: str, expect: dict | None = None, *, verify: bool = True) -> ScannIndex:
        """Reads an index written by `ScannIndex.save`; see `ExactIndex.load` for the arguments."""
        import scann

        directory = os.fspath(directory)
        manifest = read_manifest(directory, expect, kinds=("scann",))
        for name, record in manifest["files"].items():  # before ScaNN's reader meets a bad file
            files.check_file(
                os.path.join(directory, name), record, verify=verify, what="index file"
            )
        return cls(
            scann.scann_ops_pybind.load_searcher(directory),
            count=manifest["count"],
            dim=manifest["dim"],
            config=manifest["scann"],
            **provenance(manifest),
        )


def load(directory: str, expect: dict | None = None, *, verify: bool = True) -> Index:
    """Reads any host index folder, choosing `ExactIndex` or `ScannIndex` by its manifest kind."""
    kind = read_manifest(directory, None, kinds=("exact", "scann"))["kind"]
    cls = {"exact": ExactIndex, "scann": ScannIndex}[kind]
    return cls.load(directory, expect, verify=verify)
