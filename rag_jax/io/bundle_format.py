"""The bundle folder: its layout, how it is written, and how it is read back checked whole.

`rag_jax.io.bundle` is the API (`save`, `load`, `Bundle`); this module is its file format:

    <bundle>/
      manifest.json            sealed (`retrieval.files`): format, version, the passage encoder's
                               fingerprint, the corpus checksum, passage count and vector width,
                               the index kind, the training step, and the byte size and sha256
                               of every file below
      config.json              RagConfig, the passage tower's BertConfig and how it reads
                               passages, the answering defaults (`Settings`)
      params/question_encoder.safetensors  params/generator.safetensors
      params/passage_encoder.safetensors   the three towers, dtypes kept, names "a/b/c"
      tokenizers/question/  tokenizers/generator/     `save_pretrained` folders
      passages/                the passage store (`retrieval.store`)
      index/                   an exact index folder: the final passage encoder's vectors
      scann/                   a ScaNN searcher over them (only when the run searched with ScaNN)
      scann_edits.npz          the passages edited since scann/ was built (ids, vectors,
                               deletions: `retrieval.edits`), with `scann_base` in the manifest
                               naming the corpus scann/ was built from (only after edits)

A folder is written whole beside its destination and swapped in (`files.swap_dir`), so a crash
leaves the previous bundle; a crash between the swap's two renames leaves it aside, in
`.<name>.old.*/<name>`, and `read` puts it back (`restore`). `read` refuses a missing, truncated
or corrupted file (naming it), a file the manifest does not list (`check_listed`: the manifest
is the one file the format writes unlisted), parameters holding NaN or inf, a manifest edited
after it was sealed, a manifest whose encoder fingerprint or corpus checksum disagrees with the
parameters, the store or the index, a config.json value out of its type or range
(`bundle_config`, naming the field), and a tokenizer config naming a class or a file a bundle
may not hold (`bundle_tokenizers`). An edit first checks every file of the folder against the
manifest, and the folder for files it does not list (`check_bundle`), then links the model's
files into its new folder and carries their checked records into the new manifest
(`link_model`), never hashing them again; the passages and vectors it copies are hashed as read
and checked against their records before anything is sealed (`retrieval.store_edit`): damage,
even done while the edit writes, is never sealed.

Legend: C corpus size, D vector width.
"""

import dataclasses
import json
import os
import pathlib
import shutil
import time

import flax
import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from rag_jax import rag
from rag_jax.io import bundle_config, bundle_tokenizers
from rag_jax.io.bundle_config import Settings
from rag_jax.models import bart, bert, llama
from rag_jax.retrieval import files
from rag_jax.retrieval.edits import EditedIndex, LiveRowIndex
from rag_jax.retrieval.index import ExactIndex
from rag_jax.retrieval.retriever import PassageEncoder, Retriever
from rag_jax.retrieval.scann_index import ScannIndex
from rag_jax.retrieval.store import PassageStore, tokenizer_fingerprint
from rag_jax.retrieval.store_edit import EditedVectors

FORMAT = "rag_jax.bundle"
VERSION = 1
TOWERS = ("question_encoder", "generator", "passage_encoder")
PARAMS = {tower: f"params/{tower}.safetensors" for tower in TOWERS}
TOKENIZERS = {"question": "tokenizers/question", "generator": "tokenizers/generator"}
VECTORS = "index/vectors.bin"  # the exact index's rows (`retrieval.index_format`)
# Parts every bundle holds (the tokenizer folders are checked by loading them).
_REQUIRED = ("config.json", *PARAMS.values(), "passages/manifest.json", "index/manifest.json")
# The model's parts: never changed by an edit, which links them into its new folder.
MODEL_PARTS = ("config.json", "params", "tokenizers")
SCANN_EDITS = "scann_edits.npz"  # edits over a ScaNN searcher (`LiveRowIndex`, `Bundle.edit`)


