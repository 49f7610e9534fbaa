"""Passage vectors computed elsewhere, imported into a vectors folder without encoding again.

Legend: C corpus size (passages), D embedding width.

`import_vectors(source, store, out_dir)` reads the [C, D] vectors of `store`'s passages from

- a `.npy` file (float32, float16, or bfloat16 as `np.save` writes it: `|V2`), memory-mapped;
- a folder of `.npy` shards, concatenated in natural order of their names (`emb_2` before
  `emb_10`);
- a Parquet file, or a folder of them, with an `embeddings` column (a list of floats per row)
  and optionally an `id` column;
- Arrow files as `datasets` writes them: a `save_to_disk` folder (its `state.json` gives the
  files' order) such as `wiki_dpr`'s, with `embeddings` beside `id`, `text`, `title`, or
  `.arrow` files of a `datasets` cache;

and writes them as one shard of a vectors folder (`rag_jax.retrieval.vectors`, which
`load_vectors` memory-maps), in the corpus' order. Nothing holds the whole matrix: sources are
memory-mapped or read in row groups, rows are written in blocks at their place in the file, and
float16/bfloat16 stay as they are (float64 is stored as float32). The shard is written in
`.<out_dir>.import` beside the folder, its progress recorded every `COMMIT_EVERY_S`: an import
killed and started again with the same source files (paths, sizes, times), store and dtype goes
on after the last rows recorded, and writes the same folder an uninterrupted one writes.

Row i of the source is passage i of the store, unless the source has an id column: then each
row goes to the store's row of that id, and the ids must be the store's, each once. Counts,
widths, dtypes and ids are checked; every error names the file at fault. Pickles (DPR's own
embedding shards) are refused by name and magic bytes, never opened: loading a pickle runs
whatever code it holds. The error gives the one-line conversion to run where the file is
trusted.

The vectors' `encoder_fingerprint`: the encoder's (`encoder_id.encoder_fingerprint`) when the caller
names the encoder they came from, otherwise `imported:<sha256 of the shard>`, the vectors'
own identity, which no encoder's fingerprint equals: an index of them loads with `index.load`,
and a run that checks its passage encoder against the index refuses it rather than mixing
towers.
"""

import io
import json
import os
import pathlib
import re
import shutil
import time

import ml_dtypes
import numpy as np

from rag_jax.retrieval import files, index
from rag_jax.retrieval.scann_recall import RECALL_TARGET
from rag_jax.retrieval.store import PassageStore
from rag_jax.retrieval.store_edit import IdLookup
from rag_jax.retrieval.vectors import FORMAT, NPY_DTYPES, VERSION, shard_name

_PICKLE_SUFFIXES = (".pkl", ".pickle", ".pck")
COMMIT_EVERY_S = 60.0  # an import's progress is made durable this often (a kill loses less)
_PROGRESS = "progress.json"
_IGNORED = {"state.json", "dataset_info.json", "dataset_dict.json", "README.md"}
_NPY_DTYPES = {"<f2": "float16", "<f4": "float32", "<f8": "float64", "|V2": "bfloat16"}
_NPY_DTYPES |= {"<V2": "bfloat16"}
CONVERT_PICKLE = (
    'python -c "import pickle,sys,numpy as np,pyarrow as pa,pyarrow.parquet as pq; '
    "p=sys.argv[1]; d=pickle.load(open(p,'rb')); v=np.stack([x[1] for x in d]); "
    "pq.write_table(pa.table({'id':[str(x[0]).removeprefix('wiki:') for x in d],"
    "'embeddings':pa.FixedSizeListArray.from_arrays(pa.array(v.ravel()),v.shape[1])}),"
    "p+'.parquet')\" "
)


def refuse_pickle(path) -> None:
    """Raises naming `path` when it is a pickle, by its suffix or its first bytes."""
    path = pathlib.Path(path)
    with open(path, "rb") as f:
        head = f.read(2)
    magic = len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5  # PROTO opcode, 2-5
    if path.suffix in _PICKLE_SUFFIXES or magic:
        raise ValueError(
            f"{path}: a Python pickle (DPR's embedding shards are pickles); rag_jax never "
            "unpickles a file, since loading one runs whatever code it holds. Convert it once, "
            "where the file is trusted, to Parquet with columns id and embeddings:\n  "
            f"{CONVERT_PICKLE}{path}\nand import the {path.name}.parquet it writes"
        )


