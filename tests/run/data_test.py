"""Tests for rag_jax.run.data: QA readers (files, TFDS array_record), batching, eval padding."""

import gzip
import itertools
import json
import sys

import numpy as np
import pytest
from etils import epath

from rag_jax.run import articles, data
from rag_jax.run.data import Example


def _write(tmp_path, name, content):
    path = tmp_path / name
    raw = content.encode("utf-8") if isinstance(content, str) else content
    path.write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    return path


def _jsonl(*records):
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


# ---------------------------------------------------------------------------------------------
# JSONL


def test_read_jsonl_generic_fields(tmp_path):
    path = _write(
        tmp_path,
        "qa.jsonl",
        _jsonl(
            {"question": "q1", "answers": ["a", "b"], "id": "x1", "gold_ids": ["p1", "p2"]},
            {"question": "Où est Zoë?", "answers": ["東京"], "id": 7, "extra": 1},
            {"question": "q3", "answers": ["c"], "gold_ids": "p9"},
        ),
    )
    assert data.read_jsonl(path) == [
        Example("q1", ("a", "b"), "x1", ("p1", "p2")),
        Example("Où est Zoë?", ("東京",), "7", ()),
        Example("q3", ("c",), "qa.jsonl:3", ("p9",)),  # id from file name and 1-based line
    ]
    example = data.read_jsonl(path)[0]
    with pytest.raises(AttributeError):
        example.question = "changed"  # frozen


def test_read_jsonl_field_mapping_and_gzip(tmp_path):
    records = [
        {"q": "who?", "answer": ["me"], "qid": "1"},
        {"q": "why?", "answer": ["so"], "qid": "2"},
    ]
    path = _write(tmp_path, "nq.jsonl.gz", _jsonl(*records))
    got = data.read_examples(path, {"question": "q", "answers": "answer", "id": "qid"})
    assert got == [Example("who?", ("me",), "1"), Example("why?", ("so",), "2")]


def test_read_nq_open_real_file(shared_data):
    path = shared_data / "nq_open" / "NQ-open.dev.jsonl"
    examples = data.read_examples(path, data.NQ_OPEN_FIELDS)
    with open(path, encoding="utf-8") as f:
        reference = [json.loads(line) for line in f]
    assert len(examples) == len(reference) == 3610  # the README's count
    for line_no, (example, record) in enumerate(zip(examples, reference), start=1):
        want = Example(record["question"], tuple(record["answer"]), f"NQ-open.dev.jsonl:{line_no}")
        assert example == want
    assert examples[0].question == "when was the last time anyone was on the moon"
    assert examples[0].answers == ("14 December 1972 UTC", "December 1972")


def test_read_squad_questions_real_file(shared_data, tmp_path):
    # The first 400 of 8,595 lines keep the test fast; the mapping is the same on every line.
    with open(shared_data / "squad11_dev" / "questions.jsonl", encoding="utf-8") as f:
        head = list(itertools.islice(f, 400))
    path = _write(tmp_path, "questions.jsonl", "".join(head))
    examples = data.read_jsonl(path, data.SQUAD_OPEN_FIELDS)
    assert len(examples) == 400
    for example, line in zip(examples, head):
        record = json.loads(line)
        assert example == Example(
            record["question"], tuple(record["answers"]), record["id"], (record["gold_passage_id"],)
        )
    assert examples[0] == Example(
        "Which NFL team represented the AFC at Super Bowl 50?",
        ("Denver Broncos",),
        "56be4db0acb8001400a502ec",
        ("Super_Bowl_50_0",),
    )


# ---------------------------------------------------------------------------------------------
# CSV


def test_read_csv_with_header_json_lists_and_multiline_cell(tmp_path):
    content = (
        "id,question,answers,gold_ids\n"
        'a,"who, exactly?","[""Ann"", ""Anne""]","[""p1""]"\n'
        'b,"a question\non two lines",["Bob"],\n'
        'c,plain,"[\'Ca\', ""Cé\'s""]",\n'
    )
    path = _write(tmp_path, "qa.csv", content)
    assert data.read_examples(path) == [
        Example("who, exactly?", ("Ann", "Anne"), "a", ("p1",)),
        Example("a question\non two lines", ("Bob",), "b", ()),
        Example("plain", ("Ca", "Cé's"), "c", ()),
    ]


