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
import importlib.util
import json
import os
import pathlib

import numpy as np

import feedback_study
from rag_jax.devices import distributed, host
from rag_jax.retrieval import files
from rag_jax.retrieval.build import workdir_store
from rag_jax.retrieval.index import ExactIndex
from rag_jax.run import evaluation, settings
from rag_jax.training import loop, salient


def _load_config(name: str):
    """experiments/configs/<name>.py, loaded by path (the script works from any directory)."""
    spec = importlib.util.spec_from_file_location(
        name, pathlib.Path(__file__).resolve().parent / "configs" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONFIGS = {name: _load_config(name) for name in ("squad_open", "squad_llama")}
squad_open = CONFIGS["squad_open"]

ROWS = {
    "closed_book": {"rag.closed_book": True, "rag.n_docs": 1},
    "frozen": {"train.retriever_lr_factor": 0.0},
    "joint": {},
    # RAG-Token's answers depend on every passage's doc score at every token: not memoised.
    "joint_token": {"rag.variant": "token", "eval.answer_memo": False},
    # Row 2 decoded as row 4 is: what joint training adds to RAG-Token, decoding held equal.
    "frozen_token": {
        "rag.variant": "token",
        "eval.answer_memo": False,
        "train.retriever_lr_factor": 0.0,
    },
}
COLUMNS = ("answer_recall@1", "answer_recall@5", "gold_recall@5", "exact_match", "f1")


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


def summary(out: pathlib.Path, seeds: list[int]) -> dict:
    """Per row and column: the values of every seed, their mean and standard deviation."""
    table = {}
    for seed in seeds:
        results = json.loads((out / f"seed{seed}" / "results.json").read_text())
        for name, row in results["rows"].items():
            entry = table.setdefault(name, {"seconds": [], "hot_swap": []})
            entry["seconds"].append(row["seconds"])
            if row.get("hot_swap"):
                entry["hot_swap"].append(row["hot_swap"])
            for k in COLUMNS:
                if k in row["final"]:
                    entry.setdefault(k, []).append(row["final"][k])
    for entry in table.values():
        for k in COLUMNS:
            if k in entry:
                v = entry[k]
                entry[k] = {"seeds": v, "mean": float(np.mean(v)), "std": float(np.std(v))}
    return table


def markdown(table: dict) -> str:
    lines = ["| row | " + " | ".join(COLUMNS) + " | minutes / run | hot swap EM new / old |"]
    lines.append("|---" * (len(COLUMNS) + 3) + "|")
    for name, entry in table.items():
        cells = [
            f"{entry[k]['mean']:.3f} ± {entry[k]['std']:.3f}" if k in entry else "-"
            for k in COLUMNS
        ]
        swaps = entry["hot_swap"]
        swap = "-"
        if swaps:
            new = np.mean([s["em_new_answers_after_edit"] for s in swaps])
            old = np.mean([s["em_old_answers_before_edit"] for s in swaps])
            swap = f"{new:.3f} / {old:.3f}"
        minutes = np.mean(entry["seconds"]) / 60
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {minutes:.1f} | {swap} |")
    return "\n".join(lines)


def selected_rows(names: list[str], sets: list[str]) -> dict[str, dict]:
    """Row name -> its overrides, in the order asked, each with the `--set key=value` ones (a JSON
    value): a row is kept on a later run only if it ran with the same settings, and its
    results say how it ran."""
    extra = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value (a JSON value)")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--set {item!r}: the value is not JSON ({e})") from None
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
    parser.add_argument("--swap_questions", type=int, default=100)
    parser.add_argument(
        "--set", action="append", default=[], help="extra override key=value (JSON value)"
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
    seeds = [int(s) for s in args.seeds.split(",")]
    for seed in seeds:
        config = CONFIGS[args.config].get_config(args.variant)
        base = settings.override(config, {"seed": seed})
        base.retrieval.cache_dir = str(out / "index_cache")  # one encoding of the corpus
        results = feedback_study.run(
            base,
            out / f"seed{seed}",
            selected,
            swap=lambda workdir: hot_swap(workdir, args.swap_questions, 0),  # noqa: B023
            cache_dir=out / "cache",
        )
        if "preempted" in results:
            print(f"seed {seed}: stopped in row {results['preempted']}; the same command resumes")
            return
    table = summary(out, seeds)
    files.write_atomic(out / "summary.json", json.dumps(table, indent=1).encode())
    print("\n" + markdown(table))
    print(f"\nwrote {out / 'summary.json'} and {out}/seed*/curves.png")


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    main()