class DamagedBundleError(RuntimeError):
    """A bundle's own file is missing or differs from its manifest: the folder was damaged
    after it was written (the request that found it is not at fault)."""


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a bundle folder holds, read and checked (`read`)."""

    rag_cfg: rag.RagConfig
    encoder: PassageEncoder
    params: dict  # {"question_encoder", "generator", "passage_encoder"}
    question_tokenizer: object
    generator_tokenizer: object
    retriever: Retriever
    settings: Settings
    manifest: dict


# ---------------------------------------------------------------------------------------------
# Writing


def new_manifest(encoder: PassageEncoder, retriever: Retriever, settings: Settings, step) -> dict:
    """The manifest fields of a bundle of `retriever`'s passages (`files` are added when it is
    written)."""
    store = retriever.store
    return {
        "format": FORMAT,
        "version": VERSION,
        "encoder_fingerprint": encoder.fingerprint,
        "corpus_checksum": store.checksum,
        "question_tokenizer_fingerprint": tokenizer_fingerprint(encoder.tokenizer),
        "count": len(store),
        "dim": int(retriever.vectors.shape[1]),
        "index": settings.index,
        "step": step,
    }


def write_model(
    directory: pathlib.Path,
    rag_cfg: rag.RagConfig,
    encoder: PassageEncoder,
    params: dict,
    question_tokenizer,
    generator_tokenizer,
    settings: Settings,
) -> None:
    """config.json, the parameters (all three towers in `params`) and the tokenizers."""
    enc = encoder
    config = {
        "rag": dataclasses.asdict(rag_cfg),
        "passage_encoder": {
            "config": dataclasses.asdict(enc.cfg),
            "max_length": enc.max_length,
            "input_format": enc.input_format,
            "batch_size": enc.batch_size,
        },
        "settings": dataclasses.asdict(settings),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    (directory / "params").mkdir()
    for tower, tree in params.items():
        flat = flax.traverse_util.flatten_dict(jax.device_get(tree), sep="/")
        flat = {name: np.ascontiguousarray(value) for name, value in flat.items()}
        save_file(flat, str(directory / PARAMS[tower]), metadata={"format": FORMAT})
    for name, tokenizer in (("question", question_tokenizer), ("generator", generator_tokenizer)):
        tokenizer.save_pretrained(str(directory / TOKENIZERS[name]))


def link_tree(source: pathlib.Path, target: pathlib.Path) -> None:
    """`source` (a file or a folder) at `target`, hard-linked: files of a bundle are never
    modified in place, so the copies can share them (copied where links are not possible)."""
    source = pathlib.Path(source)
    rels = files.files_under(source) if source.is_dir() else [""]
    for rel in rels:
        src, dst = (source / rel, target / rel) if rel else (source, target)
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


def check_paths(directory: pathlib.Path, manifest: dict) -> None:
    """Every file the manifest lists lies inside the bundle folder: no absolute path, no `..`,
    no link that leads out of it (a crafted manifest or link would have a load read, and an
    edit carry over, a file anywhere on the machine).

    Raises:
      ValueError naming the manifest entry.
    """
    root = pathlib.Path(directory).resolve()
    path = pathlib.Path(directory) / files.MANIFEST
    for rel in manifest["files"]:
        parts = pathlib.PurePosixPath(rel).parts
        if not isinstance(rel, str) or not parts or rel.startswith(("/", "\\")) or ".." in parts:
            raise ValueError(f"{path}: the entry {rel!r} is not a path inside the bundle")
        target = (pathlib.Path(directory) / rel).resolve()
        if not target.is_relative_to(root):
            raise ValueError(
                f"{path}: the entry {rel!r} leads out of the bundle (a link to {target}); "
                "a bundle holds its own files"
            )


def unlisted(directory: pathlib.Path, manifest: dict) -> list[str]:
    """What the bundle folder `directory` holds beyond the files `manifest` lists and the
    manifest itself (the one file the format writes unlisted), as sorted relative paths: files
    and links to files, and links to folders no listed file lies under ("name/")."""
    directory = pathlib.Path(directory)
    listed = set(manifest["files"]) | {files.MANIFEST}
    above = {str(pathlib.PurePosixPath(rel).parent) for rel in listed}
    above |= {str(p) for rel in above for p in pathlib.PurePosixPath(rel).parents}
    found = []
    for root, folders, names in os.walk(directory):  # links to folders are not followed
        below = pathlib.Path(root).relative_to(directory)
        rels = [(below / name).as_posix() for name in names]
        found += [rel for rel in rels if rel not in listed]
        links = [name for name in folders if os.path.islink(os.path.join(root, name))]
        found += [f"{rel}/" for rel in ((below / n).as_posix() for n in links) if rel not in above]
    return sorted(found)


def check_listed(directory: pathlib.Path, manifest: dict) -> None:
    """Raises ValueError naming the first file of the bundle folder `directory` its manifest
    does not list (`unlisted`): a load refuses what an edit would (`check_bundle`), and no
    reader of the folder (transformers, for one) finds a file the manifest does not vouch for.
    """
    extra = unlisted(directory, manifest)
    if extra:
        raise ValueError(
            f"{os.path.join(directory, extra[0])} is not listed in "  # a folder's "/" kept
            f"{pathlib.Path(directory) / files.MANIFEST}"
            + (f" (nor {len(extra) - 1} more)" if len(extra) > 1 else "")
            + "; a bundle holds only the files its manifest lists: remove it, or restore the "
            "bundle from a good copy"
        )


def check_bundle(
    source: pathlib.Path,
    manifest: dict,
    advice: str = "the edit was not written; restore the bundle from a good copy",
) -> dict[str, dict]:
    """Checks every file `manifest` (the one the bundle folder `source` was loaded with) lists
    whole (size and sha256) against it, and that the folder holds no file it does not list (as
    a load does, `check_listed`); returns the model's files' records, for `link_model`.

    An edit calls it before it reads or writes anything: the passages and vectors it carries
    over and the model files it links must be the ones sealed, or a damaged bundle would be
    sealed again.

    Raises:
      DamagedBundleError: naming the first file missing, extra or changed.
    """
    source = pathlib.Path(source)
    path = source / files.MANIFEST
    try:
        check_paths(source, manifest)
        check_listed(source, manifest)
    except ValueError as e:
        raise DamagedBundleError(f"{e}; {advice}") from None
    for rel, record in sorted(manifest["files"].items()):
        try:
            files.check_file(source / rel, record, verify=True, what="bundle file", manifest=path)
        except (OSError, ValueError) as e:
            raise DamagedBundleError(f"{e}; {advice}") from None
    return {
        rel: dict(record)
        for rel, record in manifest["files"].items()
        if rel.split("/")[0] in MODEL_PARTS
    }


def link_model(source: pathlib.Path, target: pathlib.Path, records: dict) -> dict:
    """Hard-links the model's files of the bundle folder `source` into `target`; `records` are
    theirs, as `check_bundle` checked them, and are returned for the new manifest (`swap_dir`
    carries them over): a file damaged after the check keeps the record it no longer matches,
    so the new bundle refuses to load rather than seal the damage."""
    source, target = pathlib.Path(source), pathlib.Path(target)
    for rel in sorted(records):
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        link_tree(source / rel, target / rel)
    return records


def _aside(directory: pathlib.Path, kind: str) -> list[pathlib.Path]:
    """The folders `files.swap_dir` writes beside `directory`: kind "new" or "old"."""
    return sorted(directory.parent.glob(f".{directory.name}.{kind}.*"))


def restore(directory) -> bool:
    """Puts back the bundle a crash between `files.swap_dir`'s two renames left aside (in
    `.<name>.old.*/<name>`) when `directory` is missing; whether it did.

    The newest such folder holds it: an older one is an earlier bundle that a crash after its
    swap left, whole or half removed (putting it back would lose the edits since, or fail)."""
    directory = pathlib.Path(directory).absolute()
    if directory.exists():
        return False
    for old in sorted(_aside(directory, "old"), key=_set_aside_at, reverse=True):
        if (old / directory.name / files.MANIFEST).is_file():
            os.rename(old / directory.name, directory)
            files.fsync_dir(directory.parent)
            return True
    return False


def _set_aside_at(folder: pathlib.Path) -> int:
    """When a bundle was renamed into `folder` (its mtime, ns; -1: removed meanwhile)."""
    try:
        return folder.stat().st_mtime_ns
    except FileNotFoundError:
        return -1


def remove_stale(directory, min_age_s: float = 60.0) -> list[pathlib.Path]:
    """Restores an interrupted swap's bundle (`restore`), then removes the folders interrupted
    writes left beside `directory` (`.<name>.new.*`, `.<name>.old.*`, older than `min_age_s`: a
    write in progress elsewhere is left alone); the folders removed."""
    directory = pathlib.Path(directory).absolute()
    restore(directory)
    removed = []
    for folder in _aside(directory, "new") + _aside(directory, "old"):
        if time.time() - folder.stat().st_mtime >= min_age_s:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def write_index(
    directory,
    fingerprint: str,
    checksum: str,
    vectors,
    settings: Settings,
    scann=None,
    base_from: tuple[pathlib.Path, dict] | None = None,
) -> dict:
    """index/ (the exact index of `vectors`, encoded by the encoder of `fingerprint` from the
    corpus of `checksum`) and, with `settings.index == "scann"`, scann/: the searcher `scann`, or
    one built from the vectors. `scann` may be a `LiveRowIndex` (edits over a ScaNN base): its
    base goes to scann/ and its edits to `SCANN_EDITS`; with `base_from` = (a bundle folder,
    its scann/ files' records) the base's files are hard-linked from there, not written again.
    Returns the records of the linked files (for the manifest, as `link_model`'s)."""
    provenance = {"encoder_fingerprint": fingerprint, "corpus_checksum": checksum}
    if isinstance(vectors, EditedVectors):  # written in blocks, then read memory-mapped
        vectors = vectors.save(directory / "index", provenance)
    else:
        ExactIndex(vectors, **provenance).save(str(directory / "index"))
    if settings.index != "scann":
        return {}
    if not isinstance(scann, LiveRowIndex):
        (scann or ScannIndex.build(vectors, **provenance)).save(str(directory / "scann"))
        return {}
    linked = {}
    if base_from is None:
        scann.edited.base.save(str(directory / "scann"))
    else:
        linked = link_model(base_from[0], directory, base_from[1])
    edited = scann.edited
    with open(directory / SCANN_EDITS, "wb") as f:
        np.savez(
            f,
            edited_ids=edited.edited_ids,
            edited_vectors=edited.edited_vectors,
            deleted_ids=edited.deleted_ids,
        )
    return linked


def scann_base(index) -> dict | None:
    """The manifest's `scann_base` of a bundle whose ScaNN searcher carries edits (the corpus
    its base was built from: checksum and count), else None."""
    if not isinstance(index, LiveRowIndex):
        return None
    base = index.edited.base
    return {"corpus_checksum": base.corpus_checksum, "count": base.count}


def share_modes(directory: pathlib.Path) -> None:
    """Gives every folder and file below `directory` the mode the umask gives new ones: the
    temporary folders a bundle is written in, and safetensors' files, are private to their
    owner, and a bundle is read by others (a server's user)."""
    probe = directory / ".mode-probe"
    probe.mkdir()
    folder_mode = probe.stat().st_mode & 0o777
    probe.rmdir()
    probe.touch()
    file_mode = probe.stat().st_mode & 0o777
    probe.unlink()
    os.chmod(directory, folder_mode)
    for root, folders, names in os.walk(directory):
        for name in folders:
            os.chmod(os.path.join(root, name), folder_mode)
        for name in names:
            os.chmod(os.path.join(root, name), file_mode)


# ---------------------------------------------------------------------------------------------
# Reading


def read(directory, *, verify: bool = True) -> Parts:
    """Reads the bundle in `directory`, checking it whole (see the module docstring).

    Args:
      directory: written by `save` (or `Bundle.save`).
      verify: check every file's sha256 (sizes are always checked).

    Raises:
      FileNotFoundError / ValueError naming the file that is missing, damaged or inconsistent.
    """
    directory = pathlib.Path(directory)
    restore(directory)
    manifest = files.read_manifest(
        directory,
        {FORMAT: (VERSION,)},
        what="bundle",
        required=("encoder_fingerprint", "corpus_checksum", "count", "dim", "index", "files"),
    )
    path = directory / files.MANIFEST
    for rel in _REQUIRED:
        if rel not in manifest["files"]:
            raise ValueError(f"{path}: lists no {rel}; the bundle is incomplete")
    check_paths(directory, manifest)
    check_listed(directory, manifest)
    for rel, record in manifest["files"].items():
        files.check_file(directory / rel, record, verify=verify, what="bundle file", manifest=path)
    count = manifest["count"]
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"{path}: count {count!r:.40} is not a number of passages")
    config = bundle_config.read(directory / "config.json", count=count, index=manifest["index"])
    rag_cfg, passage_cfg, settings = config.rag_cfg, config.passage_cfg, config.settings
    shapes = {
        "question_encoder": _bert_shapes(rag_cfg.question_encoder),
        "generator": llama.param_shapes(rag_cfg.generator)
        if rag_cfg.causal
        else bart.param_shapes(rag_cfg.generator),
        "passage_encoder": _bert_shapes(passage_cfg),
    }
    params = {tower: _read_params(directory, tower, shapes[tower]) for tower in TOWERS}
    question_tokenizer = _load_tokenizer(directory, manifest, "question")
    generator_tokenizer = _load_tokenizer(directory, manifest, "generator")
    encoder = PassageEncoder(
        passage_cfg, params["passage_encoder"], question_tokenizer, **config.passage
    )
    fingerprint = encoder.fingerprint
    if fingerprint != manifest["encoder_fingerprint"]:
        raise ValueError(
            f"{path}: encoder_fingerprint {manifest['encoder_fingerprint']} disagrees with the "
            f"parameters in {directory / PARAMS['passage_encoder']} (fingerprint {fingerprint})"
        )
    found = tokenizer_fingerprint(question_tokenizer)
    if found != manifest.get("question_tokenizer_fingerprint", found):
        raise ValueError(
            f"{path}: question_tokenizer_fingerprint disagrees with the tokenizer in "
            f"{directory / TOKENIZERS['question']}"
        )
    # Every file's size (and with `verify`, sha256) is checked above: the parts need not be again.
    retriever = open_retriever(directory, manifest, settings, rag_cfg)
    store = retriever.store
    if tokenizer_fingerprint(generator_tokenizer) != store.manifest["tokenizer"]["fingerprint"]:
        raise ValueError(
            f"the generator tokenizer in {directory / TOKENIZERS['generator']} is not the one "
            f"the passage store {store.directory} was built with"
        )
    return Parts(
        rag_cfg,
        encoder,
        params,
        question_tokenizer,
        generator_tokenizer,
        retriever,
        settings,
        manifest,
    )


def open_retriever(
    directory, manifest, settings: Settings, rag_cfg, vectors=None, verify=False, scann=None
):
    """The retriever of a bundle folder's passages/ and index/ (or scann/ and its edits),
    checked against the manifest; `vectors` [C, D] when already in memory (or memory-mapped),
    and `scann` the edited ScaNN index when in memory (an edit just wrote them)."""
    directory = pathlib.Path(directory)
    store = PassageStore.open(directory / "passages", verify=verify)
    if store.checksum != manifest["corpus_checksum"]:
        raise ValueError(
            f"{directory / files.MANIFEST}: corpus_checksum {manifest['corpus_checksum']} "
            f"disagrees with the passage store {store.directory} (checksum {store.checksum})"
        )
    expect = {k: manifest[k] for k in ("encoder_fingerprint", "corpus_checksum", "count", "dim")}
    if vectors is None:
        exact = ExactIndex.load(str(directory / "index"), expect, verify=verify)
    else:
        provenance = {k: manifest[k] for k in ("encoder_fingerprint", "corpus_checksum")}
        exact = ExactIndex(vectors, **provenance)
    index = exact
    if settings.index == "scann" and scann is not None:
        index = scann
    elif settings.index == "scann" and manifest.get("scann_base"):
        index = _edited_scann(directory, manifest, verify)
    elif settings.index == "scann":
        index = ScannIndex.load(str(directory / "scann"), expect, verify=verify)
    return Retriever(
        index,
        store,
        exact.vectors,
        n_docs=rag_cfg.n_docs,
        max_combined_length=rag_cfg.max_combined_length,
        keep_question=settings.keep_question,
    )


def _edited_scann(directory: pathlib.Path, manifest: dict, verify: bool) -> LiveRowIndex:
    """The ScaNN base of an edited bundle (built from the corpus `scann_base` names) with the
    edits of `SCANN_EDITS`, its ids the store's rows."""
    base_expect = {k: manifest[k] for k in ("encoder_fingerprint", "dim")}
    base_expect |= {k: manifest["scann_base"][k] for k in ("corpus_checksum", "count")}
    base = ScannIndex.load(str(directory / "scann"), base_expect, verify=verify)
    path = directory / SCANN_EDITS
    if SCANN_EDITS not in manifest["files"]:
        raise ValueError(f"{directory / files.MANIFEST}: has scann_base but lists no {SCANN_EDITS}")
    try:
        with np.load(path, allow_pickle=False) as arrays:
            edits = {k: arrays[k] for k in ("edited_ids", "edited_vectors", "deleted_ids")}
        index = LiveRowIndex(EditedIndex(base, **edits), manifest["corpus_checksum"])
    except Exception as e:  # a damaged zip (BadZipFile), a missing array, inconsistent edits
        raise ValueError(
            f"{path}: not readable as the edits of {directory / 'scann'} "
            f"({type(e).__name__}: {e}); restore the bundle from a good copy"
        ) from None
    if index.count != manifest["count"]:
        raise ValueError(
            f"{path}: the edits leave {index.count} passages, the manifest "
            f"{directory / files.MANIFEST} says {manifest['count']}"
        )
    return index


def _bert_shapes(cfg: bert.BertConfig):
    ids = np.zeros((1, 2), np.int32)
    model = bert.BertEncoder(cfg)
    return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ids, ids)["params"])


