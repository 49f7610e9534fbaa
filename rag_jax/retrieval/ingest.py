"""DPR's `psgs_w100.tsv` into a passage store at any size: streamed, parallel and resumable.

Legend: C corpus size (passages).

`ingest_tsv` writes the same store as `PassageStore.build(corpus.read_tsv(path), ...)`, byte
for byte (files, offsets, checksums, manifest), without ever holding the corpus:

- The file is cut into chunks of `chunk_bytes` at line starts; worker processes
  (`rag_jax.retrieval.ingest_worker`, `workers` of them) each read, parse, check and tokenise
  their own chunks, and this process appends the answers in file order to the store's column
  files, hashing as it goes. At most two chunks per worker are in flight, so memory depends on
  `chunk_bytes` and `workers`, never on C (measured in docs/benchmarks.md).
- Every `commit_every_s` the column files are flushed to disk and the progress (chunks done,
  each file's length) is written atomically to `<out>/.ingest/manifest.json`. A killed ingest
  started again with the same file and settings cuts the column files back to the last commit,
  hashes what they hold again (reading, not tokenising) and goes on from the next chunk; the
  result is the store an uninterrupted ingest writes.
- A malformed row is a `ValueError` naming the file and line, as `corpus.read_tsv` words it; a
  repeated id names both lines. The ids' 8-byte digests go to `<out>/.ingest/ids.digests` and
  are compared at the end in buckets of bounded size (equal digests are checked against the ids
  themselves).
- Progress lines (`devices.progress.Eta`): megabytes of the file done, rate, time left, passages.
"""

import csv
import hashlib
import itertools
import json
import math
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import time

import numpy as np

from rag_jax.devices.progress import Eta
from rag_jax.retrieval import corpus, files, ingest_worker
from rag_jax.retrieval.store import (
    _COLUMNS,
    FORMAT,
    VERSION,
    PassageStore,
    StringColumn,
    _check_tokenizer,
    _passage_piece,
    _split_doc_sep,
    _tokenize,
)
from rag_jax.retrieval.tokenizer_id import tokenizer_fingerprint

CHUNK_BYTES = 4 << 20  # bytes of the file per chunk (about 6,500 of DPR's passages)
COMMIT_EVERY_S = 30.0  # seconds between two commits of the progress
STATE_DIR = ".ingest"  # inside the store's folder while an ingest is unfinished
STATE_FORMAT = "rag_jax.ingest_state"
DIGESTS = "ids.digests"
DIGEST_BUCKET_BYTES = 16 << 20  # digests compared at a time when looking for repeated ids
_PROBE_ROWS = 256  # rows tokenised both ways before workers use the tokenizer's Rust pipeline
_COLUMN_FILES = [f"{name}{end}" for name, _ in _COLUMNS for end in (".bin", ".offsets.bin")]