def test_read_dpr_qa_csv(tmp_path):
    """DPR's `*.qa.csv`: tab-separated, no header, answers as a Python list literal."""
    content = (
        "who got the first nobel prize in physics\t['Wilhelm Conrad Röntgen']\n"
        "who sang it\t['The Beatles', \"Lennon's band\"]\n"
    )
    path = _write(tmp_path, "nq-test.qa.csv", content)
    got = data.read_csv(path, delimiter="\t", columns=("question", "answers"))
    assert got == [
        Example(
            "who got the first nobel prize in physics",
            ("Wilhelm Conrad Röntgen",),
            "nq-test.qa.csv:1",
        ),
        Example("who sang it", ("The Beatles", "Lennon's band"), "nq-test.qa.csv:2"),
    ]
    tsv = _write(tmp_path, "qa.tsv", 'question\tanswers\nq\t["a"]\n')
    assert data.read_examples(tsv) == [Example("q", ("a",), "qa.tsv:2")]


# ---------------------------------------------------------------------------------------------
# Bad input: the error names the file, the 1-based line and the field.

GOOD = {"question": "q", "answers": ["a"]}


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"answers": ["a"]}', r"line 2, field 'question': missing"),
        ('{"question": "  ", "answers": ["a"]}', r"line 2, field 'question': expected a non-empty"),
        ('{"question": "q"}', r"line 2, field 'answers': missing"),
        ('{"question": "q", "answers": []}', r"line 2, field 'answers': expected a non-empty list"),
        (
            '{"question": "q", "answers": "a"}',
            r"line 2, field 'answers': expected a non-empty list",
        ),
        ('{"question": "q", "answers": ["a", 3]}', r"line 2, field 'answers': expected non-empty"),
        ('{"question": "q", "answers": [""]}', r"line 2, field 'answers': expected non-empty"),
        ('{"question": "q", "answers": ["a"], "id": null}', r"line 2, field 'id': expected"),
        ('{"question": "q", "answers": ["a"], "gold_ids": [1]}', r"line 2, field 'gold_ids'"),
        ('{"question": "q", "answers": ["a"]', r"line 2: invalid JSON"),
        ("", r"line 2: invalid JSON"),  # a blank line is not skipped
        ('["q", ["a"]]', r"line 2: expected a JSON object, got list"),
    ],
)
def test_jsonl_bad_lines(tmp_path, bad_line, message):
    path = _write(tmp_path, "bad.jsonl", _jsonl(GOOD) + bad_line + "\n" + _jsonl(GOOD))
    with pytest.raises(ValueError, match=f"bad.jsonl, {message}"):
        data.read_jsonl(path)


def test_jsonl_bad_files(tmp_path):
    with pytest.raises(ValueError, match=r"empty.jsonl: no examples"):
        data.read_jsonl(_write(tmp_path, "empty.jsonl", ""))
    dup = _write(tmp_path, "dup.jsonl", _jsonl({**GOOD, "id": "x"}, GOOD, {**GOOD, "id": "x"}))
    with pytest.raises(
        ValueError, match=r"dup.jsonl, line 3, field 'id': duplicate id 'x' .*line 1"
    ):
        data.read_jsonl(dup)
    with pytest.raises(ValueError, match=r"not valid UTF-8"):
        data.read_jsonl(_write(tmp_path, "bin.jsonl", b'{"question": "\xff"}\n'))
    with pytest.raises(ValueError, match=r"unknown keys \['answer'\]"):
        data.read_jsonl(dup, {"answer": "answers"})
    # A field named in the mapping is required, so a mistyped name cannot pass unnoticed.
    with pytest.raises(ValueError, match=r"line 1, field 'gold_passage_id': missing"):
        data.read_jsonl(_write(tmp_path, "ok.jsonl", _jsonl(GOOD)), data.SQUAD_OPEN_FIELDS)
    with pytest.raises(ValueError, match=r"unknown QA file format"):
        data.read_examples(tmp_path / "qa.json")


