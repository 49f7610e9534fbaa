"""Index folders on disk: a manifest with every file's size and sha256, atomic replacement.

An index folder holds `manifest.json` (format version, kind, count, dim, dtype, optional
`encoder_fingerprint` and `corpus_checksum`, and the byte size and sha256 of every file) next to
its data files. Writers build the folder beside its destination and swap it in; readers check the
manifest against what the caller holds and every file against the manifest.

Legend: C corpus size (passages), D embedding width.
"""

import errno
import hashlib
import json
import math
import os
import shutil
import tempfile

import ml_dtypes
import numpy as np

MANIFEST = "manifest.json"
VECTORS = "vectors.bin"
FORMAT_VERSION = 1
# Storage dtypes; search always computes in float32.
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Who holds the expected value of a manifest field, for the mismatch message.
_EXPECT_SOURCE = {"corpus_checksum": "the corpus", "count": "the corpus"}
_EXPECT_SOURCE |= {"encoder_fingerprint": "the encoder", "dim": "the encoder"}
IO_BLOCK = 16 << 20  # bytes per hashing or checking step: bounded memory for any size


def provenance(manifest: dict) -> dict:
    return {name: manifest.get(name) for name in ("encoder_fingerprint", "corpus_checksum")}


def digest(path: str) -> dict:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(IO_BLOCK):
            sha.update(block)
    return {"bytes": os.path.getsize(path), "sha256": sha.hexdigest()}


def check_file(path: str, record: dict, verify: bool) -> None:
    """Raises naming `path` when it is missing, of another size, or (`verify`) of another hash."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"index file {path} is missing (listed in its {MANIFEST})")
    size = os.path.getsize(path)
    if size != record["bytes"]:
        raise ValueError(
            f"index file {path} has {size} bytes but its {MANIFEST} records {record['bytes']}: "
            "the file is truncated or corrupted"
        )
    if verify and digest(path)["sha256"] != record["sha256"]:
        raise ValueError(f"index file {path} is corrupted: its sha256 differs from its {MANIFEST}")


def write_dir(directory, write_fn, manifest: dict) -> None:
    """Writes an index folder beside `directory`, then swaps it in: readers never see half of one.

    `write_fn(tmp)` writes the data files; their sizes and hashes go into the manifest. A full
    disk is an `OSError` (`errno.ENOSPC`) that says so; the previous index stays in place.
    """
    directory = os.path.abspath(directory)
    if os.path.isdir(directory) and os.listdir(directory):
        if not os.path.isfile(os.path.join(directory, MANIFEST)):
            raise FileExistsError(f"{directory} is not empty and holds no index; not replacing it")
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}.new.")
    old = tempfile.mkdtemp(dir=parent, prefix=f".{name}.old.")
    try:
        write_fn(tmp)
        files = {f: digest(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))}
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump({**manifest, "files": files}, f, indent=2, sort_keys=True)
        if os.path.exists(directory):
            os.rename(directory, os.path.join(old, name))
        os.rename(tmp, directory)
    except BaseException as e:
        if not os.path.exists(directory) and os.path.exists(os.path.join(old, name)):
            os.rename(os.path.join(old, name), directory)  # put the previous index back
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            kept = "; the previous index there is intact" if os.path.exists(directory) else ""
            raise OSError(
                errno.ENOSPC,
                f"disk full while writing the index {directory} ({e}){kept}; free space and "
                "save again",
            ) from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def save_vectors(index, vectors: np.ndarray, directory) -> None:
    little = vectors.astype(vectors.dtype.newbyteorder("<"), copy=False)  # no copy on x86/ARM
    write_fn = lambda tmp: little.tofile(os.path.join(tmp, VECTORS))
    write_dir(directory, write_fn, index._manifest(vectors.dtype.name))


def read_manifest(directory, expect: dict | None, kinds: tuple[str, ...]) -> dict:
    """Parses `<directory>/manifest.json`, checks its fields and the caller's expectations."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no index manifest at {path}")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"index manifest {path} is not valid JSON: {e}") from e
    for field in ("format_version", "kind", "count", "dim", "dtype", "files"):
        if not isinstance(manifest, dict) or field not in manifest:
            raise ValueError(f"index manifest {path} lacks the field {field!r}")
    if manifest["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"index manifest {path} has format_version {manifest['format_version']!r}; this "
            f"version of rag_jax reads {FORMAT_VERSION}"
        )
    if manifest["kind"] not in kinds:
        raise ValueError(
            f"index manifest {path} has kind {manifest['kind']!r}, not one of {kinds}; "
            "`rag_jax.index.load` picks the class by kind"
        )
    differences = [
        f"index manifest field {field!r} is {manifest.get(field)!r} in {path} but "
        f"{_EXPECT_SOURCE.get(field, 'the caller')} has {value!r}"
        for field, value in (expect or {}).items()
        if manifest.get(field) != value
    ]
    if differences:
        raise ValueError("; ".join(differences))
    return manifest


def load_vectors(directory, expect, verify, kinds) -> tuple[dict, np.ndarray]:
    """Checks and reads `vectors.bin`; returns (manifest, [C, D] vectors)."""
    directory = os.fspath(directory)
    manifest = read_manifest(directory, expect, kinds)
    shape, dtype = (manifest["count"], manifest["dim"]), DTYPES.get(manifest["dtype"])
    record = manifest["files"].get(VECTORS, {})
    if dtype is None or record.get("bytes") != math.prod(shape) * np.dtype(dtype).itemsize:
        raise ValueError(
            f"index manifest {os.path.join(directory, MANIFEST)} is inconsistent: {VECTORS} "
            f"listed as {record}, count x dim = {shape}, dtype {manifest['dtype']!r}"
        )
    path = os.path.join(directory, VECTORS)
    check_file(path, record, verify)
    vectors = np.fromfile(path, np.dtype(dtype).newbyteorder("<")).reshape(shape)
    return manifest, vectors.astype(dtype, copy=False)
