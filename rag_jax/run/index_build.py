"""Passage stores and indexes on disk, built once and opened by every run that needs them.

- `build_index`: corpus file -> passage store, passage vectors and index, the offline pipeline
  behind `experiments/build_index.py`, every step resumable and checked against what it was
  built from; `load_index_dir` opens such a folder for a run, checked against its encoder.
- `workdir_store`: the passage store of a run's own corpus in its workdir, built once and shared
  by the processes of a multi-host run.

Legend: C corpus size (passages), D embedding width.
"""

import os
import pathlib
import shutil
import socket

from rag_jax.io import hf
from rag_jax.retrieval import corpus, encoder_id, index, ingest
from rag_jax.retrieval.encode import DEFAULT_MAX_LENGTH, encode_corpus
from rag_jax.retrieval.scann_recall import RECALL_TARGET
from rag_jax.retrieval.store import PassageStore
from rag_jax.retrieval.vectors import load_vectors


def _open_or_build_store(
    corpus_path, tokenizer, store_dir: pathlib.Path, fields, overwrite, workers=None
):
    """The passage store of `corpus_path` in `store_dir`, reused when it matches the file, a
    `.tsv` ingested in parallel and resumably (`retrieval.ingest.open_or_build`)."""
    return ingest.open_or_build(
        corpus_path, tokenizer, store_dir, fields=fields, overwrite=overwrite, workers=workers
    )


def load_passage_encoder(path, compute_dtype: str = "float32"):
    """(BertConfig, params) of a DPR context encoder or a plain BERT checkpoint directory."""
    path = hf.resolve(path)
    config = hf.read_config(path)
    if config.get("model_type") == "dpr":
        if "DPRQuestionEncoder" in (config.get("architectures") or []):
            raise ValueError(
                f"{path} is a DPR question encoder; passages need the context encoder "
                "(DPRContextEncoder)"
            )
        return hf.load_dpr(path, dtype=compute_dtype)
    if config.get("model_type") == "bert":
        return hf.load_bert(path, dtype=compute_dtype)
    raise ValueError(
        f"{path / 'config.json'}: model_type {config.get('model_type')!r}; expected 'dpr' (a "
        "DPR context encoder) or 'bert'"
    )


def build_index(
    corpus_path,
    encoder_path,
    generator_tokenizer_path,
    out_dir,
    *,
    kind: str = "exact",
    encoder_tokenizer_path=None,
    fields: dict | None = None,
    max_length: int = DEFAULT_MAX_LENGTH,
    input_format: str = "pair",
    batch_size: int = 128,
    shard_size: int = 100_000,
    dtype: str = "float32",
    compute_dtype: str = "float32",
    pooling: str = "cls",
    normalize: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    workers: int | None = None,
    recall: float = RECALL_TARGET,
    queries=None,
) -> dict:
    """Corpus file -> `out_dir/passages` (store), `out_dir/vectors`, `out_dir/index`.

    Every stage resumes: a store that matches the corpus file and generator tokenizer is reused,
    encoding continues from its last finished shard, and the index is rebuilt from the vectors.

    Args:
      corpus_path: passages as DPR TSV or JSONL (see `rag_jax.retrieval.corpus.read_passages`).
      encoder_path: DPR context encoder or BERT checkpoint directory (or hub id).
      generator_tokenizer_path: the generator's tokenizer, for the passage store's tokens.
      out_dir: output directory.
      kind: "exact" (`ExactIndex`) or "scann" (`ScannIndex`, defaults from the corpus size).
      encoder_tokenizer_path: the encoder's tokenizer when not saved beside its weights.
      fields: column/key names of the corpus file where they differ from id/title/text.
      max_length, input_format, batch_size, shard_size, dtype: see `encode_corpus`.
      compute_dtype: the encoder's compute dtype, float32 or bfloat16.
      pooling, normalize: the passage vector, as the run's `model.pooling` and
        `model.normalize_embeddings` say ([CLS] for DPR; mean and normalised for MiniLM).
      overwrite: replace a store or vectors of another corpus/encoder instead of refusing.
      progress: show the encoding progress bar.
      workers: processes tokenising a `.tsv` corpus (`retrieval.ingest`; default all cores).
      recall, queries: ScaNN's recall@10 target and the [Q, D] query vectors it is measured on
        (None: a stand-in), tuned and confirmed before it is saved (`index.build_and_save`).

    Returns:
      {"passages", "vectors", "index": paths; "count": C, "dim": D, "encoder_fingerprint",
       "corpus_checksum"; ScaNN's "measured_recall" when measured}.
    """
    if kind not in ("exact", "scann"):
        raise ValueError(f"kind must be 'exact' or 'scann', got {kind!r}")
    out_dir = pathlib.Path(out_dir)
    generator_tokenizer = hf.load_tokenizer(generator_tokenizer_path)
    store = _open_or_build_store(
        corpus_path, generator_tokenizer, out_dir / "passages", fields, overwrite, workers
    )
    cfg, params = load_passage_encoder(encoder_path, compute_dtype)
    cfg = cfg.replace(pooling=pooling, normalize=normalize)
    tokenizer = hf.load_tokenizer(encoder_tokenizer_path or encoder_path)
    manifest = encode_corpus(
        store,
        cfg,
        params,
        tokenizer,
        out_dir / "vectors",
        max_length=max_length,
        input_format=input_format,
        batch_size=batch_size,
        shard_size=shard_size,
        dtype=dtype,
        overwrite=overwrite,
        progress=progress,
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
        "passages": str(out_dir / "passages"),
        "vectors": str(out_dir / "vectors"),
        "index": str(out_dir / "index"),
        "count": len(store),
        "dim": manifest["dim"],
        **provenance,
    }


