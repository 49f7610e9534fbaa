"""`ScannIndex`: approximate maximum inner product search on the host with Google's ScaNN.

ScaNN partitions the vectors into k-means leaves, scores the candidates of the leaves searched by
anisotropic hashing, and rescores the best of them exactly; `scann_defaults` picks its settings
from the corpus size after ScaNN's rules of thumb. It is the host path for any corpus size.

Two ways to build, chosen from the corpus size (`scann_defaults`'s "build"):

- "whole" (below `SAMPLE_BUILD_MIN` vectors): ScaNN is given every vector as float32 and keeps
  that copy to rescore its candidates (`dataset.npy` in the folder).
- "sample" (from `SAMPLE_BUILD_MIN` on, the 1M-21M passages of Wikipedia): the partitioner and
  the AH codebooks are trained on a random sample, and the other vectors are added to the
  searcher in batches (ScaNN's `upsert`), read block by block from the stored vectors (a
  memory-mapped float16 file stays on disk). ScaNN then holds only the leaves and the AH codes
  (one byte per two dimensions: 384 bytes a 768-d vector, 8 GB at 21M); the candidates it returns
  are rescored here in float32 against the stored vectors (float16/bfloat16 rows gathered from
  the map), so no float32 copy of the corpus exists at build or search time. The folder holds
  ScaNN's files, the stored vectors (`vectors.bin`, memory-mapped on load) and the order in which
  the vectors entered the searcher (`ids.npy`: row r of ScaNN is passage ids[r]).
`rag_jax.retrieval.index` re-exports the class (`index.ScannIndex`, the public name), and its
`load` reads a ScaNN folder as well as an exact one.

Legend: B batch of queries, C corpus size (passages), D embedding width, k neighbours per query.
"""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np

from rag_jax.retrieval import files
from rag_jax.retrieval.index_base import Index, check_vectors
from rag_jax.retrieval.index_format import (
    VECTORS,
    load_vectors,
    new_manifest,
    provenance,
    read_manifest,
)

SAMPLE_BUILD_MIN = 500_000  # from here a float32 copy of 768-d vectors passes 1.5 GB
AH_FROM = 20_000  # ScaNN: brute force below ~20k points, asymmetric hashing from there
TREE_FROM = 100_000  # ScaNN: partition into ~sqrt(C) leaves from ~100k points
ADD_BATCH = 65_536  # rows added to a sample-trained searcher per call (192 MB of float32 at 768)
_GATHER_QUERIES = 64  # queries rescored together: [64, reorder, D] float32 candidates at a time


def scann_defaults(count: int) -> dict:
    """ScaNN settings for a corpus of C=`count` vectors, after ScaNN's rules of thumb.

    ScaNN's guidance (docs/algorithms.md): brute force below ~20k points; asymmetric hashing (AH)
    plus exact reordering below ~100k; above that also partition into ~sqrt(C) leaves;
    `dimensions_per_block=2` for AH. ScaNN leaves the leaves searched and the reordering depth to
    the user; the defaults here, 5% of the leaves and 100 candidates, are the proportions of the
    ScaNN README's example (100 of 2,000 leaves, reorder 100). On 200k clustered 768-d vectors
    (benchmarks/index.py) they give recall@10 0.99; half the leaves gives 0.96. `tune` raises
    them on held-out queries where they miss a recall target, and a build to a recall target
    (`scann_recall.build_to_recall`, what `experiments/build_index.py` runs) starts from them.

    From `SAMPLE_BUILD_MIN` vectors the build trains on a sample ("build": "sample"): at least
    ScaNN's 100k, and 64 points per leaf (k-means needs tens of points a centre; at 21M,
    4,584 leaves: 293k points, 900 MB of float32 at 768-d), at most `count`.

    Returns:
      {"scoring": "brute_force" | "ah", "num_leaves": int (0: no tree), "num_leaves_to_search",
       "training_sample_size", "reorder": int (0: no reordering), "build": "whole" | "sample"}.
    """
    if count < AH_FROM:
        return {
            "scoring": "brute_force",
            "num_leaves": 0,
            "num_leaves_to_search": 0,
            "training_sample_size": count,
            "reorder": 0,
            "build": "whole",
        }
    num_leaves = round(math.sqrt(count)) if count >= TREE_FROM else 0
    sample = count >= SAMPLE_BUILD_MIN
    return {
        "scoring": "ah",
        "num_leaves": num_leaves,
        "num_leaves_to_search": max(1, math.ceil(num_leaves * 0.05)) if num_leaves else 0,
        # ScaNN's builder default, or 64 points a leaf when training on a sample
        "training_sample_size": min(count, max(100_000, 64 * num_leaves if sample else 0)),
        "reorder": 100,
        "build": "sample" if sample else "whole",
    }


