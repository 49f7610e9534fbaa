"""Files that must survive crashes and damage: manifests, checksums, atomic writes, `.npy` headers.

Every on-disk format of the project goes through this module: passage stores
(`retrieval.store`), vector shards (`retrieval.vectors`), index folders
(`retrieval.index_format`), and the trainer's own files (warm-start caches, refresh snapshots,
evaluation JSON).

- `write_atomic(path, data)`: a temporary file, fsync, rename over `path`, fsync of the folder.
  A crash leaves the old file or none, never a truncated one.
- `swap_dir(directory, write_fn, manifest)`: a whole folder built beside its destination and
  swapped in, so readers never see half of one; the previous folder survives any failure. Files
  carried over from a checked folder keep their checked records (never hashed again).
- Manifests (`write_manifest`, `read_manifest`): JSON naming a `format` and `version`, the byte
  size and sha256 of every data file, and `manifest_sha256`, a sha256 of the manifest's own
  canonical form. A manifest edited or damaged after it was written (a changed separator id, a
  flipped digit) is refused, naming the file; manifests of version 1, written before the
  checksum existed, are read as before.
- `npy_header(path)`: the shape, dtype and data offset of an `.npy` file; a damaged header is a
  `ValueError` naming the file, whatever numpy's parser raised.
- A full disk is an `OSError` with `errno.ENOSPC` that says which file was being written, what is
  left intact and what to do (`disk_full`), never numpy's or the OS's bare message.

Legend: C corpus size (passages), D embedding width.
"""

import contextlib
import errno
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable

import ml_dtypes
import numpy as np

MANIFEST = "manifest.json"
CHECKSUM_FIELD = "manifest_sha256"
# Storage dtypes of passage vectors; search always computes in float32.
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
IO_BLOCK = 16 << 20  # bytes per hashing or writing step: bounded memory for any size


# ---------------------------------------------------------------------------------------------
# Disk full


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or one it was raised from, is a full disk (Python's or a C library's)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error)
        if "No space left on device" in text or "os_error_code='28'" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def disk_full(what: str, advice: str):
    """Turns a full disk inside the block into `OSError(ENOSPC, "disk full while writing <what>
    (<cause>); <advice>")`; other errors pass unchanged."""
    try:
        yield
    except OSError as e:
        if not is_disk_full(e) or getattr(e, "rag_jax_disk_full", False):
            raise
        raise disk_full_error(what, advice, e) from e


def disk_full_error(what: str, advice: str, cause: BaseException) -> OSError:
    error = OSError(errno.ENOSPC, f"disk full while writing {what} ({cause}); {advice}")
    error.rag_jax_disk_full = True  # already explained: an outer `disk_full` keeps it
    return error


def write_bytes(f, data) -> None:
    """Writes `data` to the open file `f` in blocks: bytes, a contiguous array (its raw bytes),
    or a list of them, one after the other.

    `f.write` reports a full disk as `OSError(ENOSPC)`, where numpy's `tofile` says only how
    many bytes it wrote.
    """
    for piece in data if isinstance(data, list | tuple) else [data]:
        view = memoryview(piece).cast("B")
        for start in range(0, len(view), IO_BLOCK):
            f.write(view[start : start + IO_BLOCK])


# ---------------------------------------------------------------------------------------------
# Atomic writes


