"""Hostile input: property-based tests of the corpus and QA readers, the passage store, the metrics.

Whatever a file holds (any Unicode, empty strings, NUL bytes, huge lines, JSON of the wrong types,
bytes that are not UTF-8, a truncated gzip), a reader either returns every record or raises a
`ValueError` that starts with `<file>, line <n>` (or names the file); no other exception escapes.
Nothing is dropped: records in = records out, or the file is refused at the first bad line (and
a streaming reader has returned exactly the records before it). Each test states its oracle, an
independent statement of what is valid, and checks the reader against it.
"""

import csv
import gzip
import io
import json
import pathlib
import re
import string
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import ByteLevelBPETokenizer
from transformers import BartTokenizer

from rag_jax.retrieval import corpus
from rag_jax.retrieval.corpus import Passage
from rag_jax.retrieval.store import PassageStore, context_string
from rag_jax.run import data, metrics

FAST = settings(max_examples=60, deadline=None)
SLOWER = settings(max_examples=20, deadline=None)  # each example builds a passage store

# Characters that break naive readers: NUL, separators, quotes, line ends csv/JSON/open() treat
# differently, a BOM, combining marks, astral-plane characters.
AWKWARD = list('\x00\t\n\r"\\\x85\u2028\u2029\ufeff\u0301\x1c /') + ["中", "😀", "é", "'"]
strings = st.text(
    alphabet=st.one_of(st.characters(codec="utf-8"), st.sampled_from(AWKWARD)), max_size=24
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3),
    max_leaves=6,
)
# Lines that are not what a reader expects: arbitrary text, broken or deep JSON, a lone
# surrogate escape, a 4301-digit integer (Python refuses to parse it).
junk_lines = st.one_of(
    strings.map(lambda s: s.replace("\r", " ").replace("\n", " ")),
    st.sampled_from(
        [
            "",
            "   ",
            "{",
            "[]",
            "null",
            "[" * 5000 + "]" * 5000,
            '{"id": "\\ud800", "title": "t", "text": "x", "question": "\\udfff", "answers": ["a"]}',
            '{"id": ' + "9" * 4301 + "}",
        ]
    ),
)


def _tmp() -> pathlib.Path:
    """A fresh directory per hypothesis example (pytest's tmp_path is one per test)."""
    return pathlib.Path(tempfile.mkdtemp(prefix="hostile-"))


def _refused_at(error: str, path, line: int) -> bool:
    return error.startswith(f"{path}, line {line}:") or error.startswith(f"{path}, line {line},")


def _read_stream(reader, path):
    """(records returned before any error, the error message or None)."""
    out = []
    try:
        for record in reader(path):
            out.append(record)
    except ValueError as e:
        return out, str(e)
    return out, None


# ---------------------------------------------------------------------------------------------
# Corpus readers


def _passage_oracle(value):
    """The Passage a JSONL line should give, or None when the line must be refused."""
    if not isinstance(value, dict):
        return None
    fields = [value.get(name) for name in corpus.FIELDS]
    if not all(isinstance(f, str) and not corpus.has_surrogate(f) for f in fields):
        return None
    return Passage(*fields) if fields[0] else None


passage_objects = st.fixed_dictionaries(
    {},
    optional={name: st.one_of(strings, strings, json_values) for name in corpus.FIELDS},
)


@FAST
@given(st.lists(st.one_of(passage_objects, passage_objects, junk_lines), max_size=8))
def test_jsonl_passages_are_read_whole_or_refused_at_the_first_bad_line(lines):
    path = _tmp() / "corpus.jsonl"
    text = [
        line if isinstance(line, str) else json.dumps(line, ensure_ascii=False) for line in lines
    ]
    path.write_text("".join(t + "\n" for t in text), encoding="utf-8")
    expected = []
    for raw in text:
        try:
            expected.append(_passage_oracle(json.loads(raw)))
        except (ValueError, RecursionError):
            expected.append(None)
    out, error = _read_stream(corpus.read_passages, path)

    if None in expected:
        bad = expected.index(None)
        assert error is not None and _refused_at(error, path, bad + 1), (error, bad)
        assert out == expected[:bad]  # every record before the bad line, none dropped
        return
    ids = [p.id for p in expected]
    repeated = [i for i, pid in enumerate(ids) if pid in ids[:i]]
    if repeated:
        assert error is not None and _refused_at(error, path, repeated[0] + 1), error
        assert "duplicate id" in error
    elif not expected:
        assert error == f"{path}: no passages"
    else:
        assert error is None and out == expected  # count in = count out


