"""A trained model as one folder: everything needed to answer questions, and nothing else.

`save(directory, exp, params)` writes a run's result; `load(directory)` opens it with no data
files, warm starts or encoding, and `Bundle.answer` answers with the retrieved passages and where
the answer came from. `Bundle.edit` changes the knowledge without touching a parameter: the
changed passages are encoded with the bundle's own passage encoder, and the store, the index and
the manifest are replaced in one atomic swap.

The folder's layout and checks are `rag_jax.io.bundle_format`'s: a sealed manifest (the passage
encoder's fingerprint, the corpus checksum, every file's sha256), the config, the three towers'
parameters (safetensors, dtypes kept), both tokenizers, the passage store and the index of the
final passage encoder's vectors. A run that searched a device index gets an exact one (the same
vectors, searched on the host).

How a bundle answers (buckets, cached programs, the prepare and generate stages, compiling
ahead) is `rag_jax.io.answers`'. `edit` may run between (or during) calls to `answer`: each
answer reads one consistent snapshot of the store and index, swapped atomically.

Legend: B batch, N docs per question, S context length, L generated length, Q question length,
D vector width, C corpus size.
"""

import copy
import dataclasses
import pathlib
import threading
from collections.abc import Iterable

import jax
import numpy as np

from rag_jax import rag
from rag_jax.io import answers, bundle_format, content, hf_export
from rag_jax.io.answers import AnswerSetting
from rag_jax.io.bundle_config import Settings
from rag_jax.retrieval import files, store_edit
from rag_jax.retrieval.corpus import Passage, check_record
from rag_jax.retrieval.edits import EditedIndex, LiveRowIndex
from rag_jax.retrieval.index import ExactIndex
from rag_jax.retrieval.retriever import PassageEncoder, Retriever
from rag_jax.retrieval.scann_index import ScannIndex
from rag_jax.retrieval.store import PassageStore
from rag_jax.retrieval.store_edit import RowEdit

FORMAT, VERSION = bundle_format.FORMAT, bundle_format.VERSION
# An edit keeps the ScaNN searcher while the passages edited since it was built (replaced,
# added, deleted) are at most this share of those it holds; past it the searcher is built again.
FOLD_EDITS = 0.1
# The tokenizers that read a passage's text and title (`Bundle._content`'s names).
PASSAGE_READERS = ("passage encoder", "generator")


@dataclasses.dataclass(frozen=True)
class _Knowledge:
    """The passages a bundle answers from: one immutable snapshot, swapped whole by `edit`."""

    retriever: Retriever  # with the config's n_docs
    manifest: dict
    by_n_docs: dict = dataclasses.field(default_factory=dict)  # n_docs -> Retriever

    def for_n_docs(self, n_docs: int) -> Retriever:
        """The same passages and index, retrieving `n_docs` per question."""
        r = self.retriever
        if n_docs == r.n_docs:
            return r
        if n_docs not in self.by_n_docs:
            self.by_n_docs[n_docs] = r.with_n_docs(n_docs)
        return self.by_n_docs[n_docs]


