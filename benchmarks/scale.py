"""Scale suite: the host indexes at 1M-4M passages, and each figure extrapolated to 21M.

    python -m benchmarks.run --suites scale                                  # 1M, 2M, 4M
    python -m benchmarks.run --suites scale --scale_sizes 1000000            # one size
    python -m benchmarks.run --suites scale --quick                          # 20k, a smoke run

Data: C unit-norm 768-d float16 vectors drawn as the `index` suite draws them (C / 200 Gaussian
centres, noise as large as the centres), generated 65,536 rows at a time into a memory-mapped
.npy on disk (never the whole matrix in RAM); Q held-out queries drawn the same way (the next Q
rows of the same draw, as the `index` suite does), in float32. Truth: `ExactIndex` over the
memory-mapped file (blockwise, float16 read and upcast a block at a time).

Per size, each index is built and searched in a fresh process, one at a time, so its peak
memory is its own: `peak_rss_mb` (VmHWM: includes pages of the memory-mapped vectors the
process touched, which the kernel can drop) and `peak_anon_mb` (RssAnon polled every 0.1 s:
memory that cannot be dropped). Rows:

- `ExactIndex (mmap)`: queries/s at batch 128 and batch 1.
- `ScannIndex`: built as `ScannIndex.build` chooses from C ("sample" from 500k: trained on a
  sample, the rest added in batches, candidates rescored from the float16 file), saved, loaded
  back with `index.load` (memory-mapped), tuned with `scann_index.tune` to recall@10 >= 0.95,
  then queries/s at batch 128 and batch 1 (and the p50 latency); `edit_s`: an `EditedIndex`
  replacing 1,000 passages (new vectors drawn the same way), and its recall@10 against an exact
  search of the edited vectors.
- `faiss HNSW32,SQfp16`: M=32, vectors stored as float16 (the bytes the other indexes keep;
  HNSW's float32 copy would be 3 GB a million), efSearch raised to the recall target. Built up to
  `HNSW_MAX` passages only (its build is superlinear and takes hours beyond).
- `faiss IVF4096,PQ128` (wiki_dpr's compressed index: 4,096 lists, 128 bytes a vector, a flat
  coarse quantizer here, trained on 262,144 vectors), nprobe raised to the target; its plain PQ
  codes may plateau below it, so also with exact refinement from float16 copies of the vectors
  (`IndexRefine` over `SQfp16`, 10k candidates).

Then, for every figure, its growth exponent between consecutive sizes (log ratio of the figure
over log ratio of the sizes) and its value extrapolated to 21,015,324 passages from the largest
size with the last measured exponent, or, with one size, with the exponent a model of the index
gives (named in the row). A difficulty row compares the synthetic queries with real ones at ~20k:
MiniLM-L6 vectors of SQuAD 1.1's 18,896 training paragraphs and 1,000 of its questions (when the
model and the data are there), by relative contrast (mean distance over 10th-neighbour distance:
lower is harder) and by recall@10 of ScaNN's AH scores alone (no reordering).
"""

import concurrent.futures
import json
import math
import multiprocessing
import os
import pathlib
import shutil
import tempfile
import threading
import time

import numpy as np

from benchmarks import scale_difficulty
from benchmarks.draw import CHUNK, D, write_vectors

