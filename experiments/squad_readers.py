r"""Which reader warm start reads SQuAD best for its CPU time: oracle EM with the gold paragraph.

    python experiments/squad_readers.py --out /tmp/readers --select --steps 300
    python experiments/squad_readers.py --out /tmp/readers --variants default

Each variant is `experiments/configs/squad_open.py` with a few overrides (`VARIANTS`): how many
MiniLM layers the generator's encoder and decoder take, a BERT-initialised or fresh decoder, the
reader task (SQuAD train questions, salient spans of the train paragraphs, or both). Each trains
the reader warm start only (no retrieval, no joint training) and is then evaluated "oracle": every
question with its gold paragraph given alone (p(z|x) = 1), EM/F1 of the generated answer.

`--select` chooses among variants without touching the dev set: whole articles of SQuAD *train*
(`--holdout_articles`, drawn by seed) are left out of the reader's questions and paragraphs, and
the oracle EM is measured on their questions. Without it, the reader trains on all of SQuAD train
and the oracle EM is measured on the SQuAD dev questions (the number the README reports).

Writes `<out>/readers.json` (per variant: oracle EM/F1, reader seconds, seconds per step, context
tokens per second, the reader's loss log) and prints a Markdown table.
"""

import argparse
import json
import os
import pathlib
import time

import numpy as np

from rag_jax.devices import host
from rag_jax.retrieval import files
from rag_jax.retrieval.corpus import read_passages
from rag_jax.run import data, settings, validation
from rag_jax.training import evaluation, experiment
from squad_study import CONFIGS  # the configs, loaded by path

squad_open = CONFIGS["squad_open"]

# config -> variant -> overrides of that config (its "default" is the config as it is).
VARIANTS = {
    "squad_open": {
        "default": {},
        "enc6": {"model.generator_encoder_layers": 6},
        "enc3_dec1": {"model.generator_encoder_layers": 3, "model.generator_decoder_layers": 1},
        "fresh_decoder": {"model.generator_decoder_init": "random"},
        "cross_copy": {"model.generator_decoder_init": "bert_cross"},
        "lr_1e-3": {"warm_start.reader_learning_rate": 1e-3},
        "cross_copy_lr_1e-3": {
            "model.generator_decoder_init": "bert_cross",
            "warm_start.reader_learning_rate": 1e-3,
        },
        "qa+ssm": {"warm_start.reader_task": "qa+ssm"},
        "ssm": {"warm_start.reader_task": "ssm"},
        # The tied embedding / LM head fixed too: no gradient into the 30,522 x 384 table.
        "frozen_embedding": {"train.freeze": squad_open.FREEZE[:-1] + "|generator/shared/)"},
    },
    # SmolLM2-135M-Instruct: untrained, or its top k of 30 layers warm-started.
    "squad_llama": {
        "default": {},
        "zero_shot": {"warm_start.reader_steps": 0},
        "top10": {"warm_start.reader_trained_layers": 10},
        "top20": {"warm_start.reader_trained_layers": 20},
        "all": {"warm_start.reader_trained_layers": 30},
    },
}