def fsync_dir(directory) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, data, *, what: str | None = None, advice: str | None = None) -> None:
    """Replaces `path` with `data` atomically (temporary file, fsync, rename, fsync of the folder).

    Args:
      path: the file.
      data: bytes, a contiguous array (its raw bytes), or a list of them (`write_bytes`).
      what: how a disk-full error names the file (default: its path).
      advice: what a disk-full error tells the user to do (default: free space and retry; the
        previous file, if any, is intact).
    """
    path = pathlib.Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    advice = advice or (
        f"{'the previous ' + path.name + ' is intact; ' if path.exists() else ''}free space and "
        "try again"
    )
    try:
        with disk_full(what or str(path), advice):
            with open(tmp, "wb") as f:
                write_bytes(f, data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def swap_dir(
    directory, write_fn: Callable[[str], dict | None], manifest: dict, *, what: str
) -> dict:
    """Writes a folder beside `directory`, then swaps it in: readers never see half of one.

    `write_fn(tmp)` writes the data files into the folder `tmp` (sub-folders too: their files are
    listed by relative path, `files_under`); their sizes and sha256s go into the manifest
    (`write_manifest`), written last. A file `write_fn` carried over from a folder it checked
    (a hard link) keeps the record it was checked against, which `write_fn` returns: hashing
    it again would seal whatever befell it after the check. On any failure the previous
    folder stays in place and nothing of the new one is left; a full disk raises
    `OSError(ENOSPC)` saying so.

    Args:
      directory: the destination; an existing folder must be one with a manifest (it is
        replaced), anything else is refused.
      write_fn: writes the data files; returns None, or {relative path: {"bytes", "sha256"}}
        of the files among them it carried over, each as checked (the rest are hashed).
      manifest: the manifest's fields (`format`, `version` and the rest).
      what: how errors name the folder, e.g. "index".

    Returns:
      The manifest written (`manifest` with its `files`), as `read_manifest` reads it.
    """
    directory = os.path.abspath(directory)
    if os.path.isdir(directory) and os.listdir(directory):
        if not os.path.isfile(os.path.join(directory, MANIFEST)):
            raise FileExistsError(
                f"{directory} is not empty and holds no {what} (no {MANIFEST}); not replacing it"
            )
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}.new.")
    old = tempfile.mkdtemp(dir=parent, prefix=f".{name}.old.")
    kept = f"; the previous {what} in {directory} is intact" if os.path.exists(directory) else ""
    try:
        advice = f"nothing of it was kept{kept}; free space and save again"
        with disk_full(f"the {what} {directory}", advice):
            carried = write_fn(tmp) or {}
            written = files_under(tmp)
            stray = sorted(set(carried) - set(written))
            if stray:  # a bug of `write_fn`: the manifest would list files the folder lacks
                raise RuntimeError(f"{what}: records carried for files not written: {stray[:5]}")
            records = {f: carried.get(f) or file_record(os.path.join(tmp, f)) for f in written}
            manifest = {**manifest, "files": records}
            text = manifest_text(manifest)
            with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
                f.write(text)  # the folder's rename below is what makes it atomic
        if os.path.exists(directory):
            os.rename(directory, os.path.join(old, name))
        os.rename(tmp, directory)
    except BaseException:
        if not os.path.exists(directory) and os.path.exists(os.path.join(old, name)):
            os.rename(os.path.join(old, name), directory)  # put the previous folder back
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return manifest


def files_under(directory) -> list[str]:
    """Every file below `directory` as sorted relative paths with "/" separators: a flat folder's
    file names, and a nested one's files one by one (e.g. a bundle's passage store)."""
    found = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        rel = pathlib.Path(root).relative_to(directory).as_posix()
        found += [name if rel == "." else f"{rel}/{name}" for name in names]
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# Checksums


def sha256_file(path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(IO_BLOCK):
            sha.update(block)
    return sha.hexdigest()


def file_record(path) -> dict:
    """{"bytes", "sha256"} of a file, as manifests list their data files."""
    return {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}


def check_file(path, record: dict, *, verify: bool, what: str = "file", manifest=None) -> None:
    """Raises naming `path` when it is missing, of another size, or (`verify`) of another sha256
    than `record` ({"bytes", "sha256"}) says."""
    path = pathlib.Path(path)
    listed = f" (listed in {manifest})" if manifest else ""
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} is missing{listed}")
    size = path.stat().st_size
    if size != record["bytes"]:
        raise ValueError(
            f"{what} {path} has {size} bytes but its manifest records {record['bytes']}: the "
            "file is truncated or corrupted"
        )
    if verify and sha256_file(path) != record["sha256"]:
        raise ValueError(f"{what} {path} is corrupted: its sha256 differs from its manifest's")


