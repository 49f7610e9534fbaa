"""Passage vectors on disk: sharded `.npy` files and the manifest that describes them.

Legend: C corpus size, D embedding width.

A vectors directory (written by `rag_jax.retrieval.encode.encode_corpus`) holds
`vectors-00000.npy`, `vectors-00001.npy`, ... of `shard_size` rows `[rows, D]` each (the last may
be shorter) and `manifest.json` (`rag_jax.retrieval.files`: sealed with its own checksum): count,
dim, storage dtype, compute dtype, encoder fingerprint, corpus checksum, tokenizer, max_length,
input format, batching, and every finished shard's index, file, rows and sha256. bfloat16 vectors
are stored as their raw bits (`<u2`), since `.npy` has no bfloat16; `load_vectors` views them
back. Shards and the manifest are written atomically, so an interrupted run leaves only whole,
recorded shards and stray `*.tmp*` files, which the next run deletes.

A run of several processes (`encode_corpus` on a multi-host job) has one manifest writer,
process 0; the others record each shard they finish in a file of its own beside it,
`vectors-00003.json` (the shard's manifest entry, sealed with its checksum like a manifest).
`prepare_dir` folds such records into the manifest (a shard counts as finished whether its entry
is in the manifest or in a record), and once the manifest lists them `remove_records` deletes
them, so a finished directory holds the same files whichever number of processes wrote it.
"""

import hashlib
import io
import json
import pathlib
import re

import numpy as np

from rag_jax.retrieval import files
from rag_jax.retrieval.files import DTYPES, MANIFEST

# The `.npy` dtype each storage dtype is written as.
NPY_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}
FORMAT = "rag_jax.vectors"
VERSION = 2  # 2: the manifest carries its checksum
_FORMATS = {FORMAT: (1, 2)}
# Files a run writes: shards, and the temporary names of shards and manifest mid-write.
_OURS = re.compile(r"(vectors-\d{5}\.(npy|json)|manifest\.json)(\.tmp\d*)?")
_RECORD = re.compile(r"vectors-\d{5}\.json")
# Manifest fields that are bookkeeping, not part of what the vectors are (ignored on resume).
_PROGRESS_FIELDS = ("shards", "tokenizer", "version")
_RESUME = "the shards recorded in its manifest are intact: free space and run encode_corpus again"


def write_shard(path: pathlib.Path, vectors: np.ndarray, dtype: str) -> str:
    """Writes `vectors` [rows, D] as `.npy` (the bytes `np.save` writes) atomically; returns the
    file's sha256.

    Raises:
      OSError: `errno.ENOSPC` naming the shard when the disk is full (nothing of it is left).
    """
    body = np.ascontiguousarray(vectors).view(NPY_DTYPES[dtype])
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(body))
    pieces = [header.getvalue(), body]
    files.write_atomic(path, pieces, what=f"vectors shard {path}", advice=f"{_RESUME} to resume")
    sha = hashlib.sha256(pieces[0])
    sha.update(memoryview(body).cast("B"))
    return sha.hexdigest()


def write_manifest(directory: pathlib.Path, manifest: dict) -> None:
    """Replaces `directory/manifest.json` atomically, sealed with its checksum."""
    files.write_manifest(
        directory, manifest, what=f"the vectors manifest in {directory}", advice=_RESUME
    )


def read_manifest(directory, expect: dict | None = None) -> dict:
    """The parsed `manifest.json` of a vectors directory, checked against `expect`.

    Args:
      directory: written by `encode_corpus`.
      expect: manifest fields the caller knows (e.g. {"encoder_fingerprint": ...,
        "corpus_checksum": ...}); each difference is named in the ValueError.
    """
    required = ("count", "dim", "dtype", "shard_size", "shards")
    manifest = files.read_manifest(directory, _FORMATS, what="encoded vectors", required=required)
    path = pathlib.Path(directory) / MANIFEST
    if manifest["dtype"] not in DTYPES:
        raise ValueError(f"{path}, field 'dtype': unknown dtype {manifest['dtype']!r}")
    files.check_expected(manifest, expect, path, what="vectors")
    return manifest


def shard_name(index: int) -> str:
    """File name of shard `index` (0-based)."""
    return f"vectors-{index:05d}.npy"


def record_name(index: int) -> str:
    """File name of shard `index`'s record (a multi-process run's entry awaiting the manifest)."""
    return f"vectors-{index:05d}.json"


def write_record(directory: pathlib.Path, record: dict) -> None:
    """Writes a finished shard's manifest entry ({"index", "file", "rows", "sha256"}) beside it,
    atomically and sealed with its checksum; `prepare_dir` folds it into the manifest."""
    path = directory / record_name(record["index"])
    text = files.manifest_text(record).encode("utf-8")
    files.write_atomic(path, text, what=f"vectors shard record {path}", advice=_RESUME)


def _read_record(path: pathlib.Path) -> dict | None:
    """A record file's entry, or None when it is damaged (its shard is then computed again)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        record.pop(files.CHECKSUM_FIELD)
        if path.read_text(encoding="utf-8") != files.manifest_text(record):
            return None  # the seal does not match: damaged or edited
        if path.name != record_name(record["index"]) or record["file"] != shard_name(
            record["index"]
        ):
            return None
        return record
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def remove_records(directory: pathlib.Path) -> None:
    """Deletes the shard record files, once the manifest lists their entries."""
    for path in directory.iterdir():
        if _RECORD.fullmatch(path.name):
            path.unlink()


def _check_shard(path: pathlib.Path, record: dict, manifest: dict, verify: bool) -> int:
    """Checks a recorded shard's presence, sha256 (`verify`), shape, dtype and size; returns the
    header's length. The sha256 is checked before the header is parsed: a damaged header is
    reported as a corrupted file, not as whatever numpy's parser makes of it."""
    if not path.is_file():
        raise FileNotFoundError(f"vectors shard {path} is missing (listed in its {MANIFEST})")
    if verify and files.sha256_file(path) != record["sha256"]:
        raise ValueError(
            f"vectors shard {path} is corrupted: its sha256 differs from its {MANIFEST}"
        )
    shape, dtype, header = files.npy_header(path)
    want_shape, want_dtype = (record["rows"], manifest["dim"]), NPY_DTYPES[manifest["dtype"]]
    if shape != want_shape or dtype != want_dtype:
        raise ValueError(
            f"vectors shard {path} holds {shape} {dtype}; its {MANIFEST} records "
            f"{want_shape} {want_dtype}"
        )
    size = path.stat().st_size
    want_size = header + record["rows"] * manifest["dim"] * np.dtype(want_dtype).itemsize
    if size != want_size:
        raise ValueError(
            f"vectors shard {path} has {size} bytes, {want_size} expected: truncated or corrupted"
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
        if ".tmp" in stale.name and _OURS.fullmatch(stale.name):
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
        records = [*old["shards"]]  # the manifest's entries, then those of record files
        records += [_read_record(p) for p in sorted(directory.glob("vectors-*.json"))]
        for record in records:
            if record is None or record["index"] in done:
                continue
            try:
                _check_shard(directory / record["file"], record, old, verify=False)
            except (OSError, ValueError):
                continue  # damaged since it was recorded: computed again
            done.add(record["index"])
            manifest["shards"].append(record)
        manifest["shards"].sort(key=lambda s: s["index"])
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