def _natural(path: pathlib.Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def source_parts(source) -> list["_Part"]:
    """The files of `source` in row order, each opened as a `_Part`; see the module docstring."""
    source = pathlib.Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source}: no such vectors file or folder")
    if source.is_file():
        return [_open_part(source)]
    found = sorted((p for p in source.iterdir() if not p.name.startswith(".")), key=_natural)
    for path in found:
        if path.is_file():
            refuse_pickle(path)
    state = source / "state.json"
    if state.is_file():  # a `datasets` save_to_disk folder: its own list of files, in order
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        return [_open_part(source / name) for name in names]
    kinds = {p.suffix for p in found if p.name not in _IGNORED and not p.name.endswith(".lock")}
    if len(kinds) != 1 or kinds - {".npy", ".parquet", ".arrow"}:
        raise ValueError(
            f"{source}: expected a folder of .npy, .parquet or .arrow files (one kind), found "
            f"{sorted(kinds) or 'none'}"
        )
    return [_open_part(p) for p in found if p.suffix in kinds]


def _open_part(path: pathlib.Path) -> "_Part":
    refuse_pickle(path)
    if path.suffix == ".npy":
        return _NpyPart(path)
    if path.suffix == ".parquet":
        return _ArrowPart(path, "parquet")
    if path.suffix == ".arrow":
        return _ArrowPart(path, "arrow")
    raise ValueError(f"{path}: unknown vectors file; expected .npy, .parquet or .arrow")


class _Part:
    """One source file: `path`, `rows`, `dim`, `dtype` (a name of `files.DTYPES` or float64),
    `has_ids`, and `batches(rows)` yielding (ids or None, [n, D] array) in row order."""

    path: pathlib.Path
    rows: int
    dim: int
    dtype: str
    has_ids: bool


class _NpyPart(_Part):
    has_ids = False

    def __init__(self, path: pathlib.Path):
        self.path = path
        shape, dtype, _ = files.npy_header(path)
        if dtype not in _NPY_DTYPES or len(shape) != 2:
            raise ValueError(
                f"{path}: holds {shape} {dtype}; expected [C, D] float32, float16, bfloat16 "
                "or float64"
            )
        self.rows, self.dim = shape
        self.dtype = _NPY_DTYPES[dtype]

    def batches(self, rows: int):
        array = np.load(self.path, mmap_mode="r", allow_pickle=False)
        if self.dtype == "bfloat16":
            array = array.view(ml_dtypes.bfloat16)
        for start in range(0, self.rows, rows):
            yield None, array[start : start + rows]


class _ArrowPart(_Part):
    """A Parquet file (read by row groups) or an Arrow IPC file (memory-mapped), with an
    `embeddings` list column and an optional `id` column."""

    def __init__(self, path: pathlib.Path, kind: str, column: str = "embeddings"):
        import pyarrow as pa
        import pyarrow.compute

        self.path, self.kind, self.column = path, kind, column
        try:
            schema = self._schema()
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{path}: not a readable {kind} file ({e})") from None
        if column not in schema.names:
            raise ValueError(f"{path}: no {column!r} column (columns {schema.names})")
        self.has_ids = "id" in schema.names
        field = schema.field(column).type
        if not (pa.types.is_list(field) or pa.types.is_large_list(field)
                or pa.types.is_fixed_size_list(field)):  # fmt: skip
            raise ValueError(f"{path}: column {column!r} is {field}; expected a list of floats")
        names = {pa.float16(): "float16", pa.float32(): "float32", pa.float64(): "float64"}
        if field.value_type not in names:
            raise ValueError(
                f"{path}: column {column!r} holds {field.value_type}; expected float16, "
                "float32 or float64"
            )
        self.dtype = names[field.value_type]
        self.rows, self.dim = 0, getattr(field, "list_size", None)
        for _, batch in self._record_batches(1 << 16, ids=False):  # Parquet: decodes one column
            self.rows += len(batch)
            if self.dim is None and len(batch):
                self.dim = int(pyarrow.compute.list_value_length(batch)[0].as_py() or 0)

    def _schema(self):
        import pyarrow.ipc
        import pyarrow.parquet

        if self.kind == "parquet":
            return pyarrow.parquet.ParquetFile(self.path).schema_arrow
        with pyarrow.memory_map(str(self.path)) as source:
            return self._reader(source).schema

    @staticmethod
    def _reader(source):
        import pyarrow as pa
        import pyarrow.ipc

        try:
            return pyarrow.ipc.open_stream(source)  # what `datasets` writes
        except pa.ArrowInvalid:
            source.seek(0)
            return pyarrow.ipc.open_file(source)

    def _record_batches(self, rows: int, ids: bool):
        """Yields (ids column or None, embeddings column) of batches of at most `rows` rows."""
        import pyarrow
        import pyarrow.parquet

        columns = [self.column] + (["id"] if ids else [])
        if self.kind == "parquet":
            reader = pyarrow.parquet.ParquetFile(self.path)
            for batch in reader.iter_batches(batch_size=rows, columns=columns):
                yield (batch.column("id") if ids else None), batch.column(self.column)
            return
        with pyarrow.memory_map(str(self.path)) as source:
            reader = self._reader(source)
            batches = (
                reader.get_batch(i) for i in range(reader.num_record_batches)
            ) if hasattr(reader, "num_record_batches") else reader  # fmt: skip
            for batch in batches:
                for start in range(0, len(batch), rows):
                    part = batch.slice(start, rows)
                    yield (part.column("id") if ids else None), part.column(self.column)

    def batches(self, rows: int):
        import pyarrow.compute

        done = 0
        for ids, column in self._record_batches(rows, self.has_ids):
            if column.null_count:
                row = done + int(np.flatnonzero(column.is_null().to_numpy(False))[0])
                raise ValueError(f"{self.path}, row {row}: no embedding (null)")
            lengths = pyarrow.compute.list_value_length(column).to_numpy(False)
            if np.any(lengths != self.dim):
                row = done + int(np.flatnonzero(lengths != self.dim)[0])
                raise ValueError(
                    f"{self.path}, row {row}: an embedding of width {lengths[row - done]}, the "
                    f"file's first has {self.dim}"
                )
            values = column.flatten().to_numpy(zero_copy_only=False)
            done += len(column)
            yield (
                None if ids is None else [str(i) for i in ids.to_pylist()],
                values.reshape(len(column), self.dim),
            )


