"""rag_jax.retrieval.corpus: streaming readers, bad-input errors, 100-word splitting, checksum."""

import csv
import gzip
import hashlib
import inspect
import json

import pytest

from rag_jax.retrieval import corpus
from rag_jax.retrieval.corpus import Passage

# Quoted fields, doubled quotes, a tab inside quotes, unicode: what DPR's TSV holds.
DPR_TSV = (
    "id\ttext\ttitle\n"
    '1\t"Aaron ( or ; ""Ahärôn"") was a prophet"\tAaron\n'
    '2\tplain text, no quotes\t"""Quoted"" title"\n'
    '3\t"a\ttab inside, then a ""quote"""\tTabbed\n'
    "4\t\t\n"
    "5\tnaïve 中文 😀\tZoë\n"
)


def _write(tmp_path, name, content):
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(content.encode("utf-8") if isinstance(content, str) else content)
    else:
        path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


def _dpr_reference(path):
    """DPR's own reader (dense_retriever.py): csv over the text file, header row skipped."""
    with open(path) as f:
        return [Passage(row[0], row[2], row[1]) for row in csv.reader(f, delimiter="\t")][1:]


def test_read_tsv_parses_like_dpr(tmp_path):
    path = _write(tmp_path, "psgs.tsv", DPR_TSV)
    passages = list(corpus.read_tsv(path))
    assert passages == _dpr_reference(path)
    assert passages[0] == Passage("1", "Aaron", 'Aaron ( or ; "Ahärôn") was a prophet')
    assert passages[1].title == '"Quoted" title'
    assert passages[2].text == 'a\ttab inside, then a "quote"'
    assert passages[3] == Passage("4", "", "")


@pytest.mark.parametrize(
    "rows, line",
    [
        # An unbalanced quote: the text of row 1 would swallow row 2, whose title it would take.
        (['1\t"He said hi\tT1', '2\tbye" she said\tT2', "3\tok\tT3"], 2),
        # A quoted line break: one passage across two lines.
        (["1\tfine\tT1", '2\t"first line', 'second line"\tT2'], 3),
    ],
)
def test_a_quote_running_past_its_line_is_refused_naming_the_line(tmp_path, rows, line):
    path = _write(tmp_path, "psgs.tsv", "id\ttext\ttitle\n" + "\n".join(rows) + "\n")
    out = []
    with pytest.raises(ValueError, match=rf"psgs.tsv, line {line}: a quoted field runs on"):
        for passage in corpus.read_tsv(path):
            out.append(passage)
    assert len(out) == line - 2  # every row before the refused one, none dropped


def test_read_tsv_gzip_column_order_and_extra_columns(tmp_path):
    content = "title\tscore\tid\ttext\nT1\t0.5\ta\tfirst\nT2\t0.7\tb\tsecond\n"
    path = _write(tmp_path, "psgs.tsv.gz", content)
    assert list(corpus.read_passages(path)) == [
        Passage("a", "T1", "first"),
        Passage("b", "T2", "second"),
    ]


def test_read_tsv_reads_crlf_and_cr_line_ends_like_text_mode(tmp_path):
    # DPR opens the file in text mode, so \r\n and \r end lines.
    path = _write(tmp_path, "psgs.tsv", DPR_TSV.replace("\n", "\r\n"))
    assert list(corpus.read_tsv(path)) == _dpr_reference(path)
    assert list(corpus.read_tsv(path))[2].text == 'a\ttab inside, then a "quote"'
    path = _write(tmp_path, "cr.tsv", "id\ttext\ttitle\r1\tx\tT")
    assert list(corpus.read_tsv(path)) == [Passage("1", "T", "x")]


def test_read_jsonl_and_field_mapping(tmp_path):
    rows = [
        {"pid": "x", "title": "T", "contents": "body", "extra": 1},
        {"pid": "y", "title": "", "contents": "é"},
    ]
    path = _write(tmp_path, "c.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    passages = list(corpus.read_passages(path, fields={"id": "pid", "text": "contents"}))
    assert passages == [Passage("x", "T", "body"), Passage("y", "", "é")]
    with pytest.raises(ValueError, match="unknown keys"):
        corpus.read_jsonl(path, fields={"body": "contents"})


def test_readers_stream_records_before_reading_the_rest(tmp_path):
    # The third line is broken: a reader that loaded the whole file would fail before yielding.
    tsv = _write(tmp_path, "p.tsv", "id\ttext\ttitle\n1\tt\tT\n2\tbroken\n")
    jsonl = _write(tmp_path, "p.jsonl", '{"id": "1", "title": "T", "text": "t"}\n{broken\n')
    for path in (tsv, jsonl):
        records = corpus.read_passages(path)
        assert inspect.isgenerator(records)
        assert next(records) == Passage("1", "T", "t")
        with pytest.raises(ValueError, match="line"):
            next(records)


def test_read_passages_rejects_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"psgs\.csv.*\.tsv or \.jsonl"):
        corpus.read_passages(tmp_path / "psgs.csv")


