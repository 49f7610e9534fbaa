r"""A retriever that learns a new domain from its reader: any corpus, COVID-QA the example.

    python experiments/domain_study.py --out /tmp/covid --seeds 0 --rows bm25,frozen,hybrid_frozen
    python experiments/domain_study.py --out /tmp/covid --fill_memo dense --rows pdist_k16
    python experiments/domain_study.py --out /tmp/mine --set data.corpus_path='"passages.jsonl"' \
        --set data.train_path='"q.jsonl"' --set data.eval_path='"q.jsonl"'

Every row is `experiments/configs/covidqa.py` (or `--config`, with `--set key=JSON` overrides for
another corpus: any `passages.jsonl` + `questions.jsonl` with SQuAD-style fields and a `split`
field, or a folder of .txt/.md documents as `data.corpus_path`) with the overrides of `ROWS`
(`--set` ones win over a row's own), the same data, models, reader warm start (cached in
`<out>/cache`, shared by every row and seed) and step budget. The reader is frozen in every
row but the reader rows' (`READER_ROWS`); what changes is where the candidates come from
(`retrieval.source`: dense, bm25, hybrid) and what trains the question tower (`train.retriever_*`,
`rag_jax/retriever_losses.py`):
  bm25, frozen, hybrid_frozen    nothing trains: BM25, the bolt-on MiniLM, the two fused;
  joint                          RAG's marginal over the top 4, searched every step (the paper);
  marginal_k16, pdist_k16        RAG's marginal / Atlas' and REPLUG's PDist over 16 candidates
                                 searched once by the initial tower (RA-DIT's fixed top-k);
  *_hybrid                       the same over BM25 and dense candidates fused (hybrid);
  *_passages                     the passage tower's top layers trained too, the index
                                 re-encoded every 120 steps (rag-end2end);
  gold, gold_hybrid              DPR's supervised loss (in-batch and hard negatives) on the
                                 question tower;
  gold_towers(_hybrid)           both towers trained on the gold passages first: the ceiling;
  ict(_hybrid)                   no labels, retriever only: the inverse cloze task on the corpus;
  *_shuffled                     control: the reader's likelihoods shuffled among candidates;
  *_cut                          control: the doc scores' gradient cut (nothing reaches a tower).
The reader rows, over the hybrid rows' fixed candidates, its top 2 layers trained:
  frozen_reader                  nothing trains (bolt-on: the SQuAD reader, the frozen towers);
  pipeline(_retrained)           the reader fine-tuned apart on the training questions' gold
                                 passages, behind the frozen (gold_towers_hybrid's) retriever;
  joint_reader(_passages, _cut)  the reader and question tower (and passage head) by RAG's
                                 marginal; _cut: the doc scores' gradient cut (the reader alone).
Rows that train nothing run one step (one stands for any number).

Writes `<out>/seed<k>/<row>/per_question.jsonl` (gold recall@1/5/20, F1 and EM per dev question),
`<out>/seed<k>/results.json`, and `<out>/summary.json` with every row's paired differences (95%
bootstrap intervals on the same questions) from `frozen`, `bm25` and `hybrid_frozen`.
`--keep docs/results/covidqa` copies the per-question records and summaries into the repository.
`--holdout 0.2` chooses settings on train: the questions of a fifth of the train articles are
evaluated, the rest trained on, and dev is never read (docs/training.md says what was chosen so).
`--fill_memo dense|hybrid` first computes the frozen reader's likelihoods of every training
question's 16 candidates (resumable; what the K-candidate rows read).
"""

import argparse
import json
import os
import pathlib

import squad_study
from feedback_study import run
from rag_jax.devices import host, preemption
from rag_jax.retrieval import passage_trunk
from rag_jax.run import settings

CONFIGS = {"covidqa": squad_study._load_config("covidqa")}

