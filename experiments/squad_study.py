r"""The feedback loop on real text: does joint training beat a frozen retriever on SQuAD?

    python experiments/squad_study.py --out /tmp/squad_study                 # every row x 3 seeds
    python experiments/squad_study.py --out /tmp/squad_quick --variant dev --seeds 0
    python experiments/squad_study.py --config squad_llama --out /tmp/llama_study

Every row is `experiments/configs/squad_open.py` (or `--config squad_llama`) with the overrides of
`ROWS` (the README's row commands differ by exactly these), the same data, models, warm starts
(the reader warm start is cached once in `<out>/cache` and shared by every row and seed:
`init_seed`; so is squad_llama's answer memo) and step budget:
  1. closed_book   the generator alone, the question as its only context;
  2. frozen        MiniLM retrieves, frozen; the generator trains (bolt-on RAG; squad_llama's
                   generator is frozen in every row, so nothing trains in this one);
  3. joint         the question encoder trains through the RAG-Sequence likelihood;
  4. joint_token   the same through RAG-Token (its evaluation decodes without the memos);
  -  frozen_token  row 2 trained and decoded as row 4 (RAG-Token): row 4's own baseline.
Seeds vary the batches and dropout (`seed`), not the initial model (`init_seed`).

Hot swap on real text, for rows 2-4: in the gold paragraphs of up to `--swap_questions` dev
questions the answer (a year, date, number or name) is replaced by another of the same kind
(`salient.edit_answers`); the edited paragraphs are re-encoded with the run's unchanged passage
encoder and swapped into the index, no parameter changes; then EM on those questions against the
new answers, against the old ones (still answered from memory), and, before the edit, against the
old ones.

Writes `<out>/seed<k>/results.json` per seed (`feedback_study.run`: per row the final metrics on
every dev question, learning curves, seconds, hot swap), `<out>/seed<k>/curves.png`, and
`<out>/summary.json` + a Markdown table of the means and spreads over seeds.
"""

import argparse
import gzip
import importlib.util
import json
import os
import pathlib
import shutil
import time

import numpy as np

import feedback_study
from rag_jax.devices import distributed, host, preemption
from rag_jax.retrieval import files, passage_trunk
from rag_jax.retrieval.corpus import read_corpus
from rag_jax.retrieval.index import ExactIndex
from rag_jax.run import articles, data, paired, settings
from rag_jax.run.index_build import workdir_store
from rag_jax.training import evaluation, experiment, loop, salient
from rag_jax.training.batcher import Batcher


