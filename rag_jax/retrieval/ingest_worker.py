"""One worker of the parallel corpus ingest: reads byte ranges of a DPR TSV and tokenises them.

Legend: C corpus size (passages); P passages of one chunk.

`rag_jax.retrieval.ingest` starts its workers as `python -m rag_jax.retrieval.ingest_worker`: a
fresh interpreter that imports this module and the tokenizer library only (no jax, no caller's
script), so each worker costs tens of MB, not the hundreds a copy of the caller would. The
parent writes pickled messages to the worker's stdin and reads pickled answers from its stdout:

    parent -> ("init", config)           the file, its columns, the layout, the tokenizer
    parent -> ("chunk", k, start, end)   tokenise the rows whose lines start in [start, end)
    worker -> ("ok", k, result)          the chunk's columns (`encode_chunk`)
    worker -> ("error", k, line, text, to_line)  a malformed row, `line` 1-based in the chunk
    parent closes stdin                  the worker answers ("bye", peak RSS in KiB) and exits

A chunk is every row whose line starts at a byte offset in [start, end): chunks cut at line
starts, so they tile the file whatever its content, and each worker reads its own bytes. Rows
are parsed as `corpus.read_tsv` parses them (`csv` over universal-newline text), with the same
checks and messages; since a row is one line, the parent turns a chunk's line number into the
file's by the rows before the chunk.
"""

import csv
import hashlib
import io
import itertools
import os
import pickle
import sys

import numpy as np

from rag_jax.retrieval.corpus import _UNDECODABLE, Passage
from rag_jax.retrieval.store import _passage_piece, _tokenize

TOKENIZE_BATCH = 1024  # pieces per tokenizer call


class ChunkError(Exception):
    """A malformed row: `line` (1-based within the chunk) and the message after "line N" (from
    its ": " or ", field"); one naming a second line holds "{to_line}", that line in the chunk."""

    def __init__(self, line: int, text: str, to_line: int | None = None):
        super().__init__(line, text, to_line)
        self.line, self.text, self.to_line = line, text, to_line


def read_chunk(f, start: int, end: int) -> bytes:
    """The bytes of the lines of the open binary file `f` that start in [start, end)."""
    if start > 0:
        f.seek(start - 1)
        f.readline()  # -> the first line start at or after `start`
    else:
        f.seek(0)
    begin = f.tell()
    if begin >= end:
        return b""
    data = f.read(end - begin)
    if data and not data.endswith(b"\n"):
        data += f.readline()  # the last line starts before `end`: it is this chunk's
    return data


def parse_chunk(data: bytes, config: dict) -> list[Passage]:
    """The passages of a chunk's bytes, checked as `corpus.read_tsv` checks a file's rows.

    Args:
      data: whole lines of the TSV, after its header.
      config: "columns" (the id, title and text column indices), "header" (the column names),
        "id_field" (the id column's name, for messages).

    Raises:
      ChunkError: a row that is not valid UTF-8, has another number of columns than the header,
        holds a quoted field running past its line, or has an empty id.
    """
    header, columns, id_field = config["header"], config["columns"], config["id_field"]
    text = io.TextIOWrapper(
        io.BytesIO(data), encoding="utf-8", errors="surrogateescape", newline=None
    )
    last_line = 0

    def counted():
        nonlocal last_line
        for line in text:
            last_line += 1
            if _UNDECODABLE.search(line):
                raise ChunkError(last_line, ": not valid UTF-8")
            yield line

    passages, start = [], 1
    try:
        for row in csv.reader(counted(), delimiter="\t"):
            if last_line != start:
                raise ChunkError(
                    start,
                    ": a quoted field runs on to line {to_line} (an unbalanced quote?); a passage "
                    "row is one line",
                    last_line,
                )
            if len(row) != len(header):
                raise ChunkError(
                    start,
                    f": {len(row)} tab-separated columns, the header has {len(header)} ({header})",
                )
            if any("\n" in field for field in row):
                # A quote left open on the chunk's last line ends at the chunk's end, where the
                # whole file would have run on into the next line.
                raise ChunkError(
                    start, ": a quoted field runs on past its line (an unbalanced quote?)"
                )
            passage = Passage(*(row[c] for c in columns))
            if not passage.id:
                raise ChunkError(start, f", field '{id_field}': empty id")
            passages.append(passage)
            start = last_line + 1
    except csv.Error as e:
        raise ChunkError(last_line, f": {e}") from None
    return passages


