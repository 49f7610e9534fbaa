"""The accelerator check's search phase: `DeviceIndex` search against the memory-bandwidth bound.

`benchmarks/accelerator_check.py` is the command line and says what is measured and the goal;
`benchmarks.accelerator` runs this phase after the train step's.

Legend: B batch of queries, C index rows (C' padded to the devices), D vector width, k neighbours,
n devices.
"""

import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rag_jax.devices import sharding
from rag_jax.retrieval.device_index import DeviceIndex

SEARCH_GOAL, SEARCH_GOAL_MAX_BATCH = 0.70, 64  # of the bound, at batches up to this size


def device_index(vectors: jax.Array, count: int, mesh) -> DeviceIndex:
    """A DeviceIndex over vectors already on the devices ([C', D], sharded over `data`).

    The constructor takes host arrays; building from a template index of the same mesh and
    swapping its one pytree leaf keeps 10M+ vectors off the host. `count` masks the padding.
    """
    template = DeviceIndex(
        np.zeros((mesh.size, vectors.shape[1]), ml_dtypes.bfloat16), mesh, sharding.DATA_AXIS
    )
    ix = jax.tree.unflatten(jax.tree.structure(template), [vectors])
    ix.count = count
    return ix


@functools.cache
def _reference_search_fn(mesh, k: int, count: int, approx: bool):
    """bf16 x bf16 matmul with f32 accumulation, per-shard top-k, global merge."""
    axis = sharding.DATA_AXIS

    def per_shard(shard, queries):
        scores = jnp.einsum(
            "bd,cd->bc", queries.astype(shard.dtype), shard, preferred_element_type=jnp.float32
        )  # -> [B, C' / n]
        start = jax.lax.axis_index(axis) * shard.shape[0]
        ids = start + jnp.arange(shard.shape[0], dtype=jnp.int32)
        scores = jnp.where(ids < count, scores, -jnp.inf)
        top = jax.lax.approx_max_k if approx else jax.lax.top_k
        scores, pos = top(scores, k)
        gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
        scores, ids = gather(scores), gather(start + pos)
        scores, pos = jax.lax.top_k(scores, k)
        return scores, jnp.take_along_axis(ids, pos, axis=1)

    specs = dict(in_specs=(P(axis, None), P()), out_specs=(P(), P()), check_vma=False)
    return jax.jit(jax.shard_map(per_shard, mesh=mesh, **specs))


def _timed(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def search_check(args, mesh, peaks: dict, report) -> dict:
    """Times `DeviceIndex.search` over `args.index_size` x `args.dim` bfloat16 vectors made on the
    devices, for each batch of `args.search_batches` queries, against a reference search and the
    bound of reading every vector once; `report(out)` after each batch."""
    n, dim, count, k = mesh.size, args.dim, args.index_size, args.k
    padded = -(-count // n) * n
    vector_bytes = padded * dim * 2
    out = {"count": count, "dim": dim, "dtype": "bfloat16", "k": k, "vector_bytes": vector_bytes,
           "rows": []}  # fmt: skip
    report(out)
    print(f"search: generating {count} x {dim} bfloat16 vectors on {n} device(s)", flush=True)
    make = jax.jit(
        lambda key: jax.random.normal(key, (padded, dim), jnp.bfloat16),
        out_shardings=NamedSharding(mesh, P(sharding.DATA_AXIS, None)),
    )
    vectors = jax.block_until_ready(make(jax.random.key(7)))
    ix = device_index(vectors, count, mesh)
    approx = ix.recall_target is not None
    reference = _reference_search_fn(mesh, k, count, approx)
    replicated = NamedSharding(mesh, P())
    for batch in args.search_batches:
        queries = jax.device_put(
            jax.random.normal(jax.random.key(batch), (batch, dim), jnp.float32), replicated
        )
        scores, ids = ix.search(queries, k)
        ref_scores, ref_ids = reference(vectors, queries)
        row = {"batch": batch}
        row["index_s"] = _timed(lambda q=queries: ix.search(q, k), args.warmup, args.repeats)
        row["reference_s"] = _timed(lambda q=queries: reference(vectors, q), args.warmup,
                                    args.repeats)  # fmt: skip
        row["index_qps"] = batch / row["index_s"]
        row["reference_qps"] = batch / row["reference_s"]
        ids, ref_ids = np.asarray(ids), np.asarray(ref_ids)
        row["ids_agree_with_reference"] = float(
            np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, ref_ids)])
        )
        if args.verify_exact:  # small indexes: against numpy brute force on the fetched vectors
            host = np.asarray(jax.device_get(vectors)[:count], np.float32)
            exact = np.asarray(queries) @ host.T
            want = np.sort(exact, axis=1)[:, ::-1][:, :k]
            row["index_scores_max_error"] = float(np.max(np.abs(np.asarray(scores) - want)))
            row["index_ids_exact"] = bool(
                np.all(np.take_along_axis(exact, ids, axis=1) >= want[:, -1:] - 1e-4)
            )
        if peaks["gbps"]:
            bound_s = vector_bytes / (peaks["gbps"] * 1e9 * n)
            row["bound_s"] = bound_s
            row["bound_qps"] = batch / bound_s
            row["index_fraction_of_bound"] = bound_s / row["index_s"]
            row["reference_fraction_of_bound"] = bound_s / row["reference_s"]
        out["rows"].append(row)
        print(f"search: {json.dumps(_short(row))}", flush=True)
        report(out)
    in_goal = [r for r in out["rows"] if r["batch"] <= SEARCH_GOAL_MAX_BATCH]
    if peaks["gbps"] and in_goal:
        best = max(in_goal, key=lambda r: r["index_fraction_of_bound"])
        out.update(best_fraction_of_bound=best["index_fraction_of_bound"],
                   best_batch=best["batch"], goal=SEARCH_GOAL,
                   meets_goal=best["index_fraction_of_bound"] >= SEARCH_GOAL)  # fmt: skip
    report(out)
    return out


def _short(row: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
            if k != "step_times_s"}  # fmt: skip
