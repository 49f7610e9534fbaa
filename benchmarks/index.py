"""Index suite: queries/s at recall@10 >= 0.95 for ScaNN, faiss HNSW, faiss IVF-PQ and exact search.

    python -m benchmarks.run --suites index            # C = 200k
    python -m benchmarks.run --suites index --quick    # C = 20k

Data: C unit-norm 768-d vectors around C / 200 Gaussian cluster centres (noise as large as the
centres), queries drawn the same way, searched in batches of B = 64; recall@10 is against
`ExactIndex`. Each approximate index has its query-time knob raised step by step until recall@10
reaches 0.95 (ScaNN is first run at `rag_jax.retrieval.scann_index.scann_defaults`, and only tuned
if those miss).
The throughputs reported are then measured at those settings in one final head-to-head, every
search timed once per round, in turn, for several rounds, taking each one's fastest pass: on a
shared machine, load comes and goes, and this way it falls on all contenders alike.

Rows also give build time and index memory (serialised bytes), the goals ScaNN/HNSW >= 1.5x and
ScaNN/exact >= 5x, exact search against a plain numpy matmul + argpartition, and exact search's
read rate as a fraction of this machine's memory bandwidth, measured in the same run.
"""

import math
import os
import time

import numpy as np

from benchmarks import common
from rag_jax.retrieval import index

D = 768  # width of BERT-base passage vectors (DPR)
B = 64  # queries per search call
K = 10  # recall@K
RECALL = 0.95  # the recall every approximate index is tuned to reach
NUM_QUERIES = 640  # B * 10 batches per timed pass
ROUNDS = 5  # head-to-head rounds


def clustered_vectors(count: int, dim: int, seed: int) -> np.ndarray:
    """[count, dim] float32 unit vectors, each a random one of count // 200 centres plus noise."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(1, count // 200), dim), dtype=np.float32)
    out = np.empty((count, dim), np.float32)
    for start in range(0, count, 50_000):  # in blocks: the noise would double peak memory
        rows = min(50_000, count - start)
        noise = rng.standard_normal((rows, dim), dtype=np.float32)
        out[start : start + rows] = centres[rng.integers(len(centres), size=rows)] + noise
    out /= np.linalg.norm(out, axis=1, keepdims=True)
    return out


def recall_at_k(ids: np.ndarray, true_ids: np.ndarray) -> float:
    """Mean fraction of each row's true top-K found among its returned ids; both [Q, K]."""
    return float(np.mean([len(set(a) & set(b)) / K for a, b in zip(ids, true_ids)]))


def _batched(search_fn, queries: np.ndarray) -> np.ndarray:
    """Runs `search_fn` (ids [B, K] of queries [B, D]) over `queries` [Q, D]; -> [Q, K]."""
    return np.concatenate([search_fn(queries[s : s + B]) for s in range(0, len(queries), B)])


def _tune(name, settings, make_search_fn, queries, true_ids) -> tuple[dict, object]:
    """Tries `settings` in order; returns (row, search_fn) of the first reaching RECALL.

    Stops early with the best setting once recall stops rising (quantisation can cap it below
    the target); the row's setting then says so.
    """
    best = None
    for setting in settings:
        search_fn = make_search_fn(setting)
        recall = recall_at_k(_batched(search_fn, queries), true_ids)
        print(f"  {name} {setting}: recall@10 {recall:.4f}", flush=True)
        row = {"index": name, "setting": setting, "recall@10": recall}
        if recall >= RECALL:
            return row, search_fn
        if best is not None and recall < best[0]["recall@10"] + 1e-3:
            break
        if best is None or recall > best[0]["recall@10"]:
            best = (row, search_fn)
    best[0]["setting"] += " (recall plateaued below the target)"
    return best


def _timed(build_fn) -> float:
    start = time.perf_counter()
    build_fn()
    return time.perf_counter() - start


