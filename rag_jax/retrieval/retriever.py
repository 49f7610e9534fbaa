"""Which passages for these questions: the one home of retrieval, whichever search path.

A `Retriever` joins an index to the passage store its vectors were encoded from, and answers for
every path the trainer, the evaluation and the scripts use:

- a host index (`ExactIndex`, `ScannIndex`): question vectors come to the host and each process
  searches its own rows in its own replica of the index;
- a `DeviceIndex` searched between the steps: on one host, or spanning every device of a pod, when
  all processes search it together with the global batch and each keeps its own rows;
- a `DeviceIndex` searched inside the train step (`search_in_step`): the step embeds the next
  batch's questions with the parameters it just updated and returns the passage rows in
  `TrainState.next_doc_ids`; the retriever only turns those rows into contexts.

`for_step` picks the path, so a training loop never asks how its batch was retrieved. The index
decides *which* passages; their stored vectors come back with them so that the doc scores can be
recomputed inside the jitted step from the trainable question encoder: the approximate search
never sets the weights the loss uses.

`build(...)` makes the retriever of a passage store and a passage encoder (encode the corpus,
index it), reusing an index saved by an earlier build when one matches the encoder's fingerprint,
the corpus checksum and the encoding settings: the experiment's first build, each index refresh,
a hot swap and a restore all go through it.

Legend: B batch, N docs per question, S context length, D vector width, C corpus size.
"""

import dataclasses
import hashlib
import io
import json
import pathlib

import jax
import numpy as np

from rag_jax.devices import distributed, preemption, sharding
from rag_jax.devices.progress import Eta
from rag_jax.retrieval import encode, encoder_id, files
from rag_jax.retrieval.device_index import DeviceIndex
from rag_jax.retrieval.index import ExactIndex
from rag_jax.retrieval.index_base import Index
from rag_jax.retrieval.index_format import read_manifest
from rag_jax.retrieval.scann_index import ScannIndex
from rag_jax.retrieval.store import PassageStore, tokenizer_fingerprint


@dataclasses.dataclass
class Retrieved:
    """What retrieval hands to the step for a batch of questions."""

    doc_ids: np.ndarray  # [B, N] int64 passage rows, best first
    index_scores: np.ndarray  # [B, N] float32 scores the index returned
    doc_vectors: np.ndarray  # [B, N, D] float32 stored passage vectors
    context_input_ids: np.ndarray  # [B * N, S] int32, row b * N + n
    context_attention_mask: np.ndarray  # [B * N, S] int32


def searches_in_step(asked: bool, index_mesh, index_axis: str, step_mesh) -> bool:
    """The one rule for whether a train step searches the next batch's passages itself: it was
    asked to (`search_in_step`), and the index is a `DeviceIndex` sharded along `data` over
    exactly the step's devices (one process or a pod). `Retriever.searches_in_step` asks it of a
    built index; `Experiment.searches_in_step` of the index a config would build, before any is
    (a restore lays out its state by it).

    Args:
      asked: the retriever's `search_in_step`.
      index_mesh, index_axis: the device index's mesh and the axis its vectors are split along.
      step_mesh: the train step's mesh.
    """
    return (
        asked
        and index_axis == sharding.DATA_AXIS
        and list(index_mesh.devices.flat) == list(step_mesh.devices.flat)
    )


