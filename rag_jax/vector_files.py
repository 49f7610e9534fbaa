"""Passage vectors on disk: sharded `.npy` files and the manifest that describes them.

Legend: C corpus size, D embedding width.

A vectors directory (written by `rag_jax.encode.encode_corpus`) holds `vectors-00000.npy`,
`vectors-00001.npy`, ... of `shard_size` rows `[rows, D]` each (the last may be shorter) and
`manifest.json`: count, dim, storage dtype, compute dtype, encoder fingerprint, corpus checksum,
tokenizer, max_length, input format, batching, and every finished shard's index, file, rows and
sha256. bfloat16 vectors are stored as their raw bits (`<u2`), since `.npy` has no bfloat16;
`load_vectors` views them back. Shards and the manifest are written atomically (temporary name,
fsync, rename, fsync of the directory), so an interrupted run leaves only whole, recorded shards
and stray `*.tmp` files, which the next run deletes.
"""

import contextlib
import errno
import hashlib
import json
import os
import pathlib
import re

import ml_dtypes
import numpy as np

# Storage dtypes of the vectors, and the `.npy` dtype each is written as.
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
NPY_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}
MANIFEST = "manifest.json"
FORMAT = "rag_jax.vectors"
VERSION = 1
# Files a run writes: shards, and the temporary names of shards and manifest mid-write.
_OURS = re.compile(r"vectors-\d{5}\.npy(\.tmp)?|manifest\.json(\.tmp)?")
# Manifest fields that are bookkeeping, not part of what the vectors are (ignored on resume).
_PROGRESS_FIELDS = ("shards", "tokenizer")
_IO_BLOCK = 16 << 20