NOTHING = {"train.steps": 1, "train.retriever_lr_factor": 0.0}  # nothing trains
HYBRID = {"retrieval.source": "hybrid"}
FIXED, PDIST = squad_study.FIXED, squad_study.PDIST
# DPR's supervised loss on the question tower over the fixed candidates (hard negatives) and the
# batch's gold passages; it reads no reader (`Batcher.train_batch`). Its rate, 5e-6, was chosen
# on train (`--holdout 0.2`) among 5e-6, 2e-5 and 5e-5 (docs/results/covidqa/README.md).
GOLD = {"train.retriever_loss": "gold", **FIXED, "train.retriever_lr_factor": 0.05}
# Both towers trained before the row (`warm_start.method`), at sentence-transformers' fine-tuning
# rate (2e-5) and batch 32 (set, not chosen): on the training questions' gold passages (the
# supervised ceiling; two epochs of 1,417), or, with no labels, ICT on the corpus (one epoch).
TOWERS = {"warm_start.batch_size": 32, "warm_start.learning_rate": 2e-5}
GOLD_TOWERS = {**TOWERS, "warm_start.method": "gold", "warm_start.steps": 88}
ICT = {**TOWERS, "warm_start.method": "ict", "warm_start.steps": 184}

# The passage tower trained by the reader too (rag-end2end's setting; the gold_towers row says
# the domain's gain is mostly on the passage side): MiniLM's top 2 layers (of 6) train on the
# states of the 4 below, computed once for the corpus (`retrieval.passage_trunk`), and the index
# is re-encoded from them every 120 steps (what searches between refreshes, and what is evaluated).
PASSAGES = {
    "train.freeze": "^generator/|" + passage_trunk.trunk_pattern(4),
    "retrieval.passage_head_layers": 2,
    "retrieval.refresh_every": 120,
}

SHUFFLED = {"train.retriever_shuffle_reader": True}  # the controls
CUT = {"train.retriever_cut_gradient": True}

# The reader trained too, against the pipeline that trains it apart: every row over the PDist
# rows' fixed candidates, BM25's and the dense tower's fused (the hybrid rows are the study's
# strongest), at the same step budget. The reader trains its top READER_LAYERS layers (and final
# norm) of 30: each costs a forward and backward over B x K = 8 x 16 prompts of ~220 tokens a
# step (with the frozen tied LM head's backward over the answers), so on 2 cores 2 layers are
# what the 360 steps afford (~1 to 2 hours a row); 2 of 30 is the passage tower's share too (2
# of 6 train in `PASSAGES`), and the same 2 layers train in the pipeline's reader.
READER_LAYERS = 2
READER_CANDIDATES = {**FIXED, **HYBRID}
READER_TRUNK = "generator/(embed_tokens|layers_(" + "|".join(map(str, range(30 - READER_LAYERS)))
READER_TRUNK += "))/"  # what stays frozen of the reader: its embedding (the tied head) and trunk
TOP = {"model.generator_trained_layers": READER_LAYERS}
# The pipeline: the SQuAD-warm-started reader's top layers fine-tuned on COVID-QA's training
# questions with their gold passages (`warm_start.reader_domain_steps`: the run's own training
# questions, so the train split only; two epochs of 1,417 at the reader warm start's batch of 4,
# the questions the joint rows see), then frozen behind a frozen retriever.
PIPELINE = {**NOTHING, **READER_CANDIDATES, **TOP, "warm_start.reader_domain_steps": 720}
# Joint: the top layers train in the step on the trunk's cached states of the fixed candidates
# (`train.reader_trunk`), with the question tower, by RAG-Sequence's marginal. The reader changes,
# so no answer memo: training reads it, and its evaluation decodes with the trained reader (a
# memo of a reader evaluated once would serve nothing).
JOINT_READER = {
    **READER_CANDIDATES,
    **TOP,
    "train.reader_trunk": True,
    "train.answer_memo": False,
    "eval.answer_memo": False,
    "train.freeze": f"^(passage_encoder/|{READER_TRUNK})",
}
READER_ROWS = {
    "frozen_reader": {**NOTHING, **READER_CANDIDATES},  # bolt-on: evaluated as hybrid_frozen
    "pipeline": PIPELINE,
    # behind the best trained retriever of the study (docs/results/covidqa): gold_towers_hybrid
    "pipeline_retrained": {**PIPELINE, **GOLD_TOWERS},
    "joint_reader": JOINT_READER,
    "joint_reader_passages": {
        **JOINT_READER,
        **PASSAGES,
        "train.freeze": f"^{READER_TRUNK}|" + passage_trunk.trunk_pattern(4),
    },
    "joint_reader_cut": {**JOINT_READER, **CUT},
}

