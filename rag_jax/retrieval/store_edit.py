"""Editing a passage store (and the vectors row-aligned with it) at the speed of copying bytes.

Legend: C corpus size (passages), E edited passages (replaced or added), D embedding width.

An edit replaces passages in place, deletes some and appends new ones (`RowEdit`); the rows
after a deleted one move up. `PassageStore.build` would tokenise, hash and write every passage
again in Python (~125 us a passage: 8 minutes at 4M); `edit_store` copies the unchanged rows'
bytes as runs between the edited rows (E + 1 runs per column), tokenises only the E new
passages and computes the offsets with numpy. The corpus checksum (`corpus.corpus_checksum`:
the records' canonical bytes in order) is computed from the new columns in blocks of rows, the
canonical stream assembled by numpy (`store_checksum`), and `IdLookup` finds the rows of given
ids by vectorised 64-bit digests of the id column. The result is byte-for-byte the store
`PassageStore.build` writes from the same records; the edit's cost is linear in the store's
bytes, at memory speed, and its memory is bounded by a block (never the corpus).

What is copied is what was sealed. The old files are memory-mapped, so a check made before the
edit says nothing of the bytes the copy reads later. The copy therefore reads each old file
whole and in file order (the runs it copies and the rows the edit replaces or deletes), into
memory block by block, hashes every block as read and writes the very blocks it hashed; the
digest is compared with the old manifest's sha256 before anything new is sealed, and a
difference (`SourceChangedError`) names the file and keeps nothing of the edit. The store's
offsets are read once, checked, and that one copy cuts the runs; the vectors (`EditedVectors`)
are checked inside the index's write, before its manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pathlib
from collections.abc import Iterator, Sequence

import numpy as np

from rag_jax.retrieval import files
from rag_jax.retrieval.corpus import Passage
from rag_jax.retrieval.index import ExactIndex
from rag_jax.retrieval.index_format import save_vector_blocks
from rag_jax.retrieval.store import (
    _COLUMNS,
    FORMAT,
    VERSION,
    PassageStore,
    _passage_piece,
    _split_doc_sep,
    _tokenize,
)

_BLOCK_BYTES = 1 << 20  # canonical bytes assembled per block (8x that in gather indices): in cache
_DIGEST_BASE = np.uint64(0x100000001B3)  # FNV's 64-bit prime, as a polynomial hash's base
_LAYOUT = ("tokenizer", "prefix", "title_sep", "doc_sep", "suffix", "pad_id")


class SourceChangedError(ValueError):
    """A file an edit copies from was not, as the edit read it, the file its manifest seals: it
    changed after any check made before the edit. Nothing of the edit is kept."""


@dataclasses.dataclass(frozen=True)
class RowEdit:
    """Which rows of a C-row table an edit replaces, deletes and appends.

    The new table: the old rows in order, each of `replaced` holding its new item, each of
    `deleted` gone, then `appended` new items. New items are numbered replaced first (in row
    order), then appended.

    Attributes:
      count: C, the rows before the edit.
      replaced: [R] int64 old rows, ascending.
      deleted: [X] int64 old rows, ascending, none of them replaced.
      appended: how many new rows follow the old ones.
    """

    count: int
    replaced: np.ndarray
    deleted: np.ndarray
    appended: int

    @classmethod
    def of(cls, count: int, replaced=(), deleted=(), appended: int = 0) -> RowEdit:
        """The edit with its rows sorted and checked (in range, unique, disjoint)."""
        rows = [np.unique(np.asarray(list(r), np.int64)) for r in (replaced, deleted)]
        for name, given, unique in zip(("replaced", "deleted"), (replaced, deleted), rows):
            if len(unique) != len(list(given)):
                raise ValueError(f"{name}: a row is given twice")
            if len(unique) and not (0 <= unique[0] and unique[-1] < count):
                raise ValueError(f"{name}: rows must be in [0, {count})")
        if np.intersect1d(*rows).size:
            raise ValueError("a row is both replaced and deleted")
        if appended < 0:
            raise ValueError(f"appended must be >= 0, got {appended}")
        return cls(count, rows[0], rows[1], appended)

    @property
    def new_count(self) -> int:
        return self.count - len(self.deleted) + self.appended

    @property
    def items(self) -> int:
        """The new items: replaced, then appended."""
        return len(self.replaced) + self.appended

    def new_rows(self) -> np.ndarray:
        """[items] the new row of each new item."""
        replaced = self.replaced - np.searchsorted(self.deleted, self.replaced)
        first = self.count - len(self.deleted)
        return np.concatenate([replaced, np.arange(first, first + self.appended)])

    def pieces(self) -> Iterator[tuple[str, int, int]]:
        """The new table in order: ("old", a, b) for old rows [a, b), ("new", i, j) for new
        items [i, j); empty pieces are skipped."""
        events = np.concatenate([self.replaced, self.deleted])
        is_replaced = np.concatenate(
            [np.ones(len(self.replaced), bool), np.zeros(len(self.deleted), bool)]
        )
        order = np.argsort(events, kind="stable")
        start, item = 0, 0
        for row, replaced in zip(events[order].tolist(), is_replaced[order].tolist()):
            if row > start:
                yield "old", start, row
            if replaced:
                yield "new", item, item + 1
                item += 1
            start = row + 1
        if start < self.count:
            yield "old", start, self.count
        if self.appended:
            yield "new", item, item + self.appended

    def apply(self, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        """The new table of a per-row array: `old` [C, ...] with `new` [items, ...] placed."""
        out = np.array(old, copy=True)
        out[self.replaced] = new[: len(self.replaced)]
        out = np.delete(out, self.deleted, axis=0)
        return np.concatenate([out, new[len(self.replaced) :]], axis=0)

    def blocks(self, old: np.ndarray, new: np.ndarray, rows: int = 65536) -> Iterator[np.ndarray]:
        """The new table of a [C, D] array in blocks of at most `rows` rows, never whole in
        memory (`old` may be memory-mapped)."""
        for kind, a, b in self.pieces():
            source = old if kind == "old" else new
            for start in range(a, b, rows):
                yield np.asarray(source[start : min(b, start + rows)])


class EditedVectors:
    """The [C', D] vectors after a `RowEdit` of `old` with `new` [items, D], written in blocks
    (`blocks`) rather than held: what `bundle_format.write_index` writes to index/."""

    def __init__(
        self,
        edit: RowEdit,
        old: np.ndarray,
        new: np.ndarray,
        sealed: tuple[pathlib.Path, str] | None = None,
    ):
        """Args:
        edit: the rows replaced, deleted and appended.
        old: [C, D] the vectors before the edit (may be memory-mapped).
        new: [items, D] the edit's new vectors (`RowEdit` order).
        sealed: (the file `old` holds the rows of, its sha256 as its manifest seals it): the
          rows read are checked against it (`blocks`). None: nothing to check them against.
        """
        if len(old) != edit.count or len(new) != edit.items:
            raise ValueError(
                f"vectors: {len(old)} old and {len(new)} new rows for an edit of {edit.count} "
                f"rows with {edit.items} new items"
            )
        self.edit, self.old, self.sealed = edit, old, sealed
        self.new = np.asarray(new).astype(old.dtype, copy=False).reshape(-1, old.shape[1])
        self.shape = (edit.new_count, old.shape[1])
        self.dtype = old.dtype

    def blocks(self) -> Iterator[np.ndarray]:
        """The new table's rows in blocks, in order. The old rows are read whole and in order
        (those the edit replaces or deletes too), each block copied into memory and hashed as
        read; the blocks given are those copies. After the last block the digest is compared
        with `sealed`'s sha256: inside the index's write (`save`), before its manifest.

        Raises:
          SourceChangedError: the rows read are not the sealed file's, naming it.
        """
        sha = hashlib.sha256()
        read = 0  # old rows read so far
        for kind, a, b in self.edit.pieces():
            if kind == "new":
                yield from _blocks(self.new, a, b)
                continue
            for _ in _read_hashed(self.old, read, a, sha):  # replaced or deleted: not copied
                pass
            yield from _read_hashed(self.old, a, b, sha)
            read = b
        for _ in _read_hashed(self.old, read, len(self.old), sha):
            pass
        if self.sealed is not None:
            _check_read(self.sealed[0], sha, self.sealed[1])

    def save(self, directory, provenance: dict) -> np.ndarray:
        """Writes them as an exact index folder (`ExactIndex.load` reads it) with `provenance`
        (encoder fingerprint, corpus checksum); returns them memory-mapped from there.

        Raises:
          SourceChangedError: see `blocks` (the folder is not written then).
        """
        save_vector_blocks(directory, self.blocks(), self.shape, self.dtype, provenance)
        return ExactIndex.load(str(directory), verify=False, mmap=True).vectors


# ---------------------------------------------------------------------------------------------
# Reading what was sealed


def _blocks(array: np.ndarray, start: int, stop: int) -> Iterator[np.ndarray]:
    """Rows [start, stop) of `array` in blocks of at most `files.IO_BLOCK` bytes."""
    row_bytes = array.dtype.itemsize * math.prod(array.shape[1:])
    step = max(1, files.IO_BLOCK // max(1, row_bytes))
    for at in range(start, stop, step):
        yield array[at : min(stop, at + step)]


def _read_hashed(array: np.ndarray, start: int, stop: int, sha) -> Iterator[np.ndarray]:
    """Rows [start, stop) of `array` (memory-mapped) read into memory in blocks, little-endian
    as stored, each hashed into `sha` as read: a block written is a block hashed, whatever
    happens to the file after it was read."""
    little = array.dtype.newbyteorder("<")
    for view in _blocks(array, start, stop):
        block = np.array(view, dtype=little)  # a copy, in memory
        sha.update(block.reshape(-1).view(np.uint8))
        yield block


def _check_read(path: pathlib.Path, sha, sealed: str | None) -> None:
    """Raises `SourceChangedError` naming `path` when the bytes read of it (hashed into `sha`)
    are not those its manifest seals (`sealed`; None for a store written before sha256s were
    recorded, which is checked by its sizes and offsets only)."""
    if sealed is not None and sha.hexdigest() != sealed:
        raise SourceChangedError(
            f"{path} changed while it was read for the edit: sha256 {sha.hexdigest()} != the "
            f"manifest's {sealed}; the edit was not written"
        )


# ---------------------------------------------------------------------------------------------
# Reading the columns in bulk


def _columns(store: PassageStore) -> list[tuple[np.ndarray, np.ndarray]]:
    """(data, offsets) of the id, title and text columns, in the canonical record's order."""
    return [(c._data, c._offsets) for c in (store.ids, store._titles, store._texts)]


def _gather(data: np.ndarray, offsets: np.ndarray, a: int, b: int, dest: np.ndarray, out):
    """Copies the strings of rows [a, b) into `out` at positions `dest` [b - a] (each row's
    bytes from its destination on)."""
    lo, hi = int(offsets[a]), int(offsets[b])
    if hi == lo:
        return
    lengths = np.diff(np.asarray(offsets[a : b + 1]))
    shift = dest - (np.asarray(offsets[a:b]) - lo)
    out[np.repeat(shift, lengths) + np.arange(hi - lo)] = data[lo:hi]


def store_checksum(store: PassageStore) -> str:
    """`corpus.corpus_checksum` of the store's records, computed from its columns in blocks:
    per record, per field (id, title, text), the UTF-8 length as 8 little-endian bytes, then the
    bytes."""
    checksum = hashlib.sha256()
    columns = _columns(store)
    count = len(store)
    row = 0
    while row < count:
        # As many rows as fit a block (at least one).
        sizes = sum(np.asarray(o[row + 1 : row + 1 + (1 << 16)]) - o[row] for _, o in columns)
        rows = max(1, int(np.searchsorted(sizes + 24 * np.arange(1, len(sizes) + 1), _BLOCK_BYTES)))
        stop = min(count, row + rows)
        lengths = np.stack([np.diff(np.asarray(o[row : stop + 1])) for _, o in columns], axis=1)
        field_sizes = (lengths + 8).reshape(-1)  # [rows * 3], record by record
        field_start = np.cumsum(field_sizes) - field_sizes
        out = np.empty(int(field_sizes.sum()), np.uint8)
        headers = lengths.reshape(-1).astype("<u8").view(np.uint8).reshape(-1, 8)
        out[field_start[:, None] + np.arange(8)] = headers
        for f, (data, offsets) in enumerate(columns):
            _gather(data, offsets, row, stop, field_start[f::3] + 8, out)
        checksum.update(out)
        row = stop
    return checksum.hexdigest()


def _digests(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """[n] 64-bit polynomial digests of the strings of a (data, offsets [n + 1]) column."""
    offsets = np.asarray(offsets, np.int64)
    lengths = np.diff(offsets)
    out = np.zeros(len(lengths), np.uint64)
    if offsets[-1] == offsets[0]:
        return out
    bytes_ = np.asarray(data[offsets[0] : offsets[-1]]).astype(np.uint64) + np.uint64(1)
    position = np.arange(len(bytes_)) - np.repeat(offsets[:-1] - offsets[0], lengths)
    powers = np.ones(int(lengths.max()), np.uint64)
    powers[1:] = np.cumprod(np.full(len(powers) - 1, _DIGEST_BASE, np.uint64))  # wraps mod 2^64
    nonempty = lengths > 0
    with np.errstate(over="ignore"):
        sums = np.add.reduceat(bytes_ * powers[position], (offsets[:-1] - offsets[0])[nonempty])
        out[nonempty] = sums + lengths[nonempty].astype(np.uint64)
    return out


def _digests_of(ids: Sequence[str]) -> np.ndarray:
    encoded = [i.encode("utf-8") for i in ids]
    offsets = np.concatenate([[0], np.cumsum([len(e) for e in encoded])]).astype(np.int64)
    return _digests(np.frombuffer(b"".join(encoded), np.uint8), offsets)


class IdLookup:
    """The rows of ids in a store: every id's digest computed once (vectorised, in blocks) and
    sorted, 16 bytes a passage; a lookup is a binary search, each hit checked against the id
    itself (so a collision of digests never gives a wrong row)."""

    def __init__(self, store: PassageStore, block: int = 1 << 20):
        self.store = store
        data, offsets = store.ids._data, store.ids._offsets
        digests = [
            _digests(data, offsets[start : min(len(store), start + block) + 1])
            for start in range(0, len(store), block)
        ]
        digests = np.concatenate(digests) if digests else np.zeros(0, np.uint64)
        self._order = np.argsort(digests, kind="stable")
        self._sorted = digests[self._order]

    def rows(self, ids: Sequence[str]) -> np.ndarray:
        """[n] int64 the row of each of `ids`, -1 where the store lacks it."""
        wanted = _digests_of(list(ids))
        at = np.searchsorted(self._sorted, wanted)
        rows = np.full(len(wanted), -1, np.int64)
        for i, passage_id in enumerate(ids):
            j = int(at[i])
            while j < len(self._sorted) and self._sorted[j] == wanted[i]:
                if self.store.ids[int(self._order[j])] == passage_id:
                    rows[i] = self._order[j]
                    break
                j += 1  # a digest shared by two ids
        return rows


# ---------------------------------------------------------------------------------------------
# Writing the edited store


def _write_column(
    directory: pathlib.Path,
    name: str,
    dtype: str,
    old: tuple[np.ndarray, np.ndarray],
    new: list[bytes],
    edit: RowEdit,
    source: pathlib.Path,
    sealed: dict,
) -> dict:
    """Writes `<name>.bin` and `<name>.offsets.bin` of the edited column; returns their records
    (as `_ColumnWriter.close`).

    `old` (data, offsets) is memory-mapped from the store folder `source`, whose manifest's
    file records are `sealed`. The offsets are read once, hashed and checked before they are
    used; that copy cuts the runs and gives the lengths. The data are read whole and in file
    order (the runs copied and the rows replaced or deleted), hashed as read, each run written
    from the blocks hashed, and checked once read.

    Raises:
      SourceChangedError: an old file read is not the sealed one, naming it.
    """
    data, offsets = old
    names = [f"{name}.bin", f"{name}.offsets.bin"]
    read = [hashlib.sha256(), hashlib.sha256()]  # of the old files, as read
    offsets = np.concatenate(list(_read_hashed(offsets, 0, len(offsets), read[1])))
    _check_read(source / names[1], read[1], sealed[names[1]].get("sha256"))
    itemsize = np.dtype(dtype).itemsize
    new_lengths = np.asarray([len(b) // itemsize for b in new], np.int64)
    lengths = edit.apply(np.diff(offsets), new_lengths)
    hashes = [hashlib.sha256(), hashlib.sha256()]  # of the new files, as written
    at = 0  # old items read so far
    with open(directory / names[0], "xb") as f:
        for kind, a, b in edit.pieces():
            if kind == "new":
                for item in new[a:b]:
                    f.write(item)
                    hashes[0].update(item)
                continue
            start, stop = int(offsets[a]), int(offsets[b])
            for _ in _read_hashed(data, at, start, read[0]):  # replaced or deleted rows
                pass
            for block in _read_hashed(data, start, stop, read[0]):
                files.write_bytes(f, block)
                hashes[0].update(block.view(np.uint8))
            at = stop
        for _ in _read_hashed(data, at, len(data), read[0]):
            pass
    _check_read(source / names[0], read[0], sealed[names[0]].get("sha256"))
    new_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("<i8").tobytes()
    with open(directory / names[1], "xb") as f:
        f.write(new_offsets)
    hashes[1].update(new_offsets)
    return {
        names[0]: {
            "dtype": np.dtype(dtype).str,
            "length": int(lengths.sum()),
            "sha256": hashes[0].hexdigest(),
        },
        names[1]: {
            "dtype": "<i8",
            "length": edit.new_count + 1,
            "sha256": hashes[1].hexdigest(),
        },
    }


def edit_store(
    store: PassageStore, out_dir, tokenizer, edit: RowEdit, passages: Sequence[Passage]
) -> PassageStore:
    """Writes `store` after `edit` to the new folder `out_dir`; returns it opened.

    Args:
      store: the store before the edit (memory-mapped; not changed).
      out_dir: a new or empty folder.
      tokenizer: the store's generator tokenizer (its fingerprint is checked).
      edit: the rows replaced, deleted and appended.
      passages: the edit's new items (`RowEdit` order: replaced rows ascending, then appended),
        checked records (`corpus.check_record`).

    Raises:
      ValueError: the tokenizer is not the store's, `passages` do not match the edit, or
        `out_dir` is not empty (nothing is written then).
      SourceChangedError (a ValueError): a file of `store` read for the copy is not the one its
        manifest seals (it changed after the store was opened or checked), naming it; the
        partial files are removed.
      OSError: `errno.ENOSPC` saying the disk is full (nothing is left in `out_dir`).
    """
    if store.differences(store.checksum, tokenizer):
        raise ValueError(f"{store.directory}: built with another tokenizer than the one given")
    if len(passages) != edit.items or edit.count != len(store):
        raise ValueError(
            f"{len(passages)} passages for an edit of {edit.count} rows with {edit.items} new "
            f"items; the store {store.directory} has {len(store)}"
        )
    out_dir = pathlib.Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir}: not empty; a passage store is written into a new directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = {k: store.manifest.get(k, "") for k in _LAYOUT}
    sep_head, _ = _split_doc_sep(layout["doc_sep"])
    pieces = [_passage_piece(p, layout["prefix"], layout["title_sep"], sep_head) for p in passages]
    new_items = {
        "tokens": [np.asarray(t, "<i4").tobytes() for t in _tokenize(tokenizer, pieces)],
        "ids": [p.id.encode("utf-8") for p in passages],
        "titles": [p.title.encode("utf-8") for p in passages],
        "texts": [p.text.encode("utf-8") for p in passages],
    }
    sealed = store.manifest["files"]  # the records `PassageStore.open` checked
    old = {
        "tokens": (store._tokens, store._token_offsets),
        **dict(zip(("ids", "titles", "texts"), _columns(store), strict=True)),
    }
    try:
        records = {}
        for name, dtype in _COLUMNS:
            records |= _write_column(
                out_dir, name, dtype, old[name], new_items[name], edit, store.directory, sealed
            )
        written = PassageStore._map_all(out_dir, records)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "count": edit.new_count,
            "checksum": None,
            **layout,
            "prefix_ids": store.manifest["prefix_ids"],
            "suffix_ids": store.manifest["suffix_ids"],
            "files": records,
        }
        edited = PassageStore(out_dir, manifest, written)
        manifest["checksum"] = store_checksum(edited)
        files.write_manifest(out_dir, manifest)  # last, atomically: without it, no store
    except BaseException as e:
        for name, _ in _COLUMNS:
            for end in (".bin", ".offsets.bin"):
                (out_dir / f"{name}{end}").unlink(missing_ok=True)
        if files.is_disk_full(e):
            raise files.disk_full_error(
                f"the passage store in {out_dir}",
                "its partial files were removed: free space and edit again",
                e,
            ) from e
        raise
    return PassageStore.open(out_dir, verify=False)