K = 10  # recall@K
RECALL = 0.95  # the recall every approximate index is tuned to reach
BATCH = 128  # queries per call at the large batch
SIZES = (1_000_000, 2_000_000, 4_000_000)
QUICK_SIZES = (20_000,)
TARGET = 21_015_324  # passages in DPR's Wikipedia (psgs_w100.tsv)
NUM_QUERIES = 1024  # held-out queries: tuning, recall and batch-128 timing (8 calls)
SINGLE_QUERIES = 200  # timed one at a time
EDITS = 1_000  # passages replaced in the edit
HNSW_MAX = 1_000_000  # HNSW above this is not built (hours on two cores)
# Model exponents for one measured size: how each figure grows with C by the index's design.
MODEL_EXPONENTS = {
    "build_s": (1.0, "build cost linear in C (k-means on 64 sqrt(C) points x sqrt(C) leaves)"),
    "peak_rss_mb": (1.0, "upper bound: codes and ids grow with C"),
    "peak_anon_mb": (1.0, "upper bound: codes and ids grow with C"),
    "disk_mb": (1.0, "vectors + codes, linear in C"),
    "queries_per_s": (-1.0, "a fixed fraction of C scanned per query; HNSW: an upper bound"),
    "queries_per_s_b1": (-1.0, "a fixed fraction of C scanned per query; HNSW: an upper bound"),
    "p50_ms_b1": (1.0, "a fixed fraction of C scanned per query"),
    "edit_s": (0.0, "an edit touches the E edited vectors only"),
}


# ---------------------------------------------------------------------------------------------
# Data


# ---------------------------------------------------------------------------------------------
# Fresh processes, their peak memory


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _measured(fn, *args):
    """Runs fn(*args) in this (child) process; returns (its result, peak memory figures)."""
    peak = [0.0]
    done = threading.Event()

    def poll():
        while not done.wait(0.1):
            peak[0] = max(peak[0], _status_mb("RssAnon"))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        result = fn(*args)
    finally:
        done.set()
        poller.join()
    peak[0] = max(peak[0], _status_mb("RssAnon"))
    return result, {"peak_rss_mb": _status_mb("VmHWM"), "peak_anon_mb": peak[0]}


def _in_child(fn, *args):
    """fn(*args) in a fresh (spawned) process, with its peak memory; one at a time."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_measured, fn, *args).result()


# ---------------------------------------------------------------------------------------------
# The indexes (each runs in its own process)


def _timings(search_fn, queries: np.ndarray, singles: int) -> dict:
    """queries/s at batch BATCH over `queries`, and at batch 1 over the first `singles` of them
    (with the p50 latency); the best of two passes each."""
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        for s in range(0, len(queries), BATCH):
            search_fn(queries[s : s + BATCH])
        best = min(best, time.perf_counter() - start)
    latencies = []
    for _ in range(2):
        once = []
        for q in queries[:singles]:
            start = time.perf_counter()
            search_fn(q[None])
            once.append(time.perf_counter() - start)
        latencies = once if not latencies or sum(once) < sum(latencies) else latencies
    return {
        "queries_per_s": len(queries) / best,
        "queries_per_s_b1": len(latencies) / sum(latencies),
        "p50_ms_b1": 1e3 * float(np.median(latencies)),
    }


def _batched_ids(search_fn, queries):
    return np.concatenate(
        [search_fn(queries[s : s + BATCH]) for s in range(0, len(queries), BATCH)]
    )


def exact_child(path: str, queries: np.ndarray, singles: int) -> dict:
    """Truth (scores and ids of every query) and ExactIndex's speed, over the memory-mapped file."""
    from rag_jax.retrieval import index

    vectors = np.load(path, mmap_mode="r")
    exact = index.ExactIndex(vectors)
    start = time.perf_counter()
    scores, ids = zip(
        *(exact.search(queries[s : s + BATCH], K) for s in range(0, len(queries), BATCH))
    )
    seconds = time.perf_counter() - start
    single = []
    for q in queries[:singles]:
        t = time.perf_counter()
        exact.search(q[None], K)
        single.append(time.perf_counter() - t)
    return {
        "true_scores": np.concatenate(scores),
        "true_ids": np.concatenate(ids),
        "row": {
            "index": "ExactIndex (mmap)",
            "setting": f"float16 file, chunk_size={exact.chunk_size}",
            "recall@10": 1.0,
            "queries_per_s": len(queries) / seconds,
            "queries_per_s_b1": len(single) / sum(single),
            "p50_ms_b1": 1e3 * float(np.median(single)),
            "disk_mb": os.path.getsize(path) / 2**20,
        },
    }