# The passage tower's head trained by the reader over the same 400 questions (their memo), the
# index re-encoded every 50 steps; and its control, the reader's likelihoods shuffled.
N400_PASSAGES = {
    **PDIST,
    **HYBRID,
    **PASSAGES,
    "data.max_train": 400,
    "train.steps": 100,
    "eval.every": 50,
    "retrieval.refresh_every": 50,
    "eval.answers": False,
}

ROWS = {
    "bm25": {**NOTHING, "retrieval.source": "bm25"},
    "frozen": NOTHING,
    "hybrid_frozen": {**NOTHING, **HYBRID},
    "joint": {},
    "marginal_k16": FIXED,
    "pdist_k16": PDIST,
    "joint_hybrid": HYBRID,
    "joint_passages": PASSAGES,
    "pdist_k16_passages": {**PDIST, **PASSAGES},
    "pdist_k16_hybrid_passages": {**PDIST, **HYBRID, **PASSAGES},
    "marginal_k16_hybrid": {**FIXED, **HYBRID},
    "pdist_k16_hybrid": {**PDIST, **HYBRID},
    "gold": GOLD,
    "gold_hybrid": {**GOLD, **HYBRID},
    "gold_towers": {**NOTHING, **GOLD_TOWERS},
    "gold_towers_hybrid": {**NOTHING, **GOLD_TOWERS, **HYBRID},
    "ict": {**NOTHING, **ICT},  # no labels, retriever only: ORQA's inverse cloze task
    "ict_hybrid": {**NOTHING, **ICT, **HYBRID},
    "pdist_k16_shuffled": {**PDIST, **SHUFFLED},
    "pdist_k16_hybrid_shuffled": {**PDIST, **HYBRID, **SHUFFLED},
    "pdist_k16_cut": {**PDIST, **CUT},
    "pdist_k16_hybrid_cut": {**PDIST, **HYBRID, **CUT},
    # The curve over training-set sizes: a seeded sample of the questions (nested in its size),
    # two epochs of it, recalls only; its memo is part of the whole set's.
    "pdist_k16_hybrid_n200": {
        **PDIST,
        **HYBRID,
        "data.max_train": 200,
        "train.steps": 50,
        "eval.every": 25,
        "eval.answers": False,
    },
    "pdist_k16_hybrid_n400": {
        **PDIST,
        **HYBRID,
        "data.max_train": 400,
        "train.steps": 100,
        "eval.every": 50,
        "eval.answers": False,
    },
    "pdist_k16_hybrid_passages_n400": N400_PASSAGES,
    "pdist_k16_hybrid_passages_n400_shuffled": {**N400_PASSAGES, **SHUFFLED},
    **READER_ROWS,
}
COLUMNS = ("gold_recall@1", "gold_recall@5", "gold_recall@20", "f1", "exact_match")
BASELINES = ("frozen", "bm25", "hybrid_frozen")  # each row's paired differences are from these
FILLS = {  # --fill_memo: the candidates whose reader likelihoods are computed ahead
    "dense": PDIST,
    "hybrid": {**PDIST, **HYBRID},
    "hybrid_n200": ROWS["pdist_k16_hybrid_n200"],
    "hybrid_n400": ROWS["pdist_k16_hybrid_n400"],
}