def _universal_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


@FAST
@given(st.lists(st.tuples(strings, strings, strings), min_size=1, max_size=8))
def test_tsv_passages_round_trip_or_are_refused_at_their_line(records):
    path = _tmp() / "corpus.tsv"
    buffer = io.StringIO()
    # csv quotes a field holding a character of the line terminator: "\r\n" quotes both.
    writer = csv.writer(buffer, delimiter="\t", lineterminator="\r\n")
    writer.writerow(["id", "title", "text"])
    starts = []
    for record in records:
        starts.append(_universal_newlines(buffer.getvalue()).count("\n") + 1)
        writer.writerow(record)
    path.write_text(buffer.getvalue(), encoding="utf-8", newline="")
    # open()'s universal newlines turn "\r" inside a quoted field into "\n", as in DPR's reader.
    expected = [Passage(*(_universal_newlines(f) for f in record)) for record in records]
    out, error = _read_stream(corpus.read_tsv, path)

    # A row is one line: a field holding a line break (quoted, so it runs on past its line) is
    # refused at the row's first line, as is an empty id; both stop the stream there.
    broken = [i for i, r in enumerate(records) if any("\n" in f or "\r" in f for f in r)]
    empty = [i for i, p in enumerate(expected) if not p.id]
    ids = [p.id for p in expected]
    repeated = [i for i, pid in enumerate(ids) if pid in ids[:i]]
    if broken or empty:
        first = min(broken + empty)
        assert error is not None and _refused_at(error, path, starts[first]), error
        assert out == expected[:first]
    elif repeated:
        assert error is not None and _refused_at(error, path, starts[repeated[0]]), error
        assert out == expected
    else:
        assert error is None and out == expected


@FAST
@given(st.lists(st.binary(max_size=40), max_size=6), st.sampled_from(["tsv", "jsonl"]))
def test_arbitrary_bytes_never_escape_as_another_exception(lines, kind):
    path = _tmp() / f"corpus.{kind}"
    header = b"id\ttitle\ttext\n" if kind == "tsv" else b""
    path.write_bytes(header + b"\n".join(lines))
    out, error = _read_stream(corpus.read_passages, path)
    if error is not None:
        assert error.startswith(f"{path}"), error  # names the file (and the line, if any)
        assert re.match(rf"{re.escape(str(path))}(, line \d+)?[:,]", error), error


def test_huge_lines_parse_or_are_refused_at_their_line(tmp_path):
    huge = "word " * 200_000  # 1 MB: DPR's csv reader refuses fields over 128 KiB, and so do we
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"id": "1", "title": "t", "text": huge}) + "\n")
    assert [p.text for p in corpus.read_passages(path)] == [huge]
    path = tmp_path / "corpus.tsv"
    path.write_text(f"id\ttitle\ttext\n1\tt\tshort\n2\tt\t{huge}\n")
    out, error = _read_stream(corpus.read_passages, path)
    assert [p.id for p in out] == ["1"]
    assert _refused_at(error, path, 3) and "field larger than field limit" in error


@FAST
@given(st.integers(min_value=0, max_value=10**6))
def test_truncated_gzip_returns_a_prefix_then_names_the_file(cut_seed):
    path = _tmp() / "corpus.jsonl.gz"
    records = [Passage(str(i), f"T{i}", f"text {i} " * 20) for i in range(300)]
    raw = gzip.compress("".join(json.dumps(p._asdict()) + "\n" for p in records).encode())
    cut = cut_seed % len(raw)  # anywhere short of the end
    path.write_bytes(raw[:cut])
    out, error = _read_stream(corpus.read_passages, path)
    assert error is not None and error.startswith(f"{path}"), error
    assert out == records[: len(out)]  # a prefix, in order, never a damaged record


# ---------------------------------------------------------------------------------------------
# QA readers


def _qa_field_oracle(value, line_no, name):
    """The `Example` a parsed JSONL object should give, or None when it must be refused."""
    question, answers = value.get("question"), value.get("answers")
    if not isinstance(question, str) or not question.strip():
        return None
    if not isinstance(answers, list) or not answers:
        return None
    if not all(isinstance(a, str) and a.strip() for a in answers):
        return None
    example_id = value.get("id", f"{name}:{line_no}")
    if isinstance(example_id, int) and not isinstance(example_id, bool):
        example_id = str(example_id)
    if not isinstance(example_id, str) or not example_id:
        return None
    gold = value.get("gold_ids", [])
    gold = [gold] if isinstance(gold, str) else gold
    if not isinstance(gold, list) or not all(isinstance(g, str) and g for g in gold):
        return None
    if any(corpus.has_surrogate(s) for s in [question, *answers, example_id, *gold]):
        return None
    return data.Example(question, tuple(answers), example_id, tuple(gold))


