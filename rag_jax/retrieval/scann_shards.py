"""`ShardedScannIndex`: the corpus split into row shards, each its own ScaNN searcher, searched
together and merged; built shard by shard, each saved before the next starts.

Legend: B batch of queries, C corpus size (passages), D embedding width, k neighbours per query,
S shards.

Why: ScaNN needs ~3.3 KB a vector beyond its codes while it serialises a searcher grown by
`upsert` (docs/benchmarks.md: measured at 400k, whether the searcher was built or loaded then
grown), so one searcher over DPR's 21M passages would need ~70 GB of RAM just to be saved. A
shard of `SHARD_ROWS` vectors is built, serialised and released alone: the build's peak is one
shard's, whatever C. A killed build starts again at its first unsaved shard (each shard's folder
is written atomically and carries the rows and corpus it was built from).

The cost at search time is small: with ~sqrt(rows) leaves per searcher and the same fraction of
them searched, S shards scan the same number of points per query as one searcher over C; each
shard rescores its own `reorder` candidates, and the S top-k lists are merged by score
(descending; lower id first among equal scores, as every index here).

On disk: a folder with `manifest.json` (kind "scann_shards": count, dim, provenance, the shards'
row ranges, and every file of the shards with its size and sha256, as each shard's own
manifest sealed it; after a build to a recall target, the query-time settings it chose,
"search", and what it measured, "measured_recall") and `shard_00000/`, ... each a `ScannIndex`
folder (`index.load` reads either kind).
"""

from __future__ import annotations

import math
import os
import pathlib
import shutil

import numpy as np

from rag_jax.retrieval import files
from rag_jax.retrieval.index_base import Index, check_vectors
from rag_jax.retrieval.index_format import FORMAT, VERSION, provenance, read_manifest
from rag_jax.retrieval.scann_index import ScannIndex, _best

SHARD_ROWS = 2_000_000  # ~7 GB of peak memory while a 768-d shard is serialised
KIND = "scann_shards"


def shard_name(i: int) -> str:
    return f"shard_{i:05d}"


def _shard_provenance(corpus_checksum: str | None, rows: tuple[int, int]) -> str | None:
    """A shard's corpus checksum: the corpus' and its row range (None without the corpus')."""
    return None if corpus_checksum is None else f"{corpus_checksum}[{rows[0]}:{rows[1]}]"