class Bundle(answers.Answering):
    """A trained RAG model with its tokenizers, passages and index; see the module docstring.

    Attributes:
      rag_cfg: the RAG config (its `generation` holds the decoding defaults).
      fingerprint: the passage encoder's (`encoder_id.encoder_fingerprint`), its index's provenance.
      encoder: the passage tower and how it reads passages (`edit` encodes with it).
      question_tokenizer, generator_tokenizer: the two tokenizers.
      settings: the answering defaults.
      directory: the folder the bundle was loaded from or saved to (None: in memory only).
      step: the training step its parameters come from, when known.
    """

    def __init__(
        self,
        rag_cfg: rag.RagConfig,
        encoder: PassageEncoder,
        params: dict,
        question_tokenizer,
        generator_tokenizer,
        retriever: Retriever,
        settings: Settings,
        *,
        directory=None,
        manifest: dict | None = None,
        fast_compile: bool = False,
    ):
        """Args:
        rag_cfg, encoder, question_tokenizer, generator_tokenizer, settings: see Attributes.
        params: {"question_encoder", "generator"} (the passage tower's are the encoder's).
        retriever: the passages and their index (vectors of `encoder`).
        directory: where it lives on disk, if anywhere.
        manifest: its manifest, when loaded.
        fast_compile: compile the answering programs for a quick first answer (XLA backend
          optimisation level 0: about half the compile time) rather than for throughput.
        """
        # A manifest holds the encoder's fingerprint (hashing the parameters once is enough).
        manifest = manifest or bundle_format.new_manifest(encoder, retriever, settings, None)
        self.fingerprint = manifest["encoder_fingerprint"]
        if retriever.index.encoder_fingerprint != self.fingerprint:
            raise ValueError(
                "the retriever's index was not encoded by this passage encoder (fingerprint "
                f"{retriever.index.encoder_fingerprint} != {self.fingerprint})"
            )
        self.rag_cfg, self.encoder, self.settings = rag_cfg, encoder, settings
        self.question_tokenizer, self.generator_tokenizer = question_tokenizer, generator_tokenizer
        self.directory = None if directory is None else pathlib.Path(directory)
        self.step = manifest.get("step")
        self._params = jax.device_put({k: params[k] for k in ("question_encoder", "generator")})
        self._knowledge = _Knowledge(retriever, manifest)
        self.fast_compile = fast_compile
        self._edit_lock = threading.Lock()  # one edit at a time
        # A fast tokenizer keeps truncation and padding as state between calls, so one shared by
        # an edit and a concurrent answer can tokenise either wrongly: edits use their own copies.
        self._edit_tokenizers = None  # (generator tokenizer, passage encoder), made by `edit`
        # Answers and compiles run on threads of their own beside the answers' (a server's):
        # each has its own copies (made here, before any of them runs).
        self._decode_tokenizer = copy.deepcopy(generator_tokenizer)  # `generate`'s
        self._compile_tokenizers = copy.deepcopy((question_tokenizer, generator_tokenizer))
        # Does a question or an edited passage hold a word for the tokenizers that read it?
        # (From any thread: a server's event loop asks before it queues a request.)
        self._content = content.ContentCheck(
            {
                "question encoder": question_tokenizer,
                "passage encoder": encoder.tokenizer,
                "generator": generator_tokenizer,
            }
        )
        self._compile_lock = threading.Lock()  # one `compile` at a time
        self._ready_lock = threading.Lock()
        self._ready: dict[AnswerSetting, set[tuple[int, int]]] = {}  # compiled (bucket, width)
        self._embedded: set[int] = set()  # the buckets the question encoder is compiled for

    # -----------------------------------------------------------------------------------------
    # What it holds

    @classmethod
    def from_experiment(cls, exp, params: dict, retriever=None, step: int | None = None):
        """The bundle of a run: `exp` (an `experiment.Experiment`) with trained `params` (host
        arrays, all three towers) and the retriever of their passage encoder (default: the
        experiment's)."""
        retriever = exp.retriever if retriever is None else retriever
        if not isinstance(retriever, Retriever):
            raise ValueError(
                f"a bundle needs passages and an index; this run's retriever is "
                f"{type(retriever).__name__} (closed book?)"
            )
        c = exp.config
        settings = Settings(
            question_length=c.data.question_length,
            variant=c.rag.variant,
            sequence_decoding=c.eval.sequence_decoding,
            context_pad_multiple=c.rag.context_pad_multiple,
            index="scann" if isinstance(retriever.index, ScannIndex) else "exact",
            keep_question=c.rag.keep_question,
        )
        encoder = exp.passage_encoder(params["passage_encoder"])
        if not isinstance(retriever.index, ExactIndex | ScannIndex):  # a device index
            provenance = {"encoder_fingerprint": retriever.index.encoder_fingerprint}
            exact = ExactIndex(
                retriever.vectors, corpus_checksum=retriever.store.checksum, **provenance
            )
            retriever = Retriever(
                exact,
                retriever.store,
                exact.vectors,
                n_docs=retriever.n_docs,
                max_combined_length=retriever.max_combined_length,
                keep_question=retriever.keep_question,
            )
        manifest = bundle_format.new_manifest(encoder, retriever, settings, step)
        return cls(
            exp.rag_cfg,
            encoder,
            params,
            exp.question_tokenizer,
            exp.generator_tokenizer,
            retriever,
            settings,
            manifest=manifest,
        )

    @property
    def retriever(self) -> Retriever:
        """The current passages and index (replaced by `edit`)."""
        return self._knowledge.retriever

    @property
    def store(self) -> PassageStore:
        return self._knowledge.retriever.store

    @property
    def manifest(self) -> dict:
        return dict(self._knowledge.manifest)

    @property
    def params(self) -> dict:
        """All three towers' parameters (host arrays)."""
        host = jax.device_get(self._params)
        return {**host, "passage_encoder": self.encoder.params}

    def save(self, directory) -> None:
        """Writes the bundle to `directory` (replacing a bundle there atomically); the bundle is
        then backed by it (`edit` writes there)."""
        with self._edit_lock:  # an edit writes the folder too, and checks it by the manifest
            self._save(pathlib.Path(directory))

    def _save(self, directory: pathlib.Path) -> None:
        knowledge = self._knowledge
        r = knowledge.retriever

        def write_fn(tmp):
            tmp = pathlib.Path(tmp)
            bundle_format.write_model(
                tmp,
                self.rag_cfg,
                self.encoder,
                self.params,
                self.question_tokenizer,
                self.generator_tokenizer,
                self.settings,
            )
            bundle_format.link_tree(r.store.directory, tmp / "passages")
            scann = r.index if isinstance(r.index, ScannIndex | LiveRowIndex) else None
            checksum = r.store.checksum
            bundle_format.write_index(
                tmp, self.fingerprint, checksum, r.vectors, self.settings, scann
            )
            bundle_format.share_modes(tmp)

        manifest = files.swap_dir(directory, write_fn, knowledge.manifest, what="bundle")
        # The files' records as written: what the next edit checks the folder against.
        self._knowledge = _Knowledge(r, manifest)
        self.directory = directory

    def to_hf(self, directory, variant: str | None = None) -> dict:
        """Exports to transformers' format (`hf_export.save_rag`, with the passages and a faiss
        index of their vectors); returns its summary.

        Raises:
          hf_export.ExportError: the model has no HF equivalent, e.g. contexts that keep the
            question (HF's `RagRetriever` puts it last and cuts a long context's end, question
            included).
        """
        if self.rag_cfg.causal:
            raise hf_export.ExportError(
                "the bundle's generator is a causal LM: transformers' RAG takes only a seq2seq "
                "generator (export it alone with hf.save_llama)"
            )
        if self.settings.keep_question:
            raise hf_export.ExportError(
                "the bundle's contexts keep the question when a passage is too long "
                "(rag.keep_question); HF's RagRetriever cuts the end, question included, so this "
                "model has no HF equivalent"
            )
        r = self._knowledge.retriever
        return hf_export.save_rag(
            directory,
            self.rag_cfg,
            self.params,
            variant=variant or self.settings.variant,
            question_tokenizer=self.question_tokenizer,
            generator_tokenizer=self.generator_tokenizer,
            store=r.store,
            vectors=r.vectors,
        )

    # -----------------------------------------------------------------------------------------
    # Editing the knowledge

    def verify(self) -> None:
        """Checks every file of the folder served against the manifest it was loaded or last
        edited with (sizes and sha256s, nothing unlisted), between edits: damage done on disk
        after the load, which answers would otherwise quote until the next edit or load.

        Raises:
          bundle_format.DamagedBundleError: naming the first file missing, extra or changed.
        """
        if self.directory is None:
            return
        with self._edit_lock:  # an edit swaps the folder: check one folder with its manifest
            bundle_format.check_bundle(
                self.directory, self._knowledge.manifest, "restore the bundle from a good copy"
            )

    def edit(self, upserts: Iterable[Passage] = (), deletes: Iterable[str] = ()) -> dict:
        """Adds, replaces and deletes passages; the parameters are untouched.

        Upserted passages replace the passage of the same id in place, or are appended; only
        they are encoded (with the bundle's passage encoder), the other passages keep their
        vectors. The store and the exact index's vectors are written anew, the unchanged rows'
        bytes copied as runs between the edited rows (`retrieval.store_edit`: no unchanged
        passage tokenised again, nothing of the corpus held in memory beyond a block; the
        cost is linear in the bundle's bytes, at copying speed). A ScaNN searcher is kept as it
        was built, its files linked into the new folder, with every passage edited since beside
        it in `scann_edits.npz` (`retrieval.edits.LiveRowIndex`: searched exactly, merged by
        score), until those passages pass `FOLD_EDITS` of the ones it was built on: that edit
        builds it again from the vectors. Then the bundle's folder is replaced in one atomic
        swap: a crash before it leaves the previous bundle whole, and the folders a
        crashed edit left beside the bundle are removed by the next edit (once a minute old).
        Answers started before the swap finish on the previous passages; those started after
        see the new ones.

        Args:
          upserts: `Passage(id, title, text)` records (or (id, title, text) triples); each id at
            most once, each text holding a word for the passage encoder's and the generator's
            tokenizers (a token neither unknown nor special), each title blank, the passage's
            current one, or one they read as more than nothing or special tokens.
          deletes: ids of passages to remove; each must exist.

        Returns:
          {"encoded", "kept", "deleted", "count", "corpus_checksum", "index_rebuilt"} (the last:
          whether a ScaNN searcher was built again).

        Raises:
          ValueError: naming the record or id at fault (nothing is written then).
          bundle_format.DamagedBundleError: a file of the bundle (the model's, the passages',
            the index's) is missing or differs from the manifest, the passages read differ
            from its corpus checksum, or a passage or vector file changed while the edit
            copied it: the folder was damaged (nothing is written then).
          OSError: the new folder could not be written (e.g. a full disk, saying so); the
            previous bundle is intact.
        """
        if self.directory is None:
            raise ValueError("this bundle has no folder to write the edit to; save() it first")
        with self._edit_lock:
            if self._edit_tokenizers is None:
                encoder = dataclasses.replace(
                    self.encoder, tokenizer=copy.deepcopy(self.encoder.tokenizer)
                )
                self._edit_tokenizers = (copy.deepcopy(self.generator_tokenizer), encoder)
            generator_tokenizer, encoder = self._edit_tokenizers
            knowledge = self._knowledge
            store, old_vectors = knowledge.retriever.store, knowledge.retriever.vectors
            changed, gone = _check_edit(upserts, deletes)
            wanted = [*changed, *gone]
            rows = {
                pid: int(row)
                for pid, row in zip(wanted, store_edit.IdLookup(store).rows(wanted), strict=True)
                if row >= 0
            }
            missing = gone - rows.keys()
            if missing:
                raise ValueError(
                    "cannot delete ids that are not in the bundle's passages: "
                    f"{sorted(missing)[:5]}"
                )
            _check_content(self._content, changed, rows, store)
            old_dir = self.directory
            # Before anything is read or written: the files the edit carries over (the model's,
            # linked; the passages and vectors, copied from) must be the ones sealed, or their
            # damage would be sealed into the new manifest.
            model_records = bundle_format.check_bundle(old_dir, knowledge.manifest)
            # The records as read (memory-mapped): still the sealed ones?
            if store_edit.store_checksum(store) != knowledge.manifest["corpus_checksum"]:
                raise bundle_format.DamagedBundleError(
                    f"the passages read from {store.directory} differ from the corpus_checksum "
                    f"of {old_dir / files.MANIFEST}: the store changed after it was checked; "
                    "the edit was not written; restore the bundle from a good copy"
                )
            replaced = {rows[pid]: p for pid, p in changed.items() if pid in rows}
            appended = [p for pid, p in changed.items() if pid not in rows]  # in the order given
            edit = RowEdit.of(len(store), replaced, [rows[pid] for pid in gone], len(appended))
            if edit.new_count < self.rag_cfg.n_docs:
                raise ValueError(
                    f"the edit leaves {edit.new_count} passages, fewer than n_docs="
                    f"{self.rag_cfg.n_docs}"
                )
            passages = [replaced[row] for row in edit.replaced.tolist()] + appended
            new_vectors = np.zeros((0, old_vectors.shape[1]), old_vectors.dtype)
            if passages:
                new_vectors = encoder.encode(passages).astype(old_vectors.dtype, copy=False)
            # Copied from the live (memory-mapped) files: the store's and the vectors' bytes are
            # hashed as the copy reads them and compared with the records checked above, before
            # anything is sealed (`store_edit`): damage done since the check is never sealed.
            rel = bundle_format.VECTORS
            sealed = (old_dir / rel, knowledge.manifest["files"][rel]["sha256"])
            vectors = store_edit.EditedVectors(edit, old_vectors, new_vectors, sealed)
            manifest = dict(knowledge.manifest, count=edit.new_count)
            manifest.pop("scann_base", None)
            written = {}

            def write_fn(tmp):
                tmp = pathlib.Path(tmp)
                # Unchanged: hard links of the files checked above, recorded as checked (the
                # returned records): hashed again, damage done since the check would be sealed.
                linked = bundle_format.link_model(old_dir, tmp, model_records)
                built = store_edit.edit_store(
                    store, tmp / "passages", generator_tokenizer, edit, passages
                )
                checksum = built.checksum
                # A ScaNN searcher is kept and the edits put beside it (exact, searched with
                # it), until they pass `FOLD_EDITS` of the corpus: then it is built again.
                scann = _scann_after_edit(
                    knowledge.retriever.index, edit.replaced, new_vectors, edit.deleted, checksum
                )
                base_from = None
                if scann is not None:
                    base_records = {
                        rel: dict(record)
                        for rel, record in knowledge.manifest["files"].items()
                        if rel.startswith("scann/")
                    }
                    base_from = (old_dir, base_records)
                    manifest["scann_base"] = bundle_format.scann_base(scann)
                linked |= bundle_format.write_index(
                    tmp, self.fingerprint, checksum, vectors, self.settings, scann, base_from
                )
                bundle_format.share_modes(tmp)
                # `swap_dir` writes the manifest after this returns: the checksum goes in now.
                manifest["corpus_checksum"] = checksum
                written.update(scann=scann)
                return linked

            # A write killed earlier left its folders beside the bundle (whole copies of the
            # passages and index); those a minute old go (younger: maybe a write in progress).
            bundle_format.remove_stale(old_dir)
            # The manifest as written, its files' records those the next edit checks against.
            try:
                manifest = files.swap_dir(old_dir, write_fn, manifest, what="bundle")
            except store_edit.SourceChangedError as e:  # the previous bundle is left in place
                raise bundle_format.DamagedBundleError(
                    f"{e}; restore the bundle from a good copy"
                ) from None
            vectors = ExactIndex.load(str(old_dir / "index"), verify=False, mmap=True).vectors
            retriever = bundle_format.open_retriever(
                old_dir, manifest, self.settings, self.rag_cfg, vectors, scann=written["scann"]
            )
            self._knowledge = _Knowledge(retriever, manifest)
        return {
            "encoded": len(passages),
            "kept": edit.count - len(edit.replaced) - len(edit.deleted),
            "deleted": len(gone),
            "count": edit.new_count,
            "corpus_checksum": manifest["corpus_checksum"],
            "index_rebuilt": self.settings.index == "scann" and written["scann"] is None,
        }