class ScannIndex(Index):
    """Approximate maximum inner product search with ScaNN (`scann` 1.4).

    Scores: with exact reordering (the default whenever AH scoring is used) or brute-force scoring,
    the returned scores are float32 dot products recomputed against the stored vectors (ScaNN's
    float32 copy, or, for a sample-trained build, the stored float16/bfloat16/float32 rows), so
    they match `ExactIndex` up to float rounding; with `reorder=0` they are the AH approximations.
    Which ids come back is approximate (recall < 1), except with brute-force scoring.

    Build with `ScannIndex.build`; the constructor wraps an existing searcher.

    Attributes:
      searcher: ScaNN's searcher.
      config: the settings (`scann_defaults`' fields and the AH ones).
      vectors: [C, D] stored vectors a sample-trained index rescores against (None otherwise).
      ids: [C] int64, passage id of each searcher row of a sample-trained index (None otherwise).
      measured_recall: what a build to a recall target measured at these settings (the
        `scann_recall.measure` record: recall@k on held-out queries, their number and kind),
        saved in the manifest; None when not measured or when the settings changed since.
    """

    kind = "scann"

    def __init__(
        self,
        searcher,
        *,
        count: int,
        dim: int,
        config: dict,
        vectors: np.ndarray | None = None,
        ids: np.ndarray | None = None,
        encoder_fingerprint: str | None = None,
        corpus_checksum: str | None = None,
        measured_recall: dict | None = None,
    ):
        self.searcher = searcher
        self.count, self.dim = int(count), int(dim)
        self.config = dict(config)
        self.config.setdefault("build", "whole")  # folders written before sample builds
        if (self.config["build"] == "sample") != (vectors is not None and ids is not None):
            raise ValueError("a sample-trained ScaNN index needs its stored vectors and row ids")
        self.vectors, self.ids = vectors, ids
        self.encoder_fingerprint = encoder_fingerprint
        self.corpus_checksum = corpus_checksum
        self.measured_recall = None if measured_recall is None else dict(measured_recall)

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
        build: str | None = None,
        spherical: bool | None = None,
        training_iterations: int | None = None,
        seed: int = 0,
        encoder_fingerprint: str | None = None,
        corpus_checksum: str | None = None,
    ) -> ScannIndex:
        """Trains a ScaNN searcher on `vectors`; every None takes `scann_defaults(C)`.

        Args:
          vectors: [C, D] passage vectors. A "whole" build gives ScaNN a float32 copy; a "sample"
            build reads them block by block and keeps a reference to rescore against, so pass
            a memory-mapped array (`vectors.load_vectors`, `np.load(mmap_mode="r")`) to keep
            them on disk.
          num_leaves: k-means partitions; 0 disables partitioning.
          num_leaves_to_search: partitions scanned per query (the main speed/recall knob).
          training_sample_size: points sampled to train the partitioner and the AH codebooks
            (a "sample" build draws them once, with `seed`, and ScaNN trains on all of them).
          dimensions_per_block: AH sub-space width (ScaNN recommends 2).
          anisotropic_quantization_threshold: AH loss weighting for inner products (ScaNN's
            score-aware quantisation); nan disables it.
          reorder: candidates rescored exactly per query (raised to k when k is larger); 0: none.
            Default: 100 with AH scoring, 0 with brute force.
          scoring: "ah" (asymmetric hashing) or "brute_force".
          hash_type: "lut16" (fast in-register lookups) or "lut256".
          training_threads: 0 uses every core.
          build: "whole" or "sample" (train on a sample, add the rest in batches; AH only).
          spherical: spherical k-means for the tree (unit centres, assignment by cosine), which
            partitions unit vectors far better: on 1M clustered unit vectors (benchmarks/scale.py)
            recall@10 searching 5% of the leaves rose from 0.89 to 0.99. None: when the vectors
            are unit-norm (`is_unit_norm` of the training sample), as normalised encoders (all-
            MiniLM, e5, bge) produce them; DPR's unnormalised vectors keep ScaNN's default.
          training_iterations: k-means iterations of the tree (None: ScaNN's 12).
          seed: draws a "sample" build's training sample.
          encoder_fingerprint: provenance string written to the manifest.
          corpus_checksum: provenance string written to the manifest.
        """
        import scann  # here, not at the top: scann ships Linux wheels only; the rest runs anywhere

        vectors = check_vectors(vectors)
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
            "build": build,
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
        if config["build"] not in ("whole", "sample"):
            raise ValueError(f"build must be 'whole' or 'sample', got {config['build']!r}")
        if config["build"] == "sample" and config["scoring"] != "ah":
            raise ValueError("build='sample' needs scoring='ah' (brute force keeps every vector)")
        if config["num_leaves"] and not 1 <= config["num_leaves_to_search"] <= config["num_leaves"]:
            raise ValueError(
                f"num_leaves_to_search={config['num_leaves_to_search']} must be in "
                f"[1, num_leaves={config['num_leaves']}]"
            )
        sample = config["build"] == "sample"
        if sample:
            rng = np.random.default_rng(seed)
            sample_ids = np.sort(rng.choice(count, config["training_sample_size"], replace=False))
            data = _gather(vectors, sample_ids)  # -> [sample, D] float32
        else:
            data = np.ascontiguousarray(vectors, dtype=np.float32)
        # ScaNN wants a default k at build time; `search` always passes its own.
        builder = scann.scann_ops_pybind.builder(data, 10, "dot_product")
        if config["num_leaves"]:
            config["spherical"] = bool(is_unit_norm(data) if spherical is None else spherical)
            iterations = {}
            if training_iterations is not None:
                iterations["training_iterations"] = config["training_iterations"] = int(
                    training_iterations
                )
            builder = builder.tree(
                config["num_leaves"],
                config["num_leaves_to_search"],
                training_sample_size=config["training_sample_size"],
                spherical=config["spherical"],
                **iterations,
            )
        if config["scoring"] == "ah":
            builder = builder.score_ah(
                dimensions_per_block,
                anisotropic_quantization_threshold,
                training_sample_size=min(config["training_sample_size"], 100_000),
                hash_type=hash_type,
            )
        else:
            builder = builder.score_brute_force()
        if config["reorder"] and not sample:  # a sample build rescores from `vectors` itself
            builder = builder.reorder(config["reorder"])
        builder.set_n_training_threads(training_threads)
        searcher = builder.build()
        del data
        provenance = {
            "encoder_fingerprint": encoder_fingerprint,
            "corpus_checksum": corpus_checksum,
        }
        if not sample:
            return cls(searcher, count=count, dim=dim, config=config, **provenance)
        ids = _add_the_rest(searcher, vectors, sample_ids)
        return cls(
            searcher, count=count, dim=dim, config=config, vectors=vectors, ids=ids, **provenance
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the serialised index (ScaNN's files, plus a sample build's vectors and ids)."""
        with tempfile.TemporaryDirectory() as tmp:
            self.searcher.serialize(tmp, True)
            size = sum(os.path.getsize(os.path.join(tmp, name)) for name in os.listdir(tmp))
        if self.vectors is not None:
            size += self.vectors.nbytes + self.ids.nbytes
        return size

    def with_search_settings(
        self, *, num_leaves_to_search: int | None = None, reorder: int | None = None
    ) -> ScannIndex:
        """The same searcher with other query-time defaults (a new index, whose recall is not
        measured; this one is unchanged).

        Raises:
          ValueError: leaves outside [1, num_leaves], or a reordering depth ScaNN cannot change
            (a "whole" build without reordering keeps no float vectors to rescore against).
        """
        config = dict(self.config)
        if num_leaves_to_search is not None:
            if not 1 <= num_leaves_to_search <= max(1, config["num_leaves"]):
                raise ValueError(
                    f"num_leaves_to_search={num_leaves_to_search} must be in "
                    f"[1, num_leaves={config['num_leaves']}]"
                )
            config["num_leaves_to_search"] = int(num_leaves_to_search)
        if reorder is not None:
            if reorder and not config["reorder"] and config["build"] == "whole":
                raise ValueError("this index was built without reordering; build it with reorder")
            config["reorder"] = int(reorder)
        provenance = {
            "encoder_fingerprint": self.encoder_fingerprint,
            "corpus_checksum": self.corpus_checksum,
        }
        return ScannIndex(
            self.searcher,
            count=self.count,
            dim=self.dim,
            config=config,
            vectors=self.vectors,
            ids=self.ids,
            **provenance,
        )

    def with_measured_recall(self, record: dict) -> ScannIndex:
        """The same index carrying `record` (`scann_recall.measure`'s) as its `measured_recall`."""
        copy = self.with_search_settings()
        copy.measured_recall = dict(record)
        return copy

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
        if leaves_to_search is None and self.config["num_leaves"]:
            leaves_to_search = self.config["num_leaves_to_search"]
        sample = self.config["build"] == "sample"
        # A sample build's searcher has no reordering: asked for `depth` neighbours, it returns
        # the best `depth` by AH score, rescored below.
        final = max(depth, k) if sample else k
        pre = None if sample or not depth else max(depth, k)
        # Mini-batches spread over the cores, as BLAS and faiss spread a batch.
        rows, scores = self.searcher.search_batched_parallel(
            queries,
            final,
            pre,
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
        if not sample:
            return scores.astype(np.float32, copy=False), rows.astype(np.int64)
        ids = self.ids[rows]  # -> [B, final]
        if depth:
            scores = self._rescore(queries, ids, np.isfinite(scores))
        return _best(scores.astype(np.float32, copy=False), ids, k)

    def _rescore(self, queries: np.ndarray, ids: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """float32 dot products of `queries` [B, D] with the stored rows `ids` [B, R] -> [B, R];
        -inf where not `valid` (ScaNN's padding)."""
        scores = np.full(ids.shape, -np.inf, np.float32)
        for start in range(0, len(ids), _GATHER_QUERIES):
            block = ids[start : start + _GATHER_QUERIES]
            rows = _gather(self.vectors, block.ravel()).reshape(*block.shape, self.dim)
            part = np.einsum("bd,brd->br", queries[start : start + _GATHER_QUERIES], rows)
            scores[start : start + _GATHER_QUERIES] = part  # -> [b, R]
        return np.where(valid, scores, -np.inf)

    def save(self, directory: str) -> None:
        """Writes ScaNN's serialised searcher and `manifest.json` to `directory` (and, for a
        sample-trained index, `vectors.bin` and `ids.npy`, written block by block)."""

        def write_fn(tmp):
            # Relative asset paths, so the folder can be moved or copied.
            self.searcher.serialize(tmp, True)
            if self.vectors is not None:
                with open(os.path.join(tmp, VECTORS), "wb") as f:
                    rows = max(1, files.IO_BLOCK // (self.dim * self.vectors.itemsize))
                    for start in range(0, self.count, rows):
                        block = np.ascontiguousarray(self.vectors[start : start + rows])
                        little = block.astype(block.dtype.newbyteorder("<"), copy=False)
                        files.write_bytes(f, little.view(np.uint8))
                np.save(os.path.join(tmp, _IDS), self.ids.astype("<i8", copy=False))

        dtype = "float32" if self.vectors is None else self.vectors.dtype.name
        manifest = new_manifest(self, dtype, scann=self.config)
        if self.measured_recall is not None:
            manifest["measured_recall"] = self.measured_recall
        files.swap_dir(directory, write_fn, manifest, what="index")

    @classmethod
    def load(cls, directory: str, expect: dict | None = None, *, verify: bool = True) -> ScannIndex:
        """Reads an index written by `ScannIndex.save`; see `ExactIndex.load` for the arguments.
        A sample-trained index's vectors are memory-mapped, not read."""
        import scann

        directory = os.fspath(directory)
        manifest = read_manifest(directory, expect, kinds=("scann",))
        for name, record in manifest["files"].items():  # before ScaNN's reader meets a bad file
            if name != VECTORS:  # load_vectors checks it
                files.check_file(
                    os.path.join(directory, name), record, verify=verify, what="index file"
                )
        vectors = ids = None
        if manifest["scann"].get("build") == "sample":
            _, vectors = load_vectors(directory, expect, verify, kinds=("scann",), mmap=True)
            ids = np.load(os.path.join(directory, _IDS))
            if ids.shape != (manifest["count"],) or ids.dtype != np.int64:
                raise ValueError(
                    f"{os.path.join(directory, _IDS)} holds {ids.dtype} {ids.shape}, not the "
                    f"int64 [{manifest['count']}] row ids its manifest needs"
                )
        return cls(
            scann.scann_ops_pybind.load_searcher(directory),
            count=manifest["count"],
            dim=manifest["dim"],
            config=manifest["scann"],
            vectors=vectors,
            ids=ids,
            measured_recall=manifest.get("measured_recall"),
            **provenance(manifest),
        )


def tune(
    ix: ScannIndex, queries, true_ids: np.ndarray, *, recall: float = 0.95, k: int = 10
) -> tuple[ScannIndex, float]:
    """The cheapest of a ladder of query-time settings reaching `recall`@k on held-out queries.

    Leaves searched rise from the index's own through 1.5x, 2x, 3x, 4x, 6x, 8x (capped at all
    leaves), then the reordering depth doubles at 8x; the first setting whose recall@k against
    `true_ids` (exact search's) reaches `recall` is kept. Without a tree, the depth alone rises.

    Args:
      ix: the index, whose settings are the ladder's first rung.
      queries: [Q, D] held-out queries (not rows of the index).
      true_ids: [Q, k] exact top-k ids of `queries`.
      recall: the target.
      k: neighbours per query.

    Returns:
      (the index with the settings reached, `ScannIndex.with_search_settings`; its recall@k).
      When no rung reaches `recall`, the best one, whose recall says so.
    """
    best = (None, -1.0)
    for leaves, depth in search_ladder(ix.config):
        candidate = ix.with_search_settings(num_leaves_to_search=leaves, reorder=depth)
        got = recall_at_k(candidate.search(queries, k)[1], true_ids)
        if got > best[1]:
            best = (candidate, got)
        if got >= recall:
            break
    return best


def search_ladder(config: dict) -> list[tuple[int | None, int]]:
    """`tune`'s query-time settings for an index of ScaNN settings `config`, cheapest first,
    each once: [(num_leaves_to_search (None without a tree), reorder)]."""
    leaves, depth = config["num_leaves_to_search"], config["reorder"]
    if config["num_leaves"]:
        ladder = [(min(round(leaves * f), config["num_leaves"]), depth) for f in _LEAF_STEPS]
        ladder += [(ladder[-1][0], 2 * depth), (ladder[-1][0], 4 * depth)]
    else:
        ladder = [(None, depth * f) for f in (1, 2, 4, 8)]
    return list(dict.fromkeys(ladder))


def is_unit_norm(vectors: np.ndarray, rows: int = 10_000, tolerance: float = 1e-2) -> bool:
    """Whether `vectors` [C, D] (up to `rows` of them, evenly spaced) all have norm 1 within
    `tolerance`."""
    step = max(1, len(vectors) // rows)
    norms = np.linalg.norm(np.asarray(vectors[::step], np.float32), axis=1)
    return bool(len(norms)) and bool(np.all(np.abs(norms - 1) <= tolerance))


def recall_at_k(ids: np.ndarray, true_ids: np.ndarray) -> float:
    """Mean fraction of each row's true ids found among its returned ids; both [Q, k]."""
    return float(np.mean(recall_per_query(ids, true_ids)))


def recall_per_query(ids: np.ndarray, true_ids: np.ndarray) -> np.ndarray:
    """[Q] float64: the fraction of each row's true ids found among its returned ids; both
    [Q, k]."""
    return np.array([len(set(a) & set(b)) / len(b) for a, b in zip(ids, true_ids)])


def _gather(vectors: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` [R] of `vectors` as float32 [R, D], read in sorted order (a memory-mapped file
    is then read forward, and each page once)."""
    order = np.argsort(ids, kind="stable")
    out = np.empty((len(ids), vectors.shape[1]), np.float32)
    out[order] = vectors[ids[order]]
    return out


def _add_the_rest(searcher, vectors: np.ndarray, sample_ids: np.ndarray) -> np.ndarray:
    """Adds every row of `vectors` not in `sample_ids` to `searcher` (whose rows are the sample),
    `ADD_BATCH` rows per call, reading the rows block by block; returns the [C] passage id of each
    searcher row."""
    count = len(vectors)
    rest = np.ones(count, bool)
    rest[sample_ids] = False
    searcher.reserve(count)
    for start in range(0, count, ADD_BATCH):
        keep = rest[start : start + ADD_BATCH]
        block = np.asarray(vectors[start : start + ADD_BATCH])[keep].astype(np.float32)
        if len(block):
            # None: a new row (ScaNN appends it); the raw searcher, since the Python wrapper
            # insists on string docids for updates.
            searcher.searcher.upsert([None] * len(block), block, 4096)
    ids = np.concatenate([sample_ids, np.flatnonzero(rest)]).astype(np.int64)
    if searcher.size() != count:
        raise RuntimeError(f"ScaNN holds {searcher.size()} vectors after adding {count}")
    return ids


def _best(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of each row of (scores, ids) [B, R]: descending score, lower id first."""
    order = np.lexsort((ids, -scores), axis=1)[:, :k]
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


_LEAF_STEPS = (1, 1.5, 2, 3, 4, 6, 8)
_IDS = "ids.npy"