class Retriever:
    """An index over a passage store's vectors, plus the store that turns hits into contexts."""

    def __init__(
        self,
        index: Index,
        store: PassageStore,
        vectors: np.ndarray,
        *,
        n_docs: int,
        max_combined_length: int,
        search_in_step: bool = False,
        verify_corpus: bool = True,
        keep_question: bool = False,
        source=None,
    ):
        """Args:
        index: any index over `vectors` (`search(queries [B, D], k)`).
        store: the passage store the vectors were encoded from (same row order).
        vectors: [C, D] stored passage vectors.
        n_docs: N, passages per question.
        max_combined_length: S, generator context length.
        search_in_step: a `DeviceIndex` on the train step's devices is searched inside the step.
        verify_corpus: the index must record the store's corpus checksum (`corpus_checksum`),
          so an index of another corpus is never paired with this store. False accepts an index
          whose corpus is unknown or another: an explicit, unchecked pairing.
        keep_question: contexts longer than S lose the passage's end, not the question
          (`PassageStore.context_tokens`).
        source: a `sources.CandidateSource` (BM25, or BM25 fused with this index) choosing the
          rows instead of the index alone; None: the index (`retrieval.source = "dense"`).
        """
        if len(store) != index.count or vectors.shape[0] != index.count:
            raise ValueError(
                f"index has {index.count} vectors, the store {store.directory} has {len(store)} "
                f"passages and the vector array {vectors.shape[0]} rows; they must be equal"
            )
        if vectors.ndim != 2 or vectors.shape[1] != index.dim:
            raise ValueError(f"vectors {vectors.shape} must be [C, D] with D = {index.dim}")
        if not 1 <= n_docs <= index.count:
            raise ValueError(
                f"n_docs={n_docs} must be in [1, {index.count}] (the corpus has {index.count} "
                "passages)"
            )
        if verify_corpus and index.corpus_checksum != store.checksum:
            found = index.corpus_checksum
            source = "an unknown corpus" if found is None else f"corpus {found}"
            raise ValueError(
                f"the index was built from {source}, "
                f"not from the store {store.directory} (corpus {store.checksum}): build the index "
                "from this store's vectors with corpus_checksum=store.checksum, or pass "
                "verify_corpus=False to pair them unchecked"
            )
        self.index, self.store, self.vectors = index, store, vectors
        self.n_docs, self.max_combined_length = n_docs, max_combined_length
        self.in_step, self.verify_corpus = search_in_step, verify_corpus
        self.keep_question, self.source = keep_question, source
        if source is not None and search_in_step:
            raise ValueError(
                f"a {source.kind} source searches question texts on the host; it cannot search "
                "inside the train step (retrieval.search_in_step)"
            )

    def __call__(
        self, question_vectors: np.ndarray, question_pieces: list[list[int]], questions=None
    ) -> Retrieved:
        """Retrieves for a batch on the host.

        Args:
          question_vectors: [B, D] float32 from the current question encoder.
          question_pieces: B id lists from `store.tokenize_questions` (the generator's question
            tokens as they follow the passage in the context).
          questions: the B question texts; needed by a BM25 or hybrid `source`.

        Returns:
          Retrieved arrays for the step (index scores NaN where BM25 chose the rows).
        """
        vectors = np.asarray(question_vectors, np.float32)
        if self.source is None:
            scores, ids = self.index.search(vectors, self.n_docs)
            return self.gather(ids, question_pieces, scores)
        if questions is None or len(questions) != len(question_pieces):
            raise ValueError(
                f"retrieval.source={self.source.kind!r} reads the question texts: pass one per "
                f"question ({len(question_pieces)})"
            )
        dense = lambda k: self.index.search(vectors, k)[1]  # noqa: E731
        ids = self.source.rows(dense, questions, self.n_docs, self.index.count)  # -> [B, N]
        return self.gather(ids, question_pieces)

    def retrieve(self, question_vectors: jax.Array, question_pieces, mesh, questions=None):
        """Retrieves for this process's rows of a batch whose vectors are on the devices.

        A `DeviceIndex` spanning processes is searched by all of them together with the global
        batch (a collective); any other index is this process's own and searched with its rows.

        Args:
          question_vectors: [B, D] global, batch-sharded over `mesh`.
          question_pieces: this process's rows' pieces (`store.tokenize_questions`).
          mesh: the `data` mesh the batch is sharded over.
          questions: this process's rows' question texts (a BM25 or hybrid `source`).
        """
        index = self.index
        if isinstance(index, DeviceIndex) and not index.vectors.is_fully_addressable:
            if self.source is not None:
                raise ValueError("a BM25 or hybrid source needs a host index or one process")
            scores, doc_ids = index.search(question_vectors, self.n_docs)  # -> [B, N] replicated
            own = lambda x: distributed.own_rows(x, mesh)  # noqa: E731
            return self.gather(own(doc_ids), question_pieces, own(scores))
        return self(distributed.local_rows(question_vectors), question_pieces, questions)

    def gather(self, doc_ids, question_pieces: list[list[int]], scores=None) -> Retrieved:
        """The step's inputs for passages already chosen (e.g. by a search inside the step).

        Args:
          doc_ids: [B, N] passage rows, best first.
          question_pieces: B id lists from `store.tokenize_questions`.
          scores: [B, N] index scores when known; NaN otherwise.

        Returns:
          Retrieved arrays for the step.
        """
        ids = np.asarray(doc_ids).astype(np.int64)  # -> [B, N]
        if ids.ndim != 2 or ids.shape != (len(question_pieces), self.n_docs):
            raise ValueError(
                f"doc_ids {ids.shape} must be [B, N] = [{len(question_pieces)}, {self.n_docs}] "
                "(one row per question piece)"
            )
        if ids.size and not 0 <= ids.min() <= ids.max() < self.index.count:
            raise ValueError(
                f"doc_ids hold rows outside [0, {self.index.count}): {ids.min()}..{ids.max()}"
            )
        if scores is None:
            scores = np.full(ids.shape, np.nan, np.float32)
        vectors = np.asarray(self.vectors[ids.reshape(-1)], np.float32)
        vectors = vectors.reshape(ids.shape + (self.vectors.shape[1],))  # -> [B, N, D]
        context_ids, context_mask = self.store.context_tokens(
            ids, question_pieces, self.max_combined_length, keep_question=self.keep_question
        )
        return Retrieved(ids, np.asarray(scores, np.float32), vectors, context_ids, context_mask)

    def searches_in_step(self, mesh) -> bool:
        """Whether the train step on `mesh` searches this retriever's index itself
        (`searches_in_step`, the module's rule)."""
        index = self.index
        return isinstance(index, DeviceIndex) and searches_in_step(
            self.in_step, index.mesh, index.axis, mesh
        )

    def for_step(
        self, next_doc_ids, vectors_fn, question_pieces, next_questions_fn, mesh, questions=None
    ):
        """A training batch's passages, and the train step's retrieval argument.

        Args:
          next_doc_ids: `TrainState.next_doc_ids` ([B, N] replicated, found by the previous step's
            search), or None.
          vectors_fn: `() -> [B, D]` the batch's question vectors (batch-sharded), called when the
            search runs now, between the steps.
          question_pieces: this process's rows' pieces.
          next_questions_fn: `() -> ` the next batch's question-encoder inputs (sharded), called
            when the step searches for the next batch.
          mesh: the step's mesh.
          questions: this process's rows' question texts (a BM25 or hybrid `source`).

        Returns:
          (Retrieved for this process's rows, the step's `retrieval` argument: `(index, next
          questions)` for a search inside the step, else None).
        """
        if self.searches_in_step(mesh):
            own = distributed.own_rows(next_doc_ids, mesh)  # -> [local B, N]
            return self.gather(own, question_pieces), (self.index, next_questions_fn())
        return self.retrieve(vectors_fn(), question_pieces, mesh, questions), None

    def initial_doc_ids(self, search_fn, questions_fn, mesh):
        """The first training batch's passages when the step searches for the next batch
        (`search_fn(index, questions_fn())`), else None."""
        return search_fn(self.index, questions_fn()) if self.searches_in_step(mesh) else None

    def with_n_docs(self, n_docs: int) -> "Retriever":
        """The same retriever returning `n_docs` passages per question (e.g. more at test time
        than in training, as the paper evaluates)."""
        return self if n_docs == self.n_docs else self._replace(n_docs=n_docs)

    def swap(self, index: Index, store: PassageStore, vectors: np.ndarray) -> "Retriever":
        """The same retriever over another corpus (hot-swap): model parameters are untouched.
        The new index must record the new store's corpus checksum (see `verify_corpus`)."""
        return self._replace(index=index, store=store, vectors=vectors)

    def _replace(self, **changes) -> "Retriever":
        """A new retriever with this one's settings, but for `changes` (constructor arguments)."""
        args = dict(
            index=self.index,
            store=self.store,
            vectors=self.vectors,
            n_docs=self.n_docs,
            max_combined_length=self.max_combined_length,
            search_in_step=self.in_step,
            verify_corpus=self.verify_corpus,
            keep_question=self.keep_question,
            source=self.source,
        )
        return Retriever(**(args | changes))