def test_csv_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"e.csv: empty file"):
        data.read_csv(_write(tmp_path, "e.csv", ""))
    with pytest.raises(ValueError, match=r"h.csv: no examples"):
        data.read_csv(_write(tmp_path, "h.csv", "question,answers\n"))
    with pytest.raises(ValueError, match=r"c.csv, line 3: 3 columns, expected 2"):
        data.read_csv(_write(tmp_path, "c.csv", 'question,answers\nq,["a"]\nq,["a"],x\n'))
    with pytest.raises(ValueError, match=r"l.csv, line 2, field 'answers': expected a JSON array"):
        data.read_csv(_write(tmp_path, "l.csv", "question,answers\nq,Paris\n"))
    with pytest.raises(ValueError, match=r"s.csv, line 2, field 'answers': expected a non-empty"):
        data.read_csv(_write(tmp_path, "s.csv", 'question,answers\nq,"""Paris"""\n'))
    with pytest.raises(ValueError, match=r"m.csv, line 2, field 'answers': missing"):
        data.read_csv(_write(tmp_path, "m.csv", 'question,answer\nq,["a"]\n'))


# ---------------------------------------------------------------------------------------------
# TFDS: the real builders' features, prepared as array_record into a tmp dir, read back with
# the real `tfds.data_source`. Only the download is replaced: each builder is subclassed (same
# name, same features, unregistered) with `_split_generators` yielding crafted records.

NQ_RECORDS = [
    {"question": "when was the moon landing", "answer": ["1969", "July 1969"]},
    {"question": "qui a écrit Les Misérables", "answer": ["Victor Hugo"]},
    {"question": "東京タワーの高さ", "answer": ["333 m"]},
    {"question": "who sang yesterday", "answer": ["The Beatles", "Paul McCartney"]},
    {"question": "largest ocean", "answer": ["Pacific"]},
]
WQ_RECORDS = [
    {"url": "http://x/1", "question": "what is the capital of france?", "answers": ["Paris"]},
    {"url": "http://x/2", "question": "who plays ken?", "answers": ["Ryan Gosling", "Kj"]},
]


def _tqa_record(question_id, question, value, aliases):
    answer = {
        "aliases": aliases,
        "normalized_aliases": [a.lower() for a in aliases],
        "matched_wiki_entity_name": "",
        "normalized_matched_wiki_entity_name": "",
        "normalized_value": value.lower(),
        "type": "WikipediaEntity",
        "value": value,
    }
    return {
        "question": question,
        "question_id": question_id,
        "question_source": "http://x",
        "entity_pages": [],
        "search_results": [],
        "answer": answer,
    }


TQA_RECORDS = [
    _tqa_record("tc_1", "Which planet is red?", "Mars", ["Mars", "Red Planet", "mars"]),
    _tqa_record("tc_2", "Who wrote Hamlet?", "Shakespeare", ["William Shakespeare"]),
]


def _fake_builder(real_cls, name, splits):
    """`real_cls` with its download replaced by `splits` ({split: records})."""

    class Fake(real_cls, skip_registration=True):
        # Metadata (README, citation) is read beside the builder's code: point at the real one.
        pkg_dir_path = epath.Path(sys.modules[real_cls.__module__].__file__).parent

        def _split_generators(self, dl_manager):
            return {split: enumerate(records) for split, records in splits.items()}

    Fake.name = name
    return Fake


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    import tensorflow_datasets as tfds
    from tensorflow_datasets.datasets.natural_questions_open import (
        natural_questions_open_dataset_builder as nq,
    )
    from tensorflow_datasets.datasets.trivia_qa import trivia_qa_dataset_builder as tqa
    from tensorflow_datasets.question_answering import web_questions as wq

    data_dir = tmp_path_factory.mktemp("tfds")
    no_answer = _tqa_record("tc_9", "Hidden?", "<unk>", [])
    builders = [
        (_fake_builder(nq.Builder, "natural_questions_open", {"validation": NQ_RECORDS}), {}),
        (
            _fake_builder(
                tqa.Builder, "trivia_qa", {"validation": TQA_RECORDS, "test": [no_answer]}
            ),
            {"config": "unfiltered.nocontext"},
        ),
        (_fake_builder(wq.WebQuestions, "web_questions", {"test": WQ_RECORDS}), {}),
    ]
    for cls, kwargs in builders:
        builder = cls(data_dir=str(data_dir), file_format="array_record", **kwargs)
        # NQ in two shards, so that ids of sliced splits have to count earlier shards' records.
        shards = 2 if builder.name == "natural_questions_open" else 1
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(num_shards=shards)
        )
    assert len(list(data_dir.glob("natural_questions_open/*/*-validation.array_record-*"))) == 2
    return data_dir


