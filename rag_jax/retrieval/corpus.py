"""Passage corpora: streaming readers, 100-word splitting, and the corpus checksum.

Legend: C corpus size.

Readers (`read_tsv`, `read_jsonl`, `read_passages`) are generators of small `Passage` records, so
DPR's 21M-line `psgs_w100.tsv` never sits in memory as Python objects. Every malformed line is a
`ValueError` naming the file, the 1-based line and the field; nothing is skipped. The pre-tokenised,
memory-mapped form of a corpus is `rag_jax.retrieval.store.PassageStore`.
"""

import array
import csv
import gzip
import hashlib
import io
import itertools
import json
import pathlib
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

FIELDS = ("id", "title", "text")
# Undecodable bytes become lone surrogates under errors="surrogateescape"; valid UTF-8 never
# decodes to one, so finding one pins a bad line without losing the line count.
_UNDECODABLE = re.compile("[\udc80-\udcff]")
# JSON's "\ud800" escapes decode to lone surrogates, which no UTF-8 file or tokenizer can hold.
_SURROGATE = re.compile("[\ud800-\udfff]")
SURROGATE_ERROR = "holds a lone surrogate (a \\ud800-\\udfff escape), which is not valid Unicode"


class Passage(NamedTuple):
    """One corpus record: a string id, the article title and the passage text."""

    id: str
    title: str
    text: str


# ---------------------------------------------------------------------------------------------
# Readers


def read_passages(path, fields: Mapping[str, str] | None = None) -> Iterator[Passage]:
    """Streams passages from a `.tsv` or `.jsonl` file, either optionally gzipped (`.gz`).

    Args:
      path: the file; the format is taken from its suffix.
      fields: maps our field names (`id`, `title`, `text`) to the file's column or key names where
        they differ, e.g. `{"text": "contents"}`; unnamed fields keep their own name.

    Yields:
      `Passage` records in file order.

    Raises:
      ValueError: naming file, line and field, for a malformed record, an empty id, a non-UTF-8
        line or a truncated `.gz` (when it is reached), a duplicate id or an empty file (after the
        last record).
    """
    suffixes = [s for s in pathlib.Path(path).suffixes if s != ".gz"]
    if suffixes and suffixes[-1] == ".tsv":
        return read_tsv(path, fields)
    if suffixes and suffixes[-1] == ".jsonl":
        return read_jsonl(path, fields)
    raise ValueError(
        f"{path}: unknown passage file format; expected .tsv or .jsonl (optionally .gz)"
    )


def corpus_files(paths) -> list[str]:
    """The files of a corpus named as one path, a comma-separated list, or a sequence of paths."""
    parts = paths.split(",") if isinstance(paths, str) else list(paths)
    files = [str(p).strip() for p in parts if str(p).strip()]
    if not files:
        raise ValueError(f"no corpus file named in {paths!r}")
    return files


def read_corpus(paths, fields: Mapping[str, str] | None = None) -> Iterator[Passage]:
    """Streams the passages of one or more files (`corpus_files`) in order, as `read_passages`
    reads each; an id repeated across files is refused naming both files and lines."""
    files = corpus_files(paths)
    if len(files) == 1:
        yield from read_passages(files[0], fields)
        return
    digests, where = IdDigests(), []  # position -> (file, passage number within it)
    for f, path in enumerate(files):
        for n, passage in enumerate(read_passages(path, fields)):
            digests.add(passage.id, len(where))
            where.append((f, n))
            yield passage

    def lookup(wanted):
        out = {}
        for position in wanted:
            f, n = where[position]
            out[position] = next(itertools.islice(read_passages(files[f], fields), n, None)).id
        return out

    repeat = digests.first_repeat(lookup)
    if repeat:
        first, later, passage_id = repeat
        (f1, n1), (f2, n2) = where[first], where[later]
        raise ValueError(
            f"duplicate passage id {passage_id!r}: passage {n2 + 1} of {files[f2]} and passage "
            f"{n1 + 1} of {files[f1]}"
        )


def read_tsv(path, fields: Mapping[str, str] | None = None) -> Iterator[Passage]:
    """Streams passages from a DPR-style TSV: a header line naming the columns, then one row each.

    Parsed like DPR's own reader (`csv.reader(delimiter="\\t")` over a file opened in text mode):
    fields may be quoted with `"` and a doubled `""` inside is one quote (`psgs_w100.tsv` quotes
    its texts this way). A row is one line: a quoted field that runs on past the end of its line
    (an unbalanced quote, which would swallow the rows after it into one passage) is refused
    naming the line, as is a row with another number of columns than the header. Columns are
    found by header name, so DPR's `id, text, title` order and extra columns are fine. See
    `read_passages` for the rest.
    """
    return _checked(path, _tsv_records, _field_names(fields))


def read_jsonl(path, fields: Mapping[str, str] | None = None) -> Iterator[Passage]:
    """Streams passages from JSON Lines: one object per line with string `id`, `title`, `text`.

    Extra keys are ignored; the shared SQuAD `passages.jsonl` reads as is. See `read_passages`.
    """
    return _checked(path, _jsonl_records, _field_names(fields))


