r"""The joint step with a host index at 4M passages against the same step at 100k.

    python -m benchmarks.host_step --store /root/scale/psgs_4m_store --scratch /root/host_step
    python -m benchmarks.host_step --store S --sizes 100000,1000000 --scratch D

What a training step does around the device step when the index lives on the host (the trainer's
`Retriever.for_step` without an in-step search), phase by phase, at each corpus size C:
encode (the question tower on the batch, jitted, `device_get`), search (the host index, top N),
gather (`Retriever.gather`: the hits' stored float16 vectors upcast, their context tokens from
the passage store) and the step (the trainer's jitted, donated `make_train_step`, RAG-Sequence,
AdamW). Only search and gather read the corpus; the step and the encoder are the same program
at every size, run on the same batches.

Per size, prepared once in `--scratch` (kept and reused): C unit-norm 768-d float16 vectors and
1,024 held-out queries drawn as the `scale` suite draws them (`scale.write_vectors`), their exact
top-10 (`ExactIndex` over the memory-mapped file), a ScaNN index as `build_and_save` makes it
(in 2M-row shards past `SHARD_ROWS`) tuned to recall@10 >= 0.95 on those queries, and the first C
passages of `--store` (an ingested DPR-format corpus: `benchmarks.ingest`; a prefix of it is
written by `store_edit.edit_store`, deleting the rest). The model: BERT-base question tower
(768 wide: the vectors' width) and a BART-base generator, random weights, N = 5 passages of up to
S = 128 tokens, B = 8 questions (the first 12 words of random passages). The search is given the
held-out queries of the vectors' draw (what the index was tuned on); the random tower's outputs,
whose directions cluster, give the doc scores.

One model and optimizer state steps through the batches, each batch once per size in turn, so
the sizes see the same programs and the same load; the first round (compilation) is not timed.
Reported per size: each phase's median and fastest seconds, the step's total, and the host part
that depends on C (search + gather) at B = 8 and at B = 128 (a v5e-8 host's batch of
`configs/nq.py`, against that step's roofline estimate, `PAPER_STEP_V5E8_MS`). The issue's goal
is read from `added_pct`: what search + gather add at the larger size over the smaller (medians),
as a share of the smaller size's whole step; `total_ratio_pct` is the whole steps' ratio, which
the step's own run-to-run noise dominates. Peak RSS and anon memory of the measuring process
(both indexes open) are reported too.

JSON lines on stdout.
"""

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time

import numpy as np

from benchmarks import scale

SIZES = (100_000, 4_000_000)
BATCH, WIDE_BATCH = 8, 128  # questions per step here; a v5e-8 host's (`configs/nq.py`)
N_DOCS, CONTEXT = 5, 128
QUESTION_WORDS = 12
STEPS, WARMUP = 6, 1  # timed steps per size, after the warm-up (compilation)
WIDE_REPEATS = 5
# `python experiments/tpu_compile.py --config experiments/configs/nq.py --topology v5e:2x4
# --paths host` (README, "Results"): the paper's step at B = 128, compute-bound.
PAPER_STEP_V5E8_MS = 206.0


