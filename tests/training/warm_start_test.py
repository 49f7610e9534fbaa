"""The reader warm start (the generator reads another world first) and the warm-start cache."""

import functools
import json

import jax
import numpy as np
import pytest

from rag_jax.retrieval.store import PassageStore
from rag_jax.run import data
from rag_jax.training import reader, warm_start

# ---------------------------------------------------------------------------------------------
# The reader warm start (the generator), and its place in experiment.build


@pytest.fixture(scope="module")
def reader_exp(tmp_path_factory):
    from rag_jax.training import experiment
    from tiny_runs import tiny_config

    config = tiny_config(**{"warm_start.reader_steps": 0})
    return experiment.build(config, tmp_path_factory.mktemp("reader"))


def test_reader_warm_start_learns_to_read_deterministically(reader_exp):
    exp = reader_exp
    train_generator = functools.partial(
        reader.reader_warm_start,
        exp.rag_cfg,
        exp.params["generator"],
        exp.generator_tokenizer,
        exp.store,
        exp.train,
        steps=40,
        batch_size=8,
        learning_rate=2e-3,
        seed=0,
        answer_length=exp.config.data.answer_length,
    )
    before = jax.tree.map(np.array, exp.params["generator"])
    generator, log = train_generator()
    assert [r["step"] for r in log] == list(range(4, 41, 4))
    assert log[-1]["loss"] < 0.5 * log[0]["loss"], log
    again, _ = train_generator()
    for a, b in zip(jax.tree.leaves(generator), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(exp.params["generator"]), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)  # the caller's tree is left alone

    with pytest.raises(ValueError, match="batch_size <= examples"):
        train_generator(steps=1, batch_size=len(exp.train) + 1)
    stray = data.Example("q ?", ("a",), "x", ("no_such_passage",))
    with pytest.raises(ValueError, match="name no passage of the store, e.g. x"):
        reader.reader_warm_start(
            exp.rag_cfg,
            exp.params["generator"],
            exp.generator_tokenizer,
            exp.store,
            [stray],
            steps=1,
            batch_size=1,
            learning_rate=1e-3,
            seed=0,
            answer_length=8,
        )


