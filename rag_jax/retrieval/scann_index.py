"""`ScannIndex`: approximate maximum inner product search on the host with Google's ScaNN.

ScaNN partitions the vectors into k-means leaves, scores the candidates of the leaves searched by
anisotropic hashing, and rescores the best of them exactly; `scann_defaults` picks its settings
from the corpus size after ScaNN's rules of thumb. It is the host path for any corpus size.
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
from rag_jax.retrieval.index_format import new_manifest, provenance, read_manifest


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
            directory, write_fn, new_manifest(self, "float32", scann=self.config), what="index"
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