HEADER = "id\ttext\ttitle\n"
BAD_INPUTS = [
    # (file name, content, fields, substrings the error must contain besides the file name)
    ("p.tsv", HEADER + "1\ta\tA\n2\tonly two\n", None, ["line 3", "2 tab-separated columns"]),
    ("p.tsv", HEADER + "1\ta\tA\n\n2\tb\tB\n", None, ["line 3", "0 tab-separated columns"]),
    ("p.tsv", "id\ttext\n1\ta\n", None, ["line 1", "field 'title'", "no such column"]),
    ("p.tsv", "pid\ttext\ttitle\n1\ta\tA\n", None, ["line 1", "field 'id'"]),
    ("p.tsv", "id\ttext\ttitle\n", None, ["no passages"]),
    ("p.tsv", "", None, ["empty file"]),
    ("p.tsv", HEADER.encode() + b"1\ta\tA\n2\t\xff\xfe\tB\n", None, ["line 3", "UTF-8"]),
    (
        "p.tsv",
        HEADER + "7\ta\tA\n8\tb\tB\n7\tc\tC\n",
        None,
        ["line 4", "field 'id'", "'7'", "line 2"],
    ),
    (
        "p.jsonl",
        '{"id": "1", "title": "", "text": ""}\n{"id": \n',
        None,
        ["line 2", "invalid JSON"],
    ),
    ("p.jsonl", '{"id": "1", "title": "", "text": ""}\n\n', None, ["line 2", "invalid JSON"]),
    ("p.jsonl", "[1, 2]\n", None, ["line 1", "JSON object", "list"]),
    ("p.jsonl", '{"id": 3, "title": "", "text": ""}\n', None, ["line 1", "field 'id'", "int"]),
    ("p.jsonl", '{"id": "3", "title": null, "text": ""}\n', None, ["field 'title'", "NoneType"]),
    ("p.jsonl", '{"id": "3", "text": ""}\n', None, ["line 1", "field 'title'", "missing"]),
    ("p.jsonl", '{"id": "3", "title": "", "text": ""}\n', {"text": "body"}, ["field 'body'"]),
    (
        "p.jsonl",
        b'{"id": "3", "title": "", "text": ""}\n{"id": "\xc3("}\n',
        None,
        ["line 2", "UTF-8"],
    ),
    ("p.jsonl", "", None, ["no passages"]),
    (
        "p.jsonl.gz",
        "".join(json.dumps({"id": i, "title": "", "text": ""}) + "\n" for i in ["a", "b", "a"]),
        None,
        ["line 3", "field 'id'", "'a'", "first at line 1"],
    ),
]


@pytest.mark.parametrize("name, content, fields, needles", BAD_INPUTS)
def test_bad_input_names_file_line_and_field(tmp_path, name, content, fields, needles):
    path = _write(tmp_path, name, content)
    with pytest.raises(ValueError) as error:
        list(corpus.read_passages(path, fields=fields))
    message = str(error.value)
    for needle in [str(path), *needles]:
        assert needle in message


def test_duplicate_check_compares_ids_not_just_digests(tmp_path, monkeypatch):
    # Every id gets the same digest, so every pair is a candidate: only real repeats may fail.
    class Colliding:
        def __init__(self, *args, **kwargs):
            pass

        def digest(self):
            return bytes(8)

    monkeypatch.setattr(corpus.hashlib, "blake2b", Colliding)
    unique = _write(tmp_path, "u.tsv", HEADER + "".join(f"{i}\tt\tT\n" for i in range(5)))
    assert [p.id for p in corpus.read_tsv(unique)] == ["0", "1", "2", "3", "4"]
    repeated = _write(tmp_path, "r.tsv", HEADER + "a\tt\tT\nb\tt\tT\nc\tt\tT\nb\tt\tT\n")
    with pytest.raises(
        ValueError, match=r"line 5, field 'id': duplicate id 'b' \(first at line 3\)"
    ):
        list(corpus.read_tsv(repeated))