def holdout_split(questions_path, passages_path, articles: int, seed: int, out: pathlib.Path):
    """Writes the train questions and paragraphs of all but `articles` articles to `out`;
    returns (their two paths, the held-out articles' questions)."""
    passages = list(read_passages(passages_path))
    titles = sorted({p.title for p in passages})
    rng = np.random.default_rng(seed)
    held = {titles[i] for i in rng.choice(len(titles), articles, replace=False)}
    title_of = {p.id: p.title for p in passages}
    out.mkdir(parents=True, exist_ok=True)
    kept_passages = out / "passages.jsonl"
    kept_questions = out / "questions.jsonl"
    lines = [
        json.dumps({"id": p.id, "title": p.title, "text": p.text})
        for p in passages
        if p.title not in held
    ]
    files.write_atomic(kept_passages, ("\n".join(lines) + "\n").encode())
    kept, held_out = [], []
    with open(questions_path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            (held_out if title_of[record["gold_passage_id"]] in held else kept).append(line)
    files.write_atomic(kept_questions, "".join(kept).encode())
    evals = data.read_examples(questions_path, data.SQUAD_OPEN_FIELDS)
    ids = {json.loads(line)["id"] for line in held_out}
    return kept_questions, kept_passages, [e for e in evals if e.id in ids]


def run_variant(name, overrides, args, out: pathlib.Path) -> dict:
    config = settings.override(CONFIGS[args.config].get_config(), dict(overrides))
    config.warm_start.cache_dir = str(out / name / "cache")  # one reader per variant
    if config.warm_start.reader_steps:  # a zero-shot variant stays at 0
        config.warm_start.reader_steps = args.steps or config.warm_start.reader_steps
    config.seed = args.seed
    if args.select:
        questions, passages, evals = holdout_split(
            config.warm_start.reader_questions_path,
            config.warm_start.reader_corpus_path,
            args.holdout_articles,
            args.seed,
            out / "holdout",
        )
        config.warm_start.reader_questions_path = str(questions)
        config.warm_start.reader_corpus_path = str(passages)
    validation.validate(config, num_devices=1)
    start = time.perf_counter()
    # One workdir for every variant: its passage stores are built once; the readers are cached
    # apart (`warm_start.cache_dir`).
    exp = experiment.build(config, out / "work", retriever=False)
    seconds = time.perf_counter() - start
    if not args.select:
        evals = exp.eval
    if args.sample and args.sample < len(evals):  # a seeded sample, the same for every variant
        chosen = np.random.default_rng(args.sample_seed).choice(len(evals), args.sample, False)
        evals = [evals[i] for i in sorted(chosen)]
    start = time.perf_counter()
    oracle, predictions = evaluation.oracle(exp, exp.params, evals)
    logs = sorted((out / name / "cache" / "warm_start").glob("*.log.json"))
    # {"examples", "answer_cut": per task, "log": [...]}; absent when an old cache was reused.
    log = json.loads(logs[-1].read_text())["log"] if logs else {}
    last = (log.get("log") or [{}])[-1]
    return {
        "overrides": overrides,
        "oracle": oracle,
        "questions": len(evals),
        "build_seconds": round(seconds, 1),
        "oracle_seconds": round(time.perf_counter() - start, 1),
        "reader_steps": config.warm_start.reader_steps,
        "reader_seconds": last.get("seconds"),
        "seconds_per_step": last["seconds"] / last["step"] if last else None,
        "context_tokens_per_second": last["tokens"] / last["seconds"] if last else None,
        "reader": log,
        "examples": predictions[:20],
    }


def table(results: dict) -> str:
    """One Markdown row per variant."""
    head = ["variant", "oracle EM", "oracle F1", "reader loss", "s / step", "tokens / s", "n"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, r in results.items():
        losses = [x["loss"] for x in (r.get("reader") or {}).get("log", [])]
        cells = [
            name,
            f"{r['oracle']['exact_match']:.3f}",
            f"{r['oracle']['f1']:.3f}",
            f"{losses[0]:.2f} -> {losses[-1]:.2f}" if losses else "-",
            f"{r['seconds_per_step']:.2f}" if r["seconds_per_step"] else "-",
            f"{r['context_tokens_per_second']:.0f}" if r["context_tokens_per_second"] else "-",
            str(r["questions"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default="squad_open", choices=sorted(CONFIGS))
    parser.add_argument("--variants", default="", help="comma-separated; empty: all of them")
    parser.add_argument("--select", action="store_true", help="held-out train articles")
    parser.add_argument("--holdout_articles", type=int, default=20)
    parser.add_argument("--steps", type=int, default=0, help="reader steps; 0 = the config's")
    parser.add_argument("--sample", type=int, default=0, help="N evaluation questions; 0 = all")
    parser.add_argument("--sample_seed", type=int, default=0, help="seed of that sample")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    out = pathlib.Path(args.out).absolute()
    path = out / "readers.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    variants = VARIANTS[args.config]
    for name in args.variants.split(",") if args.variants else variants:
        if name not in variants:
            parser.error(f"unknown {args.config} variant {name!r}; choose from {sorted(variants)}")
        print(f"\n== {name} ==", flush=True)
        results[name] = run_variant(name, variants[name], args, out)
        print(json.dumps({name: results[name]["oracle"]}), flush=True)
        files.write_atomic(path, json.dumps(results, indent=1).encode())
    print("\n" + table(results))


if __name__ == "__main__":
    host.restart_with_host_settings()
    main()