# ---------------------------------------------------------------------------------------------
# Manifests


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_FIELD}
    return json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def manifest_text(manifest: dict) -> str:
    """The manifest as written: its fields plus `manifest_sha256` over their canonical form."""
    sealed = {**manifest, CHECKSUM_FIELD: hashlib.sha256(_canonical(manifest)).hexdigest()}
    return json.dumps(sealed, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def write_manifest(directory, manifest: dict, **write_options) -> None:
    """Writes `<directory>/manifest.json` atomically, sealed with its checksum."""
    path = pathlib.Path(directory) / MANIFEST
    write_atomic(path, manifest_text(manifest).encode("utf-8"), **write_options)


def read_manifest(
    directory, formats: dict[str, tuple[int, ...]], *, what: str, required=()
) -> dict:
    """Parses and checks `<directory>/manifest.json`.

    Args:
      directory: the folder.
      formats: accepted `format` -> the versions of it this version of rag_jax reads.
      what: how errors name the folder ("passage store", "vectors", "index").
      required: fields every manifest of these formats has.

    Returns:
      The manifest (without `manifest_sha256`).

    Raises:
      FileNotFoundError: no manifest. ValueError naming the file: not JSON, another format or
        version, a missing field, or a checksum that differs (the manifest was damaged or edited
        after it was written).
    """
    path = pathlib.Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; {directory} holds no {what}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the {what} manifest is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in formats:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{path}: not a {' or '.join(formats)} manifest (format {found!r})")
    versions = formats[manifest["format"]]
    if manifest.get("version") not in versions:
        raise ValueError(
            f"{path}: version {manifest.get('version')!r} of {manifest['format']}; this rag_jax "
            f"reads versions {list(versions)}"
        )
    if CHECKSUM_FIELD in manifest or manifest["version"] > 1:
        stored = manifest.get(CHECKSUM_FIELD)
        if stored != hashlib.sha256(_canonical(manifest)).hexdigest():
            raise ValueError(
                f"{path}: its {CHECKSUM_FIELD} does not match its contents: the manifest was "
                f"damaged or edited after it was written; rebuild the {what}"
            )
    for field in required:
        if field not in manifest:
            raise ValueError(f"{path}: lacks the field {field!r}")
    return {k: v for k, v in manifest.items() if k != CHECKSUM_FIELD}


def check_expected(
    manifest: dict, expect: dict | None, path, sources: dict | None = None, *, what: str
) -> None:
    """Raises naming every field of `expect` whose value the manifest at `path` does not share.

    Args:
      manifest: a manifest.
      expect: fields the caller knows, e.g. {"encoder_fingerprint": ..., "corpus_checksum": ...}.
      path: the manifest's file, for the message.
      sources: who holds each expected value, for the message (default "the caller").
      what: the manifest's kind, e.g. "index" or "vectors".
    """
    sources = sources or {}
    differences = [
        f"{what} manifest field {field!r} is {manifest.get(field)!r} in {path} but "
        f"{sources.get(field, 'the caller')} has {value!r}"
        for field, value in (expect or {}).items()
        if manifest.get(field) != value
    ]
    if differences:
        raise ValueError("; ".join(differences))


# ---------------------------------------------------------------------------------------------
# .npy headers


def npy_header(path) -> tuple[tuple, str, int]:
    """(shape, dtype string, header bytes) of an `.npy` file.

    numpy parses the header's Python literal with its tokenizer, so a damaged byte can surface as
    any exception type (`tokenize.TokenError` among them) naming nothing; every one of them
    becomes a `ValueError` naming the file.
    """
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(version)
            if read_header is None:
                raise ValueError(f"unknown .npy format version {version}")
            shape, fortran, dtype = read_header(f)
            return shape, dtype.str if not fortran else "fortran", f.tell()
    except Exception as e:  # noqa: BLE001 - whatever the parser raised, name the file
        raise ValueError(f"{path}: unreadable .npy header ({type(e).__name__}: {e})") from None
