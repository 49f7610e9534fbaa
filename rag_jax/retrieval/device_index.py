"""`DeviceIndex`: passage vectors sharded over a mesh axis, searched inside XLA programs.

Legend: B batch of queries, C corpus size (C' padded to the devices), D embedding width, k
neighbours per query, n devices on the axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rag_jax.retrieval.index_base import Index, check_query_shape, check_vectors
from rag_jax.retrieval.index_format import load_vectors, provenance, save_vectors


def _device_search(
    vectors, scales, queries, *, count, k, mesh, axis, recall_target, precision, block_rows
):
    """Top-k over `vectors` [C', D] sharded on `axis` (C' = C padded), `queries` [B, D] replicated.
    With `scales` [C'] (sharded as the rows), `vectors` are int8 codes and row c scores
    `(q . codes[c]) * scales[c]`.

    Each shard is scored `block_rows` rows at a time with a running top-k, so the temporaries are
    [B, block_rows] scores and one float32 block rather than [B, C' / n] scores. (XLA's CPU
    backend, which has no bfloat16 matmul, still converts a bfloat16 shard to float32 whole.)

    Returns (scores [B, k] float32, ids [B, k] int32), replicated.
    """
    shard_rows = vectors.shape[0] // mesh.shape[axis]
    local_k = min(k, shard_rows)
    block = min(max(block_rows, k), shard_rows)  # every block but the last yields local_k rows
    full, rest = divmod(shard_rows, block)

    def per_shard(shard, shard_scales, queries):  # shard: [C' / n, D], queries: [B, D]
        queries = queries.astype(jnp.float32)
        start = jax.lax.axis_index(axis) * shard_rows

        def block_top(first, rows):  # rows [R, D] of the shard, from its row `first`
            scores = jnp.einsum(
                "bd,cd->bc", queries, rows.astype(jnp.float32), precision=precision
            )  # -> [B, R]
            if shard_scales is not None:
                size = rows.shape[0]
                scores *= jax.lax.dynamic_slice_in_dim(shard_scales, first, size)[None, :]
            ids = start + first + jnp.arange(rows.shape[0], dtype=jnp.int32)
            scores = jnp.where(ids < count, scores, -jnp.inf)  # padding rows never win
            top = min(local_k, rows.shape[0])
            if recall_target is None:
                scores, pos = jax.lax.top_k(scores, top)  # -> [B, top]
            else:
                scores, pos = jax.lax.approx_max_k(scores, top, recall_target=recall_target)
            return scores, ids[pos]

        def merge(best, new):
            # The running best (lower ids) comes first and top_k keeps the lower position among
            # ties, so ties resolve to the lower id, as in ExactIndex.
            scores = jnp.concatenate([best[0], new[0]], axis=1)
            ids = jnp.concatenate([best[1], new[1]], axis=1)
            scores, pos = jax.lax.top_k(scores, local_k)
            return scores, jnp.take_along_axis(ids, pos, axis=1)

        def body(i, best):
            first = i * block
            return merge(best, block_top(first, jax.lax.dynamic_slice_in_dim(shard, first, block)))

        best = block_top(0, shard[:block])
        best = jax.lax.fori_loop(1, full, body, best) if full > 1 else best
        if rest:
            best = merge(best, block_top(full * block, shard[full * block :]))
        # Shards are gathered in id order and top_k keeps the lower position among ties.
        gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True, to="invarying")
        scores, ids = gather(best[0]), gather(best[1])  # -> [B, n * local_k]
        scores, pos = jax.lax.top_k(scores, k)  # -> [B, k]
        return scores, jnp.take_along_axis(ids, pos, axis=1)

    scale_spec = None if scales is None else P(axis)
    specs = {"in_specs": (P(axis, None), scale_spec, P()), "out_specs": (P(), P())}
    return jax.shard_map(per_shard, mesh=mesh, **specs)(vectors, scales, queries)


_STATIC = ("count", "k", "mesh", "axis", "recall_target", "precision", "block_rows")
_device_search_jit = jax.jit(_device_search, static_argnames=_STATIC)
STORAGES = ("", "int8")
_QUANTIZE_ROWS = 65536


def quantize_int8(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8: `vectors` [R, D] -> (codes [R, D] int8, scales [R] float32) with
    scale = max_d |x_d| / 127 and codes = round(x / scale), so each row is codes * scale within
    scale / 2 per coordinate. An all-zero row gets scale 0 (and scores 0)."""
    codes = np.empty(vectors.shape, np.int8)
    scales = np.empty(len(vectors), np.float32)
    for start in range(0, len(vectors), _QUANTIZE_ROWS):  # float32 one block at a time
        rows = np.asarray(vectors[start : start + _QUANTIZE_ROWS], np.float32)
        scale = np.abs(rows).max(axis=1) / np.float32(127)
        safe = np.where(scale > 0, scale, np.float32(1))[:, None]
        codes[start : start + len(rows)] = np.clip(np.rint(rows / safe), -127, 127)
        scales[start : start + len(rows)] = scale
    return codes, scales


def _check_storage(storage: str) -> None:
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")


@jax.tree_util.register_pytree_node_class
class DeviceIndex(Index):
    """Passage vectors sharded over a mesh axis; search is part of the XLA program.

    Each device holds C'/n rows (C' = C rounded up to a multiple of the n devices on `axis`; the
    padding rows are masked to -inf by id, so they never win). Queries are replicated: every device
    scores the whole batch against its shard, `block_rows` rows at a time, keeps its k best
    (`lax.approx_max_k`, the TPU-KNN partial reduction, on TPU; `lax.top_k` elsewhere; merged
    block by block), and the n * k candidates are all-gathered and merged with `lax.top_k`. A
    batch sharded over the same axis in the caller is gathered by `shard_map` on entry; that is
    B x D, small next to a shard.

    `search` takes numpy (host protocol: int64 ids, argument checks, numpy out) or jax arrays,
    tracers included (returns jax arrays, int32 ids), so it works inside `jax.jit`. The index is a
    pytree whose only leaf is the sharded vectors: pass it as an argument of a jitted function
    rather than closing over it, so the vectors are not baked into the program as a constant and a
    same-shaped replacement index reuses the compilation.

    On CPU (float32 matmuls, exact top-k) results equal `ExactIndex`, ties included. On TPU the
    DEFAULT matmul precision is bfloat16 and approx_max_k misses some neighbours (recall_target);
    pass `precision=jax.lax.Precision.HIGHEST` for float32 scores.

    Multi-host: the mesh may span every device of every process (`sharding.data_mesh()` after
    `distributed.maybe_initialize_distributed()`), so a corpus too large for one host's
    accelerators is split over the whole pod. Every process constructs the index with the same
    `vectors` (a `np.memmap` of the vectors file keeps the corpus out of host memory: each
    process copies only the rows of its own devices' shards) and the same mesh, and every search
    is one collective program that all processes run together: in a jitted step, pass the global
    question batch (e.g. sharded over `data`); with numpy queries, every process must pass the
    same queries (checked) and gets the same results.

    `storage="int8"` keeps each row as int8 codes with a float32 scale (`quantize_int8`:
    scale = max |x| / 127), a quarter of float32's bytes and half of bfloat16's (21M x 768: 16.2
    GB over the devices, 2.0 GB a v5e-8 chip), and scores a row as (q . codes) * scale. The ids
    are then those of the quantised vectors: approximate, like approx_max_k's (the recall is
    measured against exact search in tests/retrieval/device_index_test.py). The doc scores
    RAG trains on come from the host's vectors of the retrieved ids, not from the codes.
    """

    kind = "exact"  # on disk it is an exact index: the same vectors file and manifest
    _AUX = ("count", "dim", "mesh", "axis", "recall_target", "precision", "block_rows")
    _AUX += ("encoder_fingerprint", "corpus_checksum")

    def __init__(
        self,
        vectors,
        mesh: jax.sharding.Mesh,
        axis: str = "data",
        *,
        recall_target: float | None = None,
        precision=None,
        block_rows: int = 65536,
        storage: str = "",
        encoder_fingerprint: str | None = None,
        corpus_checksum: str | None = None,
    ):
        """Args:
        vectors: [C, D] passage vectors on the host (see `check_vectors`); storage dtype kept.
          On several processes each process passes the same vectors and places only the rows of
          its own devices.
        mesh: device mesh, possibly spanning processes; vectors are sharded over `axis`,
          replicated over the others.
        axis: mesh axis to shard the corpus over.
        recall_target: per-shard `lax.approx_max_k` recall target. None: 0.95 on TPU, and an
          exact `lax.top_k` elsewhere, where approx_max_k is also exact but leaves the order of
          equal scores unspecified.
        precision: `jax.lax.Precision` of the score matmul.
        block_rows: rows of a shard scored at once (at least k): bounds the search's temporary
          memory per device to about `B * block_rows` scores plus `block_rows * D` float32.
        storage: "" keeps the vectors' dtype on the devices; "int8": int8 codes and a float32
          scale per row, quantised shard by shard (no quantised copy of the whole corpus on
          the host).
        encoder_fingerprint: provenance string written to the manifest.
        corpus_checksum: provenance string written to the manifest.
        """
        vectors = check_vectors(vectors)
        _check_storage(storage)
        if axis not in mesh.shape:
            raise ValueError(f"mesh has axes {tuple(mesh.shape)}, not {axis!r}")
        count, dim = vectors.shape
        padded = -(-count // mesh.shape[axis]) * mesh.shape[axis]

        def rows(index):  # One device's shard: rows [start, stop) of the padded [C', D].
            start, stop, _ = index[0].indices(padded)
            shard = vectors[min(start, count) : min(stop, count)]
            pad = np.zeros((stop - start - len(shard), dim), vectors.dtype)
            return np.concatenate([shard, pad]) if len(pad) else shard

        # Built from each device's rows (not `device_put` of the whole array) so that no padded
        # copy of the corpus is made and, on a pod, each process copies only its own shards.
        placed = NamedSharding(mesh, P(axis, None))
        self.scales = None
        if storage == "int8":
            quantised = {}  # shard start -> (codes, scales): each shard read and quantised once

            def part(index, which):
                start = index[0].indices(padded)[0]
                if start not in quantised:
                    quantised[start] = quantize_int8(rows(index))
                return quantised[start][which]

            self.vectors = jax.make_array_from_callback(
                (padded, dim), placed, lambda index: part(index, 0)
            )  # -> [C', D] int8
            self.scales = jax.make_array_from_callback(
                (padded,), NamedSharding(mesh, P(axis)), lambda index: part(index, 1)
            )  # -> [C'] float32
        else:
            self.vectors = jax.make_array_from_callback((padded, dim), placed, rows)  # [C', D]
        self._set(count, dim, mesh, axis, recall_target, precision, block_rows)
        self.encoder_fingerprint = encoder_fingerprint
        self.corpus_checksum = corpus_checksum

    def _set(self, count, dim, mesh, axis, recall_target, precision, block_rows):
        self.count, self.dim, self.mesh, self.axis = count, dim, mesh, axis
        if recall_target is None and mesh.devices.flat[0].platform == "tpu":
            recall_target = 0.95
        self.recall_target = None if recall_target is None else float(recall_target)
        self.precision = precision
        if int(block_rows) < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")
        self.block_rows = int(block_rows)

    @classmethod
    def abstract(cls, count: int, dim: int, dtype, mesh, axis: str = "data", **options):
        """An index of `count` x `dim` vectors of `dtype` whose leaf is a `jax.ShapeDtypeStruct`
        (placed as the constructor places the vectors): a program that searches it compiles,
        e.g. for a TPU topology, without the vectors existing (`benchmarks.aot`). `options`:
        the constructor's `recall_target`, `precision`, `block_rows` and `storage` (with
        "int8", `dtype` is the vectors' before quantisation and is not used)."""
        options = {"recall_target": None, "precision": None, "block_rows": 65536, **options}
        storage = options.pop("storage", "")
        _check_storage(storage)
        int8 = storage == "int8"
        if axis not in mesh.shape:
            raise ValueError(f"mesh has axes {tuple(mesh.shape)}, not {axis!r}")
        padded = -(-count // mesh.shape[axis]) * mesh.shape[axis]
        index = object.__new__(cls)
        index.vectors = jax.ShapeDtypeStruct(
            (padded, dim), jnp.int8 if int8 else dtype, sharding=NamedSharding(mesh, P(axis, None))
        )  # -> [C', D]
        index.scales = (
            jax.ShapeDtypeStruct((padded,), jnp.float32, sharding=NamedSharding(mesh, P(axis)))
            if int8
            else None
        )  # -> [C']
        index._set(count, dim, mesh, axis, **options)
        index.encoder_fingerprint = index.corpus_checksum = None
        return index

    def tree_flatten(self):
        return (self.vectors, self.scales), tuple(getattr(self, name) for name in self._AUX)

    @classmethod
    def tree_unflatten(cls, aux, children):
        index = object.__new__(cls)  # leaves may be tracers: no checks, no device_put
        index.vectors, index.scales = children
        for name, value in zip(cls._AUX, aux):
            setattr(index, name, value)
        return index

    @property
    def storage(self) -> str:
        """ "int8" when the rows are codes with scales, else "" (the vectors' own dtype)."""
        return "" if self.scales is None else "int8"

    @property
    def nbytes(self) -> int:
        return self.vectors.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def search(self, queries, k: int):
        """Top-k by inner product, on the devices.

        Args:
          queries: [B, D]: a numpy array (host call) or a jax array / tracer (in-graph call).
          k: neighbours per query, 1 <= k <= C (static).

        Returns:
          (scores [B, k] float32, ids [B, k]): numpy with int64 ids for numpy queries; jax arrays
          with int32 ids, replicated over the mesh, for jax queries. Lower id first on ties.
        """
        k = self._check_k(k)
        if not isinstance(queries, jax.Array):
            queries = self._check_queries(queries)
            if not self.vectors.is_fully_addressable:
                # Replicated placement assumes equal values everywhere; a process with other
                # queries would silently get answers to some other process's questions.
                multihost_utils.assert_equal(
                    queries,
                    "DeviceIndex.search with numpy queries on several processes needs "
                    "the same queries on every process",
                )
            queries = jax.device_put(queries, NamedSharding(self.mesh, P()))
            scores, ids = self.search(queries, k)
            return np.asarray(scores), np.asarray(ids).astype(np.int64)
        check_query_shape(queries.shape, self.count, self.dim)
        static = {name: getattr(self, name) for name in _STATIC if name != "k"}
        return _device_search_jit(self.vectors, self.scales, queries, k=k, **static)

    def save(self, directory: str) -> None:
        """Writes the unpadded vectors as an exact index (readable by `ExactIndex.load` too).

        The vectors are fetched to the host. On several processes every process must call this
        (the shards are gathered from all of them) and process 0 alone writes, so `directory`
        should be storage that the processes share.

        Raises:
          ValueError: an int8 index (its codes are not the vectors: save those it was built
            from).
        """
        if self.scales is not None:
            raise ValueError(
                "an int8 DeviceIndex keeps only quantised codes; save the vectors it was built "
                "from (ExactIndex(vectors).save) and load them with storage='int8'"
            )
        if self.vectors.is_fully_addressable:
            vectors = np.asarray(jax.device_get(self.vectors))
        else:
            vectors = multihost_utils.process_allgather(self.vectors, tiled=True)
        if jax.process_index() == 0:
            save_vectors(self, vectors[: self.count], directory)

    @classmethod
    def load(
        cls,
        directory: str,
        mesh: jax.sharding.Mesh,
        axis: str = "data",
        expect: dict | None = None,
        *,
        verify: bool = True,
        **kwargs,
    ) -> DeviceIndex:
        """Reads an exact index folder onto `mesh`; see `ExactIndex.load` for the arguments."""
        manifest, vectors = load_vectors(directory, expect, verify, kinds=("exact",))
        return cls(vectors, mesh, axis, **provenance(manifest), **kwargs)