def _exact(vectors, queries, true_ids) -> list:
    """ExactIndex, and the same search written as one numpy matmul + argpartition."""
    exact = index.ExactIndex(vectors)
    row = {"index": "ExactIndex", "setting": f"chunk_size={exact.chunk_size}", "build_s": 0.0}
    row |= {"recall@10": 1.0, "index_mb": exact.nbytes / 2**20}

    def numpy_search(q):
        scores = q @ vectors.T  # -> [B, C]
        top = np.argpartition(-scores, K - 1, axis=1)[:, :K]
        order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)
        return np.take_along_axis(top, order, axis=1)

    numpy_row = {"index": "numpy matmul + argpartition", "setting": "full [B, C] scores"}
    numpy_row["recall@10"] = recall_at_k(_batched(numpy_search, queries), true_ids)
    return [(row, lambda q: exact.search(q, K)[1]), (numpy_row, numpy_search)]


def _scann(vectors, queries, true_ids) -> list:
    """ScannIndex at its defaults, tuned upward only if they miss the recall target."""
    built = []
    build_s = _timed(lambda: built.append(index.ScannIndex.build(vectors)))
    scann = built[0]
    cfg = scann.config
    leaves = cfg["num_leaves_to_search"]
    settings = [f"defaults: leaves {leaves}/{cfg['num_leaves']}, reorder {cfg['reorder']}"]
    if cfg["num_leaves"]:
        settings += [f"leaves {n}" for n in (2 * leaves, 4 * leaves, 8 * leaves)]
    else:
        settings += [f"reorder {n}" for n in (2 * cfg["reorder"], 4 * cfg["reorder"])]

    def make_search_fn(setting):
        knob = {"leaves": "leaves_to_search", "reorder": "reorder"}.get(setting.split()[0])
        kwargs = {knob: int(setting.split()[1])} if knob else {}
        return lambda q: scann.search(q, K, **kwargs)[1]

    row, search_fn = _tune("ScannIndex", settings, make_search_fn, queries, true_ids)
    return [(row | {"build_s": build_s, "index_mb": scann.nbytes / 2**20}, search_fn)]


def _hnsw(vectors, queries, true_ids) -> list:
    """faiss HNSW, M = 32, efSearch raised until the recall target."""
    import faiss

    hnsw = faiss.IndexHNSWFlat(D, 32, faiss.METRIC_INNER_PRODUCT)
    build_s = _timed(lambda: hnsw.add(vectors))

    def make_search_fn(setting):
        ef = int(setting.split("=")[1])

        def search_fn(q):
            hnsw.hnsw.efSearch = ef  # per call: the head-to-head interleaves settings
            return hnsw.search(q, K)[1]

        return search_fn

    settings = [f"efSearch={ef}" for ef in (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)]
    row, search_fn = _tune("faiss HNSW M=32", settings, make_search_fn, queries, true_ids)
    size = faiss.serialize_index(hnsw).nbytes
    return [(row | {"build_s": build_s, "index_mb": size / 2**20}, search_fn)]


def _ivfpq(vectors, queries, true_ids) -> list:
    """faiss IVF-PQ: 4 sqrt(C) lists, 96 sub-quantisers of 8 bits; nprobe raised to the target.

    Plain PQ codes may cap recall below the target, so the same trained index is also run with
    exact refinement of 10 K candidates, as ScaNN's reordering does; build time for each is the
    shared training plus its own adding.
    """
    import faiss

    nlist = round(4 * math.sqrt(len(vectors)))
    trained = faiss.IndexIVFPQ(faiss.IndexFlatIP(D), D, nlist, 96, 8, faiss.METRIC_INNER_PRODUCT)
    train_s = _timed(lambda: trained.train(vectors))
    results = []
    for refine in (False, True):
        ivf = faiss.clone_index(trained)
        searched = faiss.IndexRefineFlat(ivf) if refine else ivf
        if refine:
            searched.k_factor = 10
        add_s = _timed(lambda searched=searched: searched.add(vectors))

        def make_search_fn(setting, ivf=ivf, searched=searched):
            nprobe = int(setting.split("=")[1])

            def search(q):
                ivf.nprobe = nprobe
                return searched.search(q, K)[1]

            return search

        name = f"faiss IVF{nlist},PQ96" + (" + exact refine" if refine else "")
        settings = [f"nprobe={2**i}" for i in range(int(math.log2(nlist)) + 1)]
        row, search_fn = _tune(name, settings, make_search_fn, queries, true_ids)
        size = faiss.serialize_index(searched).nbytes
        results.append((row | {"build_s": train_s + add_s, "index_mb": size / 2**20}, search_fn))
    return results