def _fsync_dir(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """File-like wrapper that hashes what `np.save` writes (it then writes in chunks)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)


@contextlib.contextmanager
def _disk_full_names(tmp: pathlib.Path, what: str):
    """Deletes `tmp` when the block fails; a full disk becomes an error that says so."""
    try:
        yield
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC,
                f"disk full while writing {what} ({e}); the shards recorded in "
                f"{tmp.parent / MANIFEST} are intact: free space and run encode_corpus again "
                "with the same arguments to resume",
            ) from e
        raise


def write_shard(path: pathlib.Path, vectors: np.ndarray, dtype: str) -> str:
    """Writes `vectors` [rows, D] as `.npy` atomically (temp file, fsync, rename); its sha256.

    Raises:
      OSError: `errno.ENOSPC` naming the shard when the disk is full (nothing of it is left).
    """
    tmp = path.with_name(path.name + ".tmp")
    with _disk_full_names(tmp, f"vectors shard {path}"):
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            np.save(writer, vectors.view(NPY_DTYPES[dtype]), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    _fsync_dir(path.parent)
    return writer.sha.hexdigest()


def write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Replaces `path` with `data` atomically (temp file, fsync, rename): a crash mid-write leaves
    the old file or none, never a truncated one. Disk full raises `errno.ENOSPC` naming `path`."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with _disk_full_names(tmp, f"{path}"):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_manifest(directory: pathlib.Path, manifest: dict) -> None:
    """Replaces `directory/manifest.json` atomically (`write_atomic`)."""
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    write_atomic(directory / MANIFEST, text.encode("utf-8"))


def read_manifest(directory, expect: dict | None = None) -> dict:
    """The parsed `manifest.json` of a vectors directory, checked against `expect`.

    Args:
      directory: written by `encode_corpus`.
      expect: manifest fields the caller knows (e.g. {"encoder_fingerprint": ...,
        "corpus_checksum": ...}); each difference is named in the ValueError.
    """
    path = pathlib.Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; {directory} holds no encoded vectors")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise ValueError(f"{path}: version {manifest.get('version')!r}; this reads {VERSION}")
    for field in ("count", "dim", "dtype", "shard_size", "shards"):
        if field not in manifest:
            raise ValueError(f"{path}: lacks the field {field!r}")
    if manifest["dtype"] not in DTYPES:
        raise ValueError(f"{path}, field 'dtype': unknown dtype {manifest['dtype']!r}")
    differences = [
        f"field {field!r} is {manifest.get(field)!r} in {path} but the caller has {value!r}"
        for field, value in (expect or {}).items()
        if manifest.get(field) != value
    ]
    if differences:
        raise ValueError("vectors manifest mismatch: " + "; ".join(differences))
    return manifest


def shard_name(index: int) -> str:
    """File name of shard `index` (0-based)."""
    return f"vectors-{index:05d}.npy"


def _npy_header(path: pathlib.Path) -> tuple[tuple, str, int]:
    """(shape, dtype str, header bytes) of a `.npy` file; ValueError naming it if unreadable."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }[version]
            shape, fortran, dtype = read_header(f)
            return shape, dtype.str if not fortran else "fortran", f.tell()
    except (ValueError, OSError, SyntaxError, KeyError) as e:
        raise ValueError(f"vectors shard {path}: unreadable .npy header ({e})") from None


def _check_shard(path: pathlib.Path, record: dict, manifest: dict, verify: bool) -> str:
    """Checks a recorded shard's presence, shape, dtype, size and (`verify`) sha256."""
    if not path.is_file():
        raise FileNotFoundError(f"vectors shard {path} is missing (listed in its {MANIFEST})")
    shape, dtype, header = _npy_header(path)
    want_shape, want_dtype = (record["rows"], manifest["dim"]), NPY_DTYPES[manifest["dtype"]]
    if shape != want_shape or dtype != want_dtype:
        raise ValueError(
            f"vectors shard {path} holds {shape} {dtype}; its {MANIFEST} records "
            f"{want_shape} {want_dtype}"
        )
    size, want_size = (
        path.stat().st_size,
        header + record["rows"] * manifest["dim"] * (np.dtype(want_dtype).itemsize),
    )
    if size != want_size:
        raise ValueError(
            f"vectors shard {path} has {size} bytes, {want_size} expected: truncated or corrupted"
        )
    if verify:
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(_IO_BLOCK):
                sha.update(block)
        if sha.hexdigest() != record["sha256"]:
            raise ValueError(
                f"vectors shard {path} is corrupted: its sha256 differs from its {MANIFEST}"
            )
    return header


def load_vectors(directory, expect: dict | None = None, *, verify: bool = True) -> np.ndarray:
    """Reads the vectors written by `encode_corpus`, checking them against their manifest.

    Args:
      directory: the vectors directory.
      expect: manifest fields the caller knows, e.g. {"encoder_fingerprint": ...,
        "corpus_checksum": ..., "count": ...}; a difference raises ValueError naming the field.
      verify: also check every shard's sha256 (presence, shape, dtype and size always are).

    Returns:
      [C, D] array of the manifest's dtype: memory-mapped (read-only) for a single shard,
      concatenated into memory for several.

    Raises:
      FileNotFoundError / ValueError naming the manifest, the field or the shard file at fault;
      ValueError if the directory holds an unfinished run (some shards not yet written).
    """
    directory = pathlib.Path(directory)
    manifest = read_manifest(directory, expect)
    shards = manifest["shards"]
    expected = -(-manifest["count"] // manifest["shard_size"])
    if sorted(s["index"] for s in shards) != list(range(expected)):
        raise ValueError(
            f"{directory}: {len(shards)} of {expected} shards are finished (an interrupted "
            "encode_corpus); re-run it with the same arguments to finish"
        )
    arrays = []
    for record in sorted(shards, key=lambda s: s["index"]):
        path = directory / record["file"]
        header = _check_shard(path, record, manifest, verify)
        arrays.append(
            np.memmap(
                path,
                dtype=NPY_DTYPES[manifest["dtype"]],
                mode="r",
                offset=header,
                shape=(record["rows"], manifest["dim"]),
            ).view(DTYPES[manifest["dtype"]])
        )
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def prepare_dir(directory: pathlib.Path, manifest: dict, overwrite: bool) -> set[int]:
    """Creates or resumes `directory`; returns the indices of shards already finished."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.iterdir():
        if stale.name.endswith(".tmp") and _OURS.fullmatch(stale.name):
            stale.unlink()  # an interrupted write; never recorded
    if (directory / MANIFEST).is_file() and not overwrite:
        old = read_manifest(directory)
        fields = sorted((set(old) | set(manifest)) - set(_PROGRESS_FIELDS))
        differing = [f for f in fields if old.get(f) != manifest.get(f)]
        if differing:
            raise ValueError(
                f"{directory} holds vectors of another run; differing manifest fields: "
                + "; ".join(
                    f"{f!r} is {old.get(f)!r} there, {manifest.get(f)!r} now" for f in differing
                )
                + ". Pass overwrite=True to replace them, or use another directory."
            )
        done = set()
        for record in old["shards"]:
            try:
                _check_shard(directory / record["file"], record, old, verify=False)
            except (OSError, ValueError):
                continue  # damaged since it was recorded: computed again
            done.add(record["index"])
            manifest["shards"].append(record)
        return done
    others = [p.name for p in directory.iterdir() if not _OURS.fullmatch(p.name)]
    if others:
        raise FileExistsError(
            f"{directory} holds files that are not encoded vectors ({sorted(others)[:5]}); "
            "choose an empty or new directory"
        )
    for path in directory.iterdir():
        path.unlink()  # all ours (checked above): an earlier run being replaced
    return set()