# ---------------------------------------------------------------------------------------------
# Saving, loading, editing


def save(directory, exp, params: dict, *, retriever=None, step: int | None = None) -> Bundle:
    """Writes the bundle of a run (`Bundle.from_experiment`) to `directory`; returns it."""
    bundle = Bundle.from_experiment(exp, params, retriever, step)
    bundle.save(directory)
    return bundle


def load(directory, *, verify: bool = True, fast_compile: bool = False) -> Bundle:
    """Opens the bundle in `directory`, checked whole (`bundle_format.read`).

    Args:
      directory: written by `save` (or `Bundle.save`).
      verify: check every file's sha256 (sizes are always checked).
      fast_compile: see `Bundle` (scripts answering a few questions once set it).

    Raises:
      FileNotFoundError / ValueError naming the file that is missing, damaged or inconsistent.
    """
    p = bundle_format.read(directory, verify=verify)
    return Bundle(
        p.rag_cfg,
        p.encoder,
        p.params,
        p.question_tokenizer,
        p.generator_tokenizer,
        p.retriever,
        p.settings,
        directory=directory,
        manifest=p.manifest,
        fast_compile=fast_compile,
    )


def _scann_after_edit(index, replaced, vectors, deleted, checksum) -> LiveRowIndex | None:
    """The bundle's ScaNN searcher with this edit's passages beside it (`LiveRowIndex`): the
    `replaced` old rows get the first of `vectors` [E, D], the rest are new passages, the
    `deleted` old rows go; None (build the searcher again) when the index is not ScaNN or the
    edits would hold more than `FOLD_EDITS` of the passages."""
    if isinstance(index, ScannIndex):
        index = LiveRowIndex(EditedIndex(index, [], []), index.corpus_checksum)
    if not isinstance(index, LiveRowIndex):
        return None
    edited = index.edit(
        replaced, vectors[: len(replaced)], vectors[len(replaced) :], deleted, checksum
    )
    held = len(edited.edited.edited_ids) + len(edited.edited.deleted_ids)
    return None if held > FOLD_EDITS * edited.edited.base.count else edited