def test_experiment_reads_another_world_and_caches_it(tmp_path, reader_exp, capsys):
    from rag_jax.training import experiment
    from tiny_runs import tiny_config

    config = tiny_config(**{"warm_start.cache_dir": str(tmp_path / "cache")})
    exp = experiment.build(config, tmp_path / "a")
    assert "reader warm start: 2 steps" in capsys.readouterr().out
    # Only the generator moved; its world is another one (own entities left out).
    for name in ("question_encoder", "passage_encoder"):
        for a, b in zip(
            jax.tree.leaves(exp.params[name]), jax.tree.leaves(reader_exp.params[name])
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = [
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(
            jax.tree.leaves(exp.params["generator"]),
            jax.tree.leaves(reader_exp.params["generator"]),
        )
    ]
    assert sum(moved) > 10
    other = PassageStore.open(tmp_path / "a" / "reader_world")
    own_entities = {f.entity for f in exp.world.facts}
    assert not {other.title(i) for i in range(len(other))} & own_entities
    again = experiment.build(config, tmp_path / "b")  # another workdir, the same cache
    assert "reader warm start: reusing" in capsys.readouterr().out
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(exp.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    config.data.source = "files"
    with pytest.raises(ValueError, match="reader_data='synthetic' needs data.source='synthetic'"):
        warm_start.generator(
            config, exp.rag_cfg, exp.params, exp.generator_tokenizer, tmp_path, exp.world
        )


# ---------------------------------------------------------------------------------------------
# The reader warm start on files (real text's: questions with their gold passages, salient spans)


def _world_files(exp, directory):
    """The experiment's world as a questions file (with gold ids) and a passages file."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    questions = directory / "questions.jsonl"
    passages = directory / "passages.jsonl"
    rows = [
        {
            "question": e.question,
            "answers": list(e.answers),
            "id": e.id,
            "gold_ids": list(e.gold_ids),
        }
        for e in exp.train
    ]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = [exp.store.passage(i) for i in range(len(exp.store))]
    passages.write_text(
        "".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n" for p in records)
    )
    return questions, passages


def test_reader_on_files_learns_to_read_and_the_oracle_says_so(tmp_path, reader_exp, capsys):
    from rag_jax.training import evaluation, experiment
    from tiny_runs import tiny_config

    questions, passages = _world_files(reader_exp, tmp_path / "files")
    overrides = {
        "warm_start.reader_data": "files",
        "warm_start.reader_questions_path": str(questions),
        "warm_start.reader_corpus_path": str(passages),
        "warm_start.reader_steps": 60,
        "warm_start.reader_batch_size": 8,
        "warm_start.reader_learning_rate": 2e-3,
        "warm_start.cache_dir": str(tmp_path / "cache"),
    }
    config = tiny_config(**overrides)
    exp = experiment.build(config, tmp_path / "a", retriever=False)
    assert f"reader warm start: 60 steps on {len(reader_exp.train)} qa examples" in (
        capsys.readouterr().out
    )
    # Only the generator moved.
    for name in ("question_encoder", "passage_encoder"):
        for a, b in zip(
            jax.tree.leaves(exp.params[name]), jax.tree.leaves(reader_exp.params[name])
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Oracle: each question with its gold passage alone. Before the warm start the generator
    # reads nothing; after it, it answers most of the questions it read.
    before, _ = evaluation.oracle(reader_exp, reader_exp.params, reader_exp.train[:32])
    after, predictions = evaluation.oracle(exp, exp.params, exp.train[:32])
    assert before["exact_match"] < 0.1 and after["exact_match"] > 0.5, (before, after)
    assert [p["retrieved"] for p in predictions] == [list(e.gold_ids[:1]) for e in exp.train[:32]]
    # The same settings reuse the cached warm start; its log is kept beside it.
    again = experiment.build(config, tmp_path / "b", retriever=False)
    assert "reader warm start: reusing" in capsys.readouterr().out
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(exp.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (log,) = (tmp_path / "cache" / "warm_start").glob("*.log.json")
    records = json.loads(log.read_text())["log"]["log"]
    assert records[-1]["step"] == 60 and records[-1]["tokens"] > 0 and records[-1]["seconds"] > 0

    # Salient spans alternate with the questions (qa+ssm); both tasks' examples are counted.
    # The world's lower-case passages have no salient span: refused, naming the corpus.
    mixed = tiny_config(**dict(overrides, **{"warm_start.reader_task": "qa+ssm"}))
    mixed.warm_start.reader_steps = 2
    with pytest.raises(ValueError, match=rf"the ssm task found no examples in {passages}"):
        experiment.build(mixed, tmp_path / "c", retriever=False)
    spans = tmp_path / "files" / "spans.jsonl"
    records = [json.loads(line) for line in passages.read_text().splitlines()]
    for r in records:  # first: a 32-token context shows only the passage's first sentence
        r["text"] = f"It was first measured in 1889 by Gustave Eiffel. So {r['text']}"
    spans.write_text("".join(json.dumps(r) + "\n" for r in records))
    mixed.warm_start.reader_corpus_path = str(spans)
    experiment.build(mixed, tmp_path / "c", retriever=False)
    assert f"{len(exp.train)} qa examples and {len(records)} ssm examples" in (
        capsys.readouterr().out
    )

    # A question whose gold passage is not in the reader's corpus is refused, naming it.
    stray = tmp_path / "files" / "stray.jsonl"
    stray.write_text(
        questions.read_text()
        + json.dumps({"question": "q?", "answers": ["a"], "id": "odd", "gold_ids": ["nowhere"]})
        + "\n"
    )
    bad = tiny_config(**dict(overrides, **{"warm_start.reader_questions_path": str(stray)}))
    with pytest.raises(ValueError, match=r"1 examples name no passage of the store, e.g\. odd "
                       r"\(gold passage 'nowhere'\)"):  # fmt: skip
        experiment.build(bad, tmp_path / "d", retriever=False)
    with pytest.raises(ValueError, match=r"1 questions have no gold passage in the store"):
        evaluation.oracle(exp, exp.params, [data.Example("q?", ("a",), "odd", ("nowhere",))])


def test_questions_whose_gold_passage_is_not_in_the_corpus_are_refused(reader_exp, tmp_path):
    """`experiment.build` checks every question's gold ids against the store before any warm
    start: a missing one would count as a retrieval miss no model could avoid. From a questions
    file, the error names its file, line and field."""
    from rag_jax.training import experiment

    exp = reader_exp
    stray = data.Example("q?", ("a",), "odd", ("no_such_passage",))
    experiment._check_gold_ids(exp.config, exp.train, exp.eval, exp.store)  # the world's: fine
    with pytest.raises(ValueError, match=r"the eval questions: gold passage id 'no_such_passage' "
                       r"of question 'odd' is not in the corpus \(.*, \d+ passages; 1 gold ids "
                       r"of the eval questions are not\)"):  # fmt: skip
        experiment._check_gold_ids(exp.config, exp.train, [*exp.eval, stray], exp.store)
    questions = tmp_path / "q.jsonl"
    lines = [
        {"question": "q?", "answers": ["a"], "id": i, "gold": g}
        for i, g in (("fine", exp.store.ids[0]), ("odd", "no_such_passage"))
    ]  # noqa: E501
    questions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = exp.config.copy_and_resolve_references()
    config.data.update(source="files", train_path=str(questions), eval_path=str(questions))
    config.data.fields = {"gold_ids": "gold"}
    examples = data.read_examples(questions, {"gold_ids": "gold"})
    with pytest.raises(ValueError, match=r"q\.jsonl, line 2, field 'gold': gold passage id "
                       r"'no_such_passage' of question 'odd'"):  # fmt: skip
        experiment._check_gold_ids(config, examples, [], exp.store)


# ---------------------------------------------------------------------------------------------
# Answers the reader's context cuts off, and the reader's dropout


def test_an_answer_counts_as_shown_only_within_the_kept_passage_tokens(tmp_path):
    """`answers_in_context` on MiniLM's WordPiece: an answer shows when its first occurrence in
    the passage (title or text) ends within the characters of the tokens the context keeps."""
    import transformers

    import hf_fixtures

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_fixtures.minilm_path()))
    filler = " ".join(["word"] * 20)
    records = [
        ("early", "Paris", f"Levi's Stadium opened in 2014. {filler}"),
        ("late", "Paris", f"{filler} Levi's Stadium opened in 2014."),
        ("titled", "Levi's Stadium", f"{filler} It opened in 2014."),
    ]
    store = PassageStore.build(records, tokenizer, tmp_path / "store")
    ask = lambda pid, answer, question="when?": data.Example(question, (answer,), pid, (pid,))  # noqa: E731
    examples = [
        ask("early", "Levi's Stadium"),
        ask("late", "Levi's Stadium"),  # after 20 filler tokens: cut from a 16-token context
        ask("titled", "Levi's Stadium"),  # in the title
        ask("early", "2014"),
        ask("early", "Candlestick Park"),  # in no passage
        ask("late", "word"),  # its first occurrence is kept
    ]
    shown = reader.answers_in_context(store, tokenizer, examples, 16)
    np.testing.assert_array_equal(shown, [True, False, True, True, False, True])
    whole = reader.answers_in_context(store, tokenizer, examples, 64)
    np.testing.assert_array_equal(whole, [True, True, True, True, False, True])
    # keep_question: the question's 11 tokens leave the passage 7 of 18 ("2014" is its 9th).
    long = [ask("early", "2014", "in which year did the stadium open to the public?")]
    assert reader.answers_in_context(store, tokenizer, long, 20).tolist() == [True]
    assert not reader.answers_in_context(store, tokenizer, long, 20, keep_question=True).any()
    # The boundary, against the context's own tokens: kept exactly when "2014" is among them.
    two = tokenizer.convert_tokens_to_ids("2014")
    for width in range(8, 16):
        ctx, _ = store.context_tokens([[0]], store.tokenize_questions(tokenizer, ["when?"]), width)
        kept = reader.answers_in_context(store, tokenizer, [examples[3]], width)[0]
        assert kept == (two in ctx[0].tolist()), width  # the question has no "2014"
    with pytest.raises(ValueError, match=r"1 examples name no passage of the store, e.g\. x"):
        reader.answers_in_context(store, tokenizer, [ask("x", "a")], 16)


def test_the_reader_on_files_leaves_out_examples_whose_answer_is_cut(tmp_path, reader_exp, capsys):
    """Passages whose text starts with 40 filler words show no answer in a 32-token context:
    their questions are left out, counted in the warm start's log (`answer_cut`)."""
    from tiny_runs import tiny_config

    questions, passages = _world_files(reader_exp, tmp_path / "files")
    records = [json.loads(line) for line in passages.read_text().splitlines()]
    gold = {e.gold_ids[0] for e in reader_exp.train[:6]}
    for r in records:
        if r["id"] in gold:
            r["text"] = "so " * 40 + r["text"]
    passages.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = tiny_config(**{
        "warm_start.reader_data": "files",
        "warm_start.reader_questions_path": str(questions),
        "warm_start.reader_corpus_path": str(passages),
        "warm_start.reader_steps": 2,
        "warm_start.reader_batch_size": 4,
        "warm_start.cache_dir": str(tmp_path / "cache"),
    })  # fmt: skip
    exp = reader_exp
    warm_start.generator(config, exp.rag_cfg, exp.params, exp.generator_tokenizer, tmp_path, None)
    cut = sum(e.gold_ids[0] in gold for e in exp.train)
    kept = len(exp.train) - cut
    assert cut >= 6
    out = capsys.readouterr().out
    assert f"on {kept} qa examples ({cut} qa left out: the context cuts their answer off)" in out
    (log,) = (tmp_path / "cache" / "warm_start").glob("*.log.json")
    record = json.loads(log.read_text())["log"]
    assert record["examples"] == {"qa": kept} and record["answer_cut"] == {"qa": cut}


@pytest.mark.slow  # ~28 s
def test_reader_dropout_is_drawn_from_the_seed_and_step_when_asked_for(reader_exp):
    """`deterministic=False` with a generator dropout rate: dropout on, the same for the same
    seed; with no rate above 0 (the default job's generator), bitwise the deterministic run."""
    exp = reader_exp
    assert not reader.uses_dropout(exp.rag_cfg.generator)  # the default job: dropout 0.0
    dropping = exp.rag_cfg.replace(generator=exp.rag_cfg.generator.replace(dropout=0.3))
    assert reader.uses_dropout(dropping.generator)
    run = functools.partial(
        reader.reader_warm_start,
        generator_params=exp.params["generator"],
        tokenizer=exp.generator_tokenizer,
        store=exp.store,
        examples=exp.train,
        steps=3,
        batch_size=8,
        learning_rate=2e-3,
        answer_length=exp.config.data.answer_length,
    )
    leaves = lambda out: [np.asarray(x) for x in jax.tree.leaves(out[0])]  # noqa: E731
    plain = leaves(run(exp.rag_cfg, seed=0))
    for a, b in zip(leaves(run(exp.rag_cfg, seed=0, deterministic=False)), plain, strict=True):
        np.testing.assert_array_equal(a, b)  # no rate above 0: no dropout, nothing changes
    kept = leaves(run(dropping, seed=0))  # deterministic: the rates are not applied
    for a, b in zip(kept, plain, strict=True):
        np.testing.assert_array_equal(a, b)
    dropped = leaves(run(dropping, seed=0, deterministic=False))
    again = leaves(run(dropping, seed=0, deterministic=False))
    other = leaves(run(dropping, seed=1, deterministic=False))
    for a, b in zip(dropped, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(dropped, plain, strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(dropped, other, strict=True))