class ClosedBook:
    """No retrieval: each question's only "passage" is empty, so the generator sees the question
    alone and must answer from its parameters (the closed-book baseline).

    It stands in for a `Retriever` with N = 1: the one doc gets a zero vector, so p(z|x) = 1 and
    the question encoder receives no gradient; doc ids are -1 (no passage), which the metrics
    count as a miss.
    """

    n_docs = 1
    index = None

    def __init__(self, tokenizer, dim: int, *, max_combined_length: int, prefix: str = ""):
        """Args:
        tokenizer: the generator's tokenizer (adds its special tokens around the question).
        dim: D, the question encoder's output width.
        max_combined_length: S, generator context length.
        prefix: text before the question (a causal generator's prompt opening, e.g. its chat
          template's head and "Question:"); empty for BART, which reads the question alone.
        """
        self.tokenizer, self.dim = tokenizer, dim
        self.max_combined_length = max_combined_length
        # The special tokens of an empty input: [CLS] [SEP] (BERT) or <s> </s> (BART), and the
        # prefix's tokens after the first of them.
        prefix_ids = (
            list(tokenizer(prefix, add_special_tokens=False)["input_ids"]) if prefix else []
        )
        special = list(tokenizer("")["input_ids"])
        self.special = special[:1] + prefix_ids + special[1:]
        self._head = 1 + len(prefix_ids) if special else len(prefix_ids)
        self.num_special = len(self.special)
        if max_combined_length <= self.num_special:
            raise ValueError(
                f"max_combined_length={max_combined_length} leaves no room for the question "
                f"next to {self.num_special} special and prefix tokens"
            )

    def __call__(self, question_vectors, question_pieces: list[list[int]], questions=None):
        """Contexts `[B, S]` holding only each question (its piece from `tokenize_questions`)."""
        batch, length = len(question_pieces), self.max_combined_length
        pad = self.tokenizer.pad_token_id
        ids = np.full((batch, length), pad, np.int32)
        mask = np.zeros((batch, length), np.int32)
        for b, piece in enumerate(question_pieces):
            body = list(piece)[: length - self.num_special]
            row = self.special[: self._head] + body + self.special[self._head :]
            ids[b, : len(row)], mask[b, : len(row)] = row, 1
        return Retrieved(
            doc_ids=np.full((batch, 1), -1, np.int64),
            index_scores=np.zeros((batch, 1), np.float32),
            doc_vectors=np.zeros((batch, 1, self.dim), np.float32),
            context_input_ids=ids,
            context_attention_mask=mask,
        )

    def retrieve(self, question_vectors, question_pieces, mesh, questions=None) -> Retrieved:
        del question_vectors, mesh, questions  # nothing is searched
        return self(None, question_pieces)

    def searches_in_step(self, mesh) -> bool:
        del mesh
        return False

    def for_step(
        self, next_doc_ids, vectors_fn, question_pieces, next_questions_fn, mesh, questions=None
    ):
        del next_doc_ids, vectors_fn, next_questions_fn, mesh, questions
        return self(None, question_pieces), None

    def initial_doc_ids(self, search_fn, questions_fn, mesh):
        del search_fn, questions_fn, mesh
        return None