class ShardedScannIndex(Index):
    """S `ScannIndex` shards over consecutive row ranges, searched as one index.

    Attributes:
      shards: the S searchers; shard s holds rows `bounds[s]:bounds[s + 1]` of the corpus.
      bounds: [S + 1] int64 row offsets.
      config: the first shard's ScaNN settings (what `scann_index.tune` reads and raises; every
        shard is set in proportion to its own leaves).
      measured_recall: as `ScannIndex.measured_recall`, of the shards searched together.
    """

    kind = KIND

    def __init__(
        self,
        shards: list[ScannIndex],
        *,
        encoder_fingerprint: str | None = None,
        corpus_checksum: str | None = None,
        measured_recall: dict | None = None,
    ):
        if not shards:
            raise ValueError("a sharded index needs at least one shard")
        dims = {s.dim for s in shards}
        if len(dims) != 1:
            raise ValueError(f"shards of different widths: {sorted(dims)}")
        self.shards = list(shards)
        self.bounds = np.concatenate([[0], np.cumsum([s.count for s in shards])]).astype(np.int64)
        self.count, self.dim = int(self.bounds[-1]), dims.pop()
        self.config = dict(shards[0].config)
        self.encoder_fingerprint = encoder_fingerprint
        self.corpus_checksum = corpus_checksum
        self.measured_recall = None if measured_recall is None else dict(measured_recall)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def with_search_settings(
        self, *, num_leaves_to_search: int | None = None, reorder: int | None = None
    ) -> ShardedScannIndex:
        """Every shard searching the same fraction of its leaves as `num_leaves_to_search` is of
        the first shard's (at least one), with `reorder` candidates (a new index, whose recall is
        not measured)."""
        shards = []
        for shard in self.shards:
            leaves = None
            if num_leaves_to_search is not None and shard.config["num_leaves"]:
                share = num_leaves_to_search / max(1, self.config["num_leaves"])
                leaves = min(
                    shard.config["num_leaves"],
                    max(1, math.ceil(share * shard.config["num_leaves"])),
                )
            shards.append(shard.with_search_settings(num_leaves_to_search=leaves, reorder=reorder))
        return ShardedScannIndex(
            shards,
            encoder_fingerprint=self.encoder_fingerprint,
            corpus_checksum=self.corpus_checksum,
        )

    def with_measured_recall(self, record: dict) -> ShardedScannIndex:
        """The same shards carrying `record` (`scann_recall.measure`'s) as `measured_recall`."""
        return ShardedScannIndex(
            self.shards,
            encoder_fingerprint=self.encoder_fingerprint,
            corpus_checksum=self.corpus_checksum,
            measured_recall=record,
        )

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each shard's top min(k, its rows), ids offset to the corpus', merged:
        (scores [B, k] float32, ids [B, k] int64), descending score, lower id first on ties."""
        queries = self._check_queries(queries)
        k = self._check_k(k)
        scores, ids = [], []
        for shard, start in zip(self.shards, self.bounds[:-1].tolist(), strict=True):
            s, i = shard.search(queries, min(k, shard.count))
            scores.append(s)
            ids.append(i + start)
        return _best(np.concatenate(scores, axis=1), np.concatenate(ids, axis=1), k)

    def save(self, directory: str) -> None:
        """Writes every shard and the manifest to `directory` (replacing an index there
        atomically)."""

        def write_fn(tmp):
            for i, shard in enumerate(self.shards):
                shard.save(os.path.join(tmp, shard_name(i)))
            return _carried(pathlib.Path(tmp), len(self.shards))

        files.swap_dir(directory, write_fn, self._manifest(), what="index")

    def _manifest(self) -> dict:
        manifest = {"format": FORMAT, "version": VERSION, "kind": KIND, "count": self.count}
        first = self.shards[0].vectors
        manifest |= {"dim": self.dim, "dtype": "float32" if first is None else first.dtype.name}
        manifest["shards"] = [[int(a), int(b)] for a, b in zip(self.bounds[:-1], self.bounds[1:])]
        for field in ("encoder_fingerprint", "corpus_checksum"):
            if getattr(self, field) is not None:
                manifest[field] = getattr(self, field)
        if self.measured_recall is not None:
            # The shards were saved before the search settings were tuned: load applies these.
            search = {name: self.config[name] for name in ("num_leaves_to_search", "reorder")}
            manifest |= {"search": search, "measured_recall": self.measured_recall}
        return manifest

    @classmethod
    def load(
        cls, directory: str, expect: dict | None = None, *, verify: bool = True
    ) -> ShardedScannIndex:
        """Reads an index written by `build_sharded` or `save`; see `ExactIndex.load` for the
        arguments. Each shard's manifest is checked against the listing, then each shard
        loads (memory-mapped) checking its own files."""
        directory = pathlib.Path(directory)
        manifest = read_manifest(str(directory), expect, kinds=(KIND,))
        path = directory / files.MANIFEST
        ranges = manifest.get("shards")
        if not ranges or [r[0] for r in ranges] != [0] + [r[1] for r in ranges[:-1]]:
            raise ValueError(f"{path}: shard row ranges {ranges} do not tile the corpus")
        if ranges[-1][1] != manifest["count"]:
            raise ValueError(f"{path}: the shards end at row {ranges[-1][1]}, not the count")
        listed = {rel.split("/")[0] for rel in manifest["files"]}
        if listed != {shard_name(i) for i in range(len(ranges))}:
            raise ValueError(f"{path}: lists the folders {sorted(listed)}, not its shards")
        shards = []
        for i, rows in enumerate(ranges):
            folder = directory / shard_name(i)
            rel = f"{shard_name(i)}/{files.MANIFEST}"
            files.check_file(folder / files.MANIFEST, manifest["files"][rel], verify=True,
                             what="index file", manifest=path)  # fmt: skip
            shard_expect = {"count": rows[1] - rows[0], "dim": manifest["dim"]}
            checksum = _shard_provenance(manifest.get("corpus_checksum"), tuple(rows))
            if checksum is not None:
                shard_expect["corpus_checksum"] = checksum
            shard = ScannIndex.load(str(folder), shard_expect, verify=verify)
            shard_files = read_manifest(str(folder), None, kinds=("scann",))["files"]
            prefix = f"{shard_name(i)}/"
            want = {
                r.removeprefix(prefix): v
                for r, v in manifest["files"].items()
                if r.startswith(prefix) and r != rel
            }
            if want != shard_files:
                raise ValueError(f"{path}: its listing of {folder} disagrees with {rel}")
            shards.append(shard)
        loaded = cls(shards, **provenance(manifest))
        if "search" in manifest:
            loaded = loaded.with_search_settings(**manifest["search"])
        if "measured_recall" in manifest:
            loaded = loaded.with_measured_recall(manifest["measured_recall"])
        return loaded


def _carried(directory: pathlib.Path, count: int) -> dict:
    """The records of the shards' files in `directory` as their own manifests sealed them
    (hashed once, when written); the shards' manifests themselves are hashed by the caller."""
    records = {}
    for i in range(count):
        shard_files = read_manifest(str(directory / shard_name(i)), None, kinds=("scann",))
        for rel, record in shard_files["files"].items():
            records[f"{shard_name(i)}/{rel}"] = record
    return records