def _load_config(name: str):
    """experiments/configs/<name>.py, loaded by path (the script works from any directory)."""
    spec = importlib.util.spec_from_file_location(
        name, pathlib.Path(__file__).resolve().parent / "configs" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONFIGS = {name: _load_config(name) for name in ("squad_open", "squad_llama", "squad_objectives")}
squad_open = CONFIGS["squad_open"]

K = 16  # the retriever objectives' candidates per question (the reader reads rag.n_docs)
# Each training question's K candidates are searched once, before training, by the initial
# question tower (RA-DIT's fixed top-k scored once by the reader): every (passage, question)
# pair is one `--fill_memo` computed. Searched again every step, the candidates drift with the
# tower and each step's new pairs cost the frozen reader's forward passes (8-15 s a step here).
FIXED = {"train.retriever_candidates": K, "train.retriever_fixed_candidates": True}
PDIST = {"train.retriever_loss": "pdist", **FIXED}

ROWS = {
    "closed_book": {"rag.closed_book": True, "rag.n_docs": 1},
    "frozen": {"train.retriever_lr_factor": 0.0},
    "joint": {},
    # What the retriever learns from the reader (rag_jax.retriever_losses), over K candidates.
    "marginal_k16": FIXED,
    "pdist_k16": PDIST,
    "emdr2_k16": {"train.retriever_loss": "emdr2", **FIXED},
    # The recorded loop_k16 rows ran the retriever-weighted leave-one-out (now loop_weighted;
    # `loop` is Atlas' form since); the row keeps running what it ran.
    "loop_k16": {"train.retriever_loss": "loop_weighted", **FIXED},
    # pdist with its candidates searched again every step, as RAG's own rows search.
    "pdist_k16_searched": {**PDIST, "train.retriever_fixed_candidates": False},
    # The passage side: MiniLM's top layer (of 6) trains too, on the states of the 5 below it,
    # computed once (retrieval.passage_trunk); the index re-encoded from them every 150 steps.
    "pdist_k16_passages": {
        **PDIST,
        "train.freeze": "^generator/|" + passage_trunk.trunk_pattern(5),
        "retrieval.passage_head_layers": 1,
        "retrieval.refresh_every": 150,
    },
    # Controls. The ceiling: the question tower trained on the gold paragraphs (DPR's loss, in-
    # batch and hard negatives). No feedback: pdist with the reader's likelihoods shuffled among
    # each question's candidates.
    "gold": {"train.retriever_loss": "gold", **FIXED},
    "pdist_k16_shuffled": {**PDIST, "train.retriever_shuffle_reader": True},
    # The curve over training-set sizes (the article sample is nested in its size).
    "pdist_k16_n600": {**PDIST, "data.max_train": 600},
    "pdist_k16_n1500": {**PDIST, "data.max_train": 1500},
    # RAG-Token's answers depend on every passage's doc score at every token: not memoised.
    "joint_token": {"rag.variant": "token", "eval.answer_memo": False},
    # Row 2 decoded as row 4 is: what joint training adds to RAG-Token, decoding held equal.
    "frozen_token": {
        "rag.variant": "token",
        "eval.answer_memo": False,
        "train.retriever_lr_factor": 0.0,
    },
}
COLUMNS = (
    "answer_recall@1",
    "answer_recall@5",
    "gold_recall@1",
    "gold_recall@5",
    "exact_match",
    "f1",
)
BASELINE = "frozen"  # every row's paired differences are against it, seed by seed


def hot_swap(workdir: pathlib.Path, count: int, seed: int) -> dict:
    """EM before and after answers are changed in their gold paragraphs (see the module doc)."""
    exp, state, _ = loop.restore(workdir)
    store = exp.retriever.store
    passages = [store.passage(i) for i in range(len(store))]
    corpus, new, old = salient.edit_answers(passages, exp.eval, count, seed)
    edited_store = workdir_store(
        corpus, exp.generator_tokenizer, workdir / "hot_swap_passages", exp.rag_cfg.context_layout
    )
    # Only the edited paragraphs are encoded again, with the run's own passage encoder.
    encoder = exp.passage_encoder(distributed.replicated_to_host(state.params["passage_encoder"]))
    rows = [i for i, (a, b) in enumerate(zip(passages, corpus)) if a != b]
    vectors = np.array(exp.retriever.vectors, np.float32)
    vectors[rows] = encoder.encode([corpus[i] for i in rows])
    index = ExactIndex(
        vectors, encoder_fingerprint=encoder.fingerprint, corpus_checksum=edited_store.checksum
    )
    swapped = exp.retriever.swap(index, edited_store, vectors)
    mesh = loop.device_mesh(exp.config)
    variant = exp.config.rag.variant

    def em(examples, retriever):
        m, _ = evaluation.evaluate(
            exp, state.params, examples, mesh=mesh, variant=variant, retriever=retriever
        )
        return m["exact_match"]

    return {
        "edited_questions": len(new),
        "em_new_answers_after_edit": em(new, swapped),
        "em_old_answers_after_edit": em(old, swapped),
        "em_old_answers_before_edit": em(old, exp.retriever),
    }


def fill_memo(base, out: pathlib.Path, overrides=None) -> dict:
    """Computes, ahead of the rows, the frozen reader's answer likelihoods of every training
    question's K candidates under the initial question encoder (what the K-candidate rows read
    at their first steps, and the frozen row throughout), grouped by shared passage
    (`AnswerMemo.fill`); `overrides` (default `PDIST`) say how the candidates are found.
    Resumable: a killed fill keeps what it saved; a second run computes
    only what is missing. Returns (and writes to `out/memo_fill.json`) the counts and time."""
    config = feedback_study.row_config(base, overrides or PDIST, str(out / "cache"))
    start = time.perf_counter()
    # A SIGTERM during the warm starts, the encoding or the fill saves what they did (Preempted).
    preemption.install_preemption_handler()
    exp = experiment.build(config, out / "memo_fill")
    batcher = Batcher(exp, loop.device_mesh(config))
    prompts, answers = batcher.memo_pairs(exp.params, exp.train, exp.retriever)
    prepared = time.perf_counter() - start
    computed = batcher.memo.fill(exp.params["generator"], prompts, answers)
    record = {
        "questions": len(exp.train),
        "candidates": K,
        "pairs": len(prompts),
        "distinct_prompts": len({p.tobytes() for p in prompts}),
        "computed": computed,
        "setup_seconds": round(prepared, 1),
        "fill_seconds": round(time.perf_counter() - start - prepared, 1),
        "memo": str(batcher.memo.path),
    }
    files.write_atomic(out / "memo_fill.json", json.dumps(record, indent=1).encode())
    return record


def write_slice(config, count: int, path: pathlib.Path) -> int:
    """Writes `count` questions of the training file to the JSONL `path`: whole articles after
    the training sample's in its seeded order, none an article any training question is about
    (`articles.next_articles`), for choosing settings without the evaluation questions
    (`--set data.eval_path="<path>"`). Returns the articles' count."""
    d = config.data
    if d.sample_by != "article" or not d.max_train or d.sample_seed < 0:
        raise ValueError("a slice follows a seeded sample of whole articles (data.sample_by)")
    fields = dict(d.fields or {})
    train = data.read_examples(d.train_path, fields or None)
    titles = {p.id: p.title for p in read_corpus(d.corpus_path)}
    chosen = articles.next_articles(train, titles, d.max_train, count, d.sample_seed)
    key = lambda name: fields.get(name, name)  # noqa: E731  the file's names, as it reads them
    lines = [
        {
            key("id"): e.id,
            key("question"): e.question,
            key("answers"): list(e.answers),
            key("gold_ids"): list(e.gold_ids),
        }
        for e in chosen
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    files.write_atomic(path, text.encode())
    return len({titles[e.gold_ids[0]] for e in chosen})


def summary(out: pathlib.Path, seeds: list[int], columns=COLUMNS, baseline: str = BASELINE) -> dict:
    """Per row and column: the values of every seed, their mean and standard deviation, and
    each row's paired differences from `baseline` (`intervals`)."""
    table = {}
    for seed in seeds:
        results = json.loads((out / f"seed{seed}" / "results.json").read_text())
        for name, row in results["rows"].items():
            entry = table.setdefault(name, {"seconds": [], "hot_swap": []})
            entry["seconds"].append(row["seconds"])
            if row.get("hot_swap"):
                entry["hot_swap"].append(row["hot_swap"])
            for k in columns:
                if k in row["final"]:
                    entry.setdefault(k, []).append(row["final"][k])
    for entry in table.values():
        for k in columns:
            if k in entry:
                v = entry[k]
                entry[k] = {"seeds": v, "mean": float(np.mean(v)), "std": float(np.std(v))}
    for name, by_seed in intervals(out, seeds, list(table), columns, baseline).items():
        table[name]["versus_" + baseline] = by_seed
    return table


def intervals(
    out: pathlib.Path, seeds: list[int], names: list[str], columns=COLUMNS, baseline=BASELINE
) -> dict:
    """Row -> seed -> column -> the paired difference from `baseline` of the same seed on the
    same questions, with its bootstrap 95% interval (`run.paired`), from the rows'
    `per_question.jsonl`; a column only one side has (the closed book's recalls) is left out."""
    out_rows = {}
    for seed in seeds:
        base_path = out / f"seed{seed}" / baseline / "per_question.jsonl"
        if not base_path.is_file():
            continue
        base = paired.read_per_question(base_path)
        for name in names:
            path = out / f"seed{seed}" / name / "per_question.jsonl"
            if name == baseline or not path.is_file():
                continue
            row = paired.read_per_question(path)
            has = lambda records, k: any(k in r for r in records.values())  # noqa: E731
            out_rows.setdefault(name, {})[f"seed{seed}"] = {
                k: paired.paired_difference(base, row, k, seed=seed)
                for k in columns
                if has(base, k) and has(row, k)
            }
    return out_rows


def keep_per_question(out: pathlib.Path, seeds: list[int], folder: pathlib.Path) -> list:
    """Copies every row's `per_question.jsonl` (gzipped) to `folder/seed<k>/<row>.jsonl.gz`, with
    each seed's results.json: what the repository keeps beside the README's rows (the intervals
    are recomputed from them with `run.paired`)."""
    written = []
    for seed in seeds:
        for path in sorted((out / f"seed{seed}").glob("*/per_question.jsonl")):
            target = folder / f"seed{seed}" / f"{path.parent.name}.jsonl.gz"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(gzip.compress(path.read_bytes(), mtime=0))
            written.append(target)
        results = out / f"seed{seed}" / "results.json"
        if results.is_file():
            shutil.copyfile(results, folder / f"seed{seed}" / "results.json")
    return written


def write_summary(out: pathlib.Path, seeds: list[int], table: dict, keep: str) -> None:
    """Writes `out/summary.json`; with `keep` (a folder), copies it there with every row's
    per-question records and results (`keep_per_question`)."""
    files.write_atomic(out / "summary.json", json.dumps(table, indent=1).encode())
    if keep:
        kept = keep_per_question(out, seeds, pathlib.Path(keep))
        shutil.copyfile(out / "summary.json", pathlib.Path(keep) / "summary.json")
        print(f"kept {len(kept)} per-question files and the summary in {keep}")


def markdown(table: dict, columns=COLUMNS, baseline: str = BASELINE) -> str:
    """The rows' means ± spreads over seeds, then each row's paired differences from
    `baseline` per seed with their 95% intervals."""
    lines = ["| row | " + " | ".join(columns) + " | minutes / run | hot swap EM new / old |"]
    lines.append("|---" * (len(columns) + 3) + "|")
    for name, entry in table.items():
        cells = [
            f"{entry[k]['mean']:.3f} ± {entry[k]['std']:.3f}" if k in entry else "-"
            for k in columns
        ]
        swaps = entry["hot_swap"]
        swap = "-"
        if swaps:
            new = np.mean([s["em_new_answers_after_edit"] for s in swaps])
            old = np.mean([s["em_old_answers_before_edit"] for s in swaps])
            swap = f"{new:.3f} / {old:.3f}"
        minutes = np.mean(entry["seconds"]) / 60
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {minutes:.1f} | {swap} |")
    lines += ["", f"Paired differences from {baseline} (95% bootstrap intervals):", ""]
    lines.append("| row | seed | " + " | ".join(columns) + " |")
    lines.append("|---" * (len(columns) + 2) + "|")
    for name, entry in table.items():
        for seed, diffs in entry.get("versus_" + baseline, {}).items():
            cells = [
                f"{d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
                if (d := diffs.get(k))
                else "-"
                for k in columns
            ]
            lines.append(f"| {name} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_sets(items: list[str]) -> dict:
    """`--set key=value` items (a JSON value each) as overrides."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value (a JSON value)")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--set {item!r}: the value is not JSON ({e})") from None
    return out


def selected_rows(names: list[str], sets: list[str]) -> dict[str, dict]:
    """Row name -> its overrides, in the order asked, each with the `--set key=value` ones (a JSON
    value): a row is kept on a later run only if it ran with the same settings, and its
    results say how it ran."""
    extra = parse_sets(sets)
    return {name: {**ROWS[name], **extra} for name in names}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the runs and results")
    parser.add_argument("--config", default="squad_open", choices=sorted(CONFIGS))
    parser.add_argument("--variant", default="", choices=("", "dev"), help="the config's variant")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument(
        "--rows", default=",".join(ROWS), help="comma-separated subset, run in this order"
    )
    parser.add_argument(
        "--swap_questions", type=int, default=100, help="the hot swap's questions; 0: no hot swap"
    )
    parser.add_argument(
        "--set", action="append", default=[], help="extra override key=value (JSON value)"
    )
    parser.add_argument(
        "--keep", default="", help="also copy results.json and the per-question records here"
    )
    parser.add_argument(
        "--caches",
        default="",
        help="the folder whose cache/ and index_cache/ the rows share (default: --out), e.g. "
        "the main study's from a study choosing settings on a slice",
    )
    parser.add_argument(
        "--write_slice",
        type=int,
        default=0,
        help="write N training questions of the articles after the training sample's to "
        "<out>/train_slice.jsonl (to choose settings on: --set data.eval_path) and stop",
    )
    parser.add_argument(
        "--fill_memo",
        action="store_true",
        help="first compute the answer memo of the training questions' candidates (resumable)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {sorted(ROWS)}")
    try:
        selected = selected_rows(args.rows.split(","), args.set)
    except ValueError as e:
        parser.error(str(e))
    out = pathlib.Path(args.out).absolute()
    caches = pathlib.Path(args.caches).absolute() if args.caches else out
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.write_slice:
        config = CONFIGS[args.config].get_config(args.variant)
        path = out / "train_slice.jsonl"
        out.mkdir(parents=True, exist_ok=True)
        count = write_slice(config, args.write_slice, path)
        print(f"wrote {args.write_slice} questions of {count} articles to {path}")
        print(f"choose on them: --set data.eval_path='\"{path}\"'")
        return
    if args.fill_memo:  # the seeds share the initial model (init_seed): one fill serves them
        base = settings.override(CONFIGS[args.config].get_config(args.variant), {"seed": seeds[0]})
        base.retrieval.cache_dir = str(caches / "index_cache")
        try:
            print(json.dumps({"memo_fill": fill_memo(base, caches)}), flush=True)
        except preemption.Preempted as stopped:
            print(f"memo fill stopped: {stopped}; the same command resumes", flush=True)
            return
    for seed in seeds:
        config = CONFIGS[args.config].get_config(args.variant)
        base = settings.override(config, {"seed": seed})
        base.retrieval.cache_dir = str(caches / "index_cache")  # one encoding of the corpus
        results = feedback_study.run(
            base,
            out / f"seed{seed}",
            selected,
            swap=(lambda workdir: hot_swap(workdir, args.swap_questions, 0))
            if args.swap_questions
            else None,
            cache_dir=caches / "cache",
        )
        if "preempted" in results:
            print(f"seed {seed}: stopped in row {results['preempted']}; the same command resumes")
            return
    table = summary(out, seeds)
    write_summary(out, seeds, table, args.keep)
    print("\n" + markdown(table))
    print(f"\nwrote {out / 'summary.json'} and {out}/seed*/curves.png")


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    main()