def test_read_tfds_natural_questions_open(tfds_dir):
    examples = data.read_tfds("natural_questions_open", "validation", data_dir=tfds_dir)
    assert len(examples) == len(NQ_RECORDS)
    # TFDS stores records in its own order; ids name the position in the prepared split.
    assert [e.id for e in examples] == [f"natural_questions_open/validation/{i}" for i in range(5)]
    got = {e.question: e.answers for e in examples}
    assert got == {r["question"]: tuple(r["answer"]) for r in NQ_RECORDS}
    assert all(e.gold_ids == () for e in examples)
    # Slices keep the ids of the whole split.
    tail = data.read_tfds("natural_questions_open", "validation[1:]", data_dir=tfds_dir)
    assert tail == examples[1:]
    both = data.read_tfds("natural_questions_open", "validation[3:]+validation[:1]", tfds_dir)
    assert both == [examples[3], examples[4], examples[0]]


def test_read_tfds_trivia_qa_uses_value_and_aliases(tfds_dir):
    examples = data.read_tfds("trivia_qa", "validation", data_dir=tfds_dir)
    assert sorted(examples, key=lambda e: e.id) == [
        Example("Which planet is red?", ("Mars", "Red Planet", "mars"), "tc_1"),
        Example("Who wrote Hamlet?", ("Shakespeare", "William Shakespeare"), "tc_2"),
    ]
    explicit = data.read_tfds("trivia_qa/unfiltered.nocontext:1.1.0", "validation", tfds_dir)
    assert explicit == examples


def test_read_tfds_web_questions(tfds_dir):
    examples = data.read_tfds("web_questions", "test", data_dir=tfds_dir)
    got = {e.question: e.answers for e in examples}
    assert got == {r["question"]: tuple(r["answers"]) for r in WQ_RECORDS}
    assert sorted(e.id for e in examples) == ["web_questions/test/0", "web_questions/test/1"]


def test_read_tfds_errors(tfds_dir):
    with pytest.raises(ValueError, match=r"'squad' is not supported; expected one of"):
        data.read_tfds("squad", "train", data_dir=tfds_dir)
    with pytest.raises(
        ValueError, match=r"'trivia_qa/rc.nocontext' is not prepared in .*tfds build"
    ):
        data.read_tfds("trivia_qa/rc.nocontext", "validation", data_dir=tfds_dir)
    with pytest.raises(
        ValueError, match=r"'natural_questions_open', split 'train' .*Unknown split"
    ):
        data.read_tfds("natural_questions_open", "train", data_dir=tfds_dir)
    with pytest.raises(ValueError, match=r"'web_questions' is not prepared"):
        data.read_tfds("web_questions", "test", data_dir=tfds_dir / "elsewhere")
    with pytest.raises(
        ValueError, match=r"split 'test', record 0, field 'answer/value': no answer"
    ):
        data.read_tfds("trivia_qa", "test", data_dir=tfds_dir)
    with pytest.raises(ValueError, match=r"'web_questions', split 'test\[2:\]' in .*: no examples"):
        data.read_tfds("web_questions", "test[2:]", data_dir=tfds_dir)
    with pytest.raises(ValueError, match=r"(?s)split 'test\[' .*prepared splits: \['test'\]"):
        data.read_tfds("web_questions", "test[", data_dir=tfds_dir)
    with pytest.raises(ValueError, match=r"'trivia_qa/no_such_config': "):
        data.read_tfds("trivia_qa/no_such_config", "validation", data_dir=tfds_dir)
    with pytest.raises(ValueError, match=r"'web_questions:9.9.9': "):
        data.read_tfds("web_questions:9.9.9", "test", data_dir=tfds_dir)


# ---------------------------------------------------------------------------------------------
# Training batches


def _reference_stream(num_examples, seed, epochs):
    """The epochs laid end to end, built independently of `batch_indices`."""
    return np.concatenate(
        [np.random.default_rng((seed, e)).permutation(num_examples) for e in range(epochs)]
    )