# ---------------------------------------------------------------------------------------------
# Import


def import_vectors(
    source,
    store: PassageStore,
    out_dir,
    *,
    encoder_fingerprint: str | None = None,
    dtype: str | None = None,
    dim: int | None = None,
) -> dict:
    """Writes the vectors of `source` for `store`'s passages as a vectors folder in `out_dir`.

    Args:
      source: a `.npy`, Parquet or Arrow file, or a folder of them (see the module docstring).
      store: the passage store the vectors belong to (its count, ids and corpus checksum).
      out_dir: the vectors folder to write (replaced whole if it holds vectors already).
      encoder_fingerprint: the encoder the vectors came from, when the caller knows it;
        default `imported:<sha256 of the shard>` (module docstring).
      dtype: the storage dtype (float32, float16, bfloat16); default the source's (float64 is
        stored as float32).
      dim: the width the vectors must have (e.g. the question encoder's), if known.

    Returns:
      The vectors manifest written (`vectors.read_manifest`).

    Raises:
      ValueError naming the file: a pickle, an unknown format, another count than the store's,
        widths or dtypes that differ between files or from `dim`, a null or short embedding, an
        id not in the store or given twice.
    """
    parts = source_parts(source)
    first = parts[0]
    for part in parts:
        if part.dim != first.dim or part.dtype != first.dtype:
            raise ValueError(
                f"{part.path}: [{part.rows}, {part.dim}] {part.dtype}, but {first.path} holds "
                f"width {first.dim} {first.dtype}: every file of the source must agree"
            )
        if part.has_ids != first.has_ids:
            raise ValueError(f"{part.path}: ids in some files of {source} but not in others")
    if dim is not None and first.dim != dim:
        raise ValueError(f"{first.path}: vectors of width {first.dim}, expected {dim}")
    count = sum(part.rows for part in parts)
    if count != len(store):
        raise ValueError(
            f"{source}: {count} vectors ({', '.join(f'{p.path.name}: {p.rows}' for p in parts)})"
            f" but the passage store {store.directory} holds {len(store)} passages"
        )
    stored = dtype or {"float64": "float32"}.get(first.dtype, first.dtype)
    if stored not in NPY_DTYPES:
        raise ValueError(f"dtype {stored!r}: expected one of {sorted(NPY_DTYPES)}")
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "count": count,
        "dim": first.dim,
        "dtype": stored,
        "shard_size": count,
        "shards": [],
        "corpus_checksum": store.checksum,
        "source": {
            "path": str(pathlib.Path(source).resolve()),
            "dtype": first.dtype,
            "files": [p.path.name for p in parts],
        },  # fmt: skip
    }

    staging = _staging(out_dir)
    record = _write_shard(staging, parts, store, stored)
    manifest["shards"].append({"index": 0, "file": shard_name(0), "rows": count,
                               "sha256": record["sha256"]})  # fmt: skip
    manifest["encoder_fingerprint"] = encoder_fingerprint or f"imported:{record['sha256']}"

    def write_fn(tmp):
        os.replace(staging / shard_name(0), pathlib.Path(tmp) / shard_name(0))
        return {shard_name(0): record}

    written = files.swap_dir(out_dir, write_fn, manifest, what="vectors")
    shutil.rmtree(staging, ignore_errors=True)
    return {k: v for k, v in written.items() if k != "files"}