def _read_params(directory: pathlib.Path, tower: str, shapes) -> dict:
    """A tower's parameters from its safetensors file, checked against the config's shapes."""
    path = directory / PARAMS[tower]
    try:
        flat = load_file(str(path))
    except Exception as e:  # safetensors' errors name neither the file nor the cause
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    want = flax.traverse_util.flatten_dict(shapes, sep="/")
    if set(flat) != set(want):
        missing, extra = sorted(set(want) - set(flat)), sorted(set(flat) - set(want))
        raise ValueError(
            f"{path}: does not match config.json's {tower} (missing {missing[:5]}, unexpected "
            f"{extra[:5]})"
        )
    for name, spec in want.items():
        if flat[name].shape != spec.shape or flat[name].dtype != spec.dtype:
            raise ValueError(
                f"{path}: {name} is {flat[name].dtype}{list(flat[name].shape)}; config.json's "
                f"{tower} needs {spec.dtype}{list(spec.shape)}"
            )
        finite = np.isfinite(flat[name].astype(np.float32, copy=False))
        if not finite.all():  # a model that loads and then answers nothing but errors
            raise ValueError(
                f"{path}: {name} holds {finite.size - int(finite.sum())} NaN or inf values (of "
                f"{finite.size}); the parameters are damaged"
            )
    return flax.traverse_util.unflatten_dict(flat, sep="/")


def _load_tokenizer(directory: pathlib.Path, manifest: dict, name: str):
    """The tokenizer in the folder `TOKENIZERS[name]`, read from the files the manifest lists
    there alone (`bundle_tokenizers.load`)."""
    folder = TOKENIZERS[name]
    listed = {rel[len(folder) + 1 :] for rel in manifest["files"] if rel.startswith(f"{folder}/")}
    return bundle_tokenizers.load(directory / folder, listed)