def load_index_dir(directory, store: PassageStore, passage_cfg, passage_params):
    """(index, [C, D] vectors) written by `build_index` into `directory`.

    Both are checked against this run's passage encoder (parameter fingerprint) and the store's
    corpus checksum, so an index encoded by another encoder or from another corpus is refused.
    """
    directory = pathlib.Path(directory)
    expect = {
        "encoder_fingerprint": encoder_id.encoder_fingerprint(passage_cfg, passage_params),
        "corpus_checksum": store.checksum,
    }
    ix = index.load(str(directory / "index"), expect)
    if isinstance(ix, index.ExactIndex):
        return ix, ix.vectors  # one copy of the vectors, not two
    return ix, load_vectors(directory / "vectors", expect)


# ---------------------------------------------------------------------------------------------
# A run's own store


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def workdir_store(passages, tokenizer, directory, layout: dict) -> PassageStore:
    """Opens the passage store in `directory`, or builds it there from `passages`.

    An existing store must hold exactly `passages`, tokenised the same way: a workdir reused with
    another corpus (a changed world size or seed) is refused, never silently trained on.

    Several processes may share `directory` (hosts of one run on a shared workdir): each builds
    into a private sibling folder and renames it into place, so a store appears whole, with its
    manifest, or not at all; a process that finds the place taken keeps the winner's store. A
    private folder left by a killed build of this host is removed by the next build.

    Args:
      passages: the corpus' `Passage` records.
      tokenizer: the generator's tokenizer.
      directory: the store's folder.
      layout: {"prefix", "title_sep", "doc_sep"} of the contexts (HF `RagConfig`).
    """
    directory, passages = pathlib.Path(directory), list(passages)
    if not (directory / "manifest.json").is_file():
        if _build_into_place(passages, tokenizer, directory, layout):
            return PassageStore.open(directory)  # built from `passages` just now: nothing to check
    store = PassageStore.open(directory)
    stale = store.differences(corpus.corpus_checksum(passages), tokenizer, **layout)
    if stale:
        raise ValueError(
            f"{directory} holds a passage store built from another corpus or tokenizer "
            f"(differs: {stale}); use a fresh workdir or delete {directory}"
        )
    return store


def _build_into_place(passages, tokenizer, directory: pathlib.Path, layout: dict) -> bool:
    """Builds the store in a private sibling folder and renames it to `directory`.

    Returns:
      True when this build took the place; False when another process's store was there first.
    """
    host = socket.gethostname()
    for stale in directory.parent.glob(f"{directory.name}.building-{host}-*"):
        if not _process_alive(int(stale.name.rsplit("-", 1)[1])):  # a killed build
            shutil.rmtree(stale, ignore_errors=True)
    private = directory.with_name(f"{directory.name}.building-{host}-{os.getpid()}")
    shutil.rmtree(private, ignore_errors=True)
    PassageStore.build(passages, tokenizer, private, **layout)
    for _ in range(2):
        try:
            os.rename(private, directory)
            return True
        except OSError:
            if (directory / "manifest.json").is_file():
                shutil.rmtree(private)  # another process renamed its build first
                return False
            # No manifest: the leftovers of a build that wrote into place (older layouts).
            shutil.rmtree(directory)
    raise FileExistsError(f"could not move the passage store built in {private} to {directory}")
