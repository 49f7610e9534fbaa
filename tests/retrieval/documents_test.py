"""rag_jax.retrieval.documents: folder reading, 100-word windows, ids, titles, errors, jsonl."""

import os

import pytest

from rag_jax.retrieval import corpus
from rag_jax.retrieval.corpus import Passage
from rag_jax.retrieval.documents import read_documents, write_passages_jsonl

# Irregular whitespace between words: spaces, runs, newlines (\n, \r\n), tabs, a form feed.
SEPARATORS = [" ", "  ", "\n", "\t", " \n\t ", "\r\n", "\n\n\n", "\x0c", "\u00a0"]


def _text(n):
    """n words (distinct, some non-ASCII) separated by a cycle of irregular whitespace."""
    words = [f"w{i}" if i % 7 else f"naïve{i}" for i in range(n)]
    parts = []
    for i, word in enumerate(words):
        parts += [word, SEPARATORS[i % len(SEPARATORS)]]
    return "\t \n" + "".join(parts)


def _write(folder, relative, content):
    path = folder / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


@pytest.mark.parametrize("n", [1, 99, 100, 101, 250])
def test_windows_equal_reference_cut(tmp_path, n):
    text = _text(n)
    _write(tmp_path, "doc.txt", text)
    words = text.split()  # the reference: str.split, cut at 0, 100, 200, ...
    expected = [" ".join(words[i : i + 100]) for i in range(0, len(words), 100)]
    passages = read_documents(tmp_path)
    assert [p.text for p in passages] == expected
    assert [p.id for p in passages] == [f"doc_{i}" for i in range(len(expected))]
    assert [len(p.text.split()) for p in passages][-1] == n - 100 * (len(expected) - 1)
    first_line = "naïve0" if n == 1 else "naïve0 w1  w2"  # the first non-empty line, stripped
    assert {p.title for p in passages} == {first_line}


def test_ids_titles_recursion_and_order(tmp_path):
    _write(tmp_path, "b.txt", "\n\n  Plain first line  \nbody words")
    _write(tmp_path, "a/z.md", "## Zed heading ##\n\nText of zed.")
    _write(tmp_path, "a.txt", "###\nno heading text")  # '#' only: the stem is the title
    _write(tmp_path, "A.md", "#Upper")
    _write(tmp_path, "deep/er/x.y.md", "\ufeff# Dotted name\n" + " ".join(["w"] * 150))
    _write(tmp_path, "g.md.txt", "g")  # the suffix is .txt; the id stem keeps .md
    for ignored in ("c.rst", "d.TXT", "e.txt.bak", "f", "deep/notes.markdown"):
        _write(tmp_path, ignored, "ignored words")
    (tmp_path / "empty_dir").mkdir()
    passages = read_documents(str(tmp_path))
    assert [(p.id, p.title) for p in passages] == [
        ("A_0", "Upper"),
        ("a_0", "a"),
        ("a/z_0", "Zed heading ##"),
        ("b_0", "Plain first line"),
        ("deep/er/x.y_0", "Dotted name"),
        ("deep/er/x.y_1", "Dotted name"),
        ("g.md_0", "g"),
    ]
    assert passages[1].text == "### no heading text"
    assert passages[2].text == "## Zed heading ## Text of zed."  # the heading stays in the text
    assert passages[4].text == "# Dotted name " + " ".join(["w"] * 97)  # no byte-order mark
    assert passages[5].text == " ".join(["w"] * 53)


def test_errors_name_folder_file_and_line(tmp_path):
    with pytest.raises(ValueError, match="missing: not a folder"):
        read_documents(tmp_path / "missing")
    file = _write(tmp_path, "file.txt", "words")
    with pytest.raises(ValueError, match="file.txt: not a folder"):
        read_documents(file)

    only_others = tmp_path / "others"
    _write(only_others, "a.rst", "words")
    _write(only_others, "sub/b.html", "words")
    with pytest.raises(ValueError, match=r"others: no \.txt or \.md file"):
        read_documents(only_others)
    (tmp_path / "bare").mkdir()
    with pytest.raises(ValueError, match="bare: no"):
        read_documents(tmp_path / "bare")

    for name, content in [("empty", b""), ("blank", " \n\t\r\n  \n")]:
        folder = tmp_path / name
        _write(folder, "fine.md", "fine")
        _write(folder, f"sub/{name}.txt", content)
        with pytest.raises(ValueError, match=f"sub/{name}.txt: holds no word"):
            read_documents(folder)

    bad = tmp_path / "bad"
    _write(bad, "notes/latin1.md", b"line one\nline two\ncaf\xe9 line three\n")
    with pytest.raises(ValueError, match=r"notes/latin1.md, line 3: not valid UTF-8"):
        read_documents(bad)

    twins = tmp_path / "twins"
    _write(twins, "sub/a.md", "one")
    _write(twins, "sub/a.txt", "two")
    with pytest.raises(ValueError, match=r"sub/a.md and .*sub/a.txt: both give passage ids"):
        read_documents(twins)


def test_jsonl_round_trip_through_read_corpus(tmp_path):
    folder = tmp_path / "docs"
    _write(folder, "one.md", "# Título\n" + _text(230))
    _write(folder, "two/three.txt", 'quotes " and \\ backslash 中文 😀\n\ttab')
    passages = read_documents(folder)
    assert len(passages) == 4
    path = tmp_path / "corpus.jsonl"
    path.write_text("old contents\n")
    write_passages_jsonl(passages, path)
    assert list(corpus.read_corpus(str(path))) == passages
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl", "docs"]  # no temporary file left


def test_write_passages_jsonl_errors(tmp_path):
    good = [Passage("a_0", "A", "text")]
    with pytest.raises(ValueError, match=r"out.tsv: a passage file written here must end in"):
        write_passages_jsonl(good, tmp_path / "out.tsv")
    with pytest.raises(ValueError, match="no passages to write"):
        write_passages_jsonl([], tmp_path / "out.jsonl")
    with pytest.raises(ValueError, match=r"record 1, field 'id': duplicate id 'a_0' \(first in"):
        write_passages_jsonl(good + good, tmp_path / "out.jsonl")
    with pytest.raises(ValueError, match=r"record 0, field 'title': expected a string"):
        write_passages_jsonl([("a", None, "text")], tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()