def scann_build_child(path: str, out_dir: str) -> dict:
    """ScannIndex.build over the memory-mapped file (settings from C), saved to `out_dir`; past
    `scann_shards.SHARD_ROWS`, `build_sharded` (each shard saved as it is built: its save is in
    `build_s`)."""
    from rag_jax.retrieval import index, scann_shards

    vectors = np.load(path, mmap_mode="r")
    start = time.perf_counter()
    if len(vectors) > scann_shards.SHARD_ROWS:
        ix = scann_shards.build_sharded(vectors, out_dir, log=print)
    else:
        ix = index.ScannIndex.build(vectors)
    build_s = time.perf_counter() - start
    if not isinstance(ix, scann_shards.ShardedScannIndex):
        ix.save(out_dir)
    disk = sum(p.stat().st_size for p in pathlib.Path(out_dir).rglob("*") if p.is_file())
    return {
        "build_s": build_s,
        "save_s": time.perf_counter() - start - build_s,
        "disk_mb": disk / 2**20,
        "config": ix.config,
    }


def scann_search_child(out_dir, queries, true_ids, edit_ids, edit_vectors, edit_true, singles):
    """Loads the saved index (`index.load`, memory-mapped), tunes it, times it, edits it."""
    from rag_jax.retrieval import edits, index, scann_index

    start = time.perf_counter()
    loaded = index.load(out_dir, verify=False)
    load_s = time.perf_counter() - start
    ix, recall = scann_index.tune(loaded, queries, true_ids, recall=RECALL, k=K)
    shards = len(getattr(ix, "shards", [ix]))  # a sharded build is still the ScaNN row
    row = {"index": "ScannIndex", "shards": shards, "recall@10": recall, "load_s": load_s}
    shards = f"{shards} shards, each: " if shards > 1 else ""
    row["setting"] = shards + (
        f"{ix.config['build']} build, leaves {ix.config['num_leaves_to_search']}/"
        f"{ix.config['num_leaves']}, AH, reorder {ix.config['reorder']}, "
        f"sample {ix.config['training_sample_size']}"
    )
    row |= _timings(lambda q: ix.search(q, K), queries, singles)
    start = time.perf_counter()
    edited = edits.EditedIndex(ix, edit_ids, edit_vectors)
    row["edit_s"] = time.perf_counter() - start
    got = _batched_ids(lambda q: edited.search(q, K)[1], queries)
    row["edit_recall@10"] = scann_index.recall_at_k(got, edit_true)
    # Every edited passage in a query's true top-K is found (the side index is exact).
    wanted = np.isin(edit_true, edit_ids)
    row["edited_found"] = float(
        np.mean([np.isin(t[w], g).all() for t, w, g in zip(edit_true, wanted, got)])
    )
    return row


