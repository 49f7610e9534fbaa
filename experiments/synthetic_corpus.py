r"""Writes a synthetic corpus in DPR's `psgs_w100.tsv` format (`retrieval.synthetic_corpus`).

    python experiments/synthetic_corpus.py --passages 1000000 --out /tmp/psgs_1m.tsv

Wikipedia-like passages of 100 words in articles of a few passages, the same bytes for the same
(--passages, --seed); what the scale benchmarks ingest and index in place of the 21M-passage
file that cannot be downloaded here.
"""

import argparse
import json
import time

from rag_jax.retrieval import synthetic_corpus


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, required=True)
    parser.add_argument("--out", required=True, help="the .tsv file to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    info = synthetic_corpus.write_dpr_tsv(args.out, args.passages, args.seed)
    info["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(info), flush=True)
    return info


if __name__ == "__main__":
    main()