qa_objects = st.fixed_dictionaries(
    {
        "question": st.one_of(strings, strings, json_values),
        "answers": st.one_of(st.lists(strings, max_size=3), json_values),
    },
    optional={"id": st.one_of(strings, st.integers(), json_values), "gold_ids": json_values},
)


@FAST
@given(st.lists(st.one_of(qa_objects, qa_objects, qa_objects, junk_lines), max_size=8))
def test_jsonl_questions_are_read_whole_or_refused_at_the_first_bad_line(lines):
    path = _tmp() / "qa.jsonl"
    text = [
        line if isinstance(line, str) else json.dumps(line, ensure_ascii=False) for line in lines
    ]
    path.write_text("".join(t + "\n" for t in text), encoding="utf-8")
    try:
        out, error = data.read_jsonl(path), None
    except ValueError as e:
        out, error = None, str(e)

    # The file is parsed first (JSON objects), then every record's fields are checked in order.
    parsed = []
    for raw in text:
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            value = None
        parsed.append(value if isinstance(value, dict) else None)
    if None in parsed:
        assert error is not None and _refused_at(error, path, parsed.index(None) + 1), error
        return
    expected, seen = [], set()
    for line_no, value in enumerate(parsed, start=1):
        example = _qa_field_oracle(value, line_no, path.name)
        if example is None or example.id in seen:
            assert error is not None and _refused_at(error, path, line_no), (error, line_no)
            return
        seen.add(example.id)
        expected.append(example)
    if not expected:
        assert error == f"{path}: no examples"
    else:
        assert error is None and out == expected  # count in = count out


@FAST
@given(
    st.lists(
        st.tuples(strings, st.one_of(strings, st.lists(strings, min_size=1).map(json.dumps))),
        min_size=1,
        max_size=6,
    )
)
def test_csv_questions_parse_or_name_the_line(rows):
    path = _tmp() / "qa.csv"
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\r\n")
    writer.writerow(["question", "answers"])
    writer.writerows(rows)
    path.write_text(buffer.getvalue(), encoding="utf-8", newline="")
    try:
        out = data.read_csv(path)
    except ValueError as e:
        assert re.match(rf"{re.escape(str(path))}(, line \d+)?[:,]", str(e)), str(e)
        return
    assert len(out) == len(rows)  # nothing dropped
    for example, (question, _) in zip(out, rows):
        assert example.question == _universal_newlines(question)
        assert example.answers and all(isinstance(a, str) and a.strip() for a in example.answers)


@pytest.mark.parametrize(
    "cell",
    ["{[1]: 2}", "[" * 3000 + "]" * 3000, "(" * 100 + ")" * 100, "9" * 5000, "b'a'", "{'a'}"],
)
def test_csv_list_cells_that_python_cannot_build_are_refused(tmp_path, cell):
    path = tmp_path / "qa.csv"
    path.write_text(f'question,answers\nwho?,"{cell}"\n')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}, line 2, field 'answers'"):
        data.read_csv(path)


# ---------------------------------------------------------------------------------------------
# The tokenised passage store


def _training_text():
    rng = np.random.default_rng(0)
    words = ["the", "of", "won", "it's", "50", "/", "//", "naïve", "中文", "😀", "e\u0301", "who"]
    return [" ".join(rng.choice(words, 30)) for _ in range(100)]


@pytest.fixture(scope="module")
def bart_tokenizer():
    """A small byte-level BPE with BART's pipeline: every byte sequence is tokenizable."""
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        _training_text(), vocab_size=300, special_tokens=specials, show_progress=False
    )
    merges = [tuple(m) for m in json.loads(bpe._tokenizer.to_str())["model"]["merges"]]
    return BartTokenizer(vocab=bpe.get_vocab(), merges=merges)