def make_edits(count: int, queries, true_ids, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """EDITS passages to replace (at most a tenth of C) and their new vectors, chosen so the edit
    changes the answers: half the ids are queries' true top-1 passages (their replacement must
    hide them), and every new vector is a query plus noise (cosine ~0.7, above the ~0.55 of the
    best synthetic passages: it becomes that query's top passage).

    Returns:
      (ids [E] int64 sorted, vectors [E, D] float32 unit rows, in the order of `ids`).
    """
    rng = np.random.default_rng(seed)
    edits = min(EDITS, count // 10)
    tops = np.unique(true_ids[:, 0])[: edits // 2]
    others = np.setdiff1d(np.arange(count), tops)
    ids = np.sort(np.concatenate([tops, rng.choice(others, edits - len(tops), replace=False)]))
    noise = rng.standard_normal((edits, D), dtype=np.float32) / np.sqrt(D)
    vectors = queries[rng.permutation(np.arange(edits) % len(queries))] + noise
    return ids, vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def edited_truth(path: str, queries, edit_ids, edit_vectors) -> np.ndarray:
    """Exact top-K ids over the vectors with rows `edit_ids` replaced: one blockwise pass over
    the file, independent of `EditedIndex` (the reference it is checked against)."""
    vectors = np.load(path, mmap_mode="r")
    best_s = np.full((len(queries), K), -np.inf, np.float32)
    best_i = np.zeros((len(queries), K), np.int64)
    replaced = dict(zip(edit_ids.tolist(), range(len(edit_ids))))
    for start in range(0, len(vectors), CHUNK):
        block = np.asarray(vectors[start : start + CHUNK], np.float32)
        for row in [i for i in edit_ids if start <= i < start + len(block)]:
            block[row - start] = edit_vectors[replaced[int(row)]]
        scores = queries @ block.T  # -> [Q, chunk]
        ids = np.broadcast_to(np.arange(start, start + len(block)), scores.shape)
        all_s, all_i = np.concatenate([best_s, scores], 1), np.concatenate([best_i, ids], 1)
        top = np.argpartition(-all_s, K - 1, axis=1)[:, :K]
        best_s, best_i = np.take_along_axis(all_s, top, 1), np.take_along_axis(all_i, top, 1)
    return best_i


def _tune_faiss(set_fn, search_fn, settings, queries, true_ids):
    """The first of `settings` reaching RECALL (or the best, once recall stops rising)."""
    from rag_jax.retrieval.scann_index import recall_at_k

    best, why = (None, -1.0), "the last setting tried, below the target"
    for setting in settings:
        set_fn(setting)
        recall = recall_at_k(_batched_ids(search_fn, queries), true_ids)
        if recall >= RECALL:
            return setting, recall
        if recall < best[1] + 1e-3 and best[0] is not None:
            why = "recall plateaued below the target"
            break
        best = max(best, (setting, recall), key=lambda b: b[1])
    set_fn(best[0])
    return f"{best[0]} ({why})", best[1]


def _add_in_batches(index, vectors) -> None:
    for start in range(0, len(vectors), CHUNK):
        index.add(np.asarray(vectors[start : start + CHUNK], np.float32))


def hnsw_child(path, queries, true_ids, singles) -> dict:
    import faiss

    faiss.omp_set_num_threads(os.cpu_count())
    vectors = np.load(path, mmap_mode="r")
    hnsw = faiss.IndexHNSWSQ(D, faiss.ScalarQuantizer.QT_fp16, 32, faiss.METRIC_INNER_PRODUCT)
    start = time.perf_counter()
    hnsw.train(np.asarray(vectors[:CHUNK], np.float32))  # fp16 needs no statistics
    _add_in_batches(hnsw, vectors)
    build_s = time.perf_counter() - start

    def set_ef(ef):
        hnsw.hnsw.efSearch = ef

    search_fn = lambda q: hnsw.search(q, K)[1]
    efs = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
    setting, recall = _tune_faiss(set_ef, search_fn, efs, queries, true_ids)
    row = {"index": "faiss HNSW32,SQfp16", "setting": f"efSearch={setting}", "recall@10": recall}
    row |= {"build_s": build_s, "disk_mb": faiss.serialize_index(hnsw).nbytes / 2**20}
    return row | _timings(search_fn, queries, singles)


def ivfpq_child(path, queries, true_ids, singles) -> list:
    """IVF-PQ trained once (on 39 vectors a list, faiss' minimum), then searched plain and with
    fp16 refinement; each row's build_s is the shared training plus its own adding."""
    import faiss

    faiss.omp_set_num_threads(os.cpu_count())
    vectors = np.load(path, mmap_mode="r")
    nlist = min(4096, len(vectors) // 39)
    rng = np.random.default_rng(2)
    rows = np.sort(rng.choice(len(vectors), min(len(vectors), 39 * nlist), replace=False))
    sample = np.asarray(vectors[rows], np.float32)
    # The constructor, not index_factory("IVF...,PQ128"): the factory adds polysemous training,
    # which takes hours for 128 sub-quantisers and does nothing for this search.
    quantizer = faiss.IndexFlatIP(D)
    trained = faiss.IndexIVFPQ(quantizer, D, nlist, 128, 8, faiss.METRIC_INNER_PRODUCT)
    start = time.perf_counter()
    trained.train(sample)
    train_s = time.perf_counter() - start
    out = []
    for refine in (False, True):
        ivf = faiss.clone_index(trained)
        searched = ivf
        if refine:
            fp16 = faiss.IndexScalarQuantizer(
                D, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT
            )
            fp16.train(sample[:1000])  # fp16 keeps no statistics
            searched = faiss.IndexRefine(ivf, fp16)
            searched.k_factor = 10
        start = time.perf_counter()
        _add_in_batches(searched, vectors)
        add_s = time.perf_counter() - start

        def set_nprobe(n, ivf=ivf):
            ivf.nprobe = n

        search_fn = lambda q, searched=searched: searched.search(q, K)[1]
        probes = [2**i for i in range(int(math.log2(nlist)) + 1)]
        setting, recall = _tune_faiss(set_nprobe, search_fn, probes, queries, true_ids)
        name = f"faiss IVF{nlist},PQ128" + (" + fp16 refine x10" if refine else "")
        row = {"index": name, "setting": f"nprobe={setting}", "recall@10": recall}
        row |= {"build_s": train_s + add_s, "train_s": train_s}
        # Written to disk and measured there: `serialize_index` would copy the index in memory
        # (at 4M a second 6.6 GB beside the refined index, which the OOM killer ended).
        written = os.path.join(os.path.dirname(path), "ivfpq.faiss")
        faiss.write_index(searched, written)
        row["disk_mb"] = os.path.getsize(written) / 2**20
        os.remove(written)
        out.append(row | _timings(search_fn, queries, singles))
        print(json.dumps(out[-1]), flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# The suite


INDEXES = ("exact", "scann", "hnsw", "ivfpq")


def _one_size(count: int, scratch: str, num_queries: int, singles: int, indexes=INDEXES) -> list:
    path = os.path.join(scratch, f"vectors_{count}.npy")
    start = time.perf_counter()
    queries = write_vectors(path, count, num_queries, seed=0)
    print(f"  {count}: vectors written in {time.perf_counter() - start:.0f} s", flush=True)
    # Exact search is the truth every other row's recall is measured against: always run.
    exact, memory = _in_child(exact_child, path, queries, min(singles, 5))
    rows = [exact["row"] | memory]
    print(json.dumps(rows[-1]), flush=True)
    true_ids = exact["true_ids"]
    if "scann" in indexes:
        rows.append(_scann_row(count, path, scratch, queries, true_ids, singles))
    if "hnsw" in indexes and count <= HNSW_MAX:
        hnsw, memory = _in_child(hnsw_child, path, queries, true_ids, singles)
        rows.append(hnsw | memory)
        print(json.dumps(rows[-1]), flush=True)
    elif "hnsw" in indexes:
        rows.append({"index": "faiss HNSW32,SQfp16", "setting": f"not built above {HNSW_MAX}"})
    if "ivfpq" in indexes:
        try:
            ivf, memory = _in_child(ivfpq_child, path, queries, true_ids, singles)
            rows += [row | memory for row in ivf]
        except concurrent.futures.process.BrokenProcessPool:  # e.g. the kernel's OOM killer
            killed = "its process was killed (out of memory?); rows it printed are above"
            rows.append({"index": "faiss IVF-PQ", "setting": killed})
    os.remove(path)
    for row in rows:
        row["count"] = count
        print(json.dumps(row), flush=True)  # one JSON line per index and size, all together
    return rows


def _scann_row(count: int, path: str, scratch: str, queries, true_ids, singles: int) -> dict:
    """The ScaNN row: built in one process, searched, tuned and edited in another."""
    out_dir = os.path.join(scratch, "scann")
    build, build_memory = _in_child(scann_build_child, path, out_dir)
    edit_ids, edit_vectors = make_edits(count, queries, true_ids, seed=4)
    edit_true = edited_truth(path, queries, edit_ids, edit_vectors)
    scann_row, search_memory = _in_child(
        scann_search_child, out_dir, queries, true_ids, edit_ids, edit_vectors, edit_true, singles
    )
    scann_row |= {
        "build_s": build["build_s"],
        "save_s": build["save_s"],
        "disk_mb": build["disk_mb"],
    }
    scann_row |= build_memory | {f"search_{k}": v for k, v in search_memory.items()}
    shutil.rmtree(out_dir)
    print(f"  {count}: {json.dumps(scann_row)}", flush=True)
    return scann_row


def growth(rows: list, figures=tuple(MODEL_EXPONENTS)) -> list:
    """Per index and figure: the exponent between consecutive sizes and the value at TARGET.

    Extrapolated from the largest size with the last measured exponent; with one size, with
    MODEL_EXPONENTS' (the row says which).
    """
    out = []
    for name in dict.fromkeys(row["index"] for row in rows):
        mine = sorted((r for r in rows if r["index"] == name), key=lambda r: r["count"])
        for figure in figures:
            points = [(r["count"], r[figure]) for r in mine if r.get(figure, 0) > 0]
            if not points:
                continue
            exponents = [
                math.log(f2 / f1) / math.log(n2 / n1)
                for (n1, f1), (n2, f2) in zip(points, points[1:])
            ]
            if exponents:
                exponent, source = exponents[-1], f"measured {points[-2][0]}->{points[-1][0]}"
            else:
                exponent, why = MODEL_EXPONENTS[figure]
                source = f"assumed ({why})"
            n, value = points[-1]
            out.append(
                {
                    "index": name,
                    "figure": figure,
                    "sizes": [p[0] for p in points],
                    "values": [p[1] for p in points],
                    "exponents": exponents,
                    "exponent_used": exponent,
                    "exponent_source": source,
                    "at_21015324": value * (TARGET / n) ** exponent,
                }
            )
    return out


def run(quick: bool, sizes=None, out: str = "bench_results", indexes=None) -> dict:
    sizes = tuple(sizes or (QUICK_SIZES if quick else SIZES))
    indexes = tuple(indexes or INDEXES)
    unknown = set(indexes) - set(INDEXES)
    if unknown:
        raise ValueError(f"unknown scale indexes {sorted(unknown)}; choose from {INDEXES}")
    num_queries = 256 if quick else NUM_QUERIES
    singles = 20 if quick else SINGLE_QUERIES
    rows = []
    with tempfile.TemporaryDirectory(prefix="rag_jax_scale_") as scratch:
        for count in sizes:
            rows += _one_size(count, scratch, num_queries, singles, indexes)
        cache = os.path.join(out, "minilm_squad_train.npz")
        real = None if quick else scale_difficulty.minilm_squad_vectors(cache)
        difficulty, _ = _in_child(
            scale_difficulty.difficulty_child, 18_896 if real else 20_000, 1000, real
        )
    extrapolated = growth(rows)
    for row in extrapolated:
        print(json.dumps(row), flush=True)
    columns = [
        "count",
        "index",
        "setting",
        "recall@10",
        "queries_per_s",
        "queries_per_s_b1",
        "p50_ms_b1",
        "build_s",
        "peak_rss_mb",
        "peak_anon_mb",
        "disk_mb",
        "edit_s",
        "edit_recall@10",
    ]
    return {
        "columns": columns,
        "rows": rows,
        "extrapolated": extrapolated,
        "difficulty": difficulty,
        "config": {
            "sizes": list(sizes),
            "dim": D,
            "k": K,
            "batch": BATCH,
            "queries": num_queries,
            "single_queries": singles,
            "edits": EDITS,
            "target": TARGET,
            "indexes": list(indexes),
        },
        "threads": os.cpu_count(),
    }
