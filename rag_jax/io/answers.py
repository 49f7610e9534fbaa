"""How a bundle answers: the answer records, the jitted programs of each answering setting, and
the batching that keeps a server's varying batches on programs already compiled.

A batch is padded to one of `BATCH_BUCKETS` and its contexts to a multiple of
`Settings.context_pad_multiple`; the programs are cached per (model, setting), so `traces`
counts how often they were traced. `prepare` (tokenisation, question encoding, retrieval,
context assembly) and `generate` (decoding and scoring) are separate stages, so a server can
prepare the next batch while the current one generates. `compile` runs the shapes of one setting
ahead of traffic; `ready_shapes` says which are compiled. `Bundle` (`rag_jax.io.bundle`) is an
`Answering`.

Legend: B batch, N docs per question, S context length, L generated length, Q question length,
D vector width.
"""

import collections
import dataclasses
import functools
import os
import pathlib
import threading
from collections.abc import Sequence

import jax
import numpy as np

from rag_jax import causal, rag, rag_math
from rag_jax.devices import host
from rag_jax.model_inputs import context_width, question_tokens
from rag_jax.retrieval.retriever import Retriever
from rag_jax.retrieval.store import PassageStore

# Batch sizes answers are computed at (a batch is padded up to the next); larger batches are cut
# into batches of the largest.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# The tokenizers that read a question (`Bundle._content`'s names): each must find a word in it.
QUESTION_READERS = ("question encoder", "generator")


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


class Answering:
    """How a bundle answers (the `Bundle` methods of this module): batches padded to buckets, one
    knowledge snapshot per call, jitted programs cached per setting, compiled ahead on request.

    Reads the bundle's `rag_cfg`, `settings`, `_params`, `_knowledge`, tokenizers (and their
    `_content` check) and compile state, set up by `Bundle.__init__`.
    """

    @property
    def traces(self) -> int:
        """How many times the jitted programs of this bundle's model were traced (each trace
        compiles). Bundles of one model (a reloaded or edited copy) share their programs."""
        return _TRACES[self.rag_cfg]

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
          ValueError: a question (one with no word for the tokenizers: `check_questions`) or a
            setting that cannot be answered (named).
          RuntimeError: `compiled_only` before any question encoder program is compiled.
        """
        setting = self._answer_setting(questions, variant, num_beams, n_docs, sequence_decoding)
        self.check_questions(questions)
        retriever = self._retriever(setting)
        tokenizers = (self.question_tokenizer, self.generator_tokenizer)
        return self._prepare(list(questions), setting, retriever, tokenizers, compiled_only)

    def check_questions(self, questions: Sequence[str]) -> None:
        """Raises ValueError naming the first of `questions` in which the question encoder's or
        the generator's tokenizer reads no content token (nothing, or only unknown or special
        tokens: `content.ContentCheck`): it would be answered from nothing."""
        for i, question in enumerate(questions):
            self._content.check(f"questions[{i}]", question, QUESTION_READERS, "a question")

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

    def forget(self, setting: AnswerSetting) -> None:
        """Drops `setting`'s compiled programs: its shapes leave `ready_shapes` and its jitted
        program's executables are freed (a server evicting an idle setting). The question
        encoder's programs, shared by every setting, stay; the freed memory is returned to the
        kernel (`host.release_free_memory`), else RSS would not fall."""
        with self._compile_lock, self._ready_lock:
            self._ready.pop(setting, None)
            self._program(setting).clear_cache()
        host.release_free_memory()

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