def _staging(out_dir) -> pathlib.Path:
    """Where an import writes its shard and its progress before the vectors folder is sealed:
    beside `out_dir`, the same for every attempt, so a killed import resumes there."""
    out_dir = pathlib.Path(out_dir).absolute()
    return out_dir.parent / f".{out_dir.name}.import"


def _source_key(parts, store: PassageStore, dtype: str) -> dict:
    """What a resumed import must share with the killed one: the source files (path, size,
    modification time), the store's corpus and count, and the stored dtype."""
    sources = []
    for part in parts:
        stat = part.path.stat()
        sources.append([str(part.path.resolve()), stat.st_size, stat.st_mtime_ns])
    return {"files": sources, "corpus_checksum": store.checksum, "count": len(store),
            "dtype": dtype}  # fmt: skip


def _resumed(staging: pathlib.Path, key: dict) -> dict | None:
    """The progress of a killed import of the same source into `staging` ({"part",
    "part_done", "done", "seen"}), or None (nothing there, or another import's)."""
    try:
        progress = json.loads((staging / _PROGRESS).read_text())
        seen = np.load(staging / progress["seen"], allow_pickle=False)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if progress.get("key") != key or not (staging / shard_name(0)).is_file():
        return None
    if seen.shape != (key["count"],) or seen.dtype != bool:
        return None
    return progress | {"seen": seen}


def _commit(f, staging: pathlib.Path, key: dict, seen: np.ndarray, where: dict) -> None:
    """Makes the rows written so far durable and records how far the import got: the shard's
    data first, then `seen` in a file of its own, then the progress naming it (atomically)."""
    f.flush()
    os.fsync(f.fileno())
    name = f"seen.{where['done']}.npy"
    buffer = io.BytesIO()
    np.save(buffer, seen)
    files.write_atomic(staging / name, buffer.getvalue())
    progress = json.dumps({"key": key, "seen": name, **where})
    files.write_atomic(staging / _PROGRESS, progress.encode("utf-8"))
    for old in staging.glob("seen.*.npy"):
        if old.name != name:
            old.unlink(missing_ok=True)


