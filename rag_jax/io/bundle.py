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

Answering is built for repeated calls with varying batch sizes (a server's merged batches): the
batch is padded to one of `BATCH_BUCKETS` and the contexts to a multiple of
`Settings.context_pad_multiple`, the jitted programs are cached inside the bundle, and
`Bundle.traces` counts how many times they were traced. `edit` may run between (or during) calls
to `answer`: each answer reads one consistent snapshot of the store and index, swapped atomically.

Legend: B batch, N docs per question, S context length, L generated length, Q question length,
D vector width, C corpus size.
"""

import collections
import copy
import dataclasses
import functools
import os
import pathlib
import threading
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from rag_jax import causal, rag, rag_math
from rag_jax.io import bundle_format, hf_export
from rag_jax.io.bundle_format import Settings
from rag_jax.retrieval import files
from rag_jax.retrieval.corpus import Passage, check_record, corpus_checksum
from rag_jax.retrieval.index import ExactIndex
from rag_jax.retrieval.retriever import PassageEncoder, Retriever
from rag_jax.retrieval.scann_index import ScannIndex
from rag_jax.retrieval.store import PassageStore
from rag_jax.training.inputs import context_width, question_tokens

FORMAT, VERSION = bundle_format.FORMAT, bundle_format.VERSION
# Batch sizes answers are computed at (a batch is padded up to the next); larger batches are cut
# into batches of the largest.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class RetrievedPassage:
    """One retrieved passage of an answer."""

    id: str
    title: str
    text: str
    score: float  # q · d
    prior: float  # p(z|x) = softmax of the scores over the N passages
    posterior: float  # p(z|x, y): how much the answer came from this passage


@dataclasses.dataclass(frozen=True)
class TokenSource:
    """One answer token (RAG-Token) and the passages it came from."""

    token: str
    token_id: int
    posteriors: tuple[float, ...]  # p(z|x, y_<=i), in the order of `Answer.passages`


@dataclasses.dataclass(frozen=True)
class Answer:
    """The answer to one question, with its provenance (plain data: `to_dict()` is JSON-ready)."""

    question: str
    answer: str
    log_likelihood: float  # log p(y|x) of the generated tokens under the variant's model
    truncated: bool  # the question was longer than the question encoder's Q tokens
    variant: str
    passages: tuple[RetrievedPassage, ...]
    tokens: tuple[TokenSource, ...] | None  # RAG-Token: per-token provenance; else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AnswerSetting:
    """What questions are answered with: one generation and one scoring program per shape."""

    variant: str  # "sequence" | "token"
    num_beams: int
    n_docs: int  # N
    sequence_decoding: str  # RAG-Sequence "thorough" | "fast"


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedQuestion:
    """A question after `Bundle.prepare` (the host work): what `Bundle.generate` answers it from,
    all read from one snapshot of the knowledge."""

    question: str
    setting: AnswerSetting
    store: PassageStore  # the snapshot its passages were retrieved from (their texts)
    q_ids: np.ndarray  # [Q] int32 question-encoder tokens
    q_mask: np.ndarray  # [Q] int32
    doc_ids: np.ndarray  # [N] int64 rows of `store`, best first
    doc_vectors: np.ndarray  # [N, D] float32 their stored vectors
    ctx: np.ndarray  # [N, S] int32 generator contexts (passage, then question), padded
    ctx_mask: np.ndarray  # [N, S] int32
    truncated: bool  # the question was longer than the question encoder's Q tokens


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


class Bundle:
    """A trained RAG model with its tokenizers, passages and index; see the module docstring.

    Attributes:
      rag_cfg: the RAG config (its `generation` holds the decoding defaults).
      fingerprint: the passage encoder's (`encode.encoder_fingerprint`), its index's provenance.
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

    @property
    def traces(self) -> int:
        """How many times the jitted programs of this bundle's model were traced (each trace
        compiles). Bundles of one model (a reloaded or edited copy) share their programs."""
        return _TRACES[self.rag_cfg]

    def save(self, directory) -> None:
        """Writes the bundle to `directory` (replacing a bundle there atomically); the bundle is
        then backed by it (`edit` writes there)."""
        directory = pathlib.Path(directory)
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
            scann = r.index if isinstance(r.index, ScannIndex) else None
            checksum = r.store.checksum
            bundle_format.write_index(
                tmp, self.fingerprint, checksum, r.vectors, self.settings, scann
            )
            bundle_format.share_modes(tmp)

        files.swap_dir(directory, write_fn, knowledge.manifest, what="bundle")
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
    # Answering

    def answer(
        self,
        questions: Sequence[str],
        *,
        variant: str | None = None,
        num_beams: int | None = None,
        n_docs: int | None = None,
        sequence_decoding: str | None = None,
    ) -> list[Answer]:
        """Answers `questions` with the passages they were answered from (`prepare`, then
        `generate`).

        Args:
          questions: B question strings.
          variant: "sequence" or "token" (default: the run's).
          num_beams: default `rag_cfg.generation.num_beams` (1 = greedy).
          n_docs: passages per question (default `rag_cfg.n_docs`).
          sequence_decoding: RAG-Sequence "thorough" or "fast" (default: the run's).

        Returns:
          B `Answer`s, in order.
        """
        options = dict(variant=variant, num_beams=num_beams, n_docs=n_docs)
        prepared = self.prepare(questions, **options, sequence_decoding=sequence_decoding)
        return self.generate(prepared)

    def prepare(
        self,
        questions: Sequence[str],
        *,
        variant: str | None = None,
        num_beams: int | None = None,
        n_docs: int | None = None,
        sequence_decoding: str | None = None,
        compiled_only: bool = False,
    ) -> list[PreparedQuestion]:
        """The host stage of `answer`: tokenises the questions, encodes them, retrieves their
        passages and lays out the generator's contexts, all from one snapshot of the knowledge
        (an `edit` meanwhile is seen by the next call). A server runs it for the next batch
        while `generate` runs the current one.

        Args:
          questions, variant, num_beams, n_docs, sequence_decoding: as `answer`'s.
          compiled_only: encode the questions with a batch bucket already compiled (padded up
            to the smallest, or cut into the largest), never compiling one: a server's path.

        Returns:
          B `PreparedQuestion`s, in order, for `generate`.

        Raises:
          ValueError: a question or setting that cannot be answered (named).
          RuntimeError: `compiled_only` before any question encoder program is compiled.
        """
        setting = self._answer_setting(questions, variant, num_beams, n_docs, sequence_decoding)
        retriever = self._retriever(setting)
        tokenizers = (self.question_tokenizer, self.generator_tokenizer)
        return self._prepare(list(questions), setting, retriever, tokenizers, compiled_only)

    def generate(
        self, prepared: Sequence[PreparedQuestion], *, compiled_only: bool = False
    ) -> list[Answer]:
        """The device stage of `answer`: generates and scores prepared questions, padded to a
        batch bucket and their contexts to a width, and reads the answers and their provenance.

        Args:
          prepared: B `PreparedQuestion`s of one setting, from one or several `prepare` calls
            (each answered from the passages its own call retrieved).
          compiled_only: run only (bucket, width) shapes already compiled (`ready_shapes`): the
            batch pads up to the cheapest that holds it, or is cut into the largest bucket,
            never compiling a program: a server's path.

        Returns:
          B `Answer`s, in order.

        Raises:
          ValueError: questions prepared for different settings.
          RuntimeError: `compiled_only` and no compiled shape of their setting holds their
            contexts.
        """
        prepared = list(prepared)
        if not prepared:
            return []
        setting = prepared[0].setting
        others = {p.setting for p in prepared} - {setting}
        if others:
            raise ValueError(
                f"prepared questions of one setting are answered together; got {setting} and "
                f"{sorted(others, key=str)}"
            )
        # The widest context of the batch bounds every chunk's; the chunk size is the largest
        # bucket (compiled at a width that holds them, with `compiled_only`).
        width = self._width([p.ctx_mask for p in prepared])
        chunk = max(b for b, _ in self._shapes(setting, width, compiled_only))
        out = []
        for start in range(0, len(prepared), chunk):
            rows = prepared[start : start + chunk]
            width = self._width([p.ctx_mask for p in rows])
            size, width = min(
                (s for s in self._shapes(setting, width, compiled_only) if s[0] >= len(rows)),
                key=lambda s: (s[0] * s[1], s[0]),  # the fewest padded cells
            )
            out += self._generate(rows, setting, size, width, self._decode_tokenizer)
        return out

    def ready_shapes(self) -> dict[AnswerSetting, tuple[tuple[int, int], ...]]:
        """The (batch bucket, context width) shapes whose programs are compiled, per setting:
        what `generate(..., compiled_only=True)` may run (by `compile` or by earlier answers)."""
        with self._ready_lock:
            return {s: tuple(sorted(shapes)) for s, shapes in self._ready.items()}

    def compile_plan(self, max_batch: int = BATCH_BUCKETS[-1]) -> list[tuple[int, int]]:
        """The (bucket, width) shapes `compile` runs for a setting, in order. First the top
        bucket (the first of `BATCH_BUCKETS` >= `max_batch`) at the widest width: any batch of
        up to `max_batch` questions, whatever its contexts, pads up to it, so a server answers
        everything once it is compiled. Then the top bucket's narrower widths (full batches of
        short contexts, the load's shapes), then the smaller buckets, smallest first, each at
        every width (single questions at low load).
        """
        multiple, length = self.settings.context_pad_multiple, self.retriever.max_combined_length
        # The widths `context_width` rounds to: multiples of `multiple`, capped at the length.
        steps = range(multiple, length + multiple, multiple) if multiple else (length,)
        widths = sorted({min(w, length) for w in steps}, reverse=True)
        top = next((b for b in BATCH_BUCKETS if b >= max_batch), BATCH_BUCKETS[-1])
        smaller = [b for b in BATCH_BUCKETS if b < top]
        return [(top, w) for w in widths] + [(b, w) for b in smaller for w in widths]

    def compile(
        self,
        max_batch: int = BATCH_BUCKETS[-1],
        *,
        variant: str | None = None,
        num_beams: int | None = None,
        n_docs: int | None = None,
        shapes: Sequence[tuple[int, int]] | None = None,
    ) -> int:
        """Compiles the answering programs of one setting for `shapes` (default: every batch
        bucket up to `max_batch` at every context width, `compile_plan`'s order), skipping those
        compiled already, so that later answers of those shapes never compile. A server compiles
        the first shape before it reports ready and the rest on a thread of its own while it
        answers (with `compiled_only`, its answers pad up to what is compiled meanwhile).
        Arguments as `answer`'s.

        Returns:
          How many (bucket, width) shapes were run.
        """
        setting = self._answer_setting(["?"], variant, num_beams, n_docs, None)
        shapes = self.compile_plan(max_batch) if shapes is None else list(shapes)
        retriever = self._retriever(setting)
        answer_fn = self._program(setting)
        run = 0
        with self._compile_lock:  # compiles may run beside answers: their own tokenizers
            for size, width in shapes:
                if (size, width) in self.ready_shapes().get(setting, ()):
                    continue
                tokenizers = self._compile_tokenizers
                rows = self._prepare(["?"] * size, setting, retriever, tokenizers, False)
                jax.block_until_ready(answer_fn(*self._inputs(rows, setting, size, width)))
                with self._ready_lock:
                    self._ready.setdefault(setting, set()).add((size, width))
                run += 1
        return run

    def _answer_setting(self, questions, variant, num_beams, n_docs, decoding) -> AnswerSetting:
        """The setting `questions` are answered with (None: the bundle's default), checked."""
        if isinstance(questions, str):
            raise ValueError("questions: expected a sequence of strings, got one string")
        for i, q in enumerate(questions):
            if not isinstance(q, str) or not q.strip():
                raise ValueError(f"questions[{i}]: expected a non-empty string, got {q!r:.80}")
        variant = variant or self.settings.variant
        decoding = decoding or self.settings.sequence_decoding
        if variant not in ("sequence", "token"):
            raise ValueError(f"variant must be 'sequence' or 'token', got {variant!r}")
        if decoding not in ("thorough", "fast"):
            raise ValueError(f"sequence_decoding must be 'thorough' or 'fast', got {decoding!r}")
        return AnswerSetting(
            variant,
            num_beams or self.rag_cfg.generation.num_beams,
            n_docs or self.rag_cfg.n_docs,
            decoding,
        )

    def _retriever(self, setting: AnswerSetting) -> Retriever:
        """One snapshot of the knowledge (whatever `edit` does meanwhile), for `setting.n_docs`."""
        knowledge = self._knowledge
        if not 1 <= setting.n_docs <= len(knowledge.retriever.store):
            raise ValueError(
                f"n_docs={setting.n_docs} must be in [1, {len(knowledge.retriever.store)}] "
                "(the passages)"
            )
        return knowledge.for_n_docs(setting.n_docs)

    def _width(self, masks: list[np.ndarray]) -> int:
        """The context width rows whose masks are `masks` ([N, S] each) need."""
        s = masks[0].shape[-1]
        return context_width(np.stack(masks).reshape(-1, s), s, self.settings.context_pad_multiple)

    def _shapes(self, setting, width: int, compiled_only: bool) -> list[tuple[int, int]]:
        """The (bucket, width) shapes rows needing `width` columns may run at."""
        if not compiled_only:  # any: jit compiles a new one
            return [(b, width) for b in BATCH_BUCKETS]
        shapes = [(b, w) for b, w in self.ready_shapes().get(setting, ()) if w >= width]
        if not shapes:
            raise RuntimeError(
                f"no compiled program of {setting} holds contexts of width {width} (compiled: "
                f"{self.ready_shapes().get(setting, ())}); compile() it first"
            )
        return shapes

    def _prepare(
        self, questions: list[str], setting, retriever, tokenizers, compiled_only: bool
    ) -> list[PreparedQuestion]:
        q_tok, g_tok = tokenizers
        length = self.settings.question_length
        embed_fn = _embed_program(self.rag_cfg, self.fast_compile)
        with self._ready_lock:
            sizes = sorted(self._embedded) if compiled_only else list(BATCH_BUCKETS)
        if not sizes:
            raise RuntimeError("no question encoder program is compiled; compile() first")
        out = []
        for start in range(0, len(questions), sizes[-1]):
            chunk = questions[start : start + sizes[-1]]
            count = len(chunk)
            size = next(b for b in sizes if b >= count)
            fields = question_tokens(q_tok, chunk, length)
            full = q_tok(chunk, truncation=False, verbose=False)["input_ids"]
            q_ids, q_mask = fields["question_input_ids"], fields["question_attention_mask"]
            vectors = embed_fn(self._params, _pad_rows(q_ids, size), _pad_rows(q_mask, size))
            vectors = np.asarray(vectors)[:count]  # -> [count, D]
            with self._ready_lock:
                self._embedded.add(size)
            hits = retriever(vectors, retriever.store.tokenize_questions(g_tok, chunk))
            shape = (count, retriever.n_docs, -1)
            ctx = hits.context_input_ids.reshape(shape)  # -> [count, N, S]
            ctx_mask = hits.context_attention_mask.reshape(shape)
            out += [
                PreparedQuestion(
                    question=q,
                    setting=setting,
                    store=retriever.store,
                    q_ids=q_ids[b],
                    q_mask=q_mask[b],
                    doc_ids=hits.doc_ids[b],
                    doc_vectors=hits.doc_vectors[b],
                    ctx=ctx[b],
                    ctx_mask=ctx_mask[b],
                    truncated=len(full[b]) > length,
                )
                for b, q in enumerate(chunk)
            ]
        return out

    def _program(self, setting: AnswerSetting):
        """`setting`'s answering program (`_answer_program`)."""
        s = setting
        return _answer_program(
            self.rag_cfg, s.variant, s.num_beams, s.n_docs, s.sequence_decoding, self.fast_compile
        )

    def _inputs(self, rows: list[PreparedQuestion], setting, size: int, width: int) -> tuple:
        """The answering program's arguments for `rows` padded to `size` and their contexts cut to
        `width`: (params, q_ids [size, Q], q_mask, doc_vectors [size, N, D], contexts
        [size * N, W] and their mask)."""
        stack = lambda key: _pad_rows(np.stack([getattr(p, key) for p in rows]), size)  # noqa: E731
        flat = (size * setting.n_docs, width)
        return (
            self._params,
            stack("q_ids"),  # -> [size, Q]
            stack("q_mask"),
            stack("doc_vectors"),  # -> [size, N, D]
            stack("ctx")[:, :, :width].reshape(flat),  # -> [size * N, W]
            stack("ctx_mask")[:, :, :width].reshape(flat),
        )

    def _generate(
        self, rows: list[PreparedQuestion], setting, size: int, width: int, g_tok
    ) -> list[Answer]:
        """Answers `rows` (at most `size`) at the (size, width) shape, decoding with `g_tok`."""
        count, variant = len(rows), setting.variant
        outputs = self._program(setting)(*self._inputs(rows, setting, size, width))
        # -> [size, L], [size, N], ([size], [size, N], [size, N], [size, L, N])
        tokens, scores, (loglik, prior, posterior, per_token) = jax.device_get(outputs)
        with self._ready_lock:
            self._ready.setdefault(setting, set()).add((size, width))
        texts = [a.strip() for a in g_tok.batch_decode(tokens[:count], skip_special_tokens=True)]
        gen = self.rag_cfg.generator
        special = set(g_tok.all_special_ids) | {
            self.rag_cfg.pad_token_id,
            gen.eos_token_id,
            getattr(gen, "decoder_start_token_id", gen.eos_token_id),
        }
        # Row t of `per_token` explains token t + 1 of a BART output (which starts with the
        # decoder start token) and token t of a causal generator's (the answer tokens).
        shift = 0 if self.rag_cfg.causal else 1
        answers = []
        for b, row in enumerate(rows):
            store = row.store
            passages = tuple(
                RetrievedPassage(
                    id=store.ids[j],
                    title=store.title(j),
                    text=store.text(j),
                    score=float(scores[b, n]),
                    prior=float(prior[b, n]),
                    posterior=float(posterior[b, n]),
                )
                for n, j in enumerate(int(j) for j in row.doc_ids)
            )
            sources = None
            if variant == "token":  # position t of `per_token` is the token tokens[b, t + shift]
                sources = tuple(
                    TokenSource(
                        token=g_tok.convert_ids_to_tokens(int(tokens[b, t + shift])),
                        token_id=int(tokens[b, t + shift]),
                        posteriors=tuple(float(p) for p in per_token[b, t]),
                    )
                    for t in range(tokens.shape[1] - shift)
                    if int(tokens[b, t + shift]) not in special
                )
            answers.append(
                Answer(
                    question=row.question,
                    answer=texts[b],
                    log_likelihood=float(loglik[b]),
                    truncated=row.truncated,
                    variant=variant,
                    passages=passages,
                    tokens=sources,
                )
            )
        return answers

    # -----------------------------------------------------------------------------------------
    # Editing the knowledge

    def edit(self, upserts: Iterable[Passage] = (), deletes: Iterable[str] = ()) -> dict:
        """Adds, replaces and deletes passages; the parameters are untouched.

        Upserted passages replace the passage of the same id in place, or are appended; only
        they are encoded (with the bundle's passage encoder), the other passages keep their
        vectors. The store is rebuilt and the exact index updated with the new rows (a ScaNN
        searcher is rebuilt from the vectors), then the bundle's folder is replaced in one
        atomic swap: a crash before it leaves the previous bundle whole, and the folders a
        crashed edit left beside the bundle are removed by the next edit (once a minute old).
        Answers started before the swap finish on the previous passages; those started after
        see the new ones.

        Args:
          upserts: `Passage(id, title, text)` records (or (id, title, text) triples); each text
            non-empty, each id at most once.
          deletes: ids of passages to remove; each must exist.

        Returns:
          {"encoded", "kept", "deleted", "count", "corpus_checksum"}.

        Raises:
          ValueError: naming the record or id at fault (nothing is written then).
          bundle_format.DamagedBundleError: a file of the model (config, parameters, tokenizers)
            is missing or differs from the manifest (nothing is written then).
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
            changed, gone = _check_edit(upserts, deletes, store)
            passages, kept, encoded = [], [], []  # kept: (new row, old row)
            for i in range(len(store)):
                pid = store.ids[i]
                if pid in gone:
                    continue
                if pid in changed:
                    encoded.append(len(passages))
                    passages.append(changed.pop(pid))
                else:
                    kept.append((len(passages), i))
                    passages.append(store.passage(i))
            for passage in changed.values():  # new ids, in the order given
                encoded.append(len(passages))
                passages.append(passage)
            if len(passages) < self.rag_cfg.n_docs:
                raise ValueError(
                    f"the edit leaves {len(passages)} passages, fewer than n_docs="
                    f"{self.rag_cfg.n_docs}"
                )
            vectors = np.empty((len(passages), old_vectors.shape[1]), np.float32)
            if kept:
                new_rows, old_rows = (np.asarray(x) for x in zip(*kept))
                vectors[new_rows] = old_vectors[old_rows]
            if encoded:
                vectors[encoded] = encoder.encode([passages[i] for i in encoded])
            checksum = corpus_checksum(passages)
            old_dir = self.directory

            layout = {k: store.manifest[k] for k in ("prefix", "title_sep", "doc_sep")}
            layout["suffix"] = store.manifest.get("suffix", "")

            def write_fn(tmp):
                tmp = pathlib.Path(tmp)
                # Unchanged: hard links, each checked against the manifest first, so that a
                # file damaged or deleted since the load is never sealed into the new manifest.
                bundle_format.link_model(old_dir, tmp, knowledge.manifest)
                built = PassageStore.build(
                    passages, generator_tokenizer, tmp / "passages", **layout
                )
                if built.checksum != checksum:  # both hash the same records: never differs
                    raise RuntimeError(f"store checksum {built.checksum} != {checksum}")
                bundle_format.write_index(tmp, self.fingerprint, checksum, vectors, self.settings)
                bundle_format.share_modes(tmp)

            manifest = dict(knowledge.manifest, corpus_checksum=checksum, count=len(passages))
            # A write killed earlier left its folders beside the bundle (whole copies of the
            # passages and index); those a minute old go (younger: maybe a write in progress).
            bundle_format.remove_stale(old_dir)
            files.swap_dir(old_dir, write_fn, manifest, what="bundle")
            retriever = bundle_format.open_retriever(
                old_dir, manifest, self.settings, self.rag_cfg, vectors
            )
            self._knowledge = _Knowledge(retriever, manifest)
        return {
            "encoded": len(encoded),
            "kept": len(kept),
            "deleted": len(gone),
            "count": len(passages),
            "corpus_checksum": checksum,
        }


# ---------------------------------------------------------------------------------------------
# The jitted programs, one per model and answering setting (a batch bucket or context width is
# a shape: jit compiles it once)

_TRACES: collections.Counter = collections.Counter()  # RagConfig -> traces of its programs
_TRACES_LOCK = threading.Lock()


def _count_trace(cfg: rag.RagConfig) -> None:
    with _TRACES_LOCK:
        _TRACES[cfg] += 1


def _jit(fn, fast_compile: bool):
    # XLA's backend at optimisation level 0 compiles about twice as fast (the first answer of a
    # fresh process) and runs the small fused loops between library kernels somewhat slower.
    return jax.jit(fn, compiler_options=_FAST_COMPILE if fast_compile else None)


_FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.cache
def _embed_program(cfg: rag.RagConfig, fast_compile: bool):
    """jit: (params, q_ids [B, Q], q_mask [B, Q]) -> [B, D] question vectors."""

    def embed(params, q_ids, q_mask):
        _count_trace(cfg)
        return rag.question_embeddings(cfg, params, q_ids, q_mask)

    return _jit(embed, fast_compile)


@functools.cache
def _answer_program(cfg, variant: str, num_beams: int, n_docs: int, decoding, fast_compile):
    """jit: (params, q_ids [B, Q], q_mask, doc_vectors [B, N, D], contexts [B * N, W] and their
    mask) -> (tokens [B, L], doc scores [B, N], (log p(y|x) [B], prior [B, N], posterior [B, N],
    token posteriors [B, L, N])): generated as the evaluation generates
    (`evaluation.generate_fn`), then scored under the variant's model.

    One program, not a generation and a scoring one: XLA shares their common work (the
    contexts' encoder pass), which took a quarter of the time off an answer of 8 or 16 default
    job questions on 2 CPU cores, and compiles it in half the time of the two.
    """
    run_cfg = cfg.replace(n_docs=n_docs)
    ids = dict(pad_token_id=cfg.pad_token_id, n_docs=n_docs)

    def generate(params, q_ids, q_mask, doc_vectors, ctx, ctx_mask):
        q = rag.question_embeddings(run_cfg, params, q_ids, q_mask)
        scores = rag_math.doc_scores(q, doc_vectors, cfg.doc_score_scale)  # -> [B, N]
        tokens = rag.generate(
            run_cfg,
            params,
            ctx,
            ctx_mask,
            scores,
            variant=variant,
            sequence_decoding=decoding,
            num_beams=num_beams,
        )
        return tokens, scores

    def score(params, scores, ctx, ctx_mask, tokens):
        logits = rag.generator_logits(run_cfg, params, ctx, ctx_mask, tokens)
        aligned, bos = {}, cfg.bos_token_id
        if cfg.causal:  # the answer tokens themselves, scored up to their EOS
            gen = cfg.generator
            mask = causal.label_mask(tokens, gen.eos_token_id, gen.pad_token_id)
            aligned, bos = dict(aligned=True, target_mask=mask), None
        if variant == "sequence":
            nll = rag_math.rag_sequence_nll(
                logits, scores, tokens, bos_token_id=bos, **ids, **aligned
            )
        else:
            nll = rag_math.rag_token_nll(logits, scores, tokens, **ids, **aligned)
        posterior, per_token = rag_math.doc_posteriors(logits, scores, tokens, **ids, **aligned)
        return -nll, jax.nn.softmax(scores, axis=-1), posterior, per_token

    def answer(params, q_ids, q_mask, doc_vectors, ctx, ctx_mask):
        _count_trace(cfg)
        tokens, scores = generate(params, q_ids, q_mask, doc_vectors, ctx, ctx_mask)
        return tokens, scores, score(params, scores, ctx, ctx_mask, tokens)

    return _jit(answer, fast_compile)


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


def _check_edit(upserts, deletes, store: PassageStore) -> tuple[dict, set]:
    """({id: Passage} to write, {id} to delete), or ValueError naming the record or id."""
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
    missing = gone - {store.ids[i] for i in range(len(store))} if gone else set()
    if missing:
        raise ValueError(
            f"cannot delete ids that are not in the bundle's passages: {sorted(missing)[:5]}"
        )
    return changed, gone


def enable_compilation_cache(directory=None) -> str:
    """Keeps the programs a process compiles on disk (JAX's persistent compilation cache), so
    the next start of a script answering from a bundle loads them instead of compiling.

    Args:
      directory: default `$RAG_JAX_COMPILATION_CACHE`, else `~/.cache/rag_jax/jax`.

    Returns:
      The directory.
    """
    directory = directory or os.environ.get("RAG_JAX_COMPILATION_CACHE")
    directory = str(directory or pathlib.Path.home() / ".cache" / "rag_jax" / "jax")
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


def _pad_rows(array: np.ndarray, size: int) -> np.ndarray:
    """`array` [B, ...] with rows repeating row 0 up to `size` (padding rows, dropped after)."""
    pad = size - len(array)
    return np.concatenate([array, np.repeat(array[:1], pad, axis=0)]) if pad else array