def test_split_documents_into_100_word_passages():
    words = [f"w{i}" for i in range(250)]
    # Mixed whitespace between words: passages are re-joined with single spaces.
    text = "  " + "\t".join(words[:10]) + "\n" + "   ".join(words[10:]) + " \n"
    docs = [Passage("doc", "Title", text), Passage("d2", "Other", "one two")]
    passages = list(corpus.split_documents(docs))
    assert passages == [
        Passage("doc-0", "Title", " ".join(words[0:100])),
        Passage("doc-1", "Title", " ".join(words[100:200])),
        Passage("doc-2", "Title", " ".join(words[200:250])),
        Passage("d2-0", "Other", "one two"),
    ]
    sequential = list(corpus.split_documents(docs, words=120, ids="sequential"))
    assert [p.id for p in sequential] == ["1", "2", "3", "4"]
    assert [len(p.text.split()) for p in sequential] == [120, 120, 10, 2]


def test_split_documents_rejects_bad_input():
    with pytest.raises(ValueError, match="'empty'.*no words"):
        list(corpus.split_documents([Passage("empty", "T", " \n\t ")]))
    with pytest.raises(ValueError, match="words must be"):
        list(corpus.split_documents([], words=0))
    with pytest.raises(ValueError, match="ids must be"):
        list(corpus.split_documents([], ids="uuid"))


def test_corpus_checksum_is_sha256_of_length_prefixed_fields():
    records = [Passage("1", "T", "héllo"), Passage("2", "", "x")]
    reference = hashlib.sha256()
    for record in records:
        for value in record:
            data = value.encode("utf-8")
            reference.update(len(data).to_bytes(8, "little") + data)
    assert corpus.corpus_checksum(records) == reference.hexdigest()
    assert corpus.corpus_checksum([tuple(r) for r in records]) == reference.hexdigest()
    # Field boundaries and record order are part of the identity.
    assert corpus.corpus_checksum([Passage("1", "Th", "éllo"), records[1]]) != reference.hexdigest()
    assert corpus.corpus_checksum(records[::-1]) != reference.hexdigest()


@pytest.mark.parametrize(
    "record, needle",
    [(("1", "T"), "record 1: expected a Passage"), (("1", 2, "x"), "record 1, field 'title'")],
)
def test_check_record_names_index_and_field(record, needle):
    with pytest.raises(ValueError, match=needle):
        corpus.corpus_checksum([Passage("0", "", ""), record])


def test_reads_the_shared_squad_passages(shared_data):
    path = shared_data / "squad11_dev" / "passages.jsonl"
    passages = list(corpus.read_passages(path))
    assert len(passages) == 2067
    assert passages[0].id == "Super_Bowl_50_0"
    assert passages[0].title == "Super Bowl 50"
    assert passages[0].text.startswith("Super Bowl 50 was an American football game")
    with open(path, encoding="utf-8") as f:
        assert passages == [Passage(**json.loads(line)) for line in f]


def test_a_corpus_of_several_files_reads_them_in_order_and_refuses_ids_repeated_across(tmp_path):
    first, second = tmp_path / "train.jsonl", tmp_path / "dev.tsv"
    first.write_text(
        "".join(json.dumps({"id": f"t{i}", "title": "T", "text": f"x{i}"}) + "\n" for i in range(3))
    )
    second.write_text("id\ttext\ttitle\nd0\ty0\tD\nd1\ty1\tD\n")
    got = list(corpus.read_corpus(f"{first}, {second}"))
    assert [p.id for p in got] == ["t0", "t1", "t2", "d0", "d1"]
    assert list(corpus.read_corpus([first])) == got[:3] == list(corpus.read_passages(first))
    assert corpus.corpus_files(f"{first},,{second},") == [str(first), str(second)]
    with pytest.raises(ValueError, match="no corpus file"):
        corpus.corpus_files(" , ")
    second.write_text("id\ttext\ttitle\nd0\ty0\tD\nt1\ty1\tD\n")
    with pytest.raises(ValueError) as err:
        list(corpus.read_corpus(f"{first},{second}"))
    message = str(err.value)
    assert "duplicate passage id 't1'" in message
    assert f"passage 2 of {second}" in message and f"passage 2 of {first}" in message