@pytest.mark.parametrize("num_examples, batch_size", [(10, 4), (12, 4), (3, 8), (7, 7)])
def test_batch_indices_cover_each_epoch_exactly_once(num_examples, batch_size):
    steps = 20
    batches = [data.batch_indices(num_examples, batch_size, 5, step) for step in range(steps)]
    stream = np.concatenate(batches)
    assert all(b.shape == (batch_size,) and b.dtype == np.int64 for b in batches)
    epochs = len(stream) // num_examples
    np.testing.assert_array_equal(
        stream, _reference_stream(num_examples, 5, epochs + 1)[: len(stream)]
    )
    for e in range(epochs):  # every complete epoch, batches crossing its edges included
        chunk = stream[e * num_examples : (e + 1) * num_examples]
        np.testing.assert_array_equal(np.sort(chunk), np.arange(num_examples))


def test_batch_indices_pure_function_of_seed_and_step():
    forward = [data.batch_indices(10, 4, 1, s) for s in range(12)]
    backward = [data.batch_indices(10, 4, 1, s) for s in reversed(range(12))][::-1]
    for a, b in zip(forward, backward):
        np.testing.assert_array_equal(a, b)
    resumed = data.batch_indices(10, 4, 1, 1_000_003)  # no earlier step needed
    epoch, offset = divmod(1_000_003 * 4, 10)
    want = np.concatenate([np.random.default_rng((1, epoch + i)).permutation(10) for i in (0, 1)])
    np.testing.assert_array_equal(resumed, want[offset : offset + 4])
    assert not np.array_equal(data.batch_indices(100, 8, 1, 0), data.batch_indices(100, 8, 2, 0))


def test_batch_indices_hosts_split_the_global_batch():
    for step in range(8):
        full = data.batch_indices(9, 6, 3, step)
        hosts = [
            data.batch_indices(9, 6, 3, step, process_index=p, process_count=2) for p in (0, 1)
        ]
        assert all(h.shape == (3,) for h in hosts)
        np.testing.assert_array_equal(np.concatenate(hosts), full)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((10, 5, 0, 0), {"process_count": 2}, "not divisible by process_count 2"),
        (
            (10, 4, 0, 0),
            {"process_index": 2, "process_count": 2},
            r"process_index 2 is not in \[0, 2\)",
        ),
        ((0, 4, 0, 0), {}, "num_examples must be an integer >= 1"),
        ((10, 0, 0, 0), {}, "batch_size must be an integer >= 1"),
        ((10, 4, -1, 0), {}, "seed must be an integer >= 0"),
        ((10, 4, 0, -1), {}, "step must be an integer >= 0"),
        ((10, 4, 0, 1.0), {}, "step must be an integer"),
    ],
)
def test_batch_indices_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        data.batch_indices(*args, **kwargs)


def test_pick_target():
    answers = ("one", "two", "three")
    assert data.pick_target(answers, "first", 0, 5, 9) == "one"
    draws = [data.pick_target(answers, "sample", 3, step, 11) for step in range(300)]
    assert draws == [data.pick_target(answers, "sample", 3, step, 11) for step in range(300)]
    assert draws[7] == answers[np.random.default_rng((3, 7, 11)).integers(3)]
    assert set(draws) == set(answers)
    assert max(draws.count(a) for a in answers) < 140  # roughly uniform: 100 expected each
    per_example = {data.pick_target(answers, "sample", 3, 0, i) for i in range(50)}
    assert per_example == set(answers)  # the example index enters the draw too
    assert data.pick_target(["only"], "sample", 0, 0, 0) == "only"
    with pytest.raises(ValueError, match=r"mode must be one of \('first', 'sample'\)"):
        data.pick_target(answers, "random", 0, 0, 0)
    with pytest.raises(ValueError, match="non-empty list"):
        data.pick_target([], "first", 0, 0, 0)


# ---------------------------------------------------------------------------------------------
# Eval batches