def _check_edit(upserts, deletes) -> tuple[dict, set]:
    """({id: Passage} to write, {id} to delete), or ValueError naming the record or id (those
    to delete are looked up in the store by the caller)."""
    changed = {}
    for i, record in enumerate(upserts):
        if hasattr(record, "text") and not isinstance(record, tuple):  # e.g. synthetic.Passage
            record = (record.id, record.title, record.text)
        passage = check_record(tuple(record) if isinstance(record, list) else record, i)
        if not passage.text.strip():
            raise ValueError(f"upserts[{i}] (id {passage.id!r}): the passage has no text")
        if passage.id in changed:
            raise ValueError(f"upserts[{i}]: id {passage.id!r} is upserted twice")
        changed[passage.id] = passage
    gone = set()
    for i, pid in enumerate(deletes):
        if not isinstance(pid, str):
            raise ValueError(f"deletes[{i}]: expected a passage id string, got {pid!r:.80}")
        gone.add(pid)
    both = sorted(gone & set(changed))
    if both:
        raise ValueError(f"ids both upserted and deleted: {both[:5]}")
    return changed, gone


def _check_content(check: content.ContentCheck, changed: dict, rows: dict, store) -> None:
    """ValueError naming the first upsert of `changed` ({id: Passage}, in the order given) whose
    text has no word for the tokenizers that read it (`PASSAGE_READERS`): an edit would index a
    passage of nothing; or whose title they read as nothing, or as special tokens alone (a
    title of unknown words is kept: `content`). A blank title is no title, and the title a
    passage has (its row in `rows`) is not checked again: a client changing a text keeps it."""
    for i, (pid, passage) in enumerate(changed.items()):
        where = f"(id {pid!r:.80})"
        check.check(f"upserts[{i}].text {where}", passage.text, PASSAGE_READERS, "a text")
        kept = pid in rows and store.title(rows[pid]) == passage.title
        if passage.title.strip() and not kept:
            field = f"upserts[{i}].title {where}"
            check.check(field, passage.title, PASSAGE_READERS, "a title", unknown_is_word=True)