def _field_names(fields: Mapping[str, str] | None) -> tuple[str, str, str]:
    fields = dict(fields or {})
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ValueError(f"fields: unknown keys {unknown}; expected a subset of {list(FIELDS)}")
    return tuple(fields.get(name, name) for name in FIELDS)


def text_lines(path) -> Iterator[tuple[int, str]]:
    """Yields (1-based line number, line) of a UTF-8 text file (optionally .gz), universal newlines
    like open(); a line that is not valid UTF-8, or a `.gz` that is truncated or not gzip, is an
    error naming the line."""
    raw = gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")
    line_no = 0
    with io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", newline=None) as f:
        lines = iter(f)
        while True:
            try:
                line = next(lines, None)
            except (EOFError, OSError, zlib.error) as e:  # gzip: truncated, corrupted, not gzip
                raise ValueError(
                    f"{path}, line {line_no + 1}: unreadable ({type(e).__name__}: {e}); is the "
                    "file truncated or corrupted?"
                ) from None
            if line is None:
                return
            line_no += 1
            if _UNDECODABLE.search(line):
                raise ValueError(f"{path}, line {line_no}: not valid UTF-8")
            yield line_no, line


def _tsv_records(path, names) -> Iterator[tuple[int, Passage]]:
    last_line = 0

    def counted():
        nonlocal last_line
        for line_no, line in text_lines(path):
            last_line = line_no  # where the row csv is parsing ends, for error messages
            yield line

    rows = csv.reader(counted(), delimiter="\t")
    try:
        header = next(rows, None)
        if header is None:
            raise ValueError(f"{path}: empty file; expected a header line naming {list(names)}")
        if len(set(header)) != len(header):
            raise ValueError(f"{path}, line 1: repeated column name in header {header}")
        columns = []
        for name in names:
            if name not in header:
                raise ValueError(f"{path}, line 1, field '{name}': no such column in {header}")
            columns.append(header.index(name))
        start = last_line + 1
        for row in rows:
            if last_line != start:
                # A quote opened in one row and closed in another swallows the rows between into
                # one field: a passage would take another row's title and rows would vanish.
                raise ValueError(
                    f"{path}, line {start}: a quoted field runs on to line {last_line} (an "
                    "unbalanced quote?); a passage row is one line"
                )
            if len(row) != len(header):
                raise ValueError(
                    f"{path}, line {start}: {len(row)} tab-separated columns, the header has "
                    f"{len(header)} ({header})"
                )
            yield start, Passage(*(row[c] for c in columns))
            start = last_line + 1
    except csv.Error as e:
        raise ValueError(f"{path}, line {last_line}: {e}") from None


def json_objects(path) -> Iterator[tuple[int, dict]]:
    """Yields (1-based line number, object) of a JSONL file; other lines are errors naming them."""
    for line_no, line in text_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}, line {line_no}: invalid JSON ({e.msg}, column {e.colno})"
            ) from None
        except (ValueError, RecursionError) as e:  # an integer of > 4300 digits, deep nesting
            raise ValueError(f"{path}, line {line_no}: unreadable JSON ({e})") from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{path}, line {line_no}: expected a JSON object, got {type(record).__name__}"
            )
        yield line_no, record


def _jsonl_records(path, names) -> Iterator[tuple[int, Passage]]:
    for line_no, record in json_objects(path):
        values = []
        for name in names:
            if name not in record:
                raise ValueError(f"{path}, line {line_no}, field '{name}': missing")
            if not isinstance(record[name], str):
                raise ValueError(
                    f"{path}, line {line_no}, field '{name}': expected a string, got "
                    f"{type(record[name]).__name__}"
                )
            if has_surrogate(record[name]):
                raise ValueError(f"{path}, line {line_no}, field '{name}': {SURROGATE_ERROR}")
            values.append(record[name])
        yield line_no, Passage(*values)


def _checked(path, records_fn, names) -> Iterator[Passage]:
    """Yields the records of one file, then fails on an empty file or a repeated id."""
    digests = IdDigests()
    for line_no, passage in records_fn(path, names):
        if not passage.id:
            raise ValueError(f"{path}, line {line_no}, field '{names[0]}': empty id")
        digests.add(passage.id, line_no)
        yield passage
    if not len(digests):
        raise ValueError(f"{path}: no passages")
    # Re-reading on this error path only: the ids behind equal digests are compared exactly.
    repeat = digests.first_repeat(
        lambda wanted: {line: p.id for line, p in records_fn(path, names) if line in wanted}
    )
    if repeat:
        first, later, passage_id = repeat
        raise ValueError(
            f"{path}, line {later}, field '{names[0]}': duplicate id {passage_id!r} "
            f"(first at line {first})"
        )