@pytest.mark.parametrize("num_examples, batch_size", [(7, 3), (6, 3), (2, 5), (1, 1)])
def test_eval_batches_pad_and_mask_the_last_batch(num_examples, batch_size):
    batches = list(data.eval_batches(num_examples, batch_size))
    assert len(batches) == -(-num_examples // batch_size)
    for indices, mask in batches:
        assert indices.shape == mask.shape == (batch_size,)
        assert indices.dtype == np.int64 and mask.dtype == np.bool_
        assert np.all((indices >= 0) & (indices < num_examples))  # padding gathers safely
    real = np.concatenate([indices[mask] for indices, mask in batches])
    np.testing.assert_array_equal(real, np.arange(num_examples))  # each exactly once, in order
    padding = sum(int((~mask).sum()) for _, mask in batches)
    assert padding == len(batches) * batch_size - num_examples


def test_eval_batches_by_hand():
    (i0, m0), (i1, m1), (i2, m2) = data.eval_batches(7, 3)
    np.testing.assert_array_equal(i2, [6, 0, 0])
    np.testing.assert_array_equal(m2, [True, False, False])
    assert m0.all() and m1.all()
    with pytest.raises(ValueError, match="num_examples must be an integer >= 1"):
        next(data.eval_batches(0, 3))


def test_max_train_and_max_eval_take_the_first_n_or_a_seeded_sample():
    import ml_collections

    from rag_jax.training import evaluation, experiment

    examples = list(range(100))
    first = ml_collections.ConfigDict({"sample_seed": -1})
    assert experiment._first_or_sample(examples, 10, first) == list(range(10))
    seeded = ml_collections.ConfigDict({"sample_seed": 3})
    sample = experiment._first_or_sample(examples, 10, seeded)
    assert sample == sorted(sample) and len(set(sample)) == 10 and sample != list(range(10))
    assert experiment._first_or_sample(examples, 10, seeded) == sample  # the same draw
    assert experiment._first_or_sample(examples, 0, seeded) == examples
    assert experiment._first_or_sample(examples, 500, seeded) == examples
    # eval.answer_examples: a seeded sample of the evaluated questions, or all of them.
    picked = evaluation.answer_sample(5, 100, 0)
    assert len(set(picked.tolist())) == 5 and list(picked) == sorted(picked)
    # Nested: a larger evaluation's sample holds the smaller one's (their decodings are shared).
    assert set(picked.tolist()) <= set(evaluation.answer_sample(50, 100, 0).tolist())
    assert evaluation.answer_sample(0, 100, 0) is None
    assert evaluation.answer_sample(100, 100, 0) is None


def _eight_articles():
    """(passage id -> title, examples): 8 articles of 2 passages, 3 questions each."""
    titles = {f"{a}_{p}": a for a in "abcdefgh" for p in range(2)}
    examples = [
        data.Example(f"q{a}{p}{k}", ("x",), f"{a}{p}{k}", (f"{a}_{p}",))
        for a in "abcdefgh"
        for p in range(2)
        for k in range(3)
    ]
    return titles, examples


def test_a_sample_by_article_takes_whole_articles_nested_in_its_size():
    titles, examples = _eight_articles()
    small = articles.sample_articles(examples, titles, 9, seed=4)
    large = articles.sample_articles(examples, titles, 20, seed=4)
    assert len(small) == 9 and len(large) == 20
    assert {e.id for e in small} <= {e.id for e in large}  # nested: a curve adds questions
    assert small == sorted(small, key=examples.index)  # file order
    names = [e.gold_ids[0].split("_")[0] for e in large]
    counts = sorted(names.count(a) for a in set(names))
    assert counts == [2, 6, 6, 6]  # three whole articles and the start of a fourth
    assert articles.sample_articles(examples, titles, 0, seed=4) == examples
    with pytest.raises(ValueError, match="'qa00' has no gold passage id"):
        articles.sample_articles([data.Example("q", ("x",), "qa00")] * 2, titles, 1, seed=0)


def test_the_next_articles_share_none_with_the_sample():
    """A selection slice: whole articles after a training sample's in its seeded order, none of
    them an article of the sample, not even the one the sample cut."""
    titles, examples = _eight_articles()
    article = lambda e: e.gold_ids[0].split("_")[0]  # noqa: E731
    train = articles.sample_articles(examples, titles, 9, seed=4)  # one whole article + 3
    chosen = articles.next_articles(examples, titles, 9, 10, seed=4)
    assert len(chosen) == 10 and chosen == sorted(chosen, key=examples.index)
    assert not {article(e) for e in chosen} & {article(e) for e in train}
    # The articles that follow in the same order: those a larger sample adds after the cut one.
    larger = articles.sample_articles(examples, titles, 9 + 3 + 10, seed=4)
    assert {e.id for e in chosen} <= {e.id for e in larger}
    names = [article(e) for e in chosen]
    assert sorted(names.count(a) for a in set(names)) == [4, 6]  # a whole article, then a cut one
    with pytest.raises(ValueError, match="only 36 examples lie outside"):
        articles.next_articles(examples, titles, 9, 40, seed=4)


# ---------------------------------------------------------------------------------------------
# Splits named in the file (COVID-QA's `split`)

SPLITS = ("train", "dev", "test")


def _split_file(tmp_path, name="qa.jsonl"):
    return _write(
        tmp_path,
        name,
        _jsonl(
            {"question": "q1", "answers": ["a"], "id": "1", "split": "train"},
            {"question": "q2", "answers": ["b"], "id": "2", "split": "dev"},
            {"question": "q3", "answers": ["c"], "id": "3", "split": "train"},
            {"question": "q4", "answers": ["d"], "id": "4", "split": "test"},
        ),
    )


def test_a_split_reads_its_questions_in_file_order(tmp_path):
    path = _split_file(tmp_path)
    ids = lambda keep: [
        e.id for e in data.read_examples(path, None, data.Split("split", keep, SPLITS))
    ]  # noqa: E731,E501
    assert ids("train") == ["1", "3"]
    assert ids("dev") == ["2"]
    assert ids("test") == ["4"]
    assert ids("") == ["1", "2", "3", "4"]  # every question, each value still checked
    assert [e.id for e in data.read_examples(path)] == ["1", "2", "3", "4"]  # no split asked


def test_a_split_in_a_csv_column(tmp_path):
    path = _write(
        tmp_path, "qa.csv", 'question,answers,split\nq1,"[""a""]",dev\nq2,"[""b""]",train\n'
    )
    got = data.read_examples(path, None, data.Split("split", "dev", SPLITS))
    assert [e.question for e in got] == ["q1"]


@pytest.mark.parametrize(
    "line, message",
    [
        ({"question": "q", "answers": ["a"], "id": "9"}, r"line 5, field 'split': missing"),
        (
            {"question": "q", "answers": ["a"], "id": "9", "split": "val"},
            r"line 5, field 'split': 'val' is not a known split",
        ),  # noqa: E501
        (
            {"question": "q", "answers": ["a"], "id": "9", "split": 3},
            r"line 5, field 'split': 3 is not a known split",
        ),  # noqa: E501
    ],
)
def test_a_split_value_the_config_does_not_know_is_refused_by_file_line_and_field(
    tmp_path, line, message
):
    path = _split_file(tmp_path)
    path.write_text(path.read_text() + _jsonl(line))
    with pytest.raises(ValueError, match=rf"qa.jsonl, {message}"):
        data.read_examples(path, None, data.Split("split", "train", SPLITS))


def test_a_split_with_no_questions_names_the_values_found(tmp_path):
    path = _split_file(tmp_path)
    with pytest.raises(ValueError, match=r"no questions of split 'test' .*dev: 1, train: 2"):
        path.write_text(
            "".join(line for line in path.read_text().splitlines(True) if "test" not in line)
        )  # noqa: E501
        data.read_examples(path, None, data.Split("split", "test", SPLITS))
    with pytest.raises(ValueError, match=r"split 'valid' is not one of the known splits"):
        data.Split("split", "valid", SPLITS)


def test_covidqa_splits_by_article(shared_data):
    covid = shared_data / "covidqa"
    if not covid.is_dir():
        pytest.skip(reason=f"COVID-QA not found at {covid}")
    fields = {"gold_ids": "gold_passage_id"}
    read = lambda keep: data.read_examples(
        covid / "questions.jsonl", fields, data.Split("split", keep, SPLITS)
    )  # noqa: E731,E501
    train, dev = read("train"), read("dev")
    assert (len(train), len(dev)) == (1417, 203)  # its README's counts
    article = lambda e: e.gold_ids[0].rsplit("_", 1)[0]  # noqa: E731  <document id>_<window>
    assert not {article(e) for e in train} & {article(e) for e in dev}