# ---------------------------------------------------------------------------------------------
# Encode + index


@dataclasses.dataclass(frozen=True)
class PassageEncoder:
    """The passage tower and how it reads passages: what the stored vectors are a function of."""

    cfg: object  # bert.BertConfig
    params: dict
    tokenizer: object
    max_length: int
    input_format: str  # "pair" | "single", see `encode.tokenize_passages`
    batch_size: int = 128

    @property
    def fingerprint(self) -> str:
        """The encoder's parameter fingerprint (`encoder_id.encoder_fingerprint`)."""
        return encoder_id.encoder_fingerprint(self.cfg, self.params)

    def encode(self, passages) -> np.ndarray:
        """[n, D] float32 vectors of `passages` (`Passage` records), read as `encode_store`
        reads a store's, on this process's devices."""
        return encode.encode_passages(
            self.cfg,
            self.params,
            self.tokenizer,
            [p.title for p in passages],
            [p.text for p in passages],
            max_length=self.max_length,
            input_format=self.input_format,
            batch_size=self.batch_size,
            dtype="float32",
            mesh=sharding.data_mesh(jax.local_devices()),
        )

    def encode_rows(self, store: PassageStore, rows: range) -> np.ndarray:
        """[n, D] float32 vectors of the store's passages `rows` (`encode_store`'s windows)."""
        return self.encode([store.passage(i) for i in rows])

    def encoding(self, store: PassageStore) -> dict:
        """Everything the vectors of `store` depend on."""
        return {
            "encoder_fingerprint": self.fingerprint,
            "corpus_checksum": store.checksum,
            "tokenizer_fingerprint": tokenizer_fingerprint(self.tokenizer),
            "max_length": self.max_length,
            "input_format": self.input_format,
            "compute_dtype": self.cfg.dtype,
        }