def encode_chunk(passages: list[Passage], tokenize_fn, config: dict) -> dict:
    """A chunk's store columns, corpus checksum bytes and id digests.

    Args:
      passages: the chunk's P passages.
      tokenize_fn: list of passage pieces -> list of token id lists.
      config: "prefix", "title_sep", "sep_head" (the store's layout).

    Returns:
      {"count": P, "tokens": `[*] <i4` bytes, "token_lengths": `[P] <i8` bytes,
       "ids" / "titles" / "texts": (UTF-8 bytes, `[P] <i8` byte lengths),
       "canonical": the records' canonical form (`corpus.update_checksum`),
       "digests": `[P]` 8-byte blake2b digests of the ids (`corpus.IdDigests`)}.
    """
    pieces = [
        _passage_piece(p, config["prefix"], config["title_sep"], config["sep_head"])
        for p in passages
    ]
    lengths, tokens = [], []
    for start in range(0, len(pieces), TOKENIZE_BATCH):
        # Into arrays batch by batch: a chunk's ids as Python ints would take 9 times the room.
        token_ids = tokenize_fn(pieces[start : start + TOKENIZE_BATCH])
        lengths.append(np.fromiter(map(len, token_ids), np.int64, len(token_ids)))
        flat = itertools.chain.from_iterable(token_ids)
        tokens.append(np.fromiter(flat, "<i4", int(lengths[-1].sum())))
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    tokens = np.concatenate(tokens) if tokens else np.zeros(0, "<i4")
    encoded = [[value.encode("utf-8") for value in p] for p in passages]
    canonical = b"".join(
        piece for values in encoded for value in values for piece in (_length(value), value)
    )
    result = {
        "count": len(passages),
        "tokens": tokens.tobytes(),
        "token_lengths": lengths.astype("<i8").tobytes(),
        "canonical": canonical,
        "digests": b"".join(hashlib.blake2b(v[0], digest_size=8).digest() for v in encoded),
    }
    for i, name in enumerate(("ids", "titles", "texts")):
        values = [v[i] for v in encoded]
        sizes = np.fromiter(map(len, values), np.int64, len(values)).astype("<i8")
        result[name] = (b"".join(values), sizes.tobytes())
    return result


def _length(value: bytes) -> bytes:
    return len(value).to_bytes(8, "little")


def tokenize_fn(spec: tuple):
    """pieces -> token id lists, from what the parent sent (`ingest.tokenizer_spec`).

    ("backend", json, encode_special_tokens): the HF tokenizer's own Rust pipeline, which its
    `__call__` runs for these arguments (the parent checked that they agree on the first rows);
    ("hf", pickled tokenizer): the HF tokenizer itself, for any other.
    """
    if spec[0] == "backend":
        from tokenizers import Tokenizer  # the Rust library alone: no transformers in a worker

        backend = Tokenizer.from_str(spec[1])
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = spec[2]
        return lambda pieces: [
            e.ids for e in backend.encode_batch(pieces, add_special_tokens=False)
        ]
    tokenizer = pickle.loads(spec[1])
    return lambda pieces: _tokenize(tokenizer, pieces)


def peak_rss_kib() -> int | None:
    """This process's peak resident memory in KiB (Linux's VmHWM; None elsewhere).

    Not `getrusage`'s ru_maxrss: Linux carries that over an exec, so a worker started by a large
    parent would report the parent's peak as its own.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def main() -> None:
    """Serves the parent's messages on stdin/stdout until stdin closes (see the docstring)."""
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers may reach the parent's pipe
    _, config = pickle.load(source)
    tokenize = tokenize_fn(config["tokenizer"])
    with open(config["path"], "rb") as f:
        while True:
            try:
                _, k, start, end = pickle.load(source)
            except EOFError:
                break
            try:
                passages = parse_chunk(read_chunk(f, start, end), config)
                answer = ("ok", k, encode_chunk(passages, tokenize, config))
            except ChunkError as e:
                answer = ("error", k, e.line, e.text, e.to_line)
            pickle.dump(answer, sink, protocol=pickle.HIGHEST_PROTOCOL)
            sink.flush()
    pickle.dump(("bye", peak_rss_kib()), sink, protocol=pickle.HIGHEST_PROTOCOL)
    sink.flush()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