def _head_to_head(contenders: list, queries: np.ndarray) -> None:
    """Sets each row's queries_per_s from its fastest of ROUNDS interleaved passes."""
    fastest = [math.inf] * len(contenders)
    for _ in range(ROUNDS):
        for i, (_, search_fn) in enumerate(contenders):
            # Two timed passes (nothing compiles here, so the first counts as well).
            timing = common.time_fn(lambda fn=search_fn: _batched(fn, queries), repeats=1)
            fastest[i] = min(fastest[i], timing["first_s"], timing["min_s"])
    for (row, _), seconds in zip(contenders, fastest):
        row["queries_per_s"] = len(queries) / seconds


def _memory_bandwidth() -> dict:
    """GB/s of a 1 GiB copy (bytes read + written) and of a 1 GiB sum (bytes read)."""
    src = np.ones(1 << 28, np.float32)
    dst = np.empty_like(src)
    copy = common.time_fn(lambda: np.copyto(dst, src), repeats=5)["min_s"]
    total = common.time_fn(lambda: src.sum(), repeats=5)["min_s"]
    return {"copy_gb_s": 2 * src.nbytes / copy / 1e9, "read_gb_s": src.nbytes / total / 1e9}


def _ratio_row(name: str, a: dict, b: dict, goal: float | None) -> dict:
    ratio = a["queries_per_s"] / b["queries_per_s"]
    verdict = "" if goal is None else f">= {goal}: " + ("met" if ratio >= goal else "MISSED")
    return {"index": name, "ratio": ratio, "goal": verdict}


def run(quick: bool) -> dict:
    import faiss

    count = 20_000 if quick else 200_000
    data = clustered_vectors(count + NUM_QUERIES, D, seed=0)
    vectors, queries = data[:count], data[count:]
    faiss.omp_set_num_threads(os.cpu_count())  # BLAS and ScaNN use every core too
    true_ids = index.ExactIndex(vectors).search(queries, K)[1]

    contenders = []
    for section in (_exact, _scann, _hnsw, _ivfpq):
        contenders += section(vectors, queries, true_ids)
    _head_to_head(contenders, queries)
    rows = [row for row, _ in contenders]
    exact_row, numpy_row, scann_row, hnsw_row = rows[:4]
    rows.append(_ratio_row("ScaNN / HNSW queries/s", scann_row, hnsw_row, 1.5))
    rows.append(_ratio_row("ScaNN / exact queries/s", scann_row, exact_row, 5))
    rows.append(_ratio_row("ExactIndex / numpy queries/s", exact_row, numpy_row, None))

    bandwidth = _memory_bandwidth()
    read_gb_s = exact_row["queries_per_s"] / B * vectors.nbytes / 1e9  # one corpus pass per batch
    rows.append(
        {
            "index": "ExactIndex corpus read rate / memory read bandwidth",
            "setting": f"{read_gb_s:.2f} GB/s of {bandwidth['read_gb_s']:.1f} GB/s "
            f"(copy: {bandwidth['copy_gb_s']:.1f} GB/s)",
            "ratio": read_gb_s / bandwidth["read_gb_s"],
        }
    )
    columns = ["index", "setting", "recall@10", "queries_per_s", "build_s", "index_mb"]
    return {
        "columns": columns + ["ratio", "goal"],
        "rows": rows,
        "config": {"count": count, "dim": D, "batch": B, "k": K, "queries": NUM_QUERIES},
        "memory_bandwidth": bandwidth,
        "threads": os.cpu_count(),
    }