def ingest_tsv(
    path,
    tokenizer,
    out_dir,
    *,
    prefix: str = "",
    title_sep: str = " / ",
    doc_sep: str = " // ",
    suffix: str = "",
    fields: dict | None = None,
    workers: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    commit_every_s: float = COMMIT_EVERY_S,
    progress: bool = True,
    overwrite: bool = False,
    stats: dict | None = None,
) -> PassageStore:
    """Tokenises a DPR-style TSV into a passage store in `out_dir`, resuming a killed ingest.

    Args:
      path: the corpus, an uncompressed `.tsv` (chunks are read by byte offset).
      tokenizer: the generator tokenizer, as for `PassageStore.build`.
      out_dir: a new or empty folder, or one holding an unfinished ingest of the same file with
        the same settings (resumed).
      prefix, title_sep, doc_sep, suffix: the context layout, as for `PassageStore.build`.
      fields: column names where they differ from id/title/text, as for `corpus.read_tsv`.
      workers: tokenising processes (default: `os.cpu_count()`).
      chunk_bytes: bytes of the file per chunk (fixed for a resumed ingest).
      commit_every_s: seconds between two commits of the progress (0: after every chunk).
      progress: print progress lines.
      overwrite: start over where `out_dir` holds an unfinished ingest of another file or
        other settings, instead of refusing.
      stats: a dict filled with what the ingest did: "chunks", "resumed_at_chunk" (0: from the
        start), "workers", "worker_peak_rss_kib" (one per worker).

    Returns:
      The store, opened (and checked) from disk.

    Raises:
      ValueError: a malformed row or repeated id (naming file and line), an empty corpus, a
        finished store or other files in `out_dir`, or an unfinished ingest of another file or
        settings (naming what differs).
    """
    path, out_dir = pathlib.Path(path), pathlib.Path(out_dir)
    if path.suffix != ".tsv":
        raise ValueError(f"{path}: ingest_tsv reads an uncompressed .tsv (decompress it first)")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    workers = workers or os.cpu_count() or 1
    sep_head, sep_tail = _split_doc_sep(doc_sep)
    header, columns, header_end = _header(path, fields)
    first = list(itertools.islice(corpus.read_tsv(path, fields), 3))
    if not first:
        raise ValueError(f"{path}: no passages")
    pieces = [_passage_piece(p, prefix, title_sep, sep_head) for p in first]
    layout = _check_tokenizer(tokenizer, pieces, sep_head, sep_tail, suffix)
    size = path.stat().st_size
    settings = {
        "source": _source_identity(path, size),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "layout": {"prefix": prefix, "title_sep": title_sep, "doc_sep": doc_sep, "suffix": suffix},
        "fields": list(corpus._field_names(fields)),
        "chunk_bytes": chunk_bytes,
    }
    state = _prepare(out_dir, settings, overwrite)
    config = {
        "path": str(path.resolve()),
        "header": header,
        "columns": columns,
        "id_field": settings["fields"][0],
        "prefix": prefix,
        "title_sep": title_sep,
        "sep_head": sep_head,
        "tokenizer": tokenizer_spec(tokenizer, path, fields, prefix, title_sep, sep_head),
    }
    writer = _Writer(out_dir, state)
    stats = {} if stats is None else stats
    stats.update(resumed_at_chunk=state["chunks"], workers=workers)
    n_chunks = stats["chunks"] = math.ceil((size - header_end) / chunk_bytes)
    eta = Eta(f"ingest {path.name}", math.ceil(size / 1e6), "MB", start=state["offset"] // 10**6)
    try:
        with _Workers(workers, config) as pool:
            ranges = (
                (k, header_end + k * chunk_bytes, header_end + (k + 1) * chunk_bytes)
                for k in range(state["chunks"], n_chunks)
            )
            for k, end, answer in pool.run(ranges):
                if answer[0] == "error":
                    raise _row_error(path, writer.count, answer)
                writer.append(answer[2])
                state.update(chunks=k + 1, offset=min(end, size))
                if time.monotonic() - writer.committed >= commit_every_s:
                    writer.commit(state)
                if progress:
                    eta.update(state["offset"] // 10**6, f"{writer.count:,} passages")
        stats["worker_peak_rss_kib"] = pool.peak_rss_kib
        if progress:
            eta.update(eta.total, f"{writer.count:,} passages", force=True)
        if not writer.count:
            raise ValueError(f"{path}: no passages")
        records = writer.close()
        _check_repeats(path, out_dir, writer.count, settings["fields"][0])
    except BaseException:
        writer.abandon()
        raise
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "count": writer.count,
        "checksum": writer.checksum.hexdigest(),
        "tokenizer": {
            "class": type(tokenizer).__name__,
            "name": str(getattr(tokenizer, "name_or_path", "")),
            "fingerprint": settings["tokenizer"],
        },
        **settings["layout"],
        "pad_id": tokenizer.pad_token_id,
        **layout,
        "files": records,
    }
    files.write_manifest(out_dir, manifest)  # last: a folder without it is no store
    shutil.rmtree(out_dir / STATE_DIR)
    return PassageStore.open(out_dir)


def open_or_build(
    corpus_path, tokenizer, store_dir, *, fields=None, overwrite=False, workers=None, progress=True
) -> PassageStore:
    """The passage store of `corpus_path` in `store_dir`: reused when it holds that corpus with
    that tokenizer, resumed when unfinished, built otherwise (`ingest_tsv` for a `.tsv`,
    `PassageStore.build` over `corpus.read_passages` for JSONL and `.gz`).

    Whether a store holds the corpus is decided by the corpus checksum, which reads and parses
    the whole file (minutes at 21M passages). Once that is known, `<store_dir>.source.json`
    records the file it was checked against (path, size, mtime, first MiB's sha256, the fields
    read); a later call whose file still matches that record, with the store's checksum
    unchanged, reuses the store without reading the corpus. A file written since (a new mtime
    or size) is read and checked again.

    Raises:
      ValueError: `store_dir` holds a store of another corpus or tokenizer (unless `overwrite`).
    """
    store_dir = pathlib.Path(store_dir)
    path = pathlib.Path(corpus_path)
    record = _source_record(path, fields)  # before reading: a file written meanwhile differs
    if (store_dir / files.MANIFEST).is_file():
        store = PassageStore.open(store_dir)
        known = _read_source_record(store_dir) == dict(record, checksum=store.checksum)
        checksum = (
            store.checksum
            if known
            else corpus.corpus_checksum(corpus.read_passages(corpus_path, fields))
        )
        stale = store.differences(checksum, tokenizer)
        if not stale:
            shutil.rmtree(store_dir / STATE_DIR, ignore_errors=True)  # killed while tidying
            _write_source_record(store_dir, record, store.checksum)
            return store
        if not overwrite:
            raise ValueError(
                f"{store_dir} was built from another corpus or tokenizer (differs: {stale}); "
                "pass overwrite=True to rebuild it"
            )
        shutil.rmtree(store_dir)
    _source_path(store_dir).unlink(missing_ok=True)
    if path.suffix == ".tsv":
        store = ingest_tsv(corpus_path, tokenizer, store_dir, fields=fields, workers=workers,
                           progress=progress, overwrite=overwrite)  # fmt: skip
    else:
        if store_dir.exists():  # an interrupted build (PassageStore.build does not resume)
            shutil.rmtree(store_dir)
        store = PassageStore.build(corpus.read_passages(corpus_path, fields), tokenizer, store_dir)
    _write_source_record(store_dir, record, store.checksum)
    return store


def _source_path(store_dir: pathlib.Path) -> pathlib.Path:
    """Beside the store, not in it: a store's folder holds its own files only."""
    return store_dir.with_name(store_dir.name + ".source.json")


def _source_record(path: pathlib.Path, fields) -> dict:
    return {
        "source": _source_identity(path, path.stat().st_size),
        "fields": list(corpus._field_names(fields)),
    }


def _read_source_record(store_dir: pathlib.Path) -> dict | None:
    try:
        return json.loads(_source_path(store_dir).read_text())
    except (OSError, ValueError):
        return None  # none, or unreadable: the corpus is read and checked instead


def _write_source_record(store_dir: pathlib.Path, record: dict, checksum: str) -> None:
    text = json.dumps(dict(record, checksum=checksum), indent=1, sort_keys=True)
    files.write_atomic(_source_path(store_dir), text.encode())


def _header(path: pathlib.Path, fields) -> tuple[list[str], list[int], int]:
    """(column names, the id/title/text column indices, the header's byte length)."""
    names = corpus._field_names(fields)
    with open(path, "rb") as f:
        raw = f.readline()
    lines = corpus.text_lines(path)
    try:
        first = next(lines, None)
    finally:
        lines.close()
    if first is None:
        raise ValueError(f"{path}: empty file; expected a header line naming {list(names)}")
    line = first[1]
    if len(line.encode("utf-8", "surrogateescape")) != len(raw) - raw.endswith(b"\r\n"):
        raise ValueError(
            f"{path}, line 1: ends in a lone carriage return; the ingest cuts lines at \\n"
        )
    header = next(csv.reader([line], delimiter="\t"))
    if len(set(header)) != len(header):
        raise ValueError(f"{path}, line 1: repeated column name in header {header}")
    missing = [name for name in names if name not in header]
    if missing:
        raise ValueError(f"{path}, line 1, field '{missing[0]}': no such column in {header}")
    return header, [header.index(name) for name in names], len(raw)


def _source_identity(path: pathlib.Path, size: int) -> dict:
    """What tells a resumed ingest that the file is the one it began: size, mtime, first MiB."""
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()
    return {"path": str(path.resolve()), "bytes": size, "mtime_ns": path.stat().st_mtime_ns,
            "head_sha256": head}  # fmt: skip


def tokenizer_spec(tokenizer, path, fields, prefix, title_sep, sep_head) -> tuple:
    """How workers tokenise: the tokenizer's Rust pipeline when its `__call__` is that pipeline
    (a `transformers` fast tokenizer whose encoding is not overridden, agreeing with it on the
    file's first rows), else the pickled tokenizer (workers then import transformers)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    plain = (
        backend is not None
        and type(tokenizer)._encode_plus.__qualname__ == "TokenizersBackend._encode_plus"
        and type(tokenizer).__call__.__qualname__ == "PreTrainedTokenizerBase.__call__"
    )
    if plain:
        spec = ("backend", backend.to_str(), bool(getattr(tokenizer, "split_special_tokens", 0)))
        rows = itertools.islice(corpus.read_tsv(path, fields), _PROBE_ROWS)
        pieces = [_passage_piece(p, prefix, title_sep, sep_head) for p in rows]
        if ingest_worker.tokenize_fn(spec)(pieces) == _tokenize(tokenizer, pieces):
            return spec
    return ("hf", pickle.dumps(tokenizer))


def _row_error(path, rows_before: int, answer: tuple) -> ValueError:
    """The file's error for a worker's ("error", k, line, text, to_line): a row is one line and
    the header line 1, so a chunk's line n is the file's line rows_before + 1 + n."""
    _, _, line, text, to_line = answer
    base = rows_before + 1
    if to_line is not None:
        text = text.format(to_line=base + to_line)
    return ValueError(f"{path}, line {base + line}{text}")


# ---------------------------------------------------------------------------------------------
# The store's files and the progress


def _prepare(out_dir: pathlib.Path, settings: dict, overwrite: bool) -> dict:
    """The progress to go on from: a resumed ingest's, or a fresh one's (files created)."""
    state_dir = out_dir / STATE_DIR
    if (out_dir / files.MANIFEST).is_file():
        shutil.rmtree(state_dir, ignore_errors=True)  # a finished ingest killed while tidying
        raise ValueError(f"{out_dir}: holds a finished passage store; ingest into a new folder")
    if (state_dir / files.MANIFEST).is_file():
        state = files.read_manifest(state_dir, {STATE_FORMAT: (1,)}, what="ingest progress")
        differing = [key for key in settings if state["settings"].get(key) != settings[key]]
        if not differing:
            return state
        if not overwrite:
            raise ValueError(
                f"{out_dir} holds an unfinished ingest of another file or settings (differs: "
                f"{differing}); delete the folder, or pass overwrite=True to start over"
            )
    ours = set(_COLUMN_FILES) | {STATE_DIR}
    if out_dir.is_dir():
        others = [p.name for p in out_dir.iterdir() if p.name not in ours]
        if others:
            raise ValueError(
                f"{out_dir}: not empty ({sorted(others)[:5]}); ingest into a new folder"
            )
        shutil.rmtree(state_dir, ignore_errors=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    zero = np.zeros(1, "<i8").tobytes()
    for name in _COLUMN_FILES:  # the offsets files start with offset 0
        (out_dir / name).write_bytes(zero if name.endswith(".offsets.bin") else b"")
    (state_dir / DIGESTS).write_bytes(b"")
    lengths = {name: (out_dir / name).stat().st_size for name in _COLUMN_FILES}
    state = {"format": STATE_FORMAT, "version": 1, "settings": settings, "chunks": 0,
             "offset": 0, "count": 0, "lengths": lengths}  # fmt: skip
    files.write_manifest(state_dir, state)
    return state


class _Writer:
    """Appends chunks to the column files and hashes them; commits and resumes the progress."""

    def __init__(self, out_dir: pathlib.Path, state: dict):
        self.out_dir, self.count = out_dir, state["count"]
        self.paths = {name: out_dir / name for name in _COLUMN_FILES}
        self.paths[DIGESTS] = out_dir / STATE_DIR / DIGESTS
        lengths = {**state["lengths"], DIGESTS: 8 * state["count"]}
        self.hashes, self.files, self.ends = {}, {}, {}
        for name, path in self.paths.items():
            with open(path, "r+b") as f:
                f.truncate(lengths[name])  # drops what was written after the last commit
            self.hashes[name] = _sha256_prefix(path, lengths[name])
            self.files[name] = open(path, "ab")
        for name, _ in _COLUMNS:  # the last offset (in items): where the next passage begins
            self.ends[name] = _last_offset(self.paths[f"{name}.offsets.bin"])
        self.checksum = _corpus_checksum(out_dir, self.count)
        self.committed = time.monotonic()

    def append(self, result: dict) -> None:
        """Writes one chunk's answer (`ingest_worker.encode_chunk`) after the ones before."""
        lengths = {"tokens": np.frombuffer(result["token_lengths"], "<i8")}
        data = {"tokens": result["tokens"]}
        for name in ("ids", "titles", "texts"):
            data[name], sizes = result[name]
            lengths[name] = np.frombuffer(sizes, "<i8")
        for name, _ in _COLUMNS:
            offsets = (self.ends[name] + np.cumsum(lengths[name])).astype("<i8")
            self._write(f"{name}.bin", data[name])
            self._write(f"{name}.offsets.bin", offsets.tobytes())
            if len(offsets):
                self.ends[name] = int(offsets[-1])
        self._write(DIGESTS, result["digests"])
        self.checksum.update(result["canonical"])
        self.count += result["count"]

    def _write(self, name: str, data: bytes) -> None:
        self.files[name].write(data)
        self.hashes[name].update(data)

    def commit(self, state: dict) -> None:
        """Flushes every file to disk, then records the progress atomically."""
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        lengths = {name: self.files[name].tell() for name in _COLUMN_FILES}
        state.update(count=self.count, lengths=lengths)
        files.write_manifest(self.out_dir / STATE_DIR, state)
        self.committed = time.monotonic()

    def close(self) -> dict:
        """Closes the files; returns the manifest's records of the column files."""
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        records = {}
        for name, dtype in _COLUMNS:
            records[f"{name}.bin"] = {
                "dtype": np.dtype(dtype).str,
                "length": self.ends[name],
                "sha256": self.hashes[f"{name}.bin"].hexdigest(),
            }
            records[f"{name}.offsets.bin"] = {
                "dtype": "<i8",
                "length": self.count + 1,
                "sha256": self.hashes[f"{name}.offsets.bin"].hexdigest(),
            }
        return records

    def abandon(self) -> None:
        """Closes the files, keeping the last commit for a resumed ingest."""
        for f in self.files.values():
            f.close()


def _sha256_prefix(path: pathlib.Path, length: int):
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while length > 0 and (block := f.read(min(files.IO_BLOCK, length))):
            sha.update(block)
            length -= len(block)
    return sha


def _last_offset(path: pathlib.Path) -> int:
    with open(path, "rb") as f:
        f.seek(-8, os.SEEK_END)
        return int(np.frombuffer(f.read(8), "<i8")[0])


def _map(path: pathlib.Path, dtype) -> np.ndarray:
    size = path.stat().st_size // np.dtype(dtype).itemsize
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


def _corpus_checksum(out_dir: pathlib.Path, count: int):
    """The corpus checksum's hash state after the first `count` passages of the column files."""
    checksum = hashlib.sha256()
    columns = [
        StringColumn(_map(out_dir / f"{n}.bin", "u1"), _map(out_dir / f"{n}.offsets.bin", "<i8"))
        for n in ("ids", "titles", "texts")
    ]
    for start in range(0, count, 1 << 14):
        stop = min(count, start + (1 << 14))
        checksum.update(_canonical(columns, start, stop))
    return checksum


def _canonical(columns, start: int, stop: int) -> bytes:
    """The canonical form (`corpus.update_checksum`) of passages [start, stop) of the columns."""
    pieces = []
    for i in range(start, stop):
        for column in columns:
            value = column._data[column._offsets[i] : column._offsets[i + 1]].tobytes()
            pieces += (len(value).to_bytes(8, "little"), value)
    return b"".join(pieces)


def _check_repeats(path, out_dir: pathlib.Path, count: int, id_field: str) -> None:
    """Raises naming both lines when an id repeats, reading the digests in bounded buckets."""
    digests_path = out_dir / STATE_DIR / DIGESTS
    buckets = max(1, math.ceil(8 * count / DIGEST_BUCKET_BYTES))
    ids = StringColumn(_map(out_dir / "ids.bin", "u1"), _map(out_dir / "ids.offsets.bin", "<i8"))
    repeats = []
    for bucket in range(buckets):
        found, where = [], []
        for start in range(0, count, 1 << 20):
            block = np.fromfile(digests_path, "<u8", min(1 << 20, count - start), offset=8 * start)
            mine = np.flatnonzero(block % buckets == bucket)
            found.append(block[mine])
            where.append(start + mine)
        digests = IdDigestsView(np.concatenate(found), np.concatenate(where))
        repeat = digests.first_repeat(lambda wanted: {i: ids[i] for i in wanted})
        if repeat:
            repeats.append(repeat)
    if repeats:
        first, later, passage_id = min(repeats, key=lambda r: r[1])
        raise ValueError(
            f"{path}, line {later + 2}, field '{id_field}': duplicate id {passage_id!r} (first "
            f"at line {first + 2})"
        )


class IdDigestsView(corpus.IdDigests):
    """`corpus.IdDigests` over digests and positions already in arrays."""

    def __init__(self, digests: np.ndarray, where: np.ndarray):
        self._digests = digests.astype("<u8").tobytes()
        self._where = where.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Workers


class _Workers:
    """`n` worker processes (`python -m rag_jax.retrieval.ingest_worker`), fed chunk ranges."""

    DEPTH = 2  # chunks queued per worker

    def __init__(self, n: int, config: dict):
        self.n, self.config, self.procs, self.peak_rss_kib = n, config, [], []

    def __enter__(self):
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
        package_root = str(pathlib.Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        for _ in range(self.n):
            proc = subprocess.Popen(
                [sys.executable, "-m", "rag_jax.retrieval.ingest_worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            self.procs.append(proc)
            self._send(proc, ("init", self.config))
        return self

    def _send(self, proc, message) -> None:
        pickle.dump(message, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        proc.stdin.flush()

    def _receive(self, proc):
        try:
            return pickle.load(proc.stdout)
        except EOFError:
            code = proc.wait()
            raise RuntimeError(
                f"ingest worker {proc.pid} exited with code {code} (its error is above)"
            ) from None

    def run(self, ranges):
        """Yields (k, end, answer) for each (k, start, end) of `ranges`, in order."""
        ranges, pending = iter(ranges), []
        for proc in itertools.islice(itertools.cycle(self.procs), self.DEPTH * self.n):
            task = next(ranges, None)
            if task is None:
                break
            self._send(proc, ("chunk", *task))
            pending.append((proc, task))
        while pending:
            proc, (k, _, end) = pending.pop(0)
            answer = self._receive(proc)
            if answer[1] != k:
                raise RuntimeError(f"ingest worker {proc.pid} answered chunk {answer[1]}, not {k}")
            task = next(ranges, None)
            if task is not None:
                self._send(proc, ("chunk", *task))
                pending.append((proc, task))
            yield k, end, answer

    def __exit__(self, kind, error, tb):
        for proc in self.procs:
            if kind is None:
                proc.stdin.close()
                answer = self._receive(proc)
                self.peak_rss_kib.append(answer[1])
                proc.wait()
            else:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            if not proc.stdin.closed:
                proc.stdin.close()
