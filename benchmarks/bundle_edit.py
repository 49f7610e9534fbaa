r"""Editing 1,000 passages of a bundle searched with ScaNN: the searcher kept, its edits beside it
(`Bundle.edit`, `retrieval.edits.LiveRowIndex`), against the searcher built again.

    python -m benchmarks.bundle_edit --bundle /tmp/rag_default/bundle --passages 200000

For each size N: a corpus of N passages in DPR's format (`synthetic_corpus`), stored with the
bundle's generator tokenizer and layout, encoded by the bundle's passage tower, and a ScaNN
searcher over the vectors, saved as a copy of the bundle's model with those passages. Then the
same edit, twice, each in a fresh process on its own hard-linked copy of that bundle: 500
passages replaced, 250 added, 250 deleted, once as `Bundle.edit` does it and once with
`FOLD_EDITS = 0` (the searcher built again, as every edit did before). Per edit: seconds, peak
anon memory and peak RSS of the process (`benchmarks.scale._in_child`), and the load of the
edited bundle. What an edited searcher returns is tested, not measured here
(tests/io/bundle_test.py: equal to the exact bundle's edit below 20k passages;
tests/retrieval/edits_test.py: an edited ScaNN's recall; the synthetic texts' encodings are too
alike for a recall to mean anything).

JSON lines on stdout; the setup's own times too.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
import time

import numpy as np

from benchmarks import scale
from rag_jax.retrieval import corpus, synthetic_corpus

EDITS = {"replaced": 500, "added": 250, "deleted": 250}


def make_bundle(source: str, count: int, scratch: pathlib.Path, target: pathlib.Path) -> dict:
    """The bundle at `source` with N synthetic passages (written in `scratch`), their vectors
    and a ScaNN searcher over them, saved to `target`; returns the setup's times."""
    from rag_jax.io import bundle
    from rag_jax.retrieval.retriever import Retriever, encode_store
    from rag_jax.retrieval.scann_index import ScannIndex
    from rag_jax.retrieval.store import PassageStore

    model = bundle.load(source)
    times = {}
    start = time.perf_counter()
    tsv = scratch / "corpus.tsv"
    synthetic_corpus.write_dpr_tsv(tsv, count, seed=0)
    layout = {k: model.store.manifest[k] for k in ("prefix", "title_sep", "doc_sep")}
    layout["suffix"] = model.store.manifest.get("suffix", "")
    store = PassageStore.build(
        corpus.read_passages(tsv), model.generator_tokenizer, scratch / "store", **layout
    )
    times["store_s"] = time.perf_counter() - start
    start = time.perf_counter()
    vectors = encode_store(store, model.encoder)
    times["encode_s"] = time.perf_counter() - start
    start = time.perf_counter()
    provenance = {"encoder_fingerprint": model.fingerprint, "corpus_checksum": store.checksum}
    index = ScannIndex.build(vectors, **provenance)
    times["scann_build_s"] = time.perf_counter() - start
    r = model.retriever
    retriever = Retriever(
        index, store, vectors, n_docs=r.n_docs, max_combined_length=r.max_combined_length
    )
    settings = dataclasses.replace(model.settings, index="scann")
    big = bundle.Bundle(
        model.rag_cfg,
        model.encoder,
        model.params,
        model.question_tokenizer,
        model.generator_tokenizer,
        retriever,
        settings,
    )
    start = time.perf_counter()
    big.save(target)
    times["save_s"] = time.perf_counter() - start
    return {k: round(v, 1) for k, v in times.items()}


def the_edit(store_dir: pathlib.Path, seed: int):
    """(upserts, deletes): `EDITS` of the store in `store_dir`."""
    from rag_jax.retrieval.corpus import Passage
    from rag_jax.retrieval.store import PassageStore

    store = PassageStore.open(store_dir, verify=False)
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(store), EDITS["replaced"] + EDITS["deleted"], replace=False)
    replaced, deleted = rows[: EDITS["replaced"]], rows[EDITS["replaced"] :]
    upserts = [
        Passage(store.ids[i], store.title(i), "edited " + store.text(int(i))) for i in replaced
    ]
    upserts += [
        Passage(f"added-{k}", "Added", store.text(int(replaced[k]))) for k in range(EDITS["added"])
    ]
    return upserts, [store.ids[i] for i in deleted]


def edit_child(folder: str, fold: bool, seed: int) -> dict:
    """In a fresh process: load the bundle in `folder`, edit it (with `fold`, the searcher is
    built again) and load the result."""
    from rag_jax.io import bundle

    if fold:
        bundle.FOLD_EDITS = 0.0
    start = time.perf_counter()
    model = bundle.load(folder, verify=False)
    loaded = time.perf_counter() - start
    upserts, deletes = the_edit(pathlib.Path(folder) / "passages", seed)
    start = time.perf_counter()
    report = model.edit(upserts=upserts, deletes=deletes)
    edit_s = time.perf_counter() - start
    start = time.perf_counter()
    again = bundle.load(folder, verify=False)
    reload_s = time.perf_counter() - start
    r = again.retriever
    return {
        "index_rebuilt": report["index_rebuilt"],
        "index": type(r.index).__name__,
        "load_s": round(loaded, 2),
        "edit_s": round(edit_s, 2),
        "reload_s": round(reload_s, 2),
        "count": report["count"],
    }


def _linked_copy(source: pathlib.Path, target: pathlib.Path) -> None:
    """A copy of `source` whose files are hard links (an edit writes a new folder and swaps it
    in, never a file in place)."""
    shutil.copytree(source, target, copy_function=os.link)


def run(bundle_dir: str, sizes: list[int], scratch_root: str | None) -> list[dict]:
    """With `scratch_root`, each size's bundle is kept in `<scratch_root>/bundle_<N>` and reused
    by the next run (the setup is most of the time at millions of passages)."""
    rows = []
    for count in sizes:
        with tempfile.TemporaryDirectory(dir=scratch_root) as tmp:
            scratch = pathlib.Path(tmp)
            source = scratch / "bundle"
            if scratch_root is not None:
                source = pathlib.Path(scratch_root) / f"bundle_{count}"
            if (source / "manifest.json").exists():
                print(json.dumps({"passages": count, "setup": f"reused {source}"}), flush=True)
            else:
                setup = make_bundle(bundle_dir, count, scratch, source)
                print(json.dumps({"passages": count, "setup": setup}), flush=True)
            for fold in (False, True):
                folder = scratch / ("rebuilt" if fold else "kept")
                _linked_copy(source, folder)
                result, memory = scale._in_child(edit_child, str(folder), fold, 0)
                row = {"passages": count, "edit": EDITS, **result, **memory}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default="/tmp/rag_default/bundle", help="a bundle folder")
    parser.add_argument("--passages", default="200000", help="comma-separated corpus sizes")
    parser.add_argument(
        "--scratch", default=None, help="folder for the corpora, kept and reused (default: a temp)"
    )
    args = parser.parse_args(argv)
    run(args.bundle, [int(n) for n in args.passages.split(",")], args.scratch)


if __name__ == "__main__":
    main()