@SLOWER
@given(
    st.lists(st.tuples(strings, strings), min_size=1, max_size=6),
    strings,
    st.integers(min_value=4, max_value=40),
)
def test_store_round_trips_any_text_and_assembles_contexts_exactly(
    bart_tokenizer, titles_and_texts, question, max_length
):
    records = [Passage(f"p{i}", title, text) for i, (title, text) in enumerate(titles_and_texts)]
    store = PassageStore.build(records, bart_tokenizer, _tmp() / "store")
    reopened = PassageStore.open(store.directory)
    assert len(reopened) == len(records)  # count in = count out
    assert [reopened.passage(i) for i in range(len(records))] == records
    pieces = reopened.tokenize_questions(bart_tokenizer, [question])
    idx = np.arange(len(records))[None, :]  # -> [1, N]: every passage for one question
    ids, mask = reopened.context_tokens(idx, pieces, max_length)
    for n, record in enumerate(records):
        want = bart_tokenizer(
            context_string(record.title, record.text, question),
            max_length=max_length,
            truncation=True,
            padding="max_length",
        )
        assert ids[n].tolist() == want["input_ids"] and mask[n].tolist() == want["attention_mask"]


bad_records = st.one_of(
    st.tuples(st.just(""), strings, strings),  # empty id
    st.tuples(strings.filter(bool), json_values.filter(lambda v: not isinstance(v, str)), strings),
    st.tuples(st.just("x\ud800"), strings, strings),  # a lone surrogate cannot be stored
    json_values.filter(lambda v: not isinstance(v, (list, tuple)) or len(v) != 3),
)


@SLOWER
@given(st.lists(st.tuples(strings, strings), max_size=4), bad_records)
def test_store_refuses_a_bad_record_by_index_and_leaves_nothing(bart_tokenizer, good, bad):
    records = [Passage(f"p{i}", title, text) for i, (title, text) in enumerate(good)]
    records.append(bad)
    directory = _tmp() / "store"
    with pytest.raises(ValueError, match=rf"^record {len(good)}\b"):
        PassageStore.build(records, bart_tokenizer, directory)
    assert not any(directory.iterdir())


# ---------------------------------------------------------------------------------------------
# Metrics


@FAST
@given(strings, st.lists(strings, min_size=1, max_size=4))
def test_metrics_of_any_unicode_are_bounded_and_reflexive(prediction, answers):
    em, f1 = metrics.exact_match(prediction, answers), metrics.f1(prediction, answers)
    assert em in (0.0, 1.0) and 0.0 <= f1 <= 1.0
    assert metrics.exact_match(prediction, [prediction]) == 1.0
    normalized = metrics.normalize_answer(prediction)
    assert metrics.f1(prediction, [prediction]) == (1.0 if normalized else 0.0)
    assert normalized == " ".join(normalized.split())  # single spaces, no edge whitespace
    assert not set(normalized) & set(string.punctuation)
    if em:
        assert f1 == 1.0 or not normalized


@FAST
@given(
    st.lists(st.tuples(strings, st.lists(strings, min_size=1, max_size=3)), min_size=1, max_size=6),
    st.data(),
)
def test_metric_counts_equal_the_unmasked_rows(rows, draw):
    predictions = [p for p, _ in rows]
    answers = [a for _, a in rows]
    mask = np.asarray(draw.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows))))
    qa = metrics.qa_metrics(predictions, answers, mask)
    assert qa["exact_match"][1] == qa["f1"][1] == int(mask.sum())
    passages = [[p, p + " x"] for p in predictions]
    recall = metrics.answer_recall(answers, passages, [1, 2], mask)
    assert recall["answer_recall@1"][1] == int(mask.sum())
    assert recall["answer_recall@1"][0] <= recall["answer_recall@2"][0] <= int(mask.sum())


wrong = st.one_of(
    st.none(), st.integers(), st.binary(max_size=4), st.lists(st.integers(), max_size=2)
)


@FAST
@given(st.integers(min_value=0, max_value=3), wrong, st.sampled_from(["prediction", "answer"]))
def test_metrics_refuse_wrong_types_naming_the_row(row, value, where):
    predictions, answers = ["a", "b", "c", "d"], [["a"], ["b"], ["c"], ["d"]]
    passages = [["a"], ["b"], ["c"], ["d"]]
    if where == "prediction":
        predictions[row], passages[row] = value, [value]
    else:
        answers[row] = value if isinstance(value, list) else [value]
    calls = {
        "qa_metrics": lambda: metrics.qa_metrics(predictions, answers),
        "answer_recall": lambda: metrics.answer_recall(answers, passages, [1]),
    }
    for name, call in calls.items():
        with pytest.raises((TypeError, ValueError)) as refused:
            call()
        assert f"[{row}]" in str(refused.value), (name, str(refused.value))
