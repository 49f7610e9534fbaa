"""An index on disk: a folder holding `manifest.json` beside the index's data files.

The manifest records the kind, count, dim, dtype, optional `encoder_fingerprint` and
`corpus_checksum`, and the byte size and sha256 of every file; it is sealed and written with the
data files in one atomic swap (`rag_jax.retrieval.files`). An exact index (`ExactIndex`,
`DeviceIndex`) keeps its vectors in `vectors.bin`, raw little-endian rows; a ScaNN index keeps
ScaNN's serialised searcher, and its manifest its settings ("scann") and, when built to a recall
target, what was measured ("measured_recall", `rag_jax.retrieval.scann_recall`). Reading
refuses a manifest that disagrees with what the caller holds (`expect`) and a file whose size or
hash disagrees with the manifest, naming each.

Legend: C corpus size (passages), D embedding width.
"""

import json
import math
import os

import numpy as np

from rag_jax.retrieval import files
from rag_jax.retrieval.files import DTYPES, MANIFEST
from rag_jax.retrieval.index_base import Index

FORMAT = "rag_jax.index"
VERSION = 2  # 2: the manifest carries its checksum (1: `format_version` 1, read as before)
VECTORS = "vectors.bin"
# Who holds the expected value of a manifest field, for the mismatch message.
_EXPECT_SOURCE = {"corpus_checksum": "the corpus", "count": "the corpus"}
_EXPECT_SOURCE |= {"encoder_fingerprint": "the encoder", "dim": "the encoder"}


def provenance(manifest: dict) -> dict:
    """The encoder fingerprint and corpus checksum a manifest records (None where it has none)."""
    return {name: manifest.get(name) for name in ("encoder_fingerprint", "corpus_checksum")}


def new_manifest(index: Index, dtype: str, **extra) -> dict:
    """The manifest fields of `index`'s folder: format, kind, `dtype` (of the stored vectors),
    `extra`, and the index's size and provenance where it has them."""
    manifest = {"format": FORMAT, "version": VERSION, "kind": index.kind, "dtype": dtype}
    manifest.update(extra)
    for field in ("count", "dim", "encoder_fingerprint", "corpus_checksum"):
        if getattr(index, field) is not None:
            manifest[field] = getattr(index, field)
    return manifest


def read_manifest(directory, expect: dict | None, kinds: tuple[str, ...]) -> dict:
    """Parses `<directory>/manifest.json`, checks its fields and the caller's expectations."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            legacy = json.load(f)
    except (OSError, ValueError):
        legacy = None
    if isinstance(legacy, dict) and "format" not in legacy and legacy.get("format_version") == 1:
        manifest = legacy  # written before manifests were sealed
    else:
        manifest = files.read_manifest(directory, {FORMAT: (VERSION,)}, what="index")
    for field in ("kind", "count", "dim", "dtype", "files"):
        if field not in manifest:
            raise ValueError(f"index manifest {path} lacks the field {field!r}")
    if manifest["kind"] not in kinds:
        raise ValueError(
            f"index manifest {path} has kind {manifest['kind']!r}, not one of {kinds}; "
            "`rag_jax.retrieval.index.load` picks the class by kind"
        )
    files.check_expected(manifest, expect, path, _EXPECT_SOURCE, what="index")
    return manifest


def save_vectors(index: Index, vectors: np.ndarray, directory, extra: dict | None = None):
    """Writes an exact index folder: `vectors.bin` (raw little-endian rows) and the manifest
    (with `extra` fields, e.g. how the vectors were encoded)."""
    little = vectors.astype(vectors.dtype.newbyteorder("<"), copy=False)  # no copy on x86/ARM

    def write_fn(tmp):
        with open(os.path.join(tmp, VECTORS), "wb") as f:
            files.write_bytes(f, np.ascontiguousarray(little).view(np.uint8))

    manifest = new_manifest(index, vectors.dtype.name, **(extra or {}))
    files.swap_dir(directory, write_fn, manifest, what="index")


def save_vector_blocks(directory, blocks, shape, dtype, extra: dict | None = None) -> None:
    """Writes an exact index folder from its [C, D] vectors in `blocks` (row blocks in order, C
    rows in all: the matrix is never whole in memory); `extra` fields (e.g. the provenance) go
    into the manifest."""
    dtype = np.dtype(dtype)

    def write_fn(tmp):
        rows = 0
        with open(os.path.join(tmp, VECTORS), "wb") as f:
            for block in blocks:
                block = np.ascontiguousarray(block, dtype.newbyteorder("<"))
                files.write_bytes(f, block.reshape(-1, shape[1]).view(np.uint8))
                rows += len(block)
        if rows != shape[0]:
            raise RuntimeError(f"{directory}: {rows} rows written for an index of {shape[0]}")

    manifest = {"format": FORMAT, "version": VERSION, "kind": "exact", "dtype": dtype.name}
    manifest |= {"count": shape[0], "dim": shape[1]}
    manifest |= {k: v for k, v in (extra or {}).items() if v is not None}
    files.swap_dir(directory, write_fn, manifest, what="index")


def load_vectors(directory, expect, verify, kinds, mmap=False) -> tuple[dict, np.ndarray]:
    """Checks and reads an index folder's `vectors.bin`; returns (manifest, [C, D] vectors),
    memory-mapped read-only with `mmap` (of the stored dtype: float16 stays float16)."""
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
    files.check_file(path, record, verify=verify, what="index file")
    little = np.dtype(dtype).newbyteorder("<")
    if mmap:
        vectors = np.memmap(path, little, mode="r", shape=shape)
        return manifest, vectors if little == np.dtype(dtype) else vectors.astype(dtype)
    vectors = np.fromfile(path, little).reshape(shape)
    return manifest, vectors.astype(dtype, copy=False)