class IdDigests:
    """Finds repeated ids in a stream: 64-bit digests of every id and where it was seen, packed.

    21M ids cost 16 bytes each and no Python objects. Equal digests are only candidates; callers
    compare the ids themselves before reporting, so a hash collision never rejects a corpus.
    """

    def __init__(self):
        self._digests = bytearray()
        self._where = array.array("q")

    def __len__(self) -> int:
        return len(self._where)

    def add(self, passage_id: str, where: int) -> None:
        self._digests += hashlib.blake2b(passage_id.encode("utf-8"), digest_size=8).digest()
        self._where.append(where)

    def first_repeat(
        self, lookup: Callable[[set[int]], Mapping[int, str]]
    ) -> tuple[int, int, str] | None:
        """The repeated id seen earliest, as (first position, repeat position, id), or None.

        Args:
          lookup: maps a set of positions (the few whose digests are shared) to their ids.
        """
        digests = np.frombuffer(self._digests, dtype="<u8")
        where = np.frombuffer(self._where, dtype=np.int64)
        order = np.argsort(digests, kind="stable")  # stable: positions ascend within a digest
        sorted_digests = digests[order]
        same = sorted_digests[1:] == sorted_digests[:-1]
        shared = np.zeros(len(order), bool)
        shared[1:] |= same
        shared[:-1] |= same
        if not shared.any():
            return None
        candidates, candidate_digests = where[order[shared]], sorted_digests[shared]
        ids = lookup({int(w) for w in candidates})
        groups = np.split(candidates, np.flatnonzero(np.diff(candidate_digests)) + 1)
        repeats = []
        for group in groups:  # a group may mix distinct ids whose digests collide
            first_seen = {}
            for position in group.tolist():
                passage_id = ids[position]
                if passage_id in first_seen:
                    repeats.append((first_seen[passage_id], position, passage_id))
                first_seen.setdefault(passage_id, position)
        return min(repeats, key=lambda repeat: repeat[1], default=None)


# ---------------------------------------------------------------------------------------------
# Documents to passages, checksum


def split_documents(
    documents: Iterable[Passage], words: int = 100, ids: str = "chunk"
) -> Iterator[Passage]:
    """Splits documents into passages of `words` words, DPR's recipe for `psgs_w100.tsv`.

    The text is split at any whitespace (`str.split()`), cut into consecutive non-overlapping
    chunks of `words` words (the last may be shorter) and each chunk re-joined with single spaces;
    the document title is carried onto every chunk.

    Args:
      documents: records whose `id` names the document and whose `text` is the whole article.
      words: words per passage.
      ids: `"chunk"` gives `<doc id>-<chunk index>` (0-based; unique because the part after the last
        `-` is the index), `"sequential"` gives `"1"`, `"2"`, ... across all documents, as in DPR.

    Yields:
      `Passage` records. A document without any word is a `ValueError` naming it.
    """
    if words < 1:
        raise ValueError(f"words must be >= 1, got {words}")
    if ids not in ("chunk", "sequential"):
        raise ValueError(f"ids must be 'chunk' or 'sequential', got {ids!r}")
    serial = itertools.count(1)
    for doc in documents:
        tokens = doc.text.split()
        if not tokens:
            raise ValueError(f"document {doc.id!r}: text has no words to split into passages")
        for chunk, start in enumerate(range(0, len(tokens), words)):
            passage_id = f"{doc.id}-{chunk}" if ids == "chunk" else str(next(serial))
            yield Passage(passage_id, doc.title, " ".join(tokens[start : start + words]))


def corpus_checksum(records: Iterable[Passage]) -> str:
    """sha256 hex digest of the canonical records, the corpus identity stored in manifests.

    Canonical form: for each record in order, for id, title, text: the UTF-8 byte length as 8
    little-endian bytes, then the bytes (lengths make field boundaries unambiguous).
    """
    checksum = hashlib.sha256()
    for index, record in enumerate(records):
        update_checksum(checksum, check_record(record, index))
    return checksum.hexdigest()


def update_checksum(checksum, passage: Passage) -> None:
    """Feeds one record's canonical form (see `corpus_checksum`) to a `hashlib.sha256()`."""
    for value in passage:
        data = value.encode("utf-8")
        checksum.update(len(data).to_bytes(8, "little"))
        checksum.update(data)


def check_record(record: Any, index: int) -> Passage:
    """A `Passage` from a record of any iterable; `ValueError` naming `index` and field if bad
    (not a string, not encodable as UTF-8, or an empty id)."""
    if not isinstance(record, Sequence) or isinstance(record, str) or len(record) != 3:
        raise ValueError(
            f"record {index}: expected a Passage (id, title, text), got {record!r:.80}"
        )
    for field, value in zip(FIELDS, record, strict=True):
        if not isinstance(value, str):
            raise ValueError(
                f"record {index}, field '{field}': expected a string, got {type(value).__name__}"
            )
        if has_surrogate(value):
            raise ValueError(f"record {index}, field '{field}': {SURROGATE_ERROR}")
    if not record[0]:
        raise ValueError(f"record {index}, field 'id': empty id")
    return Passage(*record)


def has_surrogate(text: str) -> bool:
    """Whether `text` holds a lone surrogate (a JSON `"\\ud800"` escape), which is no Unicode
    character: UTF-8 cannot encode it and tokenizers fail on it."""
    return bool(_SURROGATE.search(text))