def _write_shard(staging: pathlib.Path, parts, store: PassageStore, dtype: str) -> dict:
    """Writes the `.npy` shard in `staging`, each row at its store row, recording its progress
    every `COMMIT_EVERY_S`; started again after a kill with the same source, store and dtype,
    it goes on after the last rows recorded. Returns the shard's {"bytes", "sha256"}."""
    count, dim = len(store), parts[0].dim
    npy = np.dtype(NPY_DTYPES[dtype])
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": npy.str, "fortran_order": False, "shape": (count, dim)}
    )
    head = header.getvalue()
    row_bytes, rows = dim * npy.itemsize, max(1, files.IO_BLOCK // (dim * 4))
    key = _source_key(parts, store, dtype)
    progress = _resumed(staging, key)
    if progress is None:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        progress = {"part": 0, "part_done": 0, "done": 0, "seen": np.zeros(count, bool)}
    path, seen, ids = staging / shard_name(0), progress["seen"], _StoreRows(store)
    with open(path, "r+b" if progress["done"] else "wb") as f:
        if not progress["done"]:
            f.write(head)
            f.truncate(len(head) + count * row_bytes)
        done, last = progress["done"], time.monotonic()
        for index, part in enumerate(parts):
            if index < progress["part"]:
                continue
            skip = progress["part_done"] if index == progress["part"] else 0
            part_done = 0
            for batch_ids, block in part.batches(rows):
                if part_done + len(block) <= skip:  # written before the kill
                    part_done += len(block)
                    continue
                block = np.ascontiguousarray(block.astype(files.DTYPES[dtype], copy=False))
                targets = (
                    np.arange(done, done + len(block))
                    if batch_ids is None
                    else ids.rows(batch_ids, done, part.path, part_done)
                )
                _check_once(targets, seen, part.path, store)
                _place(f.fileno(), block.view(npy), targets, len(head), row_bytes)
                done += len(block)
                part_done += len(block)
                if time.monotonic() - last >= COMMIT_EVERY_S:
                    where = {"part": index, "part_done": part_done, "done": done}
                    _commit(f, staging, key, seen, where)
                    last = time.monotonic()
        f.flush()
        os.fsync(f.fileno())
    if not seen.all():  # unreachable when the counts agree and no id repeats; checked anyway
        missing = int(np.argmin(seen))
        raise ValueError(f"{parts[0].path}: no vector for passage {store.ids[missing]!r}")
    return files.file_record(path)


def _check_once(targets: np.ndarray, seen: np.ndarray, path, store: PassageStore) -> None:
    """Marks rows `targets` [n] written in `seen` [C]; raises naming a row's id given twice
    (within the batch or before it)."""
    ordered = np.sort(targets)
    twice = ordered[1:][ordered[1:] == ordered[:-1]]
    twice = np.concatenate([targets[seen[targets]], twice])
    if len(twice):
        raise ValueError(f"{path}: id {store.ids[int(twice[0])]!r} is given twice")
    seen[targets] = True


def _place(fd: int, block: np.ndarray, targets: np.ndarray, head: int, row_bytes: int) -> None:
    """Writes the rows of `block` at rows `targets` of the file, one write per run of rows."""
    if np.any(np.diff(targets) < 0):
        order = np.argsort(targets, kind="stable")
        targets, block = targets[order], block[order]
    breaks = np.flatnonzero(np.diff(targets) != 1) + 1
    for run in np.split(np.arange(len(targets)), breaks):
        if len(run):
            data = np.ascontiguousarray(block[run[0] : run[-1] + 1])
            os.pwrite(fd, memoryview(data).cast("B"), head + int(targets[run[0]]) * row_bytes)


class _StoreRows:
    """The store rows of ids: the next rows when the ids are the store's in order (checked id by
    id), else looked up among the sorted digests of every store id (built on first need)."""

    def __init__(self, store: PassageStore):
        self.store, self._lookup = store, None

    def rows(self, ids: list[str], start: int, path, file_row: int) -> np.ndarray:
        """Store rows [n] of `ids` [n], rows `start`... of the source and `file_row`... of
        `path`; raises naming the file and row of an id the store lacks."""
        if start + len(ids) <= len(self.store) and all(
            self.store.ids[start + i] == passage_id for i, passage_id in enumerate(ids)
        ):
            return np.arange(start, start + len(ids))
        if self._lookup is None:
            self._lookup = IdLookup(self.store)
        rows = self._lookup.rows(ids)
        missing = np.flatnonzero(rows < 0)
        if len(missing):
            i = int(missing[0])
            raise ValueError(
                f"{path}, row {file_row + i}: id {ids[i]!r} is not "
                f"in the passage store {self.store.directory}"
            )
        return rows


def index_from_vectors(
    source,
    store: PassageStore,
    out_dir,
    *,
    kind: str = "exact",
    encoder_fingerprint: str | None = None,
    dtype: str | None = None,
    recall: float = RECALL_TARGET,
    queries=None,
) -> dict:
    """Imported vectors -> `out_dir/vectors` (`import_vectors`) and `out_dir/index`.

    The index's manifest carries the vectors' `encoder_fingerprint` and the store's corpus
    checksum, as an index built from encoded vectors does, so `index.load(out_dir / "index",
    expect=...)` checks it the same way. The exact index is built on the memory-mapped shard
    (float16 stays float16); ScaNN keeps its own float32 copy, as it always does. ScaNN is
    tuned to `recall`@10 on `queries` ([Q, D]; None: a stand-in) before it is saved
    (`index.build_and_save`).

    Returns:
      {"vectors", "index": paths; "count": C, "dim": D, "dtype", "encoder_fingerprint",
       "corpus_checksum"; ScaNN's "measured_recall" when measured}.
    """
    if kind not in ("exact", "scann"):
        raise ValueError(f"kind must be 'exact' or 'scann', got {kind!r}")
    out_dir = pathlib.Path(out_dir)
    manifest = import_vectors(
        source, store, out_dir / "vectors", encoder_fingerprint=encoder_fingerprint, dtype=dtype
    )
    provenance = index.index_vectors(
        out_dir,
        kind,
        manifest["encoder_fingerprint"],
        store.checksum,
        recall=recall,
        queries=queries,
    )
    return {
        "vectors": str(out_dir / "vectors"),
        "index": str(out_dir / "index"),
        "count": manifest["count"],
        "dim": manifest["dim"],
        "dtype": manifest["dtype"],
        **provenance,
    }