# Passages encoded between two looks at a stop request (a SIGTERM before training starts): about
# two minutes of MiniLM on 2 CPU cores, so a stop is honoured within the grace time a preempted
# machine gives (SQuAD's 20,963 paragraphs were one window of 65,536 and never stopped early).
ENCODE_WINDOW = 4096


def encode_store(store: PassageStore, encoder: PassageEncoder, partial=None) -> np.ndarray:
    """[C, D] float32 vectors of every passage in the store.

    Encoded on this process's devices: on several hosts each one encodes the whole corpus, for
    its own replica of a host index, or for its own devices' rows of a `DeviceIndex` (the
    encoder's default mesh refuses to span processes). A stop request (`preemption.should_stop`)
    is honoured between windows of `ENCODE_WINDOW` passages, raising `preemption.Preempted`.

    Resuming: with `partial` (a file path), the stop first saves the windows encoded so far there
    (`_save_partial`: one file, written atomically by process 0, keyed by everything the vectors
    depend on and by the window size), and the next call with the same `partial` starts after
    them. Each window is encoded alone (`encode.encode_passages` batches within it), so a
    resumed encoding equals one never stopped bit for bit. A saved file of another encoder,
    corpus or window is ignored; the file is removed once the whole corpus is encoded.
    """
    count, key = len(store), _partial_key(store, encoder)
    parts = _load_partial(partial, key)
    first = sum(len(p) for p in parts)
    if first:
        print(f"corpus encoding: resuming at passage {first} of {count} from {partial}", flush=True)
    eta = Eta("corpus encoding", count, "passages", start=first)
    for start in range(first, count, ENCODE_WINDOW):
        eta.update(start)
        if preemption.should_stop():
            if partial is None:
                kept = "are not kept; the next run encodes them again"
            else:
                _save_partial(partial, key, parts)
                kept = f"are saved in {partial}, and the next run resumes there"
            raise preemption.Preempted(
                f"stopped while encoding the corpus of {store.directory}: {start} of {count} "
                f"passages were encoded and {kept}"
            )
        parts.append(encoder.encode_rows(store, range(start, min(count, start + ENCODE_WINDOW))))
    eta.update(count)
    if partial is not None and jax.process_index() == 0:
        pathlib.Path(partial).unlink(missing_ok=True)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _partial_key(store: PassageStore, encoder: PassageEncoder) -> str:
    """What a partial encoding is a function of: the encoding and the window size."""
    return json.dumps({**encoder.encoding(store), "window": ENCODE_WINDOW}, sort_keys=True)


def _save_partial(path, key: str, parts: list[np.ndarray]) -> None:
    """The windows encoded so far, [n, D] float32, with `key`, in one `.npz` at `path`."""
    if jax.process_index() != 0:
        return
    done = np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)
    buffer = io.BytesIO()
    np.savez(buffer, vectors=done, key=np.array(key))
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    files.write_atomic(path, buffer.getvalue())


def _load_partial(path, key: str) -> list[np.ndarray]:
    """The windows `_save_partial` saved at `path` for `key`, as one part; [] when none."""
    if path is None or not pathlib.Path(path).is_file():
        return []
    try:
        with np.load(path, allow_pickle=False) as saved:
            if str(saved["key"]) != key:
                return []  # another encoder, corpus or window: encoded again from the start
            done = saved["vectors"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"{path}: the saved partial corpus encoding is unreadable ({e}); delete it to "
            "encode the corpus from the start"
        ) from e
    return [done] if len(done) else []


def index_provenance(index: Index) -> dict:
    """The encoder fingerprint and corpus checksum an index carries."""
    return {
        "encoder_fingerprint": index.encoder_fingerprint,
        "corpus_checksum": index.corpus_checksum,
    }