def holdout(fraction: float) -> dict:
    """The overrides that choose settings on train (`--holdout`): `data.eval_path` empty, so the
    questions of `fraction` of the train split's articles, drawn by the seed, are evaluated and
    those of the rest trained on; the eval split is never read."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"--holdout {fraction}: a fraction of the train articles, in (0, 1)")
    return {"data.eval_path": "", "data.eval_fraction": fraction}


def summary(out: pathlib.Path, seeds: list[int]) -> dict:
    """Per row: each column's values over seeds (mean, spread) and its paired differences, seed
    by seed, from every baseline that ran (`squad_study.summary`)."""
    table = squad_study.summary(out, seeds, COLUMNS, BASELINES[0])
    for baseline in BASELINES[1:]:
        by_row = squad_study.intervals(out, seeds, list(table), COLUMNS, baseline)
        for name, by_seed in by_row.items():
            table[name]["versus_" + baseline] = by_seed
    return table


def markdown(table: dict) -> str:
    """`squad_study.markdown`'s tables, one block of paired differences per baseline."""
    blocks = [squad_study.markdown(table, COLUMNS, BASELINES[0])]
    for baseline in BASELINES[1:]:
        text = squad_study.markdown(table, COLUMNS, baseline)
        blocks.append(text[text.index("Paired differences") :])
    return "\n\n".join(blocks)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the runs and results")
    parser.add_argument("--config", default="covidqa", choices=sorted(CONFIGS))
    parser.add_argument("--variant", default="", help="the config's variant ('docs': a folder)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated, run in order")
    parser.add_argument("--set", action="append", default=[], help="override key=JSON value")
    parser.add_argument("--keep", default="", help="copy per-question records and summaries here")
    parser.add_argument("--caches", default="", help="the folder whose caches rows share")
    parser.add_argument("--fill_memo", default="", choices=("", *FILLS), help="fill first")
    parser.add_argument(
        "--holdout",
        type=float,
        default=0.0,
        help="choose settings on train: evaluate on the questions of this fraction of the train "
        "articles (held out whole, drawn by the seed) and train on the rest; the eval split unread",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {sorted(ROWS)}")
    try:  # the --set values apply to the base config and over every row's own overrides
        sets = squad_study.parse_sets(args.set)
    except ValueError as e:
        parser.error(str(e))
    selected = {name: {**ROWS[name], **sets} for name in args.rows.split(",")}
    try:
        held = holdout(args.holdout) if args.holdout else {}
    except ValueError as e:
        parser.error(str(e))
    out = pathlib.Path(args.out).absolute()
    caches = pathlib.Path(args.caches).absolute() if args.caches else out
    seeds = [int(s) for s in args.seeds.split(",")]

    def base_config(seed: int):
        config = CONFIGS[args.config].get_config(args.variant)
        config = settings.override(config, {**sets, "seed": seed, **held})
        config.retrieval.cache_dir = str(caches / "index_cache")  # one encoding of the corpus
        return config

    if args.fill_memo:  # the seeds share the initial model (init_seed): one fill serves them
        try:
            record = squad_study.fill_memo(base_config(seeds[0]), caches, FILLS[args.fill_memo])
            print(json.dumps({"memo_fill": record}), flush=True)
        except preemption.Preempted as stopped:
            print(f"memo fill stopped: {stopped}; the same command resumes", flush=True)
            return
    for seed in seeds:
        results = run(base_config(seed), out / f"seed{seed}", selected, cache_dir=caches / "cache")
        if "preempted" in results:
            print(f"seed {seed}: stopped in row {results['preempted']}; the same command resumes")
            return
    table = summary(out, seeds)
    squad_study.write_summary(out, seeds, table, args.keep)
    print("\n" + markdown(table))


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    main()