def build_sharded(
    vectors,
    directory,
    *,
    shard_rows: int | None = None,
    encoder_fingerprint: str | None = None,
    corpus_checksum: str | None = None,
    log=None,
    tune_fn=None,
    **scann_kwargs,
) -> ShardedScannIndex:
    """Builds a `ShardedScannIndex` over `vectors` into `directory`, one shard at a time.

    Each shard (`shard_rows` consecutive rows; the last holds the rest) is built with
    `ScannIndex.build(**scann_kwargs)` and saved to `directory/shard_<s>` before the next
    starts; only then, the manifest. Started again after a kill (the same vectors, provenance
    and settings), the shards already saved are kept: without a `corpus_checksum` nothing ties
    a saved shard to the vectors, and every shard is built again.

    Args:
      vectors: [C, D] (memory-mapped, to keep them on disk: a shard reads its rows).
      directory: a new folder, or the folder of a build that was killed (no manifest yet).
      shard_rows: rows a shard (default `SHARD_ROWS`).
      encoder_fingerprint, corpus_checksum: provenance for the manifests.
      log: called with a line per shard (e.g. `print`), or None.
      tune_fn: called with the index once every shard is saved, before the manifest; returns
        the index to finish (e.g. `scann_recall.tune_to_recall`'s, whose search settings and
        measured recall the manifest records) or raises, leaving the folder unfinished (no
        manifest: not loadable; started again, the saved shards are kept).
      **scann_kwargs: `ScannIndex.build` settings, applied to every shard.

    Raises:
      FileExistsError: `directory` holds a finished index (delete it, or build elsewhere).
    """
    vectors = check_vectors(vectors)
    directory = pathlib.Path(directory)
    if (directory / files.MANIFEST).exists():
        raise FileExistsError(f"{directory} holds a finished index; delete it or build elsewhere")
    shard_rows = SHARD_ROWS if shard_rows is None else shard_rows
    if shard_rows < 1:
        raise ValueError(f"shard_rows must be >= 1, got {shard_rows}")
    count, dim = vectors.shape
    ranges = [(a, min(count, a + shard_rows)) for a in range(0, count, shard_rows)]
    directory.mkdir(parents=True, exist_ok=True)
    for leftover in directory.glob(".shard_*"):  # a shard's write killed before its rename
        shutil.rmtree(leftover, ignore_errors=True)
    shards = []
    for i, rows in enumerate(ranges):
        folder = directory / shard_name(i)
        checksum = _shard_provenance(corpus_checksum, rows)
        expect = {"count": rows[1] - rows[0], "dim": dim, "corpus_checksum": checksum}
        expect["encoder_fingerprint"] = encoder_fingerprint
        shard = _saved_shard(folder, expect, scann_kwargs) if checksum else None
        if shard is None:
            built = ScannIndex.build(
                vectors[rows[0] : rows[1]],
                encoder_fingerprint=encoder_fingerprint,
                corpus_checksum=checksum,
                **scann_kwargs,
            )
            built.save(str(folder))
            del built  # the shard is read back memory-mapped: the build's memory goes
            shard = ScannIndex.load(str(folder), verify=False)
            if log:
                log(f"scann shard {i + 1}/{len(ranges)}: rows {rows[0]}-{rows[1]} built")
        elif log:
            log(f"scann shard {i + 1}/{len(ranges)}: rows {rows[0]}-{rows[1]} kept from before")
        shards.append(shard)
    index = ShardedScannIndex(
        shards, encoder_fingerprint=encoder_fingerprint, corpus_checksum=corpus_checksum
    )
    if tune_fn is not None:
        index = tune_fn(index)
    manifest = index._manifest()
    manifest["files"] = _carried(directory, len(ranges))
    for i in range(len(ranges)):
        rel = f"{shard_name(i)}/{files.MANIFEST}"
        manifest["files"][rel] = files.file_record(directory / rel)
    files.write_manifest(directory, manifest)  # last: a folder without it is a build under way
    return index


def _saved_shard(folder: pathlib.Path, expect: dict, scann_kwargs: dict) -> ScannIndex | None:
    """The shard saved in `folder` by an earlier build with these rows, provenance and
    settings, or None (nothing there, or something else: it is built again)."""
    if not (folder / files.MANIFEST).exists():
        return None
    try:
        shard = ScannIndex.load(str(folder), {k: v for k, v in expect.items() if v is not None})
    except (OSError, ValueError):
        return None
    given = {k: v for k, v in scann_kwargs.items() if k in shard.config and v is not None}
    if any(shard.config[k] != v for k, v in given.items()):
        return None
    return shard