def make_index(
    vectors: np.ndarray, kind: str, mesh=None, device_storage: str = "", **provenance
) -> Index:
    """The index `kind` names over `vectors` [C, D], carrying `provenance`
    (`encoder_fingerprint`, `corpus_checksum`).

    "exact" and "scann" search on the host; "device" shards the vectors over the `data` axis of
    `mesh` (`DeviceIndex`; default: this process's devices) and searches there, one jitted
    program per batch, storing them as `device_storage` says ("" their dtype, "int8" codes and
    scales). A mesh that spans processes splits the corpus over the whole pod; every process
    must then build it from the same vectors and search it together (see `DeviceIndex`).
    """
    if kind == "exact":
        return ExactIndex(vectors, **provenance)
    if kind == "scann":
        return ScannIndex.build(vectors, **provenance)
    if kind == "device":
        if mesh is None:
            mesh = sharding.data_mesh(jax.local_devices())
        return DeviceIndex(vectors, mesh, storage=device_storage, **provenance)
    raise ValueError(f"config.retrieval.index must be exact, scann or device, got {kind!r}")


def saved_index_dir(cache_dir, encoder: PassageEncoder, store: PassageStore) -> pathlib.Path:
    """Where `build` saves (and looks for) the index of `store` encoded by `encoder`."""
    key = json.dumps(encoder.encoding(store), sort_keys=True).encode()
    return pathlib.Path(cache_dir) / hashlib.sha256(key).hexdigest()[:16]


def load_saved(directory, encoder: PassageEncoder, store: PassageStore) -> np.ndarray | None:
    """The vectors an earlier `build` saved in `directory` for this encoder and store, or None
    when there are none (or they were encoded otherwise, which the manifest says)."""
    directory = pathlib.Path(directory)
    if not (directory / "manifest.json").is_file():
        return None
    expected = encoder.encoding(store)
    manifest = read_manifest(str(directory), None, kinds=("exact",))
    if manifest.get("encoding") != expected:
        return None
    return ExactIndex.load(str(directory)).vectors


def build(
    store: PassageStore,
    encoder: PassageEncoder,
    *,
    kind: str,
    n_docs: int,
    max_combined_length: int,
    search_in_step: bool = False,
    mesh=None,
    cache_dir=None,
    keep_question: bool = False,
    device_storage: str = "",
    source=None,
) -> Retriever:
    """The retriever of `store` encoded by `encoder`: encode the corpus and index it.

    With `cache_dir`, an index saved there by an earlier build for the same encoder parameters,
    corpus and encoding settings is loaded instead of encoding (a restore, a sibling run, a
    resumed refresh), and a new encoding is saved there (process 0 writes). The saved form is
    an exact index folder; ScaNN and device indexes are made from its vectors.

    Args:
      store: the passages.
      encoder: the passage tower and its input settings.
      kind: "exact" | "scann" | "device" (see `make_index`).
      n_docs, max_combined_length, search_in_step, keep_question: see `Retriever`.
      mesh: the device index's mesh (default: this process's devices).
      cache_dir: where encoded corpora are saved and looked for, and where an encoding stopped
        midway keeps what it encoded (`encode_store`'s `partial`); None: always encode.
      device_storage: a device index's storage (see `make_index`).
      source: see `Retriever`.
    """
    vectors = None
    saved = saved_index_dir(cache_dir, encoder, store) if cache_dir else None
    if saved is not None:
        vectors = load_saved(saved, encoder, store)
    if vectors is None:
        partial = saved.with_name(f"{saved.name}.partial.npz") if saved is not None else None
        vectors = encode_store(store, encoder, partial)
        if saved is not None and jax.process_index() == 0:
            provenance = {"encoder_fingerprint": encoder.fingerprint}
            exact = ExactIndex(vectors, corpus_checksum=store.checksum, **provenance)
            exact.save(str(saved), encoding=encoder.encoding(store))
    provenance = {"encoder_fingerprint": encoder.fingerprint, "corpus_checksum": store.checksum}
    index = make_index(vectors, kind, mesh, device_storage, **provenance)
    if isinstance(index, ExactIndex):
        vectors = index.vectors  # one copy of the vectors, not two
    return Retriever(
        index,
        store,
        vectors,
        n_docs=n_docs,
        max_combined_length=max_combined_length,
        search_in_step=search_in_step,
        keep_question=keep_question,
        source=source,
    )