def _log(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------------------------------------
# Prepared once per size, kept in the scratch folder


def prepare_vectors(
    folder: pathlib.Path, count: int
) -> tuple[pathlib.Path, np.ndarray, np.ndarray]:
    """(the [C, D] float16 .npy, [Q, D] held-out queries, [Q, 10] their exact top-10)."""
    path, queries_path = folder / "vectors.npy", folder / "queries.npy"
    truth_path = folder / "true_ids.npy"
    if not truth_path.is_file():
        start = time.perf_counter()
        partial = folder / "vectors.partial.npy"
        queries = scale.write_vectors(partial, count, scale.NUM_QUERIES, seed=0)
        os.replace(partial, path)
        np.save(queries_path, queries)
        exact, _ = scale._in_child(scale.exact_child, str(path), queries, 1)
        np.save(truth_path, exact["true_ids"])
        _log(f"  {count}: vectors and their exact top-10 in {time.perf_counter() - start:.0f} s")
    return path, np.load(queries_path), np.load(truth_path)


def prepare_index(folder: pathlib.Path, path: pathlib.Path, count: int) -> dict:
    """Builds ScaNN over the vectors into `folder/scann` unless it is there (a sharded build
    resumes its saved shards); returns the build's figures (None when reused)."""
    from rag_jax.retrieval import index

    out = folder / "scann"
    try:
        index.load(str(out), verify=False)
        return {}
    except (OSError, ValueError):
        pass
    build, memory = scale._in_child(scale.scann_build_child, str(path), str(out))
    _log(f"  {count}: ScaNN built in {build['build_s']:.0f} s")
    return {k: build[k] for k in ("build_s", "disk_mb")} | memory


def prepare_store(folder: pathlib.Path, store, tokenizer, count: int):
    """The first `count` passages of `store` (the store itself when it has `count`)."""
    from rag_jax.retrieval.store import PassageStore
    from rag_jax.retrieval.store_edit import RowEdit, edit_store

    if len(store) == count:
        return store
    if len(store) < count:
        raise ValueError(f"--store {store.directory} has {len(store)} passages, fewer than {count}")
    out = folder / "store"
    try:
        return PassageStore.open(out)
    except (OSError, ValueError):
        pass
    partial = folder / "store.partial"
    if partial.exists():
        import shutil

        shutil.rmtree(partial)
    edit = RowEdit.of(len(store), deleted=np.arange(count, len(store)))
    edit_store(store, partial, tokenizer, edit, [])
    os.replace(partial, out)
    return PassageStore.open(out)


# ---------------------------------------------------------------------------------------------
# The step, phase by phase


class HostStep:
    """A training step around a host index, phase by phase, as the trainer runs it: one model
    and optimizer state, stepped on the retrievers' batches in turn."""

    def __init__(self, cfg, params):
        import jax
        import jax.numpy as jnp

        from benchmarks import train_step as ts
        from rag_jax import rag
        from rag_jax.training.step import init_state

        self.cfg = cfg
        self.step_fn, tx = ts._jax_train_step(cfg, "sequence")
        self.state = init_state(jax.tree.map(jnp.array, params), tx)
        self.embed = jax.jit(lambda p, ids, mask: rag.question_embeddings(cfg, p, ids, mask))

    @staticmethod
    def host_part(retriever, queries, pieces) -> tuple[float, float]:
        """(search, gather) seconds for one batch of `queries`."""
        start = time.perf_counter()
        _, ids = retriever.index.search(queries, N_DOCS)
        searched = time.perf_counter()
        retriever.gather(ids, pieces)
        return searched - start, time.perf_counter() - searched

    def step(self, batch, retriever, queries) -> dict:
        import jax

        t0 = time.perf_counter()
        jax.device_get(
            self.embed(
                self.state.params, batch["question_input_ids"], batch["question_attention_mask"]
            )
        )  # -> [B, D]: as the trainer embeds the batch; the search reads the tuned queries
        t1 = time.perf_counter()
        _, ids = retriever.index.search(queries, N_DOCS)
        t2 = time.perf_counter()
        hits = retriever.gather(ids, batch["pieces"])
        t3 = time.perf_counter()
        shape = hits.doc_ids.shape + (-1,)
        device_batch = jax.device_put(
            {
                "question_input_ids": batch["question_input_ids"],
                "question_attention_mask": batch["question_attention_mask"],
                "doc_vectors": hits.doc_vectors,
                "context_input_ids": hits.context_input_ids.reshape(shape),  # -> [B, N, S]
                "context_attention_mask": hits.context_attention_mask.reshape(shape),
                "labels": batch["labels"],
            }
        )
        self.state, metrics = self.step_fn(self.state, device_batch)
        jax.device_get(metrics["loss"])  # blocks until the step is done
        t4 = time.perf_counter()
        return {"encode": t1 - t0, "search": t2 - t1, "gather": t3 - t2, "step": t4 - t3}


def make_batches(store, tokenizer, cfg, count: int, seed: int = 5) -> list[dict]:
    """`count` batches of B questions (the first words of random passages) and random labels."""
    from benchmarks import train_step as ts
    from rag_jax.model_inputs import question_tokens

    rng = np.random.default_rng(seed)
    batches = []
    for i in range(count):
        rows = rng.integers(0, len(store), BATCH)
        questions = [" ".join(store.passage(int(r)).text.split()[:QUESTION_WORDS]) for r in rows]
        enc = question_tokens(tokenizer, questions, ts.QUESTION)
        labels = ts.make_batch(cfg, BATCH, seed=seed + i)["labels"]
        pieces = store.tokenize_questions(tokenizer, questions)
        batches.append(dict(enc, labels=labels, pieces=pieces))
    return batches


def _summary(times: list[dict]) -> dict:
    out = {}
    for phase in ("encode", "search", "gather", "step", "total"):
        values = [sum(t.values()) if phase == "total" else t[phase] for t in times]
        out[f"{phase}_s"] = statistics.median(values)
        out[f"{phase}_min_s"] = min(values)
    return out


def run(store_dir: str, sizes, scratch: str, steps: int = STEPS) -> list[dict]:
    import transformers

    from benchmarks import train_step as ts
    from rag_jax.io import hf
    from rag_jax.retrieval import index, scann_index
    from rag_jax.retrieval.retriever import Retriever
    from rag_jax.retrieval.store import PassageStore

    store = PassageStore.open(store_dir, verify=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(store.manifest["tokenizer"]["name"])
    scratch = pathlib.Path(scratch)
    rows, retrievers = [], {}
    for count in sizes:
        folder = scratch / str(count)
        folder.mkdir(parents=True, exist_ok=True)
        path, queries, true_ids = prepare_vectors(folder, count)
        build = prepare_index(folder, path, count)
        sub = prepare_store(folder, store, tokenizer, count)
        start = time.perf_counter()
        loaded = index.load(str(folder / "scann"), verify=False)
        tuned, recall = scann_index.tune(loaded, queries, true_ids, recall=scale.RECALL, k=scale.K)
        vectors = np.load(path, mmap_mode="r")
        retrievers[count] = (
            Retriever(
                tuned,
                sub,
                vectors,
                n_docs=N_DOCS,
                max_combined_length=CONTEXT,
                verify_corpus=False,  # synthetic vectors: an explicit pairing
            ),
            queries,
        )
        row = {"count": count, "recall@10": recall, "setting": tuned.config, "build": build}
        row["load_and_tune_s"] = time.perf_counter() - start
        rows.append(row)
        _log(f"  {count}: loaded and tuned to recall@10 {recall:.3f}")

    with tempfile.TemporaryDirectory() as tmp:
        ts.save_hf_rag("base", tmp)
        cfg, params = hf.load_rag(tmp)
    pipeline = HostStep(cfg, params)
    del params
    batches = make_batches(store, tokenizer, cfg, WARMUP + steps)
    times = {c: [] for c in sizes}
    for i, batch in enumerate(batches):
        query_rows = np.arange(i * BATCH, (i + 1) * BATCH) % scale.NUM_QUERIES
        for count in sizes:
            retriever, queries = retrievers[count]
            took = pipeline.step(batch, retriever, queries[query_rows])
            if i >= WARMUP:
                times[count].append(took)
            _log(f"  step {i}, {count}: " + ", ".join(f"{k} {v:.3f}s" for k, v in took.items()))
    wide_pieces = [p for b in batches for p in b["pieces"]][:WIDE_BATCH]
    while len(wide_pieces) < WIDE_BATCH:
        wide_pieces += wide_pieces[: WIDE_BATCH - len(wide_pieces)]
    for row in rows:
        count = row["count"]
        row |= _summary(times[count])
        wide = []
        for r in range(WIDE_REPEATS):
            query_rows = (r * WIDE_BATCH + np.arange(WIDE_BATCH)) % scale.NUM_QUERIES
            retriever, queries = retrievers[count]
            wide.append(pipeline.host_part(retriever, queries[query_rows], wide_pieces))
        row["search_b128_s"] = statistics.median(w[0] for w in wide)
        row["gather_b128_s"] = statistics.median(w[1] for w in wide)
        row["host_b128_over_v5e8_step"] = (
            (row["search_b128_s"] + row["gather_b128_s"]) * 1e3 / PAPER_STEP_V5E8_MS
        )
    small, large = rows[0], rows[-1]
    added = large["search_s"] + large["gather_s"] - small["search_s"] - small["gather_s"]
    comparison = {
        "sizes": [small["count"], large["count"]],
        "host_part_added_ms": 1e3 * added,
        "added_pct": 100 * added / small["total_s"],
        "total_ratio_pct": 100 * (large["total_s"] / small["total_s"] - 1),
        "total_ratio_pct_fastest": 100 * (large["total_min_s"] / small["total_min_s"] - 1),
        "peak_rss_mb": scale._status_mb("VmHWM"),
        "anon_mb": scale._status_mb("RssAnon"),
    }
    for row in rows:
        print(json.dumps(row, default=str), flush=True)
    print(json.dumps(comparison), flush=True)
    return rows + [comparison]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="an ingested passage store (largest size)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated")
    parser.add_argument("--scratch", required=True, help="folder for vectors and indexes, kept")
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per size")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    run(args.store, [int(n) for n in args.sizes.split(",")], args.scratch, args.steps)


if __name__ == "__main__":
    from rag_jax.devices import host

    host.restart_with_host_settings()
    main()
